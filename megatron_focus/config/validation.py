"""The rules between flags: `validate_args` refuses bad combinations before anything is built,
with a message that says which flag to change, and derives what the flags leave implicit."""

import argparse
import importlib.util
import os
import warnings
from typing import Optional

from megatron_focus.config.compat import check_compat_args
from megatron_focus.config.deepspeed_config import json_settings
from megatron_focus.config.flags import SEQ_LENGTH
from megatron_focus.config.global_batch import GlobalBatch
from megatron_focus.config.run_config import RunConfig
from megatron_focus.data import reads_data_files
from megatron_focus.data.paths import check_data_prefix, check_tokenizer_files, data_prefixes
from megatron_focus.model.config import ModelConfig
from megatron_focus.outputs import check_writable
from megatron_focus.variants import VARIANTS, FocusConfig, settings_classes, variant


def _gpu() -> bool:
    """Whether this process has a GPU, asked of torch alone (~2 s to import), not of
    `platform.has_cuda`, whose module brings Megatron-Core (several seconds more) for a refusal
    that needs none of it."""
    import torch  # here, not at import: --help and the flags' refusals need no torch

    return torch.cuda.is_available()


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
    parsed: argparse.Namespace, world_size: Optional[int] = None, training: bool = True
) -> RunConfig:
    """The run's config: the parsed flags with their derived defaults, once what cannot run is
    refused, before any model is built; `training=False` for a model that only evaluates (what
    only training refuses passes). `parsed` itself is left as it was."""
    if world_size is None:  # as a launcher (torchrun, deepspeed) tells it
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = argparse.Namespace(**vars(parsed))
    _derive_and_check(args, world_size, training)
    config = RunConfig.of(vars(args))
    config.model_config  # the model's own checks (xsa layers, window), the one time it is built
    return config


def _derive_and_check(args: argparse.Namespace, world_size: int, training: bool) -> None:
    if args.seq_length is None:
        args.seq_length = SEQ_LENGTH
    _check_ranges(args)
    _schedule(args, world_size)
    _fill_defaults(args)
    check_compat_args(args)
    if args.use_rotary_position_embeddings:  # Megatron-LM's other name
        args.position_embedding_type = "rope"
    tp = args.tensor_model_parallel_size
    for settings in settings_classes():  # every variant's flags, whatever the variant
        settings.from_args(args)
    _validate_focus(args, training)
    _validate_recompute(args)
    if args.hidden_size % args.num_attention_heads and args.kv_channels is None:
        raise ValueError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}; set --kv-channels explicitly"
        )
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    ModelConfig.check_heads(args.num_attention_heads, args.num_query_groups, tp)
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
    _validate_architecture(args)
    _validate_training(args, world_size)
    # before any data or model: the ZeRO stage and precision the JSON sets become the run's
    vars(args).update(json_settings(args, data_parallel_size(args, world_size)))
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
    if not variant(args.attention).focus or focus.kernel == "auto":
        return  # (auto takes a kernel that runs: nothing to refuse, nor torch to import)
    if focus.kernel == "flex" and not _gpu():
        raise ValueError(
            "--focus-kernel flex needs a GPU: FlexAttention has no CPU backward "
            "(use auto or chunked)"
        )
    import torch

    from megatron_focus.model.kernels.kernels import soft_gate

    # a kernel asked by name: fused ones take no dropout nor context parallelism; Triton is
    # installed, and interpreted on the CPU
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


def check_paths(args) -> None:
    """The files and folders a training run's flags name, on the file system alone
    (data/paths.py): what the run would refuse once its libraries had loaded, refused in a
    fraction of a second. Apart from `validate_args`: a plan or a model built from the flags
    elsewhere (the planner, an export) reads none of them."""
    if reads_data_files(args) and args.tokenizer_type is not None:
        check_tokenizer_files(
            args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file
        )
        for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            flag = "--" + name.replace("_", "-")
            for prefix in data_prefixes(getattr(args, name), flag):
                check_data_prefix(prefix, flag)
    own_run = args.load and os.path.abspath(args.load) == os.path.abspath(args.save or "")
    for name in ("load", "pretrained_checkpoint"):
        folder = getattr(args, name)
        if folder and not os.path.isdir(folder) and not (name == "load" and own_run):
            flag = "--" + name.replace("_", "-")
            raise FileNotFoundError(f"{flag} {folder}: no checkpoint there (no such folder)")
    if args.save:
        check_writable("--save", args.save)


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
