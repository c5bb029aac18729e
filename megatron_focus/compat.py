"""Megatron-LM flags that a launch script brings along, beyond the ones this trainer implements.

Three kinds, each listed once here and shown by `pretrain_gpt.py --help`:

- *no effect here*: they tune fused CUDA kernels, Transformer Engine or Megatron's own
  optimizer and checkpoint plumbing, which this trainer replaces (DeepSpeed, Megatron-Core's
  model on PyTorch kernels); accepted so that the script runs, and said to do nothing;
- *refused*: what this trainer does not offer (pipeline parallelism, mixture of
  experts, fp8 without Transformer Engine), refused by name before
  any compute, with what to use instead, unless given at the value that means "off";
- *translated*: Megatron's name for something DeepSpeed does here (`--use-distributed-optimizer`
  is ZeRO-1, `--overlap-grad-reduce` / `--overlap-param-gather` DeepSpeed's overlapped
  communication).
"""

import argparse

FP8_TUNING = "tunes fp8 (--fp8-format), which needs Transformer Engine"
TIKTOKEN = "read by Megatron's TikTokenizer only; tokenizers here are --tokenizer-type's"
# flag: (argparse keywords, why it has no effect here)
NO_EFFECT = {
    "--use-mcore-models": (
        {"action": "store_true"},
        "the model is always Megatron-Core's GPTModel",
    ),
    "--no-masked-softmax-fusion": (
        {"action": "store_true"},
        "attention runs in PyTorch's kernels, not Megatron's fused softmax",
    ),
    "--no-bias-gelu-fusion": ({"action": "store_true"}, "the bias-GELU fusion is always off"),
    "--cross-entropy-loss-fusion": (
        {"action": "store_true"},
        "the loss is PyTorch's cross entropy",
    ),
    "--no-create-attention-mask-in-dataloader": (
        {"action": "store_true"},
        "batches never carry an attention mask",
    ),
    "--no-mmap-bin-files": ({"action": "store_true"}, "indexed datasets are always memory-mapped"),
    "--empty-unused-memory-level": (
        {"type": int, "default": 0},
        "the CUDA cache is left to PyTorch's allocator",
    ),
    "--attention-backend": (
        {"default": "auto"},
        "the kernel is chosen per device and variant (model/kernels.py)",
    ),
    "--use-flash-attn": (
        {"action": "store_true"},
        "flash-attn is used for standard attention whenever it is installed",
    ),
    "--no-rope-fusion": ({"action": "store_true"}, "RoPE is never fused here"),
    "--no-gradient-accumulation-fusion": (
        {"action": "store_true"},
        "gradient accumulation is DeepSpeed's",
    ),
    "--no-bias-swiglu-fusion": ({"action": "store_true"}, "the bias-SwiGLU fusion is always off"),
    "--no-bias-dropout-fusion": (
        {"action": "store_true"},
        "bias-dropout-add is fused on a GPU, not on the CPU",
    ),
    # fp8 itself (--fp8-format) is refused; its tuning flags alone change nothing, as in Megatron
    **{
        flag: (kwargs, FP8_TUNING)
        for flag, kwargs in (
            ("--fp8-amax-history-len", {"type": int, "default": 1}),
            (
                "--fp8-amax-compute-algo",
                {"choices": ("most_recent", "max"), "default": "most_recent"},
            ),
            ("--fp8-margin", {"type": int, "default": 0}),
            ("--fp8-interval", {"type": int, "default": 1}),
            ("--fp8-param-gather", {"action": "store_true"}),
        )
    },
    **{
        flag: (kwargs, TIKTOKEN)
        for flag, kwargs in (
            ("--tiktoken-pattern", {"default": None}),
            ("--tiktoken-num-special-tokens", {"type": int, "default": 1000}),
        )
    },
}

# flag: (argparse keywords, the value that means "off", why refused and what to use instead)
REFUSED = {
    "--pipeline-model-parallel-size": (
        {"type": int, "default": 1},
        1,
        "pipeline parallelism is not supported; use --zero-stage 3 or tensor parallelism",
    ),
    "--virtual-pipeline-model-parallel-size": (
        {"type": int, "default": None},
        None,
        "pipeline parallelism is not supported",
    ),
    "--num-experts": ({"type": int, "default": None}, None, "mixture of experts is not supported"),
    "--expert-model-parallel-size": (
        {"type": int, "default": 1},
        1,
        "expert parallelism is not supported",
    ),
    "--fp8-format": (
        {"default": None},
        None,
        "fp8 needs Transformer Engine, which this trainer does not use; use --bf16",
    ),
}


def add_compat_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-LM flags with no effect here")
    for flag, (kwargs, why) in NO_EFFECT.items():
        g.add_argument(flag, help=f"no effect: {why}", **kwargs)
    g = p.add_argument_group("Megatron-LM flags refused unless off")
    for flag, (kwargs, off, why) in REFUSED.items():
        g.add_argument(flag, help=f"only {off}: {why}", **kwargs)
    g = p.add_argument_group("Megatron-LM flags done by DeepSpeed")
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Megatron's sharded optimizer state: ZeRO stage 1 (the default) or more",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="overlap gradient reduction with the backward pass (DeepSpeed's overlap_comm)",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="overlap parameter gathering with compute (DeepSpeed's overlap_comm)",
    )
    g.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="reduce gradients across data-parallel ranks in bf16 (DeepSpeed's "
        "communication_data_type; fp32 otherwise)",
    )


def check_compat_args(args: argparse.Namespace) -> None:
    """Refuse what is not offered, by flag name, before anything is built."""
    for flag, (_, off, why) in REFUSED.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value != off:
            raise ValueError(f"{flag} {value}: {why}")
    if args.use_distributed_optimizer and args.zero_stage == 0:
        raise ValueError(
            "--use-distributed-optimizer shards the optimizer state: not with --zero-stage 0"
        )


def compat_table(megatron_flags: list, parser: argparse.ArgumentParser) -> str:
    """docs/megatron-compat.md: each of Megatron-LM's flags, as this trainer's parser takes it."""
    actions = {o: a for a in parser._actions for o in a.option_strings}
    rows, counts = [], {"yes": 0, "no effect": 0, "refused": 0, "not offered": 0}
    for flag in megatron_flags:
        if flag in NO_EFFECT:
            status, note = "no effect", NO_EFFECT[flag][1]
        elif flag in REFUSED:
            status, note = "refused", f"unless {REFUSED[flag][1]}: {REFUSED[flag][2]}"
        elif flag in actions:
            status, note = "yes", (actions[flag].help or "").replace("%%", "%")
        else:
            status, note = "not offered", "refused as an unknown flag, naming the closest one"
        counts[status] += 1
        rows.append(f"| `{flag}` | {status} | {note.replace('|', '/')} |")
    ours = sorted(
        {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
        - set(megatron_flags)
        - {"--help"}
    )
    return "\n".join(
        [
            "# Megatron-LM flags here",
            "",
            "Generated by `python tools/megatron_compat.py` from this trainer's own parser and the "
            "flag list of Megatron-LM core_v0.16.1's `pretrain_gpt.py` "
            "(`docs/megatron-lm-flags.txt`); "
            "`tests/test_cli.py` checks that it is current. *yes*: does what Megatron-LM does (the "
            "note is `--help`'s); *no effect*: accepted, tunes something this trainer does not "
            "use; "
            "*refused*: stops the run before any compute, with the alternative; *not offered*: an "
            "unknown flag.",
            "",
            ", ".join(f"{n} {status}" for status, n in counts.items())
            + f" (of {len(megatron_flags)}).",
            "",
            "| Megatron-LM flag | Here | Note |",
            "|---|---|---|",
            *rows,
            "",
            "Flags of this trainer that Megatron-LM does not have: "
            + ", ".join(f"`{flag}`" for flag in ours)
            + ".",
            "",
        ]
    )


def megatron_flags(path: str) -> list:
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]
