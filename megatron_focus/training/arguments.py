"""The command line to a run: Megatron-LM's flags parsed (`config/flags.py`), read from
`--yaml-cfg` or, with `--use-checkpoint-args`, from `--load`'s checkpoint, then validated
(`config/validation.py`). Here, above both `config/` and `checkpoint/`, as the one place that
needs both (Megatron-LM's is megatron/training/arguments.py)."""

import argparse
import os
import sys
from typing import List, Optional

from megatron_focus.config.flags import build_parser
from megatron_focus.config.run_config import RunConfig
from megatron_focus.config.validation import validate_args


def parse_args(argv: Optional[List[str]] = None) -> RunConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.yaml_cfg is not None:
        args = _from_yaml(args, parser, sys.argv[1:] if argv is None else argv)
    if args.use_checkpoint_args:
        _use_checkpoint_args(args)
    return validate_args(args)


def _from_yaml(
    given: argparse.Namespace, parser: argparse.ArgumentParser, argv: List[str]
) -> argparse.Namespace:
    """Megatron-LM's --yaml-cfg: the flags the file holds, and the launcher's beside them."""
    from megatron_focus.config import yaml_config

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
    from megatron_focus.model.config import LAYOUT_KEYS, RECORDED_ONLY

    if not args.load:
        raise ValueError("--use-checkpoint-args needs --load (the checkpoint to read them from)")
    tag = checkpoint_format.resume_tag(args)
    if tag is None:
        raise FileNotFoundError(f"--use-checkpoint-args: --load {args.load} holds no checkpoint")
    checkpoint = SavedCheckpoint.open(os.path.join(args.load, tag), args.allow_unsafe_checkpoints)
    saved = checkpoint.model_args
    if args.seq_length is None:  # not given: the record's (not forced, as in Megatron-LM)
        args.seq_length = checkpoint.seq_length
    for key, value in saved.items():
        if key not in LAYOUT_KEYS + RECORDED_ONLY:  # the model's, not this run's layout
            setattr(args, key, value)
    # the record holds one group per head without GQA, as validation would make it
    args.group_query_attention = saved["num_query_groups"] != saved["num_attention_heads"]
