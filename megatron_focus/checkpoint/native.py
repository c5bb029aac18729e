"""A checkpoint's native model, built from its own record, without a training run.

A checkpoint tag (its files: `format.py`) holds DeepSpeed's model-states file per tensor-parallel
rank, whose `module` is that rank's Megatron state dict (ZeRO stages 0-2 keep the whole TP shard
there; stage 3 partitions the weights over its optimizer files, which DeepSpeed's `zero_to_fp32`
reassembles), plus the model's record (`model_args.json`: its shape, its attention variant and the
variant's recorded settings) and its tokenizer's (and a retrofit's trained-only checkpoint, the
base it holds routers for). `native_args` turns the record back into the run config of
`pretrain_gpt.py`'s flags, `read_weights` returns the full model, `native_model` builds it: any
registered variant, with or without an HF layer, evaluates (`evaluation/`) and exports (`hf/`) from
these.
"""

import os
from typing import Dict, Optional

import torch
from tqdm import tqdm

from megatron_focus.checkpoint import format as checkpoint_format
from megatron_focus.checkpoint import integrity, safe_load, tp_layout
from megatron_focus.config.run_config import RunConfig, is_flag
from megatron_focus.data.tokenizer import build_tokenizer
from megatron_focus.variants import added_weight, variant

StateDict = Dict[str, torch.Tensor]
LAYOUT_KEYS = ("tensor_model_parallel_size", "padded_vocab_size")  # a run's, not its model's


def checkpoint_tag_dir(load_dir: str, iteration: Optional[int] = None) -> str:
    """`load_dir/iter_XXXXXXX`: the given iteration, or the latest."""
    tag = (
        checkpoint_format.tag_for(iteration)
        if iteration is not None
        else checkpoint_format.latest_tag(load_dir, flag="--iteration")
    )
    if tag is None:
        raise FileNotFoundError(
            f"{load_dir}: no checkpoint there (no '{checkpoint_format.LATEST}' file)"
        )
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such checkpoint")
    return path


def checkpoint_vocabulary(
    tag_dir: str, tokenizer_type: Optional[str] = None, tokenizer_model: Optional[str] = None
):
    """`(vocab_size, tokenizer)` of a checkpoint: the tokenizer given (e.g. if the recorded one
    has moved) or the recorded one; an imported model without a tokenizer records only its
    vocabulary size, and its tokenizer is None.
    """
    recorded = checkpoint_format.TokenizerRecord.read(tag_dir)
    if tokenizer_model is None:
        tokenizer_type, files = recorded.tokenizer_type, recorded.paths(tag_dir)
        if not files:  # synthetic data, NullTokenizer or an import without a tokenizer
            return recorded.vocab_size, None
        gone = [path for path in files.values() if not os.path.exists(path)]
        if gone:
            raise FileNotFoundError(
                f"the checkpoint's tokenizer {', '.join(gone)} is gone; "
                "pass --tokenizer-type and --tokenizer-model"
            )
    else:
        files = {"tokenizer_model": tokenizer_model}
    if tokenizer_type is None:
        raise ValueError("--tokenizer-model needs --tokenizer-type")
    return recorded.vocab_size, build_tokenizer(tokenizer_type, **files)


def native_args(tag_dir: str, **settings) -> RunConfig:
    """`pretrain_gpt.py`'s arguments (TP = 1) for the model a checkpoint records, validated as a
    run's are: every key of its `model_args.json` (the shape, the attention variant, the variant's
    recorded settings) as recorded, so nothing is re-derived from a default; `settings` are the
    variant's unrecorded ones by key (`focus_top_k=1`; None: the flag's default)."""
    from megatron_focus.config.flags import build_parser
    from megatron_focus.config.validation import validate_args

    saved = checkpoint_format.saved_model_args(tag_dir)  # older ones at what they computed
    keys = checkpoint_format.SHAPE_KEYS
    if "attention" in saved:
        keys += variant(saved["attention"]).recorded_keys()
    missing = [key for key in keys if key not in saved]
    if missing:
        raise ValueError(
            f"model_args.json lacks {', '.join(missing)}: the checkpoint was "
            "saved by a megatron-focus that did not record them yet"
        )
    unknown = [key for key in settings if not is_flag(key)]
    if unknown:
        raise TypeError(f"native_args: {unknown[0]!r} is no setting of pretrain_gpt.py")
    parser = build_parser()
    parser.set_defaults(  # the recorded model, as the flags' defaults
        **{key: value for key, value in settings.items() if value is not None},
        **{key: saved[key] for key in keys if key not in LAYOUT_KEYS},  # the run's split
        # the record holds one group per head without GQA, as validation would make it
        group_query_attention=saved["num_query_groups"] != saved["num_attention_heads"],
    )
    # any length the model can take
    parsed = parser.parse_args(["--seq-length", str(saved["max_position_embeddings"])])
    return validate_args(parsed, world_size=1, training=False)


def read_weights(
    tag_dir: str, vocab_size: int, progress: bool = True, allow_unsafe: bool = False
) -> StateDict:
    """The full weights (Megatron's names, the vocabulary's `vocab_size` rows) of a checkpoint,
    split as its record says; files holding pickled objects are refused unless `allow_unsafe`
    (see `safe_load.load_file`), and so is a checkpoint whose files differ from what its save
    wrote."""
    integrity.verify(tag_dir)
    saved = checkpoint_format.saved_model_args(tag_dir)
    tp = saved["tensor_model_parallel_size"]
    files = checkpoint_format.model_files(tag_dir)
    if not files and checkpoint_format.is_zero3(tag_dir):
        # ZeRO-3 (TP = 1) partitions the weights over its optimizer files; DeepSpeed reassembles
        # them.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        safe_load.check_safe_to_load(tag_dir, allow_unsafe)  # DeepSpeed reads with pickle
        load_dir, tag = os.path.split(os.path.normpath(tag_dir))
        modules = [
            checkpoint_format.current_names(get_fp32_state_dict_from_zero_checkpoint(load_dir, tag))
        ]
    elif len(files) == tp:
        modules = [
            checkpoint_format.read_model_file(f, allow_unsafe)["module"]
            for f in tqdm(files, desc="reading TP shards", disable=not progress)
        ]
    else:
        raise ValueError(f"{tag_dir}: {len(files)} model files for tensor-parallel size {tp}")
    splits = tp_layout.declared_splits(native_args(tag_dir)) if len(modules) > 1 else None
    weights = tp_layout.merge(modules, splits, vocab_size)
    base_dir = checkpoint_format.base_checkpoint(tag_dir)
    if base_dir is None:
        return weights
    # A retrofit's trained-only checkpoint: its routers over the weights of its base checkpoint.
    base = read_weights(base_dir, vocab_size, progress, allow_unsafe)
    return {**{k: w for k, w in base.items() if not added_weight(k)}, **weights}


def native_model(config: RunConfig, vocab_size: int, weights: StateDict) -> torch.nn.Module:
    """The native Megatron-Core model of `config` (TP = 1, eval mode) holding `weights`.

    Needs torch.distributed and Megatron's parallel state for a world of one
    (`platform.init_distributed(1)`).
    """
    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model, padded_vocab_size

    platform.manual_seed(0)  # build_model initialises (then we overwrite) through Megatron's RNG
    model = build_model(config, vocab_size)
    padded = padded_vocab_size(vocab_size, config.model.make_vocab_size_divisible_by, 1)
    model.load_state_dict(tp_layout.split(weights, 1, None, padded)[0])
    return model.eval()


def load_native_model(
    tag_dir: str, vocab_size: int, allow_unsafe: bool = False, **settings
) -> tuple:
    """`(config, model)`: a checkpoint's native model as `native_args` and `native_model` make
    it, merged to one process whatever its TP size or ZeRO stage."""
    config = native_args(tag_dir, **settings)
    weights = read_weights(tag_dir, vocab_size, progress=False, allow_unsafe=allow_unsafe)
    return config, native_model(config, vocab_size, weights)


@torch.no_grad()
def native_logits(
    load_dir: str,
    tokens: torch.Tensor,
    iteration: Optional[int] = None,
    focus_attention_mode: Optional[str] = None,
    focus_top_k: Optional[int] = None,
) -> torch.Tensor:
    """Logits `[b, s, vocab]` of the native model of a checkpoint on `tokens` `[b, s]`.

    A Focus model runs in `focus_attention_mode` (soft by default; sparse: the packed top-k
    dispatch, as `--focus-attention-mode sparse` evaluates) with `focus_top_k`.
    """
    from megatron_focus import platform

    platform.init_distributed(1)
    tag_dir = checkpoint_tag_dir(load_dir, iteration)
    vocab_size, _ = checkpoint_vocabulary(tag_dir)
    _, model = load_native_model(
        tag_dir, vocab_size, focus_attention_mode=focus_attention_mode, focus_top_k=focus_top_k
    )
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, None)[..., :vocab_size].float()
