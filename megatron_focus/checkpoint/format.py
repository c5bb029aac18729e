"""The checkpoint format: what a checkpoint folder holds, its names and records, and how each of
its files is written. Training (`training/checkpointing.py`, `training/layouts.py`) and the HF
tools (`hf/native.py`) both read and write checkpoints through it.

Layout (`--save DIR`): `DIR/iter_0000100/` holds DeepSpeed's files (model and optimizer shards per
rank), `model_args.json` (the model's shape and variant), `tokenizer_args.json`, `layout.json` (the
TP / DP size, ZeRO stage and precision that wrote it, `training/layouts.py`) and `checksums.json`
(`integrity.py`); `DIR/latest` names the newest complete tag (DeepSpeed's own pointer, so its tools
such as `zero_to_fp32.py` work on these checkpoints). Markers: `weights_only` (an imported model: no
optimizer, no run state), `no_optimizer` (`--no-save-optim`), `base_checkpoint.json` (a retrofit's
trained-only checkpoint: where its frozen weights are).
"""

import argparse
import contextlib
import json
import os
import re
from typing import Optional

from megatron_focus.variants import MODEL, VARIANTS, FocusConfig, variant

# What must match for weights to load: the model's shape, what it computes, and how it is split.
SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "normalization",
    "swiglu",
    "position_embedding_type",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "max_position_embeddings",
    "attention",
    "tensor_model_parallel_size",
    "padded_vocab_size",
    "norm_epsilon",
    "rotary_base",
    "rotary_percent",
    "xsa_layers",
    "openai_gelu",
    "window_size",
    "add_qkv_bias",
    "apply_layernorm_1p",
    "qk_layernorm",
    "squared_relu",
    "use_rope_scaling",
    "rope_scaling_factor",
)
# What a Focus model computes: the model settings of FocusConfig (its top-k, mode and kernel are
# free to change); the routers' shapes are the first two.
FOCUS_KEYS = tuple(f"focus_{name}" for name in FocusConfig.names(MODEL))
# Recorded since: what a checkpoint saved before a key was recorded computed.
BEFORE_RECORDED = {
    "window_size": None,
    "add_qkv_bias": False,
    "apply_layernorm_1p": False,
    "qk_layernorm": False,
    "squared_relu": False,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
}
LATEST = "latest"
ARGS_FILE = "model_args.json"
# The tokenizer the model was trained with (for the HF export); not compared on load.
TOKENIZER_FILE = "tokenizer_args.json"
# Marks a checkpoint that holds weights only (tools/convert_from_hf.py): no optimizer, no run state.
WEIGHTS_ONLY = "weights_only"
# Marks a checkpoint saved with --no-save-optim: weights, schedule position and data position only.
NO_OPTIMIZER = "no_optimizer"
# In a retrofit's trained-only checkpoint: {"load": DIR, "tag": TAG} of the frozen weights.
BASE_FILE = "base_checkpoint.json"


def tag_for(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def write_atomically(path: str, text: str) -> None:
    """Every file of the checkpoint format is written so: whole under its name, or not at all (a
    failed write, e.g. on a full disk, removes its temporary file and raises naming it)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):  # never written, or not ours to remove
            os.remove(tmp)
        raise OSError(e.errno, e.strerror, e.filename or tmp) from e


def model_args(args: argparse.Namespace) -> dict:
    """What decides the model, as `model_args.json` holds it (tuples as lists)."""
    keys = SHAPE_KEYS + (FOCUS_KEYS if variant(args.attention).focus else ())
    values = {key: getattr(args, key) for key in keys}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def saved_model_args(checkpoint_dir: str) -> dict:
    with open(os.path.join(checkpoint_dir, ARGS_FILE)) as f:
        return with_unrecorded_defaults(json.load(f))


def with_unrecorded_defaults(saved: dict) -> dict:
    """A checkpoint's model args, with the settings it predates at what it computed."""
    saved = {**BEFORE_RECORDED, **saved}
    if saved.get("attention") in VARIANTS and variant(saved["attention"]).focus:
        saved = {**FocusConfig.before_recorded(), **saved}
    return saved


def check_compatible(args: argparse.Namespace, checkpoint_dir: str, ignore: tuple = ()) -> None:
    """Refuse, before any weight is read, a checkpoint whose model has another shape."""
    saved, ours = saved_model_args(checkpoint_dir), model_args(args)
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r}, this run {ours.get(k)!r}"
        for k in sorted(set(saved) | set(ours))
        if saved.get(k) != ours.get(k) and k not in ignore
    ]
    if diffs:
        raise ValueError(f"checkpoint {checkpoint_dir} is of another model: " + "; ".join(diffs))


def current_name(name: str) -> str:
    """A weight's name in this version: checkpoints of earlier versions hold each router beside
    its core attention (`self_attention.router.*`); it now lives inside it."""
    return name.replace(".self_attention.router.", ".self_attention.core_attention.router.")


def current_names(weights: dict) -> dict:
    return {current_name(name): value for name, value in weights.items()}


def latest_tag(load_dir: str, flag: str = "--ckpt-step") -> Optional[str]:
    """The newest complete checkpoint's tag, or None if the folder holds none yet. A `latest`
    that names no complete checkpoint is refused, with those the folder holds: `flag` (the
    command's) picks one."""
    pointer = os.path.join(load_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer, "rb") as f:
        tag = f.read().decode(errors="replace").strip()
    complete = complete_tags(load_dir)
    if tag in complete:
        return tag
    if not tag:
        damage = "it is empty"
    elif re.fullmatch(r"iter_\d{7}", tag):
        damage = f"it names {tag!r}, which is not in {load_dir}"
    else:
        damage = f"it holds {tag[:40]!r}, not a checkpoint's name"
    offer = (
        f"complete checkpoints there: {', '.join(complete)}; pick one with {flag} (e.g. "
        f"{int(complete[-1][len('iter_') :])})"
        if complete
        else f"{load_dir} holds no complete checkpoint"
    )
    raise ValueError(f"{pointer} is damaged: {damage}; {offer}")


def resume_tag(args: argparse.Namespace) -> Optional[str]:
    """The tag `--load` resumes from: `--ckpt-step`'s, else the latest (None: no checkpoint)."""
    if args.ckpt_step is None:
        return latest_tag(args.load) if os.path.isdir(args.load) else None
    tag = tag_for(args.ckpt_step)
    if not os.path.isdir(os.path.join(args.load, tag)):
        held = complete_tags(args.load) if os.path.isdir(args.load) else []
        raise FileNotFoundError(
            f"--ckpt-step {args.ckpt_step}: {args.load} holds no {tag} "
            f"(it holds: {', '.join(held) or 'no checkpoint'})"
        )
    return tag


def complete_tags(folder: str) -> list:
    return sorted(
        name
        for name in os.listdir(folder)
        if re.fullmatch(r"iter_\d{7}", name) and os.path.isdir(os.path.join(folder, name))
    )


def base_checkpoint(checkpoint_dir: str) -> Optional[str]:
    """The checkpoint holding the frozen weights of a retrofit's trained-only checkpoint, or None
    for a complete checkpoint."""
    path = os.path.join(checkpoint_dir, BASE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        base = json.load(f)
    base_dir = os.path.join(base["load"], base["tag"])
    if not os.path.isdir(base_dir):
        raise FileNotFoundError(
            f"{checkpoint_dir} holds only a retrofit's routers; the checkpoint "
            f"with its other weights, {base_dir}, is gone"
        )
    return base_dir
