"""The tiny runs, flag sets and files that several test modules share."""

import gzip
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
VOCAB = 200  # not a multiple of 128: exercises Megatron's vocabulary padding
SEQ, BATCH = 16, 2
SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    str(SEQ),
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]
LLAMA = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
]
FAMILIES = {
    "gpt2": SMALL,
    "gpt2-rope-gqa": SMALL
    + ["--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2"],
    "llama": SMALL + LLAMA,
    "llama-gqa": SMALL + LLAMA + ["--group-query-attention", "--num-query-groups", "2"],
}

TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-warmup-iters",
    "2",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
    "--eval-iters",
    "1",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]


def run_pretrain(argv):
    from megatron_focus.training.arguments import parse_args
    from megatron_focus.training.trainer import pretrain
    from pretrain_gpt import main as _  # noqa: F401  (the entry point imports cleanly)

    return pretrain(parse_args(argv))


def train(world_size, argv):
    return run_distributed(run_pretrain, world_size, argv)


def fresh_world() -> dict:
    """This process's environment, less the torch.distributed rendezvous of its own ranks."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in names}


def launch(argv, *launcher, env=None, **popen):
    """`pretrain_gpt.py argv` as a job of its own (under `launcher`, e.g. torchrun's command;
    else this Python) in a fresh world (and `env`'s variables), its output piped as text."""
    return subprocess.Popen(
        [*(launcher or [sys.executable]), "pretrain_gpt.py", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**fresh_world(), **(env or {})},
        cwd=ROOT,
        **popen,
    )


def torchrun(argv, *flags):
    """`pretrain_gpt.py argv` under torchrun, two ranks on this machine (`flags`: torchrun's),
    in a session of its own (a signal to the group reaches every process of the job)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", *flags]
    return launch(argv, *command, "--nproc_per_node", "2", start_new_session=True)


def tiny_argv(cache, *extra, iters=4):
    return TINY + ["--data-cache-path", cache, "--train-iters", str(iters)] + list(extra)


def write_docs(path, docs, key="text"):
    """Write `docs` as jsonl, jsonl.gz or parquet according to the suffix."""
    path = str(path)
    if path.endswith(".parquet"):
        pq.write_table(pa.table({key: docs}), path, row_group_size=2)
    else:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({key: d}) + "\n" for d in docs)
    return path


def gpt2_bpe_files(folder):
    """GPT-2-style vocab.json and merges.txt (a small byte-level BPE with <|endoftext|>)."""
    from tokenizers import ByteLevelBPETokenizer

    from megatron_focus.hf.tokenizer import PROBES

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(list(PROBES) * 20, vocab_size=400, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(folder))
    return str(folder / "vocab.json"), str(folder / "merges.txt")


def full_weights(ckpt):
    """The whole model of a checkpoint as the HF export reads it (a base under trained-only)."""
    from megatron_focus.checkpoint import native

    tag_dir = native.checkpoint_tag_dir(ckpt)
    vocab_size, _ = native.checkpoint_vocabulary(tag_dir)
    return native.read_weights(tag_dir, vocab_size, progress=False)


def byte_level_bpe(folder, special_tokens):
    """A small GPT-2 style byte-level BPE trained on the probe texts, saved as
    `folder/tokenizer.json` (the folder is created); returns the `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from megatron_focus.hf.tokenizer import PROBES

    folder.mkdir()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        PROBES * 10,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=special_tokens,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    bpe.save(str(folder / "tokenizer.json"))
    return bpe
