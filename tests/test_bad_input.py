"""Every bad input ends in one `error:` line and exit code 2, before any model is built, having
written nothing: `pretrain_gpt.py` and every tool, one table of cases.

The table is also `docs/reliability.md` (with what the user sees); after changing a case or a
message, rewrite it with `UPDATE_DOCS=1 python -m pytest tests/test_bad_input.py`.
"""

import concurrent.futures
import contextlib
import dataclasses
import gzip
import io
import json
import multiprocessing
import os
import re
import runpy
import shutil
import sys
from typing import Callable, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "reliability.md")
P = "pretrain_gpt.py"
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
    "--train-iters",
    "4",
    "--lr-warmup-iters",
    "1",
    "--data-cache-path",
    "{cache}",
]
DATA = [
    "--data-path",
    "{data}",
    "--tokenizer-type",
    "SentencePieceTokenizer",
    "--tokenizer-model",
    "{tok}",
]


@dataclasses.dataclass
class Case:
    script: str
    what: str  # the mistake, in the user's words
    argv: list  # {tmp}: this case's own folder; {data}, {tok}, {corpus}, {run}, {hf}: shared
    error: str  # a regular expression the message must match
    setup: Optional[Callable[[dict], None]] = None  # writes the case's files under {tmp}


def _write(name: str, content, binary: bool = False):
    def setup(paths):
        path = os.path.join(paths["tmp"], name)
        with open(path, "wb" if binary else "w") as f:
            f.write(content)

    return setup


def _deepspeed_json(config):
    return _write("ds.json", config if isinstance(config, str) else json.dumps(config))


def _copy_run(change: Callable[[str], None]):
    """A copy of the shared run under {tmp}/run, then `change(its latest checkpoint folder)`."""

    def setup(paths):
        shutil.copytree(paths["run"], os.path.join(paths["tmp"], "run"))
        change(os.path.join(paths["tmp"], "run", "iter_0000002"))

    return setup


def _megatron_lm_folder(tracker: str, files: dict):
    """{tmp}/mlm as Megatron-LM names a checkpoint folder: its iteration pointer and `files`."""

    def setup(paths):
        folder = os.path.join(paths["tmp"], "mlm")
        for name, text in {"latest_checkpointed_iteration.txt": tracker, **files}.items():
            os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)

    return setup


def _rewrite_latest(tag: str):
    def change(folder):
        with open(os.path.join(os.path.dirname(folder), "latest"), "w") as f:
            f.write(tag)

    return change


def _remove_latest(folder):
    os.remove(os.path.join(os.path.dirname(folder), "latest"))


def _truncate(name: str):
    def change(folder):
        path = os.path.join(folder, name)
        os.truncate(path, os.path.getsize(path) // 2)

    return change


def _pickled_code(folder):
    """A shard that runs code as it loads, its checksums recomputed as a forger would."""
    import torch

    from megatron_focus.checkpoint import integrity

    path = os.path.join(folder, "mp_rank_00_model_states.pt")
    torch.save({**torch.load(path, weights_only=False), "extra": _Payload()}, path)
    integrity.write(folder, integrity.digests(folder))


class _Payload:
    def __reduce__(self):
        return print, ("ran",)


def _bad_index(paths):
    shutil.copy(paths["data"] + ".bin", os.path.join(paths["tmp"], "d_text_document.bin"))
    with open(os.path.join(paths["tmp"], "d_text_document.idx"), "wb") as f:
        f.write(b"not an index file at all")


def _gz_truncated(paths):
    data = gzip.compress(b'{"text": "one"}\n' * 2000)
    with open(os.path.join(paths["tmp"], "in.jsonl.gz"), "wb") as f:
        f.write(data[: len(data) // 2])


def _hf_folder(paths):
    os.makedirs(os.path.join(paths["tmp"], "hf"))


def _nonempty_out(paths):
    os.makedirs(os.path.join(paths["tmp"], "out"))
    _write("out/keep.txt", "another model's file")(paths)


PRE = "tools/preprocess_data.py"
PRE_SP = [
    "--tokenizer-type",
    "SentencePieceTokenizer",
    "--tokenizer-model",
    "{tok}",
    "--output-prefix",
    "{tmp}/out",
]
CASES = [
    # --- pretrain_gpt.py: values no run can use, refused by flag as they are parsed
    *[
        Case(P, f"{flag} {value}", [flag, value], f"^{flag} {value}: must be")
        for flag, value in [
            ("--num-layers", "0"),
            ("--hidden-size", "0"),
            ("--num-attention-heads", "0"),
            ("--seq-length", "0"),
            ("--micro-batch-size", "0"),
            ("--tensor-model-parallel-size", "0"),
            ("--kv-channels", "0"),
            ("--make-vocab-size-divisible-by", "0"),
            ("--log-interval", "0"),
            ("--eval-interval", "0"),
            ("--exit-interval", "-1"),
            ("--clip-grad", "-1.0"),
            ("--rotary-percent", "0.0"),
            ("--lr", "-0.001"),
            ("--hidden-dropout", "1.0"),
        ]
    ],
    Case(P, "a misspelt flag", ["--num-layer", "2"], r"--num-layer.*--num-layers"),
    Case(P, "a word for a number", ["--num-layers", "two"], r"--num-layers.*'two'"),
    Case(P, "an unknown attention variant", ["--attention", "linear"], r"--attention.*'linear'"),
    Case(P, "an unknown tokenizer type", ["--tokenizer-type", "Nope"], r"--tokenizer-type.*Nope"),
    Case(
        P,
        "a batch that micro-batches do not divide",
        TINY + ["--micro-batch-size", "3"],
        r"not divisible by --micro-batch",
    ),
    Case(
        P,
        "a batch-size ramp-up in a run counted in iterations",
        TINY + ["--rampup-batch-size", "4", "4", "64"],
        r"--rampup-batch-size counts samples: it needs --train-samples",
    ),
    Case(
        P,
        "a batch-size ramp-up whose increment does not reach the global batch",
        TINY[: TINY.index("--train-iters")]  # the model and batch, then a run in samples
        + ["--data-cache-path", "{cache}", "--train-samples", "64"]
        + ["--rampup-batch-size", "4", "3", "64"],
        r"--global-batch-size 8 must be START plus a whole number",
    ),
    Case(
        P,
        "a hidden size the heads do not divide",
        TINY + ["--num-attention-heads", "3"],
        r"hidden.size.*num.attention.heads|heads",
    ),
    Case(
        P,
        "more tensor-parallel ranks than processes",
        TINY + ["--tensor-model-parallel-size", "2"],
        r"world size 1 is not divisible by TP size 2",
    ),
    Case(
        P,
        "NCCL on a machine without GPUs",
        TINY + ["--distributed-backend", "nccl"],
        r"--distributed-backend nccl needs GPUs",
    ),
    Case(
        P,
        "--profile without a folder for its trace",
        TINY + ["--profile"],
        r"--profile writes the PyTorch profiler's trace to --tensorboard-dir",
    ),
    Case(P, "both fp16 and bf16", TINY + ["--fp16", "--bf16"], r"fp16.*bf16|bf16.*fp16"),
    Case(P, "fp16 on a machine without GPUs", TINY + ["--fp16"], r"--fp16 needs a GPU"),
    Case(
        P,
        "--wandb-project without a run name",
        TINY + ["--wandb-project", "p"],
        r"--wandb-project needs --wandb-exp-name",
    ),
    Case(P, "--ckpt-step without --load", TINY + ["--ckpt-step", "2"], r"--ckpt-step needs --load"),
    Case(
        P,
        "--data-path and --train-data-path",
        TINY + DATA + ["--train-data-path", "{data}"],
        r"--data-path and --train-data-path .*: give one",
    ),
    Case(
        P,
        "--valid-data-path without --train-data-path",
        TINY + ["--valid-data-path", "{data}"],
        r"--valid-data-path and --test-data-path need --train-data-path",
    ),
    Case(
        P,
        "--split with per-split paths",
        TINY + ["--train-data-path", "{data}", "--split", "98,2,0", *DATA[2:]],
        r"--split 98,2,0 divides --data-path",
    ),
    Case(
        P,
        "--squared-relu with --swiglu",
        TINY + ["--squared-relu", "--swiglu"],
        r"--squared-relu is the MLP's activation: not with --swiglu",
    ),
    Case(
        P,
        "--no-position-embedding with learned positions",
        TINY + ["--no-position-embedding"],
        r"--no-position-embedding is deprecated, use --position-embedding-type none",
    ),
    Case(
        P,
        "--use-rope-scaling without RoPE",
        TINY + ["--use-rope-scaling"],
        r"--use-rope-scaling scales RoPE: it needs --position-embedding-type rope",
    ),
    Case(
        P,
        "--no-save-optim under ZeRO-3",
        TINY + ["--no-save-optim", "--zero-stage", "3"],
        r"--no-save-optim: ZeRO stage 3 keeps the weights",
    ),
    Case(
        P,
        "--retrofit without --load",
        TINY + ["--attention", "focus", "--retrofit"],
        r"need --load",
    ),
    Case(
        P,
        "--retrofit on a standard model",
        TINY + ["--retrofit", "--load", "{run}"],
        r"--retrofit adds Focus",
    ),
    Case(
        P,
        "--exit-signal-handler without --save",
        TINY + DATA + ["--exit-signal-handler"],
        r"--exit-signal-handler saves a checkpoint when a signal stops the run: give --save",
    ),
    Case(
        P,
        "a Focus top-k above its group count",
        TINY + ["--attention", "focus", "--focus-groups", "4", "--focus-top-k", "5"],
        r"--focus-top-k",
    ),
    Case(
        P,
        "a fused Focus kernel with attention dropout",
        TINY + ["--attention", "focus", "--focus-kernel", "triton", "--attention-dropout", "0.1"],
        r"--focus-kernel triton needs --attention-dropout 0",
    ),
    Case(
        P,
        "sparse Focus training with attention dropout",
        TINY
        + ["--attention", "focus", "--focus-attention-mode", "sparse"]
        + ["--attention-dropout", "0.1"],
        r"--focus-attention-mode sparse has no attention dropout: add --attention-dropout 0",
    ),
    Case(
        P,
        "a retrofit in sparse Focus mode",
        TINY
        + ["--attention", "focus", "--focus-attention-mode", "sparse", "--retrofit"]
        + ["--attention-dropout", "0", "--load", "{run}"],
        r"--retrofit trains the routers, which --focus-attention-mode sparse freezes",
    ),
    # --- DeepSpeed JSON
    Case(
        P,
        "a DeepSpeed config that does not exist",
        TINY + ["--deepspeed_config", "{tmp}/no.json"],
        r"no.json: no such file",
    ),
    Case(
        P,
        "a DeepSpeed config with a syntax error",
        TINY + ["--deepspeed_config", "{tmp}/ds.json"],
        r"ds.json: not valid JSON: .* line 1",
        _deepspeed_json('{"zero_optimization": }'),
    ),
    Case(
        P,
        "a DeepSpeed config that is a list",
        TINY + ["--deepspeed_config", "{tmp}/ds.json"],
        r"ds.json: the JSON must be an object",
        _deepspeed_json([1, 2]),
    ),
    Case(
        P,
        "ZeRO stage 7",
        TINY + ["--deepspeed_config", "{tmp}/ds.json"],
        r"stage must be 0, 1, 2 or 3, not 7",
        _deepspeed_json({"zero_optimization": {"stage": 7}}),
    ),
    Case(
        P,
        "an optimizer section DeepSpeed would use instead of ours",
        TINY + ["--deepspeed_config", "{tmp}/ds.json"],
        r"section 'optimizer' is not used here",
        _deepspeed_json({"optimizer": {"type": "Adam"}}),
    ),
    Case(
        P,
        "a misspelt DeepSpeed section",
        TINY + ["--deepspeed_config", "{tmp}/ds.json"],
        r"unknown section 'zero_optimisation' \(did you mean 'zero_optimization'",
        _deepspeed_json({"zero_optimisation": {"stage": 1}}),
    ),
    Case(
        P,
        "--grad-reduce-in-bf16 against the DeepSpeed config's reduction dtype",
        TINY + ["--deepspeed_config", "{tmp}/ds.json", "--grad-reduce-in-bf16"],
        r"--grad-reduce-in-bf16, but --deepspeed_config sets communication_data_type 'fp32'",
        _deepspeed_json({"bf16": {"enabled": True}, "communication_data_type": "fp32"}),
    ),
    Case(
        P,
        "a DeepSpeed batch size that disagrees with the flags",
        TINY + ["--deepspeed_config", "{tmp}/ds.json"],
        r"train_batch_size=16 but the flags give 8",
        _deepspeed_json({"train_batch_size": 16}),
    ),
    # --- data and tokenizers
    Case(
        P,
        "--data-path without a tokenizer",
        TINY + ["--data-path", "{data}"],
        r"--data-path and a tokenizer .* go together",
    ),
    Case(
        P,
        "a data prefix with no files",
        TINY + DATA[:0] + ["--data-path", "{tmp}/missing_text_document", *DATA[2:]],
        r"missing_text_document",
    ),
    Case(
        P,
        "a data path given with its .bin",
        TINY + ["--data-path", "{data}.bin", *DATA[2:]],
        r"without the suffix: --data-path .*_text_document$",
    ),
    Case(
        P,
        "a tokenizer model that does not exist",
        TINY + DATA[:4] + ["--tokenizer-model", "{tmp}/none.model"],
        r"none.model",
    ),
    Case(
        P,
        "a damaged .idx file",
        TINY + ["--data-path", "{tmp}/d_text_document", *DATA[2:]],
        r"d_text_document.idx",
        _bad_index,
    ),
    Case(
        P,
        "data tokenized with a larger vocabulary than the tokenizer's",
        TINY
        + ["--data-path", "{data}", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
        r"vocab",
    ),
    Case(
        P,
        "blend weights without a prefix for each",
        TINY + ["--data-path", "0.7", "{data}", "0.3", *DATA[2:]],
        r"--data-path",
    ),
    Case(
        P,
        "a negative blend weight",
        TINY + ["--data-path", "-1", "{data}", "2", "{data}", *DATA[2:]],
        r"weight",
    ),
    Case(
        P,
        "a blend weight that is not a number",
        TINY + ["--data-path", "heavy", "{data}", "light", "{data}", *DATA[2:]],
        r"weight",
    ),
    Case(P, "a split of four parts", TINY + DATA + ["--split", "90,5,3,2"], r"--split"),
    Case(
        P,
        "a SentencePiece file given as an HF tokenizer",
        TINY
        + [
            "--data-path",
            "{data}",
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            "{tok}",
        ],
        r"tokenizer.model.*(Hugging Face|tokenizer.json)",
    ),
    # --- checkpoints
    Case(
        P,
        "a --save inside a file",
        TINY + ["--save", "{tmp}/file/ckpt"],
        r"--save .*file/ckpt: cannot write there",
        _write("file", ""),
    ),
    Case(
        P,
        "a --load with no checkpoint",
        TINY + ["--load", "{tmp}/none", "--save", "{tmp}/new"],
        r"--load .*none: no checkpoint there",
    ),
    Case(
        P,
        "checkpoints whose 'latest' file is gone",
        TINY + ["--load", "{tmp}/run"],
        r"holds checkpoints iter_0000002 but no 'latest' file",
        _copy_run(_remove_latest),
    ),
    Case(
        P,
        "a 'latest' naming a missing checkpoint",
        TINY + ["--load", "{tmp}/run"],
        r"run/latest is damaged: it names 'iter_0000009', which is not in .*run; complete "
        r"checkpoints there: iter_0000002; pick one with --ckpt-step \(e.g. 2\)",
        _copy_run(_rewrite_latest("iter_0000009")),
    ),
    Case(
        P,
        "an empty 'latest' file",
        TINY + ["--load", "{tmp}/run", "--save", "{tmp}/run"],
        r"run/latest is damaged: it is empty; complete checkpoints there: iter_0000002; pick "
        r"one with --ckpt-step \(e.g. 2\)",
        _copy_run(_rewrite_latest("")),
    ),
    Case(
        P,
        "a 'latest' file holding garbage",
        TINY + ["--load", "{tmp}/run"],
        r"run/latest is damaged: it holds '\\x00\\x01junk', not a checkpoint's name; complete "
        r"checkpoints there: iter_0000002",
        _copy_run(_rewrite_latest("\x00\x01junk")),
    ),
    Case(
        P,
        "--ckpt-step of a checkpoint that is not there",
        TINY + ["--load", "{run}", "--ckpt-step", "7"],
        r"holds no iter_0000007 \(it holds: "
        r"iter_0000002\)",
    ),
    Case(
        P,
        "a checkpoint of another shape",
        TINY[:2] + ["--hidden-size", "128"] + TINY[4:] + ["--load", "{run}"],
        r"is of another model: .*hidden_size: checkpoint 64, this run 128",
    ),
    Case(
        P,
        "a changed learning rate on resume",
        TINY + ["--lr", "0.01", "--load", "{run}"],
        r"schedule differs from the checkpoint's: --lr 0.01",
    ),
    Case(
        P,
        "a Megatron-LM torch_dist checkpoint whose metadata.json is damaged",
        TINY + ["--finetune", "--load", "{tmp}/mlm"],
        r"mlm/iter_0000007/metadata.json is not a distributed checkpoint's record",
        _megatron_lm_folder("7", {"iter_0000007/metadata.json": "{not json"}),
    ),
    Case(
        P,
        "Megatron-LM's latest_checkpointed_iteration.txt naming a missing checkpoint",
        TINY + ["--finetune", "--load", "{tmp}/mlm"],
        r"latest_checkpointed_iteration.txt names iter_0000009, which is not in .*mlm",
        _megatron_lm_folder("9", {"iter_0000007/metadata.json": "{}"}),
    ),
    Case(
        P,
        "a checkpoint shard that runs code as it loads",
        TINY + ["--load", "{tmp}/run"],
        r"holds pickled objects that could run code",
        _copy_run(_pickled_code),
    ),
    Case(
        P,
        "a truncated checkpoint shard",
        TINY + ["--load", "{tmp}/run"],
        r"iter_0000002 is damaged: mp_rank_00_model_states.pt is \d+ bytes",
        _copy_run(_truncate("mp_rank_00_model_states.pt")),
    ),
    Case(
        P,
        "a truncated model_args.json",
        TINY + ["--load", "{tmp}/run"],
        r"is damaged: model_args.json is \d+ bytes",
        _copy_run(_truncate("model_args.json")),
    ),
    # --- tools/preprocess_data.py
    Case(
        PRE,
        "an input pattern that matches nothing",
        ["--input", "{tmp}/none-*.jsonl", *PRE_SP],
        r"none-\*.jsonl",
    ),
    Case(
        PRE,
        "a tokenizer model that does not exist",
        [
            "--input",
            "{corpus}",
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            "{tmp}/none.model",
            "--output-prefix",
            "{tmp}/out",
        ],
        r"none.model",
    ),
    Case(
        PRE,
        "input that is not UTF-8",
        ["--input", "{tmp}/latin1.jsonl", *PRE_SP],
        r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9",
        _write(
            "latin1.jsonl", '{"text": "ok"}\n{"text": "caf\xe9"}\n'.encode("latin-1"), binary=True
        ),
    ),
    Case(
        PRE,
        "a truncated .gz input",
        ["--input", "{tmp}/in.jsonl.gz", *PRE_SP],
        r"in.jsonl.gz: the gzip stream is damaged or truncated",
        _gz_truncated,
    ),
    Case(
        PRE,
        "a line that is not JSON",
        ["--input", "{tmp}/bad.jsonl", *PRE_SP],
        r"bad.jsonl:2: not valid JSON",
        _write("bad.jsonl", '{"text": "ok"}\nnot json\n'),
    ),
    Case(
        PRE,
        "documents without the text key",
        ["--input", "{tmp}/k.jsonl", *PRE_SP],
        r"k.jsonl.*'text'",
        _write("k.jsonl", '{"body": "no text key"}\n'),
    ),
    # --- tools/train_tokenizer.py
    Case(
        "tools/train_tokenizer.py",
        "a vocabulary too small for the corpus",
        ["--input", "{corpus}", "--output-prefix", "{tmp}/tok", "--vocab-size", "300"],
        r"--vocab-size 300",
    ),
    Case(
        "tools/train_tokenizer.py",
        "an input that does not exist",
        ["--input", "{tmp}/none.jsonl", "--output-prefix", "{tmp}/tok", "--vocab-size", "1000"],
        r"none.jsonl",
    ),
    # --- tools/convert_to_hf.py
    Case(
        "tools/convert_to_hf.py",
        "a checkpoint folder that does not exist",
        ["--load", "{tmp}/none", "--save-dir", "{tmp}/out"],
        r"none",
    ),
    Case(
        "tools/convert_to_hf.py",
        "an export into a folder holding another model",
        ["--load", "{run}", "--save-dir", "{tmp}/out"],
        r"out.*--overwrite",
        _nonempty_out,
    ),
    Case(
        "tools/convert_to_hf.py",
        "an empty 'latest' file",
        ["--load", "{tmp}/run", "--save-dir", "{tmp}/out"],
        r"run/latest is damaged: it is empty; complete checkpoints there: iter_0000002; pick "
        r"one with --iteration \(e.g. 2\)",
        _copy_run(_rewrite_latest("")),
    ),
    Case(
        "tools/convert_to_hf.py",
        "an iteration that was not saved",
        ["--load", "{run}", "--save-dir", "{tmp}/out", "--iteration", "9"],
        r"iter_0000009",
    ),
    # --- tools/convert_from_hf.py
    Case(
        "tools/convert_from_hf.py",
        "an HF folder that does not exist",
        ["--hf-dir", "{tmp}/none", "--save", "{tmp}/out"],
        r"--hf-dir .*none: no such folder",
    ),
    Case(
        "tools/convert_from_hf.py",
        "an HF folder without config.json",
        ["--hf-dir", "{tmp}/hf", "--save", "{tmp}/out"],
        r"hf: no config.json",
        _hf_folder,
    ),
    Case(
        "tools/convert_from_hf.py",
        "an import into an existing run",
        ["--hf-dir", "{hf}", "--save", "{run}"],
        r"--overwrite",
    ),
    Case(
        "tools/convert_from_hf.py",
        "a TP size that does not divide the heads",
        ["--hf-dir", "{hf}", "--save", "{tmp}/out", "--tensor-model-parallel-size", "3"],
        r"tensor-model-parallel-size 3|3.*heads",
    ),
    # --- evaluation tools
    Case(
        "tools/eval_ppl.py",
        "a checkpoint folder that does not exist",
        ["--load", "{tmp}/none"],
        r"none",
    ),
    Case(
        "tools/eval_ppl.py",
        "a zero evaluation length",
        ["--load", "{run}", "--seq-lengths", "0"],
        r"--seq-lengths",
    ),
    Case(
        "tools/eval_passkey.py",
        "a checkpoint folder that does not exist",
        ["--load", "{tmp}/none"],
        r"none",
    ),
    Case(
        "tools/eval_passkey.py",
        "a depth outside 0-1",
        ["--load", "{run}", "--depths", "1.5"],
        r"--depths",
    ),
    Case(
        "tools/plan.py",
        "heads the tensor-parallel size does not divide",
        TINY + ["--tensor-model-parallel-size", "3", "--gpus-per-node", "3"],
        r"--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3",
    ),
    Case(
        "tools/compare_runs.py",
        "a run folder with no TensorBoard events",
        ["{tmp}"],
        r"no TensorBoard",
    ),
    Case(
        "tools/prepare_fineweb.py",
        "an input that does not exist",
        [
            "--input",
            "{tmp}/none.parquet",
            "--output-prefix",
            "{tmp}/fw",
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            "{tok}",
        ],
        r"none.parquet",
    ),
]


# --- running the table: one process (imports once), each case from a clean state ---------------


def _snapshot(roots):
    seen = {}
    for root in roots:
        for folder, _, files in os.walk(root):
            for name in files:
                path = os.path.join(folder, name)
                stat = os.stat(path)
                seen[path] = (stat.st_size, stat.st_mtime_ns)
            seen[folder] = "dir"
    return seen


class _ModelBuilt(Exception):
    """Raised in place of building the model: the case got past every check."""


def _run_case(case: Case, paths: dict) -> dict:
    import torch.distributed as dist

    from megatron_focus import platform
    from megatron_focus.model import gpt

    os.makedirs(paths["tmp"])
    if case.setup:
        case.setup(paths)
    roots = [paths["tmp"], paths["shared"], paths["cache"]]
    before = _snapshot(roots)
    argv = [part.format(**paths) for part in case.argv]
    sys.argv = [case.script, *argv]
    os.environ.pop("MASTER_PORT", None)
    err, code = io.StringIO(), None

    def no_model(*args, **kwargs):
        raise _ModelBuilt()

    gpt.build_model, build_model = no_model, gpt.build_model
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(os.path.join(ROOT, case.script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except _ModelBuilt:
        code = "reached the model"
    except BaseException as e:  # noqa: BLE001 - reported as the case's outcome
        code = f"raised {type(e).__name__}: {str(e)[:500]}"
    finally:
        gpt.build_model = build_model
        if dist.is_initialized():
            platform.destroy_distributed()
    after = _snapshot(roots)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    return {"code": code, "stderr": err.getvalue(), "changed": changed}


def _run_all(paths: dict) -> list:
    os.chdir(ROOT)
    sys.path.insert(0, ROOT)
    results = []
    for i, case in enumerate(CASES):
        case_paths = {**paths, "tmp": os.path.join(paths["base"], f"case{i:03d}")}
        results.append(_run_case(case, case_paths))
    return results


@pytest.fixture(scope="module")
def outcomes(embedded_cache, tmp_path_factory):
    from megatron_focus.data.embedded import ensure_embedded_data
    from megatron_focus.hf import export_to_hf

    from tiny_runs import train

    shared = tmp_path_factory.mktemp("shared")
    data, tok = ensure_embedded_data(embedded_cache)
    run = str(shared / "run")
    train(
        1,
        [part.replace("{cache}", embedded_cache) for part in TINY]
        + ["--save", run, "--exit-interval", "2"],
    )
    hf = str(shared / "hf")
    export_to_hf(run, hf, progress=False)
    paths = {
        "data": data,
        "tok": tok,
        "corpus": os.path.join(os.path.dirname(data), "stdlib.jsonl"),
        "run": run,
        "hf": hf,
        "shared": str(shared),
        "cache": embedded_cache,
        "base": str(tmp_path_factory.mktemp("cases")),
    }
    with concurrent.futures.ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        results = pool.submit(_run_all, paths).result(timeout=1200)
    return {"results": results, "paths": paths}


def _message(outcome) -> str:
    lines = [line for line in re.split(r"[\r\n]", outcome["stderr"]) if line.startswith("error: ")]
    return lines[0][len("error: ") :] if lines else ""


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"{c.script.split('/')[-1]}: {c.what}" for c in CASES]
)
def test_bad_input_is_refused_in_one_line_before_compute(outcomes, index):
    case, outcome = CASES[index], outcomes["results"][index]
    assert outcome["code"] == 2, (outcome["code"], outcome["stderr"][-3000:])
    assert re.search(case.error, _message(outcome)), outcome["stderr"][-3000:]
    assert "Traceback" not in outcome["stderr"]
    assert outcome["changed"] == []


def test_the_table_has_sixty_distinct_cases():
    assert len({(c.script, c.what) for c in CASES}) == len(CASES) >= 60


def _doc(outcomes) -> str:
    rows = []
    replace = {
        value: "{" + key + "}"
        for key, value in outcomes["paths"].items()
        if key not in ("base", "shared")
    }
    for i, (case, outcome) in enumerate(zip(CASES, outcomes["results"])):
        message = _message(outcome)
        message = message.replace(os.path.join(outcomes["paths"]["base"], f"case{i:03d}"), "...")
        for value, name in sorted(replace.items(), key=lambda kv: -len(kv[0])):
            message = message.replace(value, name)
        message = message.replace("`", "'").replace("|", "\\|")
        rows.append(f"| `{case.script}` | {case.what} | `error: {message}` |")
    return "\n".join(
        [
            "# Reliability: what a mistake looks like",
            "",
            "Generated from `tests/test_bad_input.py` (rewrite with `UPDATE_DOCS=1 python -m "
            "pytest tests/test_bad_input.py`): every case exits with code 2 and the one line "
            "shown, before any model is built, and leaves every file as it was. `...` is the "
            "case's folder; `{run}` a checkpoint folder, `{data}` / `{tok}` a dataset and its "
            "tokenizer, `{hf}` an HF export.",
            "",
            "| Command | Mistake | What the user sees |",
            "|---|---|---|",
            *rows,
            "",
            FAULTS,
        ]
    )


FAULTS = """## Faults during a run

| Fault | What happens | Test |
|---|---|---|
| SIGKILL mid-save | `iter_N.partial.<job>` never becomes `latest`; the run resumes from the previous checkpoint | `tests/training/test_resume.py::test_resume_is_exact_with_dropout` |
| Files an interrupted save or layout conversion left (`iter_N.partial.<job>`, `iter_N.universal`, `latest.<id>.tmp`) | removed by the next run, which says so | `tests/training/test_faults.py::test_what_an_interrupted_run_left_is_removed_and_reported` |
| SIGTERM with `--exit-signal-handler` to one process (`python pretrain_gpt.py`) and its DataLoader workers (its process group, as a terminal or a scheduler sends it) | the workers leave it to the trainer, which saves at the current iteration and exits 0 | `tests/training/test_training.py::test_sigterm_saves_a_checkpoint_and_exits_cleanly` |
| SIGTERM or SIGINT with `--exit-signal-handler` under torchrun (TP 2, `--num-workers 2`): to every process of the job (SLURM's preemption), to torchrun alone (which passes it to each rank's process group) or to one rank | every rank saves at the same iteration and exits 0, no DataLoader worker dies of it, the run resumes bit for bit; torchrun, when signalled itself, then reports that signal (its `SignalException`, exit 1) | `tests/training/test_faults.py::test_a_signal_under_torchrun_saves_where_the_ranks_agree_and_resumes_exactly` |
| A save fails on any rank (disk full, quota, permission, read-only file system) | every rank stops with `error: saving iter_N failed on rank R: the disk is full (No space left on device: <the file>); iter_M stays the latest checkpoint: free space on that disk or give --save another folder, then rerun with --load to resume` (likewise `the disk quota is used up`, `no permission to write there`, `the file system is read-only`), exit 1, no traceback, the partial folder and any temporary file removed | `tests/training/test_faults.py::test_a_full_disk_mid_save_is_named_and_the_last_checkpoint_stays`, `tests/training/test_faults.py::test_a_save_that_fails_on_one_rank_stops_the_run_and_keeps_the_last`, `tests/training/test_faults.py::test_a_failed_write_is_told_in_words_naming_the_file`, `tests/training/test_faults.py::test_a_record_that_cannot_be_written_leaves_no_temporary_file` |
| A job suspended (SIGSTOP: `scontrol suspend`, gang scheduling) past its lock's lease, a second job started on the same `--save` | from the same host: refused, naming the suspended holder (a live process on its own host is never taken over); from another host: takes the folder over in one line naming the previous holder (host, pid, start, last renewal) and why it was judged gone. Resumed, the first job stops at its next save (or its next signal check) in one line naming the new holder, writes nothing there, exit 1; `latest` and every checkpoint stay as the new holder wrote them | `tests/training/test_one_job_per_folder.py::test_a_job_suspended_past_its_lease_never_writes_to_the_folder_it_lost` |
| A refusal (a bad flag, a `--save` in use) under `torchrun --max-restarts N` or the DeepSpeed launcher | one `error:` line for the job, exit 2; torchrun does not restart it (the refusal is declared final in torchelastic's error file, and this package's torchrun plugin honours it) | `tests/test_launchers.py::test_a_flag_refused_under_a_launcher_is_told_once_and_final`, `tests/test_launchers.py::test_a_folder_in_use_under_a_launcher_is_told_once_and_final` |
| A checkpoint file damaged after its save (size or SHA-256) | refused before any compute, naming the file and the previous complete checkpoint to resume with `--ckpt-step` | `tests/training/test_faults.py::test_a_damaged_checkpoint_is_refused_and_the_previous_one_resumes` |
| Ctrl-C without `--exit-signal-handler` (a terminal's SIGINT to `python pretrain_gpt.py` and its DataLoader workers) | the run stops with the one line `interrupted (Ctrl-C): nothing saved since the last checkpoint; with --exit-signal-handler, Ctrl-C saves and then stops`, exit 130, no traceback | `tests/test_first_run.py::test_first_run_names_its_folders_builds_nothing_and_stops_on_ctrl_c` |
| Losses non-finite for `--max-skipped-steps` steps in a row | the run stops, exit 1, no checkpoint of the diverged state | `tests/training/test_training.py::test_skipped_steps_in_a_row_stop_the_run` |
| Two jobs building one index cache at once | built under the cache folder's lock; the later job reads whole files | `tests/data/test_data.py::test_two_jobs_building_one_index_cache_at_once` |
| A damaged or pickled index-cache file | the damaged set is rebuilt (with a warning); a pickled one is refused | `tests/data/test_data.py::test_damaged_index_cache_is_rebuilt_and_a_pickled_one_refused` |
| A preprocessing run killed mid-write | its `.tmp<pid>` files are removed by the next run | `tests/data/test_data.py::test_files_left_by_a_killed_preprocessing_run_are_removed` |
| An HF export whose tokenizer `AutoTokenizer` would load as another class (transformers 5 reads every Qwen2 folder's as `Qwen2Tokenizer`) | the export takes the custom class, or, if no class's folder encodes as training did, stops naming the text and both encodings; nothing written | `tests/hf/test_export_matrix.py::test_export_is_exact_or_refused`, `tests/hf/test_export_matrix.py::test_a_tokenizer_no_stock_class_loads_alike_is_refused_by_name` |
| Resuming at another TP / DP size or ZeRO stage | converted through DeepSpeed's universal checkpoint; losses and optimizer state as uninterrupted | `tests/training/test_layouts.py` |
"""


def test_reliability_doc_is_generated_from_this_table(outcomes):
    text = _doc(outcomes)
    if os.environ.get("UPDATE_DOCS"):
        with open(DOC, "w") as f:
            f.write(text)
    with open(DOC) as f:  # numbers (sizes, line counts) vary with library versions
        assert re.sub(r"\d+", "N", f.read()) == re.sub(r"\d+", "N", text), (
            "docs/reliability.md is stale: rerun with UPDATE_DOCS=1"
        )


def test_every_fault_row_names_a_test_that_exists():
    for path, name in re.findall(r"`(tests/[\w/]*test_\w+\.py)::(\w+)`", FAULTS):
        with open(os.path.join(ROOT, path)) as f:
            assert f"def {name}(" in f.read(), (path, name)
