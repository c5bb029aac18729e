"""Command-line flags, named and defaulted as in Megatron-LM's `pretrain_gpt.py`.

A Megatron-LM user's launch script carries over: the same flag means the same thing. What this
project adds is grouped under "megatron-focus". Each group is a section of the run's config
(`run_config.py`); `validation.py` holds the rules between flags.
"""

import argparse

from megatron_focus import cli
from megatron_focus.config.compat import add_compat_args
from megatron_focus.data.choices import TOKENIZER_TYPES
from megatron_focus.variants import VARIANTS, settings_classes

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
