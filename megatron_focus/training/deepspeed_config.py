"""The DeepSpeed config: the user's `--deepspeed_config` JSON, completed and checked against flags.

DeepSpeed owns the optimizer step, precision, gradient clipping and data-parallel reduction. The
batch sizes, clipping and precision are also Megatron flags; rather than letting the two disagree
silently, a key the JSON leaves out is filled from the flags and a key it sets differently is an
error. Without `--deepspeed_config` the whole config comes from the flags.
"""

import argparse
import json
import os


def deepspeed_config(args: argparse.Namespace, data_parallel_size: int) -> dict:
    config = {}
    if args.deepspeed_config:
        if not os.path.isfile(args.deepspeed_config):
            raise FileNotFoundError(f"--deepspeed_config {args.deepspeed_config}: no such file")
        with open(args.deepspeed_config) as f:
            config = json.load(f)

    from_flags = {
        "train_batch_size": args.global_batch_size,
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps":
            args.global_batch_size // (args.micro_batch_size * data_parallel_size),
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
    args.zero_stage = zero["stage"]
    if args.zero_stage == 3 and args.tensor_model_parallel_size > 1:
        raise ValueError("ZeRO stage 3 is supported with --tensor-model-parallel-size 1 only")

    for flag, key in (("bf16", "bf16"), ("fp16", "fp16")):
        section = config.setdefault(key, {})
        section.setdefault("enabled", getattr(args, flag))
        setattr(args, flag, bool(section["enabled"]))
    if args.bf16 and args.fp16:
        raise ValueError("--deepspeed_config enables both bf16 and fp16")
    config.setdefault("steps_per_print", 10**9)  # our own log line replaces DeepSpeed's
    config.setdefault("wall_clock_breakdown", False)
    return config
