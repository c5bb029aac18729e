"""The DeepSpeed config: the user's `--deepspeed_config` JSON, completed and checked against flags.

DeepSpeed owns the optimizer step, precision, gradient clipping and data-parallel reduction. The
batch sizes, clipping and precision are also Megatron flags; rather than letting the two disagree
silently, a key the JSON leaves out is filled from the flags and a key it sets differently is an
error. Without `--deepspeed_config` the whole config comes from the flags.
"""

import argparse
import difflib
import json
import os
import warnings

from megatron_focus.config.global_batch import GlobalBatch

# Sections DeepSpeed would honour but this trainer sets itself: (why, what to use instead).
NOT_HONOURED = {
    "optimizer": "the optimizer is Megatron-Core's AdamW, set by flags: use --lr, --weight-decay, "
    "--adam-beta1/--adam-beta2/--adam-eps",
    "scheduler": "the LR schedule is Megatron-Core's OptimizerParamScheduler, set by flags: use "
    "--lr-warmup-iters, --lr-decay-style, --lr-decay-iters, --min-lr",
    "pipeline": "pipeline parallelism is not supported: use tensor parallelism or ZeRO stage 3",
}
# Top-level keys of DeepSpeed's config that this trainer passes on (a key close to one of these,
# e.g. "zero_optimisation", is a misspelling that DeepSpeed would silently ignore).
KNOWN = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_optimization",
    "bf16",
    "fp16",
    "steps_per_print",
    "wall_clock_breakdown",
    "prescale_gradients",
    "gradient_predivide_factor",
    "communication_data_type",
    "seq_parallel_communication_data_type",
    "memory_breakdown",
    "dump_state",
    "checkpoint",
    "data_types",
    "activation_checkpointing",
    "flops_profiler",
    "comms_logger",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "aio",
    "torch_autocast",
    "timers",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "dataloader_drop_last",
)


def read_deepspeed_json(path: str) -> dict:
    """The user's JSON, refused with the file's name for what DeepSpeed would reject late or
    ignore: bad syntax, not an object, sections this trainer does not honour, misspelt keys,
    a ZeRO stage other than 0-3."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--deepspeed_config {path}: no such file")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--deepspeed_config {path}: not valid JSON: {e.msg} at line {e.lineno}, "
            f"column {e.colno}"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"--deepspeed_config {path}: the JSON must be an object of sections, "
            f"not a {type(config).__name__}"
        )
    for key in config:
        if key in NOT_HONOURED:
            raise ValueError(
                f"--deepspeed_config {path}: section {key!r} is not used here ({NOT_HONOURED[key]})"
            )
        if key not in KNOWN:
            close = difflib.get_close_matches(key, KNOWN, n=1, cutoff=0.8)
            if close:
                raise ValueError(
                    f"--deepspeed_config {path}: unknown section {key!r} (did you "
                    f"mean {close[0]!r}?)"
                )
            warnings.warn(
                f"--deepspeed_config {path}: section {key!r} is passed to DeepSpeed unchecked"
            )
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict) or zero.get("stage", 0) not in (0, 1, 2, 3):
        raise ValueError(
            f"--deepspeed_config {path}: zero_optimization.stage must be 0, 1, 2 or "
            f"3, not {zero.get('stage') if isinstance(zero, dict) else zero!r}"
        )
    return config


def deepspeed_config(args: argparse.Namespace, data_parallel_size: int) -> dict:
    config = read_deepspeed_json(args.deepspeed_config) if args.deepspeed_config else {}
    batch = GlobalBatch.of(args, data_parallel_size).running_final
    from_flags = {
        # DeepSpeed's data-parallel ranks are every rank holding the same weights (platform.py):
        # each context-parallel rank counts the micro-batch it holds a part of.
        # once ramped up (--rampup-batch-size): the trainer sets each step's
        "train_batch_size": batch * args.context_parallel_size,
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": batch // (args.micro_batch_size * data_parallel_size),
        "gradient_clipping": args.clip_grad,
    }
    for key, value in from_flags.items():
        if key in config and config[key] != "auto" and config[key] != value:
            raise ValueError(
                f"--deepspeed_config sets {key}={config[key]} but the flags give {value}; "
                "make them agree (or drop the key from the JSON)"
            )
        config[key] = value

    zero = config.setdefault("zero_optimization", {})
    zero.setdefault("stage", args.zero_stage)
    if args.overlap_grad_reduce or args.overlap_param_gather:  # Megatron's names for it
        zero.setdefault("overlap_comm", True)
    if zero["stage"] == 3 and args.tensor_model_parallel_size > 1:
        raise ValueError("ZeRO stage 3 is supported with --tensor-model-parallel-size 1 only")
    offloaded = (zero.get("offload_optimizer") or {}).get("device", "none") != "none"
    if args.rampup_batch_size and zero["stage"] in (1, 2) and offloaded:
        # ZeRO-1/2's offloaded accumulation keeps the accumulation steps it was built with
        raise ValueError(
            "--rampup-batch-size changes the gradient accumulation between steps, which ZeRO "
            "stage 1/2's offload_optimizer does not follow: use ZeRO stage 3 or no offload"
        )

    half = {}
    for key in ("bf16", "fp16"):
        section = config.setdefault(key, {})
        section.setdefault("enabled", getattr(args, key))
        half[key] = bool(section["enabled"])
    if half["bf16"] and half["fp16"]:
        raise ValueError("--deepspeed_config enables both bf16 and fp16")
    if half["bf16"] or half["fp16"]:
        _gradients_in_fp32(config, args)
    config.setdefault("steps_per_print", 10**9)  # our own log line replaces DeepSpeed's
    config.setdefault("wall_clock_breakdown", False)
    return config


def json_settings(args: argparse.Namespace, data_parallel_size: int) -> dict:
    """At validation: the JSON checked, and the ZeRO stage and precision the run takes from it
    (the flags' where it sets none), by flag."""
    config = deepspeed_config(args, data_parallel_size)
    return {
        "zero_stage": config["zero_optimization"]["stage"],
        **{key: config[key]["enabled"] for key in ("bf16", "fp16")},
    }


def _gradients_in_fp32(config: dict, args: argparse.Namespace) -> None:
    """Half-precision training accumulates gradients over micro-batches and reduces them across
    data-parallel ranks in fp32, as Megatron-LM does (`--grad-reduce-in-bf16` reduces in bf16);
    what the JSON sets stays. DeepSpeed accumulates in another dtype than the model's only under
    ZeRO (stage 0 refuses the mix)."""
    wanted = "bf16" if args.grad_reduce_in_bf16 else "fp32"
    given = config.setdefault("communication_data_type", wanted)
    if args.grad_reduce_in_bf16 and given != wanted:
        raise ValueError(
            f"--grad-reduce-in-bf16, but --deepspeed_config sets communication_data_type "
            f"{given!r}: drop one of them"
        )
    if config["zero_optimization"]["stage"] > 0:
        config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
