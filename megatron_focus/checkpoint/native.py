"""A checkpoint's native model, built from its own record, without a training run.

A checkpoint tag (its files: `format.py`) holds DeepSpeed's model-states file per tensor-parallel
rank, whose `module` is that rank's Megatron state dict (ZeRO stages 0-2 keep the whole TP shard
there; stage 3 partitions the weights over its optimizer files, which DeepSpeed's `zero_to_fp32`
reassembles), plus the model's record (`model_args.json`: its shape, its attention variant and the
variant's recorded settings) and its tokenizer's (and a retrofit's trained-only checkpoint, the
base it holds routers for). `recorded_model` turns the record back into the `ModelConfig`,
`read_weights` returns the full model, `native_model` builds it: any
registered variant, with or without an HF layer, evaluates (`evaluation/`) and exports (`hf/`) from
these.
"""

import os
from typing import Dict, Optional

import torch
from tqdm import tqdm

from megatron_focus.checkpoint import format as checkpoint_format
from megatron_focus.checkpoint import integrity, safe_load, tp_layout
from megatron_focus.data.tokenizer import build_tokenizer
from megatron_focus.model.config import ModelConfig
from megatron_focus.variants import added_weight

StateDict = Dict[str, torch.Tensor]


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


def recorded_model(tag_dir: str, **settings) -> ModelConfig:
    """The model a checkpoint records (its `model_args.json`, older ones at what they computed);
    `settings` are the variant's unrecorded ones by key (`focus_top_k=1`; None: the default)."""
    return ModelConfig.from_record(checkpoint_format.saved_model_args(tag_dir), **settings)


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
    splits = tp_layout.declared_splits(ModelConfig.from_record(saved)) if len(modules) > 1 else None
    weights = tp_layout.merge(modules, splits, vocab_size)
    base_dir = checkpoint_format.base_checkpoint(tag_dir)
    if base_dir is None:
        return weights
    # A retrofit's trained-only checkpoint: its routers over the weights of its base checkpoint.
    base = read_weights(base_dir, vocab_size, progress, allow_unsafe)
    return {**{k: w for k, w in base.items() if not added_weight(k)}, **weights}


def native_model(model: ModelConfig, vocab_size: int, weights: StateDict) -> torch.nn.Module:
    """The native Megatron-Core model `model` describes (TP = 1, eval mode) holding `weights`.

    Needs torch.distributed and Megatron's parallel state for a world of one
    (`platform.init_distributed(1)`).
    """
    from megatron_focus import platform
    from megatron_focus.model.gpt import build, on_device, padded_vocab_size

    platform.manual_seed(0)  # building initialises (then we overwrite) through Megatron's RNG
    padded = padded_vocab_size(vocab_size, 128, 1)  # rows past the vocabulary are never used
    built = on_device(build(model, padded))
    built.load_state_dict(tp_layout.split(weights, 1, None, padded)[0])
    return built.eval()


def load_native_model(
    tag_dir: str, vocab_size: int, allow_unsafe: bool = False, **settings
) -> tuple:
    """`(model config, model)`: a checkpoint's native model as `recorded_model` and
    `native_model` make it, merged to one process whatever its TP size or ZeRO stage."""
    model = recorded_model(tag_dir, **settings)
    weights = read_weights(tag_dir, vocab_size, progress=False, allow_unsafe=allow_unsafe)
    return model, native_model(model, vocab_size, weights)


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
