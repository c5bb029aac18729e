"""Command-line flags, named and defaulted as in Megatron-LM's `pretrain_gpt.py`.

A Megatron-LM user's launch script carries over: the same flag means the same thing. What this
project adds is grouped under "megatron-focus". `validate_args` refuses bad combinations before
anything is built, with a message that says which flag to change.
"""

import argparse
import importlib.util
import os
import sys
import warnings
from typing import List, Optional

from megatron_focus import cli
from megatron_focus.choices import TOKENIZER_TYPES
from megatron_focus.compat import add_compat_args, check_compat_args
from megatron_focus.data import reads_data_files
from megatron_focus.deepspeed_config import take_json_settings
from megatron_focus.global_batch import GlobalBatch
from megatron_focus.variants import VARIANTS, FocusConfig, settings_classes, variant

SEQ_LENGTH = 256  # --seq-length when neither the flag nor a Megatron-LM checkpoint gives one


def int_tuple(text: str) -> tuple:
    """Megatron-LM's tuple flags: "127,0" or "(127,0)" -> (127, 0)."""
    try:
        return tuple(int(x) for x in text.strip("()[] ").split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers, e.g. 127,0") from None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--num-layers",
        type=int,
        default=4,
        help="transformer layers (the demo's tiny model unless given)",
    )
    g.add_argument("--hidden-size", type=int, default=256, help="width of the residual stream")
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="default 4 x hidden, or the SwiGLU-equivalent 8/3 x hidden rounded to 64",
    )
    g.add_argument("--num-attention-heads", type=int, default=4, help="query heads per layer")
    g.add_argument("--kv-channels", type=int, default=None, help="head dim; default hidden/heads")
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="share key and value heads between query heads (--num-query-groups)",
    )
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=1,
        help="with --group-query-attention: key and value heads",
    )
    g.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help=f"tokens per sample (default {SEQ_LENGTH}; with --use-checkpoint-args, a "
        "Megatron-LM checkpoint's, as there)",
    )
    g.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="size of the learned position table; default --seq-length",
    )
    g.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope", "none"),
        default="learned_absolute",
        help="none: no position information (NoPE)",
    )
    g.add_argument(
        "--no-position-embedding",
        dest="add_position_embedding",
        action="store_false",
        help="deprecated in Megatron-LM: no effect with rope, refused otherwise (use "
        "--position-embedding-type none)",
    )
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE's base period")
    g.add_argument(
        "--rotary-percent",
        type=float,
        default=1.0,
        help="share of each head's dimensions that RoPE rotates",
    )
    g.add_argument(
        "--use-rope-scaling",
        action="store_true",
        help="Llama 3.1's RoPE frequency scaling (low 1, high 4, original context 8192)",
    )
    g.add_argument(
        "--rope-scaling-factor", type=float, default=8.0, help="with --use-rope-scaling: the factor"
    )
    g.add_argument(
        "--normalization",
        choices=("LayerNorm", "RMSNorm"),
        default="LayerNorm",
        help="the norm before attention, before the MLP and at the end",
    )
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of --normalization")
    g.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="norm scales stored zero-centred, applied as 1 + weight (weight decay "
        "pulls them towards 1)",
    )
    g.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="normalise each query and key head (over the head dimension) before "
        "attention, with --normalization's norm",
    )
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated SiLU) instead of GELU")
    g.add_argument(
        "--openai-gelu",
        action="store_true",
        help="GELU's tanh approximation (GPT-2's gelu_new) instead of the exact one",
    )
    g.add_argument(
        "--squared-relu",
        action="store_true",
        help="relu(x)^2 as the MLP's activation instead of GELU",
    )
    g.add_argument(
        "--disable-bias-linear",
        dest="add_bias_linear",
        action="store_false",
        help="no biases in the linear layers (Llama style)",
    )
    g.add_argument(
        "--add-qkv-bias",
        action="store_true",
        help="a bias on the QKV projection even with --disable-bias-linear (Qwen2)",
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="the output layer has its own weights instead of the input embedding's",
    )
    g.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.1,
        help="dropout on each layer's output before the residual add",
    )
    g.add_argument(
        "--attention-dropout",
        type=float,
        default=0.1,
        help="dropout on the attention probabilities",
    )
    g.add_argument(
        "--init-method-std",
        type=float,
        default=0.02,
        help="standard deviation of the normal initialisation of the weights",
    )
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this times --tensor-model-parallel-size",
    )
    g.add_argument(
        "--window-size",
        type=int_tuple,
        default=None,
        metavar="LEFT,RIGHT",
        help="sliding-window attention (standard and xsa): query i sees keys "
        "i - LEFT .. i; RIGHT must be 0 (causal); as Megatron-LM's",
    )
    g.add_argument(
        "--attention",
        choices=VARIANTS,
        default="standard",
        help="core attention variant (megatron-focus)",
    )
    g.add_argument(
        "--xsa-layers",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="layers (1-based) that use XSA; the others use the base attention. "
        "Default: all (megatron-focus)",
    )


def _add_variant_settings_args(p: argparse.ArgumentParser) -> None:
    """One group of flags per settings class of the registered variants (Focus's: --focus-*)."""
    for settings, names in settings_classes().items():
        settings.add_flags(
            p.add_argument_group(f"{settings.prefix} (--attention {', '.join(names)})")
        )


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="ranks that split each layer's weights (Megatron-Core's tensor parallelism)",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with tensor parallelism: split the norms' and dropouts' activations along the "
        "sequence too",
    )
    g.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="ranks that split each sequence (Megatron's rank order: TP, CP, DP); the sequence is "
        "cut in 2 x CP chunks, rank r holding chunks r and 2 CP - 1 - r",
    )
    g.add_argument(
        "--cp-comm-type",
        nargs="+",
        default=["allgather"],
        help="how context-parallel ranks exchange keys and values: allgather (the only one "
        "here; Megatron's p2p, a2a and a2a+p2p are refused)",
    )
    g.add_argument(
        "--distributed-backend",
        choices=("nccl", "gloo"),
        default=None,
        help="default: nccl with a GPU, gloo without",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10,
        help="how long a collective waits for the other ranks before failing: a rank that "
        "stalls or dies then ends the job, naming the iteration (fractions allowed)",
    )


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument(
        "--decoupled-lr",
        type=float,
        default=None,
        help="a peak LR of their own for the input embedding and output layer",
    )
    g.add_argument(
        "--decoupled-min-lr",
        type=float,
        default=None,
        help="with --decoupled-lr: their minimum LR (default --min-lr)",
    )
    g.add_argument(
        "--recompute-activations",
        action="store_true",
        help="recompute each layer's core attention in the backward pass (= "
        "--recompute-granularity selective)",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="full: recompute whole layers (with --recompute-method); selective: the "
        "core attention only",
    )
    g.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        default=None,
        help="with full recompute: uniform checkpoints groups of "
        "--recompute-num-layers layers; block only the first "
        "--recompute-num-layers layers",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="layers per recompute group (uniform) or recomputed layers (block)",
    )
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="the loss is the mean over every loss token of the global batch (each "
        "token weighs the same), not the mean of the micro-batches' means",
    )
    g.add_argument(
        "--micro-batch-size", type=int, default=8, help="samples per rank per forward pass"
    )
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="default micro batch x data-parallel size (no accumulation)",
    )
    g.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="grow the global batch from START to --global-batch-size by INCREMENT, evenly over "
        "the first SAMPLES consumed samples (Megatron-LM's; needs --train-samples); the LR "
        "schedule and the logs count samples",
    )
    g.add_argument(
        "--decrease-batch-size-if-needed",
        action="store_true",
        help="train a global batch that is not a multiple of micro batch x data-parallel size "
        "rounded down to one, instead of refusing it (Megatron-LM's)",
    )
    g.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="default 300, or --train-samples / --global-batch-size",
    )
    g.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="instead of --train-iters: samples to train on; the run takes whole global "
        "batches (a last partial one is dropped) and counts the LR schedule in samples",
    )
    g.add_argument(
        "--lr-warmup-samples",
        type=int,
        default=None,
        help="with --train-samples: warmup in samples (default 0)",
    )
    g.add_argument(
        "--lr-decay-samples",
        type=int,
        default=None,
        help="with --train-samples: decay in samples (default --train-samples)",
    )
    g.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="warmup as a fraction of the decay (instead of --lr-warmup-iters)",
    )
    g.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="peak learning rate (Megatron-LM's scripts always give one)",
    )
    g.add_argument(
        "--min-lr",
        type=float,
        default=None,
        help="default 0 (Megatron-LM's); the demo's: --lr / 10",
    )
    g.add_argument(
        "--lr-warmup-iters",
        type=int,
        default=None,
        help="default 0 (Megatron-LM's); the demo's: 10%% of --train-iters",
    )
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument(
        "--lr-decay-style",
        choices=("constant", "linear", "cosine"),
        default=None,
        help="default linear (Megatron-LM's); the demo's: cosine",
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        default=0.01,
        help="AdamW's decoupled weight decay (not on biases and norms)",
    )
    g.add_argument(
        "--clip-grad",
        type=float,
        default=1.0,
        help="clip the global gradient norm to this (0: no clipping)",
    )
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's first-moment decay")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam's second-moment decay")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam's epsilon")
    g.add_argument(
        "--seed", type=int, default=1234, help="seed of the initialisation, data order and dropout"
    )
    precision = g.add_mutually_exclusive_group()
    precision.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 weights and compute (DeepSpeed's bf16), fp32 optimizer state",
    )
    precision.add_argument(
        "--fp16",
        action="store_true",
        help="fp16 weights and compute with dynamic loss scaling (DeepSpeed's fp16; GPU only)",
    )
    g.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 1, 2, 3),
        default=1,
        help="DeepSpeed ZeRO stage (overridden by --deepspeed_config if it sets one)",
    )
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="save (with --save) and exit when the iteration is a multiple of this",
    )
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on SIGTERM or SIGINT (to any rank or the whole process group), save a "
        "checkpoint at the current iteration and exit cleanly (needs --save)",
    )
    g.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        help="save (with --save) and exit once the run has lasted this long (e.g. "
        "under a job's time limit)",
    )
    g.add_argument(
        "--manual-gc",
        action="store_true",
        help="turn Python's automatic garbage collection off (its pauses differ "
        "between ranks and stall them all); collect every --manual-gc-interval "
        "iterations and around evaluations",
    )
    g.add_argument(
        "--manual-gc-interval",
        type=int,
        default=0,
        help="with --manual-gc: collect every N iterations (0: only around evaluations)",
    )
    g.add_argument(
        "--no-manual-gc-eval",
        "--disable-manual-gc-eval",
        dest="manual_gc_eval",
        action="store_false",
        help="with --manual-gc: no collection around evaluations",
    )
    g.add_argument(
        "--max-skipped-steps",
        type=int,
        default=10,
        help="stop with an error, saving nothing more, after this many consecutive "
        "steps skipped for a non-finite loss (0: never stop)",
    )


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="a prefix, or weights and prefixes: 0.7 a_text_document 0.3 b_text_document;"
        " default: the embedded stdlib corpus",
    )
    g.add_argument(
        "--mock-data",
        action="store_true",
        help="Megatron-Core's mock data: synthetic sequences, nothing read (for "
        "trying a launch script); needs a tokenizer, e.g. --tokenizer-type "
        "NullTokenizer --vocab-size 32000",
    )
    g.add_argument(
        "--eod-mask-loss", action="store_true", help="leave end-of-document tokens out of the loss"
    )
    g.add_argument(
        "--reset-position-ids",
        action="store_true",
        help="restart position ids after each end of document (learned position "
        "embeddings; RoPE follows the sequence, as in Megatron-Core)",
    )
    g.add_argument(
        "--train-data-path",
        nargs="*",
        default=None,
        help="instead of --data-path and --split: the training data, a prefix or "
        "weights and prefixes as --data-path's",
    )
    g.add_argument(
        "--valid-data-path",
        nargs="*",
        default=None,
        help="with --train-data-path: the validation data (none: no validation)",
    )
    g.add_argument(
        "--test-data-path",
        nargs="*",
        default=None,
        help="with --train-data-path: the test data (checked, not read by training)",
    )
    g.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="tokens attend only within their own document (Megatron-Core's dataset "
        "builds the mask); Focus's groups, window, sinks and Sinkhorn restart at each document",
    )
    g.add_argument(
        "--split",
        default=None,
        help="train,valid,test weights dividing --data-path's documents; default 969,30,1",
    )
    g.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="default: GPT2BPETokenizer when --vocab-file and --merge-file are given "
        "(Megatron-LM's GPT-3 example script gives no type)",
    )
    g.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece .model, or an HF tokenizer.json or its folder",
    )
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt")
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer: ids before the end-of-document id",
    )
    g.add_argument(
        "--data-cache-path",
        default=None,
        help="where dataset indices (and the embedded corpus) are cached",
    )
    g.add_argument(
        "--mqar",
        action="store_true",
        help="train and validate on synthetic multi-query associative recall "
        "(data/mqar.py: key-value pairs, then queries far after them) instead of "
        "--data-path (megatron-focus)",
    )
    g.add_argument("--mqar-pairs", type=int, default=32, help="key-value pairs per sequence")
    g.add_argument(
        "--mqar-queries",
        type=int,
        default=None,
        help="queries per sequence: every key once, then random keys (default: one per pair)",
    )
    g.add_argument(
        "--mqar-packed",
        action="store_true",
        help="each pair one token (key x value): recall in one attention hop, which a "
        "tiny model learns on a CPU",
    )
    g.add_argument(
        "--mqar-vocab-size",
        type=int,
        default=512,
        help="ids: the filler, keys in the lower half, values in the upper",
    )
    g.add_argument(
        "--mqar-min-distance",
        type=int,
        default=256,
        help="tokens at least between the pairs and the first query",
    )
    g.add_argument(
        "--num-workers",
        type=int,
        default=2,
        help="DataLoader worker processes that read and collate batches ahead of the "
        "step (0: in the training process)",
    )


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument(
        "--save",
        default=None,
        help="checkpoint folder to write (none: nothing saved, except the demo's runs/ folder)",
    )
    g.add_argument(
        "--load",
        default=None,
        help="checkpoint folder to resume from (its latest checkpoint, or --ckpt-step's)",
    )
    g.add_argument(
        "--pretrained-checkpoint",
        default=None,
        help="the weights to start from while --load holds no checkpoint yet (as "
        "--finetune from it); once this run has saved, --load resumes it",
    )
    g.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="the model's shape flags from --load's checkpoint instead of the "
        "command line (all but the tensor-parallel size)",
    )
    g.add_argument(
        "--no-load-optim",
        action="store_true",
        help="resume the weights, iteration and data position but not the optimizer "
        "state or LR schedule (this run's start afresh)",
    )
    g.add_argument(
        "--no-load-rng",
        action="store_true",
        help="resume without the checkpoint's random states (seeded from --seed and the iteration)",
    )
    g.add_argument(
        "--no-save-rng",
        action="store_true",
        help="checkpoints hold no random states (a resume seeds from --seed and the iteration)",
    )
    g.add_argument(
        "--no-save-optim",
        action="store_true",
        help="checkpoints hold no optimizer state (smaller; such a checkpoint resumes "
        "with --no-load-optim or --finetune); not with ZeRO stage 3, whose "
        "optimizer shards hold the weights",
    )
    g.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="resume from --load's checkpoint of this iteration rather than its latest "
        "(e.g. the one before a damaged checkpoint)",
    )
    g.add_argument(
        "--save-interval",
        "--persistent-save-interval",
        type=int,
        default=None,
        help="save (with --save) every this many iterations; besides, at the end of the run",
    )
    g.add_argument(
        "--ckpt-format",
        choices=("torch", "torch_dist"),
        default="torch",
        help="torch: DeepSpeed's files; torch_dist: each checkpoint is also Megatron-Core's "
        "distributed checkpoint (model, iteration, args, LR schedule) as Megatron-LM saves it, "
        "read by Megatron-LM with --no-load-optim at any TP size (its optimizer and schedule "
        "restart); the optimizer state stays in DeepSpeed's files beside it, from which a "
        "resume here is exact. A Megatron-LM torch_dist checkpoint starts a run here with "
        "--finetune, --pretrained-checkpoint or --retrofit, or continues with --no-load-optim "
        "(default: torch)",
    )
    g.add_argument(
        "--finetune",
        action="store_true",
        help="load only the model weights from --load; iteration, optimizer and "
        "LR schedule start fresh",
    )
    g.add_argument(
        "--retrofit",
        action="store_true",
        help="train only the Focus routers (W_g, C) of --load's model, every other "
        "weight frozen; from a non-Focus checkpoint this implies --finetune",
    )
    g.add_argument(
        "--save-full",
        action="store_true",
        help="with --retrofit: checkpoints hold the whole model, not only the trained "
        "routers and a reference to --load's checkpoint",
    )
    schedule = g.add_mutually_exclusive_group()
    schedule.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        help="on resume, this run's schedule flags (--lr, --min-lr, warmup, "
        "decay, --weight-decay, --train-iters) replace the checkpoint's",
    )
    schedule.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        help="on resume, keep the checkpoint's schedule whatever the flags say "
        "(default: a difference is an error)",
    )
    add_unsafe_checkpoints_flag(g)


def add_unsafe_checkpoints_flag(group) -> None:
    """`--allow-unsafe-checkpoints`, for every command that reads checkpoints."""
    group.add_argument(
        "--allow-unsafe-checkpoints",
        action="store_true",
        help="read checkpoint files that hold pickled objects other than tensors "
        "and DeepSpeed's own records (a file can run code as it loads): "
        "only for files from a source you trust",
    )


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument(
        "--log-interval", type=int, default=None, help="default 100 (Megatron-LM's); the demo's: 10"
    )
    g.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="default 1000 (Megatron-LM's); the demo's: 100",
    )
    g.add_argument(
        "--eval-iters", type=int, default=None, help="default 100 (Megatron-LM's); the demo's: 10"
    )
    g.add_argument(
        "--tensorboard-dir",
        default=None,
        help="write TensorBoard curves here (none: no TensorBoard)",
    )
    g.add_argument(
        "--log-throughput",
        action="store_true",
        help="the log line shows Megatron's throughput per GPU (TFLOP/s/GPU); with "
        "--log-timers-to-tensorboard also the 'throughput' curve",
    )
    g.add_argument(
        "--log-timers-to-tensorboard",
        action="store_true",
        help="TensorBoard gets 'iteration-time' (seconds per iteration)",
    )
    g.add_argument(
        "--no-log-loss-scale-to-tensorboard",
        "--disable-log-loss-scale-to-tensorboard",
        dest="log_loss_scale_to_tensorboard",
        action="store_false",
        help="TensorBoard gets no 'loss-scale' curve",
    )
    g.add_argument(
        "--log-world-size-to-tensorboard",
        action="store_true",
        help="TensorBoard gets a 'world-size' curve",
    )
    g.add_argument(
        "--log-params-norm",
        action="store_true",
        help="the log line and TensorBoard ('params-norm') get the L2 norm of all weights",
    )
    g.add_argument(
        "--log-num-zeros-in-grad",
        action="store_true",
        help="the log line and TensorBoard ('num-zeros') get the number of zero elements in the "
        "gradients each logged step applies",
    )
    g.add_argument(
        "--log-memory-to-tensorboard",
        action="store_true",
        help="TensorBoard gets the memory curves (mem-*: CUDA allocator on a GPU, "
        "resident set on the CPU)",
    )
    g.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="TensorBoard gets the validation perplexity ('lm loss validation ppl')",
    )
    g.add_argument(
        "--tensorboard-log-interval",
        type=int,
        default=1,
        help="write TensorBoard at log steps whose iteration is a multiple of this",
    )
    g.add_argument(
        "--wandb-project",
        default="",
        help="also log the curves to Weights & Biases, this project (pip install -e "
        "'.[wandb]'; WANDB_MODE=offline needs no network)",
    )
    g.add_argument("--wandb-exp-name", default="", help="with --wandb-project: the run's name")
    g.add_argument("--wandb-entity", default="", help="with --wandb-project: the team or user")
    g.add_argument(
        "--wandb-save-dir",
        default="",
        help="with --wandb-project: wandb's local files (default --save/wandb, or "
        "--tensorboard-dir/wandb)",
    )
    g.add_argument(
        "--profile",
        action="store_true",
        help="trace iterations --profile-step-start to --profile-step-end on "
        "--profile-ranks (see --use-pytorch-profiler)",
    )
    g.add_argument(
        "--use-pytorch-profiler",
        action="store_true",
        help="with --profile: the PyTorch profiler's trace in --tensorboard-dir (always "
        "so without a GPU); otherwise cudaProfilerStart/Stop for nsys",
    )
    g.add_argument(
        "--profile-step-start",
        type=int,
        default=10,
        help="with --profile: the first traced iteration",
    )
    g.add_argument(
        "--profile-step-end",
        type=int,
        default=12,
        help="with --profile: the iteration the trace stops at",
    )
    g.add_argument(
        "--profile-ranks",
        type=int,
        nargs="+",
        default=[0],
        help="with --profile: the global ranks that trace",
    )


def _gpu() -> bool:
    from megatron_focus import platform  # here, not at import: --help needs no torch

    return platform.has_cuda()


def _add_deepspeed_args(p: argparse.ArgumentParser) -> None:
    """DeepSpeed's own flags, as `deepspeed.add_config_arguments` adds them (tests/test_cli.py
    checks that they stay the same): importing DeepSpeed takes seconds that --help should not."""
    g = p.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    g.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)",
    )
    g.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file."
    )
    g.add_argument(
        "--deepscale",
        default=False,
        action="store_true",
        help="Deprecated enable DeepSpeed (helper flag for user code, no impact on "
        "DeepSpeed backend)",
    )
    g.add_argument(
        "--deepscale_config",
        default=None,
        type=str,
        help="Deprecated DeepSpeed json configuration file.",
    )


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(
        description="megatron-focus: GPT pretraining with Focus and XSA attention",
        usage="%(prog)s [--flag [value ...] ...]",
        allow_abbrev=False,
    )
    _add_model_args(p)
    _add_variant_settings_args(p)
    _add_parallel_args(p)
    _add_training_args(p)
    _add_data_args(p)
    _add_checkpoint_args(p)
    _add_logging_args(p)
    p.add_argument(
        "--local_rank",
        type=int,
        default=None,
        help="passed by the deepspeed launcher, which sets LOCAL_RANK too: the device is that "
        "variable's",
    )
    _add_deepspeed_args(p)
    p.add_argument(
        "--yaml-cfg",
        default=None,
        metavar="PATH",
        help="all flags from this YAML file instead of the command line, laid out as "
        "Megatron-LM's (flag names with underscores at the top; language_model: and "
        "model_parallel: sections in Megatron-Core's config names)",
    )
    add_compat_args(p)
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.yaml_cfg is not None:
        args = _from_yaml(args, parser, sys.argv[1:] if argv is None else argv)
    if args.use_checkpoint_args:
        _use_checkpoint_args(args)
    validate_args(args)
    return args


def _from_yaml(
    given: argparse.Namespace, parser: argparse.ArgumentParser, argv: List[str]
) -> argparse.Namespace:
    """Megatron-LM's --yaml-cfg: the flags the file holds, and the launcher's beside them."""
    from megatron_focus import yaml_config

    yaml_config.check_command_line(argv)
    args = parser.parse_args(yaml_config.yaml_argv(given.yaml_cfg, parser))
    beside = {a.dest for a in parser._actions if set(a.option_strings) & set(yaml_config.LAUNCHER)}
    for dest in beside | {"yaml_cfg"}:
        setattr(args, dest, getattr(given, dest))
    return args


def _use_checkpoint_args(args: argparse.Namespace) -> None:
    """Megatron's --use-checkpoint-args: the model as --load's checkpoint records it."""
    from megatron_focus.checkpoint import format as checkpoint_format
    from megatron_focus.checkpoint.saved import SavedCheckpoint

    if not args.load:
        raise ValueError("--use-checkpoint-args needs --load (the checkpoint to read them from)")
    tag = checkpoint_format.resume_tag(args)
    if tag is None:
        raise FileNotFoundError(f"--use-checkpoint-args: --load {args.load} holds no checkpoint")
    checkpoint = SavedCheckpoint.open(os.path.join(args.load, tag), args.allow_unsafe_checkpoints)
    saved = checkpoint.model_args
    if args.seq_length is None:  # not given: Megatron-LM's record has one (not forced, as there)
        args.seq_length = checkpoint.seq_length
    for key, value in saved.items():
        if key not in ("tensor_model_parallel_size", "padded_vocab_size"):
            setattr(args, key, value)
    # the record holds one group per head without GQA, as validation would make it
    args.group_query_attention = saved["num_query_groups"] != saved["num_attention_heads"]


# The least value each numeric flag may take (flags left unset, None, are not checked).
AT_LEAST = {
    **dict.fromkeys(
        (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "kv_channels",
            "ffn_hidden_size",
            "num_query_groups",
            "seq_length",
            "max_position_embeddings",
            "make_vocab_size_divisible_by",
            "micro_batch_size",
            "global_batch_size",
            "tensor_model_parallel_size",
            "train_iters",
            "lr_decay_iters",
            "log_interval",
            "eval_interval",
            "train_samples",
            "lr_decay_samples",
            "save_interval",
            "exit_interval",
            "recompute_num_layers",
            "tensorboard_log_interval",
        ),
        1,
    ),
    **dict.fromkeys(
        (
            "lr",
            "min_lr",
            "clip_grad",
            "lr_warmup_iters",
            "eval_iters",
            "num_workers",
            "max_skipped_steps",
            "lr_warmup_samples",
            "lr_warmup_fraction",
            "init_method_std",
            "hidden_dropout",
            "attention_dropout",
            "weight_decay",
            "ckpt_step",
            "manual_gc_interval",
            "decoupled_lr",
            "decoupled_min_lr",
            "profile_step_start",
        ),
        0,
    ),
}
# Flags bounded above too: (whether a value is allowed, the rule in words).
WITHIN = {
    "rotary_percent": (lambda v: 0 < v <= 1, "above 0 and at most 1"),
    "rope_scaling_factor": (lambda v: v >= 1, "at least 1"),
    "exit_duration_in_mins": (lambda v: v > 0, "above 0"),
    "distributed_timeout_minutes": (lambda v: v > 0, "above 0"),
    "hidden_dropout": (lambda v: v < 1, "below 1"),
    "attention_dropout": (lambda v: v < 1, "below 1"),
}


# Flags left unset take Megatron-LM 0.16's default, except in the demo (no --data-path: the
# embedded corpus or --mqar), whose short runs want a warmup, frequent logs and a short validation.
DEFAULTS = {  # dest: (Megatron-LM's, the demo's)
    "min_lr": (lambda a: 0.0, lambda a: a.lr / 10),
    "lr_decay_style": (lambda a: "linear", lambda a: "cosine"),
    # a run in samples (--train-samples) gives its warmup in samples
    "lr_warmup_iters": (
        lambda a: None if a.train_samples else 0,
        lambda a: None if a.train_samples else a.train_iters // 10,
    ),
    "lr_warmup_samples": (
        lambda a: 0 if a.train_samples else None,
        lambda a: a.train_samples // 10 if a.train_samples else None,
    ),
    "log_interval": (lambda a: 100, lambda a: 10),
    "eval_interval": (lambda a: 1000, lambda a: 100),
    "eval_iters": (lambda a: 100, lambda a: 10),
}


def _fill_defaults(args: argparse.Namespace) -> None:
    demo = not reads_data_files(args) and not args.mock_data
    for dest, (megatron, ours) in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, (ours if demo else megatron)(args))
    if args.decoupled_lr is not None and args.decoupled_min_lr is None:
        args.decoupled_min_lr = args.min_lr
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ValueError("--decoupled-min-lr needs --decoupled-lr")


def _check_ranges(args: argparse.Namespace) -> None:
    """Refuse values no run can use (a zero size, a negative interval) by flag name."""
    for dest, least in AT_LEAST.items():
        value = getattr(args, dest)
        if value is not None and value < least:
            raise ValueError(f"--{dest.replace('_', '-')} {value}: must be at least {least}")
    for dest, (allowed, words) in WITHIN.items():
        if getattr(args, dest) is not None and not allowed(getattr(args, dest)):
            raise ValueError(f"--{dest.replace('_', '-')} {getattr(args, dest)}: must be {words}")


def _validate_recompute(args: argparse.Namespace) -> None:
    """Megatron's rules: --recompute-activations means selective; full needs a method and a
    layer count, which selective does not take."""
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        if args.recompute_method is None:
            raise ValueError(
                "--recompute-granularity full needs --recompute-method uniform or block"
            )
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1
        if args.recompute_method == "block" and args.recompute_num_layers > args.num_layers:
            raise ValueError(
                f"--recompute-num-layers {args.recompute_num_layers} exceeds "
                f"--num-layers {args.num_layers}"
            )
    elif args.recompute_method is not None or args.recompute_num_layers is not None:
        raise ValueError(
            "--recompute-method and --recompute-num-layers are for --recompute-granularity full"
        )


def validate_args(
    args: argparse.Namespace, world_size: Optional[int] = None, training: bool = True
) -> None:
    """Fill derived defaults and refuse what cannot run, before any model is built;
    `training=False` for a model that only evaluates (what only training refuses passes)."""
    if world_size is None:  # as a launcher (torchrun, deepspeed) tells it
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.seq_length is None:
        args.seq_length = SEQ_LENGTH
    _check_ranges(args)
    _schedule(args, world_size)
    _fill_defaults(args)
    check_compat_args(args)
    tp = args.tensor_model_parallel_size
    for settings in settings_classes():  # every variant's flags, whatever the variant
        settings.from_args(args)
    _validate_focus(args, training)
    _validate_recompute(args)
    if args.xsa_layers is not None:
        if not variant(args.attention).xsa:
            xsa = " or ".join(v.name for v in VARIANTS.values() if v.xsa)
            raise ValueError(f"--xsa-layers needs --attention {xsa}, not {args.attention}")
        missing = [n for n in args.xsa_layers if not 1 <= n <= args.num_layers]
        if missing:
            raise ValueError(
                f"--xsa-layers {' '.join(map(str, missing))}: no such layer; layers are numbered "
                f"1 to --num-layers {args.num_layers}"
            )
    if args.hidden_size % args.num_attention_heads and args.kv_channels is None:
        raise ValueError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}; set --kv-channels explicitly"
        )
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.num_attention_heads % tp:
        raise ValueError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups:
        raise ValueError(
            f"--num-query-groups {args.num_query_groups} does not divide "
            f"--num-attention-heads {args.num_attention_heads}"
        )
    if args.num_query_groups % tp and tp % args.num_query_groups:
        raise ValueError(
            f"--num-query-groups {args.num_query_groups} must be a multiple or a divisor of "
            f"--tensor-model-parallel-size {tp}"
        )
    if args.sequence_parallel and tp == 1:  # Megatron-LM turns it off too (launch scripts set it)
        warnings.warn(
            "--sequence-parallel has no effect with --tensor-model-parallel-size 1: turned off"
        )
        args.sequence_parallel = False
    if args.sequence_parallel and args.seq_length % tp:
        raise ValueError(
            f"--sequence-parallel splits --seq-length {args.seq_length} over "
            f"{tp} tensor-parallel ranks: it must be divisible"
        )
    if world_size % tp:
        raise ValueError(f"world size {world_size} is not divisible by TP size {tp}")
    _validate_context_parallel(args, world_size)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if (
        args.position_embedding_type == "learned_absolute"
        and args.seq_length > args.max_position_embeddings
    ):
        raise ValueError(
            f"--seq-length {args.seq_length} is longer than the learned position table "
            f"(--max-position-embeddings {args.max_position_embeddings})"
        )
    if args.window_size is not None:
        if len(args.window_size) != 2 or args.window_size[1] != 0 or args.window_size[0] < 0:
            raise ValueError(
                f"--window-size {args.window_size}: give LEFT,0 with LEFT >= 0 "
                "(a causal window of LEFT + 1 keys)"
            )
        if variant(args.attention).focus:
            raise ValueError(
                "--window-size is for standard and xsa attention: Focus has its own "
                "local window (--focus-window)"
            )
    _validate_architecture(args)
    _validate_training(args, world_size)
    take_json_settings(args, data_parallel_size(args, world_size))  # before any data or model
    if args.fp16 and not _gpu():
        raise ValueError(
            "--fp16 needs a GPU (DeepSpeed has no fp16 on the CPU): use --bf16 or fp32"
        )
    if args.zero_stage == 3 and args.ckpt_format == "torch_dist":
        raise ValueError(
            "--ckpt-format torch_dist: ZeRO stage 3 partitions the weights; use --zero-stage 2 "
            "or lower, or save as torch and export the weights (tools/convert_to_hf.py)"
        )
    if args.zero_stage == 3 and args.no_save_optim:
        raise ValueError(
            "--no-save-optim: ZeRO stage 3 keeps the weights in the optimizer's "
            "shards; use --zero-stage 2 or lower, or save the optimizer"
        )
    if args.ffn_hidden_size is None:
        if args.swiglu:
            # Megatron-LM's rule: keep the MLP's parameter count that of a 4h GELU MLP.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size


def _validate_architecture(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for the model flags that exclude each other."""
    if args.openai_gelu and args.swiglu:
        raise ValueError("--openai-gelu chooses the GELU of a GELU MLP: not with --swiglu")
    if args.squared_relu and (args.swiglu or args.openai_gelu):
        raise ValueError(
            "--squared-relu is the MLP's activation: not with --swiglu or --openai-gelu"
        )
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise ValueError(
            "--no-position-embedding is deprecated, use --position-embedding-type "
            "none (as in Megatron-LM)"
        )
    if args.use_rope_scaling and args.position_embedding_type != "rope":
        raise ValueError("--use-rope-scaling scales RoPE: it needs --position-embedding-type rope")


def _validate_focus(args: argparse.Namespace, training: bool) -> None:
    focus = FocusConfig.from_args(args)
    if training and focus.attention_mode == "sparse" and args.attention_dropout > 0:
        raise ValueError(
            "--focus-attention-mode sparse has no attention dropout: add --attention-dropout 0"
        )
    if focus.attention_mode == "sparse" and args.retrofit:
        raise ValueError(
            "--retrofit trains the routers, which --focus-attention-mode sparse freezes: "
            "retrofit in soft mode"
        )
    if focus.router == "random" and args.retrofit:
        raise ValueError(
            "--retrofit trains the routers alone, which --focus-router random freezes: nothing "
            "would train (random-centroids trains W_g)"
        )
    if focus.kernel == "flex" and not _gpu():
        raise ValueError(
            "--focus-kernel flex needs a GPU: FlexAttention has no CPU backward "
            "(use auto or chunked)"
        )
    import torch

    from megatron_focus.model.kernels import soft_gate

    # fused kernels: no dropout nor context parallelism; Triton: installed, and interpreted on
    # the CPU
    soft_gate(
        focus.kernel,
        torch.device("cuda" if _gpu() else "cpu"),
        args.attention_dropout,
        context_parallel=args.context_parallel_size > 1,
        head_dim=args.kv_channels,
        dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32,
    )


def _schedule(args: argparse.Namespace, world_size: int) -> None:
    """The global batch and the run's length in iterations; the LR schedule is in the unit the
    run counts, as in Megatron-LM: iterations with --train-iters, samples with --train-samples
    (where --train-samples need not be a multiple of the batch: the last partial batch is
    dropped, and --lr-warmup-samples / --lr-decay-samples count samples exactly)."""
    data_parallel = max(data_parallel_size(args, world_size), 1)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * data_parallel
    batch = GlobalBatch.of(args, data_parallel)
    if args.train_samples is None:
        in_samples = ("rampup_batch_size", "lr_warmup_samples", "lr_decay_samples")
        given = [f for f in in_samples if getattr(args, f)]
        if given:
            raise ValueError(
                f"--{given[0].replace('_', '-')} counts samples: it needs --train-samples "
                "(sample-based training, as in Megatron-LM) instead of --train-iters"
            )
    batch.check()
    if args.train_samples is None:
        if args.train_iters is None:
            args.train_iters = 300
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        if args.lr_warmup_fraction is not None:
            if args.lr_warmup_iters:  # Megatron-LM's default 0 is no conflict
                raise ValueError("--lr-warmup-fraction and --lr-warmup-iters: give one of them")
            args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
        return
    in_iterations = {
        "--train-iters": "give one of them",
        "--lr-decay-iters": "a run in samples gives --lr-decay-samples",
        "--lr-warmup-iters": "a run in samples gives --lr-warmup-samples",
    }
    for flag, instead in in_iterations.items():
        if getattr(args, flag[2:].replace("-", "_")):  # Megatron-LM's default warmup 0 is none
            raise ValueError(f"--train-samples and {flag}: {instead}")
    args.train_iters = batch.train_iters(args.train_samples)
    if args.train_iters < 1:
        raise ValueError(
            f"--train-samples {args.train_samples} is less than one global batch "
            f"({batch.running(0)})"
        )
    args.lr_warmup_iters = args.lr_decay_iters = None
    if args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_samples:
            raise ValueError("--lr-warmup-fraction and --lr-warmup-samples: give one of them")
        args.lr_warmup_samples = args.lr_warmup_fraction * args.lr_decay_samples  # as Megatron's


def _validate_data_paths(args: argparse.Namespace) -> None:
    """Megatron's two ways to name the data: --data-path divided by --split, or one path per
    split."""
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if not any(p is not None for p in per_split):
        # Quotes kept by a launch script's unquoted array ("--split '99,1,0'"): Megatron reads
        # only the numbers, so do we.
        args.split = args.split.strip("'\" ") if args.split else "969,30,1"
        return
    if args.data_path:
        raise ValueError(
            "--data-path and --train-data-path / --valid-data-path / "
            "--test-data-path: give one or the other"
        )
    if not args.train_data_path:
        raise ValueError("--valid-data-path and --test-data-path need --train-data-path")
    if args.split is not None:
        raise ValueError(
            f"--split {args.split} divides --data-path; with --train-data-path each "
            "split has its own data"
        )
    if args.valid_data_path == [] or args.test_data_path == []:
        raise ValueError("--valid-data-path / --test-data-path given without a path")


def _validate_context_parallel(args: argparse.Namespace, world_size: int) -> None:
    cp = args.context_parallel_size
    if cp == 1:
        return
    if args.cp_comm_type != ["allgather"]:
        raise ValueError(
            f"--cp-comm-type {' '.join(args.cp_comm_type)}: only allgather (keys and values "
            "gathered from every context-parallel rank) is implemented"
        )
    if world_size % (args.tensor_model_parallel_size * cp):
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size} x --context-parallel-size {cp}"
        )
    if args.seq_length % (2 * cp):
        raise ValueError(
            f"--context-parallel-size {cp} cuts --seq-length {args.seq_length} in {2 * cp} "
            "chunks (two per rank, for balanced causal attention): it must be divisible"
        )
    if args.sequence_parallel and (args.seq_length // cp) % args.tensor_model_parallel_size:
        raise ValueError(
            f"--sequence-parallel splits each context-parallel rank's {args.seq_length // cp} "
            f"tokens over {args.tensor_model_parallel_size} tensor-parallel ranks: it must be "
            "divisible"
        )


def data_parallel_size(args: argparse.Namespace, world_size: int) -> int:
    """Replicas of the model, each reading its own samples: the ranks not splitting the model
    (TP) or the sequence (CP)."""
    return world_size // (args.tensor_model_parallel_size * args.context_parallel_size)


def _validate_training(args: argparse.Namespace, world_size: int) -> None:
    if args.zero_stage == 3 and args.tensor_model_parallel_size > 1:
        raise ValueError("ZeRO stage 3 is supported with --tensor-model-parallel-size 1 only")
    unit = "samples" if args.train_samples else "iters"
    if args.train_samples:
        warmup, decay = args.lr_warmup_samples, args.lr_decay_samples
    else:
        warmup, decay = args.lr_warmup_iters, args.lr_decay_iters
    if warmup >= decay:
        raise ValueError(
            f"--lr-warmup-{unit} must be shorter than the decay (--lr-decay-{unit}, default "
            f"--train-{unit})"
        )
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    _validate_data_paths(args)
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        args.tokenizer_type = "GPT2BPETokenizer"
    tokenizer_given = args.tokenizer_type is not None or args.tokenizer_model or args.vocab_file
    if args.mqar:
        if reads_data_files(args) or tokenizer_given:
            raise ValueError("--mqar makes its own data: not with --data-path or a tokenizer")
        from megatron_focus.data.mqar import check_mqar

        check_mqar(
            args.seq_length,
            args.mqar_pairs,
            args.mqar_vocab_size,
            args.mqar_min_distance,
            args.mqar_queries,
            args.mqar_packed,
        )
    if args.mock_data:
        if reads_data_files(args) or args.mqar:
            raise ValueError("--mock-data makes its own data: not with --data-path or --mqar")
        if args.tokenizer_type is None:
            raise ValueError(
                "--mock-data needs a tokenizer for its vocabulary, e.g. "
                "--tokenizer-type NullTokenizer --vocab-size 32000"
            )
    elif bool(tokenizer_given) != reads_data_files(args):
        raise ValueError(
            "--data-path and a tokenizer (--tokenizer-type with --tokenizer-model, --vocab-file "
            "and --merge-file, or --vocab-size) go together: give both, or neither to use the "
            "embedded corpus and its tokenizer"
        )
    if reads_data_files(args) and args.tokenizer_type is None:
        raise ValueError("--data-path needs --tokenizer-type")
    if args.retrofit and not variant(args.attention).focus:
        focus = " or ".join(v.name for v in VARIANTS.values() if v.focus)
        raise ValueError(f"--retrofit adds Focus routers: it needs --attention {focus}")
    if (args.retrofit or args.finetune) and not args.load:
        raise ValueError("--retrofit and --finetune need --load (the pretrained checkpoint)")
    if args.distributed_backend == "nccl" and not _gpu():
        raise ValueError("--distributed-backend nccl needs GPUs; without one the backend is gloo")
    if args.profile:
        if args.profile_step_end <= args.profile_step_start:
            raise ValueError(
                f"--profile-step-end {args.profile_step_end} must be after "
                f"--profile-step-start {args.profile_step_start}"
            )
        if args.tensorboard_dir is None and (args.use_pytorch_profiler or not _gpu()):
            raise ValueError(
                "--profile writes the PyTorch profiler's trace to --tensorboard-dir: give one"
            )
    if args.wandb_project:
        if not args.wandb_exp_name:
            raise ValueError("--wandb-project needs --wandb-exp-name (as in Megatron-LM)")
        if importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb-project needs wandb: pip install -e '.[wandb]'")
    if args.ckpt_step is not None and not args.load:
        raise ValueError("--ckpt-step needs --load (the run whose checkpoint it names)")
    if args.save_full and not args.retrofit:
        raise ValueError("--save-full is for --retrofit runs (other runs always save everything)")
