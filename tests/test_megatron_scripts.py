"""Megatron-LM's own launch scripts (core_v0.16.1), their flags as written, only the sizes shrunk:
`examples/gpt3/train_gpt3_175b_distributed.sh` and `examples/llama/train_llama3_8b_h100_fp8.sh`.

What this trainer does not offer (pipeline parallelism, fp8, fp16 without a GPU) is refused by
name before any compute, and so is what Megatron-LM itself refuses (the GPT-3 script's
batch-size ramp-up in a run counted in iterations); with those flags at the values that mean
"off", each script trains for 2 iterations at TP 1 and 2 (the Llama-3 script saving, as written,
Megatron's distributed checkpoint format).
"""

import json
import math
import os

import pytest

from tiny_runs import gpt2_bpe_files, train, write_docs


def _gpt3(folder, tp):
    """The GPT-3 175B script's flags: a GPT-2 BPE dataset, the script's schedule and logging."""
    from megatron_focus.data.preprocess import preprocess

    vocab, merges = gpt2_bpe_files(folder)
    docs = [
        f"Document {i}: the quick brown fox jumps over the lazy dog. " * (1 + i % 3)
        for i in range(1200)
    ]  # enough that the 949,50,1 split gives each part a document
    prefix = preprocess(
        [write_docs(folder / "docs.jsonl", docs)],
        str(folder / "gpt3"),
        "GPT2BPETokenizer",
        vocab_file=vocab,
        merge_file=merges,
        append_eod=True,
    ).prefixes[0]
    run = str(folder / "run")
    return [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "64",
        "--attention-backend",
        "auto",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
        "--train-iters",
        "2",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--init-method-std",
        "0.006",
        "--clip-grad",
        "1.0",
        "--bf16",
        "--lr",
        "6.0e-5",
        "--lr-decay-style",
        "cosine",
        "--min-lr",
        "6.0e-6",
        "--lr-warmup-fraction",
        ".001",
        "--lr-decay-iters",
        "430000",
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        "1",
        "--data-path",
        prefix,
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--split",
        "949,50,1",
        "--log-interval",
        "1",
        "--save-interval",
        "10000",
        "--eval-interval",
        "1000",
        "--save",
        run,
        "--load",
        run,
        "--eval-iters",
        "1",
        "--tensorboard-dir",
        str(folder / "tb"),
        "--data-cache-path",
        str(folder / "cache"),
    ]


# The refusals of the GPT-3 script: (flags, what the one-line error says)
GPT3_REFUSED = [
    (["--pipeline-model-parallel-size", "16"], "pipeline parallelism is not supported"),
    # Megatron-LM: "expected no batch-size rampup for iteration-based training"
    (["--rampup-batch-size", "16", "16", "5859375"], "it needs --train-samples"),
]


def _llama3(folder, tp):
    """The Llama-3 8B fp8 script's flags, its mock-data branch (the script's default)."""
    run = str(folder / "run")
    return [
        "--use-mcore-models",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--ffn-hidden-size",
        "224",
        "--num-attention-heads",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--kv-channels",
        "16",
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "64",
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        "1000000",
        "--rotary-percent",
        "1.0",
        "--attention-dropout",
        "0.0",
        "--hidden-dropout",
        "0.0",
        "--swiglu",
        "--init-method-std",
        "0.0134",
        "--attention-backend",
        "fused",
        "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
        "--train-samples",
        "8",
        "--lr-decay-samples",
        "8",
        "--lr-warmup-samples",
        "4",
        "--lr",
        "0.00015",
        "--min-lr",
        "0.00001",
        "--decoupled-lr",
        "5.0e-4",
        "--decoupled-min-lr",
        "4.5e-5",
        "--lr-decay-style",
        "cosine",
        "--clip-grad",
        "1.0",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--bf16",
        "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion",
        "--calculate-per-token-loss",
        "--manual-gc",
        "--empty-unused-memory-level",
        "1",
        "--exit-duration-in-mins",
        "235",
        "--fp8-amax-history-len",
        "1024",
        "--fp8-amax-compute-algo",
        "max",
        "--fp8-param-gather",
        "--tensor-model-parallel-size",
        str(tp),
        "--context-parallel-size",
        "1",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        # the script writes "--split '99,1,0'" in an unquoted array: the quotes reach the trainer
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "1000",
        "--data-cache-path",
        str(folder / "cache"),
        "--tiktoken-pattern",
        "v2",
        "--split",
        "'99,1,0'",
        "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files",
        "--num-workers",
        "1",
        "--log-interval",
        "1",
        "--eval-iters",
        "2",
        "--eval-interval",
        "100",
        "--save-interval",
        "1000",
        "--log-throughput",
        "--profile",
        "--profile-step-start",
        "1",
        "--profile-step-end",
        "2",
        "--ckpt-format",
        "torch_dist",
        "--distributed-timeout-minutes",
        "60",
        "--save",
        run,
        "--load",
        run,
        "--tensorboard-dir",
        str(folder / "tb"),
    ]


LLAMA3_REFUSED = [
    (["--fp8-format", "hybrid"], "fp8 needs Transformer Engine"),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p"], "only allgather"),
]
SCRIPTS = {"gpt3": (_gpt3, GPT3_REFUSED), "llama3": (_llama3, LLAMA3_REFUSED)}


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_megatron_launch_script_trains_as_written(script, tp, tmp_path):
    flags, _ = SCRIPTS[script]
    argv = flags(tmp_path, tp)
    history = train(tp, argv)
    assert len(history["losses"]) == 2 and all(map(math.isfinite, history["losses"]))
    run = tmp_path / "run"
    assert (run / "latest").read_text() == "iter_0000002"
    if script == "llama3":  # --ckpt-format torch_dist: Megatron-LM's pointer too
        assert (run / "latest_checkpointed_iteration.txt").read_text() == "2"
    with open(run / "iter_0000002" / "model_args.json") as f:
        assert json.load(f)["tensor_model_parallel_size"] == tp
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_what_a_megatron_script_asks_for_and_is_not_offered_is_refused(script, tmp_path):
    from megatron_focus.training.arguments import parse_args

    flags, refused = SCRIPTS[script]
    argv = flags(tmp_path, 1)
    for extra, message in refused:
        with pytest.raises(ValueError, match=message):
            parse_args(argv + extra)
    with pytest.raises(ValueError, match="--fp16 needs a GPU"):  # the GPT-3 script's precision
        parse_args([flag for flag in argv if flag != "--bf16"] + ["--fp16"])
