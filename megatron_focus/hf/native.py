"""This project's checkpoints without a training run: read one, write one, run one.

A checkpoint tag (its files: `checkpoint/format.py`) holds DeepSpeed's model-states file per
tensor-parallel rank, whose `module` is that rank's Megatron state dict (ZeRO stages 0-2 keep the
whole TP shard there; stage 3 partitions the weights over its optimizer files, which DeepSpeed's
`zero_to_fp32` reassembles), plus the model's args and its tokenizer's record (and a retrofit's
trained-only checkpoint, the base it holds routers for).
`read_weights` returns the full model, `write_checkpoint` writes a
weights-only checkpoint that `pretrain_gpt.py --load` starts from, and `native_logits` runs the
native Megatron-Core model of a checkpoint.
"""

import json
import os
import shutil
from typing import Dict, Optional

import torch
from tqdm import tqdm

from megatron_focus.checkpoint import format as checkpoint_format
from megatron_focus.checkpoint import integrity, safe_load
from megatron_focus.data.tokenizer import HF_TOKENIZER_CONFIG, build_tokenizer
from megatron_focus.hf import layout
from megatron_focus.hf.architecture import Architecture
from megatron_focus.outputs import fresh_folder

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


def recorded_special_tokens(tag_dir: str) -> dict:
    """The bos/eos/pad ids an imported model's HF config gave (`{"bos_token_id": 1, ...}`), for
    exporting a checkpoint that has no tokenizer."""
    return checkpoint_format.TokenizerRecord.read(tag_dir).special_token_ids


def read_architecture(
    tag_dir: str,
    vocab_size: int,
    focus_top_k: Optional[int] = None,
    focus_attention_mode: Optional[str] = None,
) -> Architecture:
    """The model of a checkpoint; a Focus model's inference settings as given, or the defaults."""
    model_args = checkpoint_format.saved_model_args(tag_dir)
    return Architecture.from_model_args(model_args, vocab_size, focus_top_k, focus_attention_mode)


def read_weights(
    tag_dir: str, arch: Architecture, progress: bool = True, allow_unsafe: bool = False
) -> StateDict:
    """The full, unpadded weights (Megatron's names) of a checkpoint of `arch`; files holding
    pickled objects are refused unless `allow_unsafe` (see `safe_load.load_file`), and so is a
    checkpoint whose files differ from what its save wrote."""
    integrity.verify(tag_dir)
    tp = checkpoint_format.read_json(tag_dir, checkpoint_format.ARGS_FILE)[
        "tensor_model_parallel_size"
    ]
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
    weights = layout.merge(modules, arch.swiglu, arch.vocab_size)
    base_dir = checkpoint_format.base_checkpoint(tag_dir)
    if base_dir is None:
        return weights
    # A retrofit's trained-only checkpoint: its routers over the weights of its base checkpoint.
    base = read_weights(
        base_dir, read_architecture(base_dir, arch.vocab_size), progress, allow_unsafe
    )
    return {**{k: w for k, w in base.items() if ".router." not in k}, **weights}


def write_checkpoint(
    save_dir: str,
    args,
    weights: StateDict,
    vocab_size: int,
    tokenizer_type: Optional[str] = None,
    tokenizer_file: Optional[str] = None,
    special_token_ids: Optional[dict] = None,
    progress: bool = True,
    overwrite: bool = False,
) -> str:
    """A weights-only checkpoint (iteration 0) of the model of `args` for `pretrain_gpt.py --load`.

    `args` are the model's validated `pretrain_gpt.py` arguments (`Architecture.native_args`), so
    `model_args.json` is what a training run with the same flags writes. The weight files are what
    DeepSpeed's `load_checkpoint(load_module_only=True)` reads; the `weights_only` marker tells
    `training/checkpointing.py` to start the run's optimizer and schedule fresh. The tokenizer file,
    if any, is copied in (with an HF tokenizer's config) and recorded by its name, so the checkpoint
    does not depend on where it came from, nor on where it is moved. The folder is written whole or
    not at all (`outputs.fresh_folder`).
    """
    with fresh_folder(save_dir, overwrite) as partial:
        _write_checkpoint(
            partial,
            args,
            weights,
            vocab_size,
            tokenizer_type,
            tokenizer_file,
            special_token_ids,
            progress,
        )
    return os.path.join(save_dir, checkpoint_format.tag_for(0))


def _write_checkpoint(
    save_dir, args, weights, vocab_size, tokenizer_type, tokenizer_file, special_token_ids, progress
) -> None:
    import deepspeed

    tp = args.tensor_model_parallel_size
    tag = checkpoint_format.tag_for(0)
    tag_dir = os.path.join(save_dir, tag)
    os.makedirs(tag_dir)
    shards = layout.split(weights, tp, args.swiglu, args.padded_vocab_size)
    for rank, shard in enumerate(tqdm(shards, desc="writing TP shards", disable=not progress)):
        torch.save(
            {
                "module": shard,
                "dp_world_size": 1,
                "mp_world_size": tp,
                "ds_version": deepspeed.__version__,
            },
            checkpoint_format.model_file(tag_dir, rank),
        )
    files = {}
    if tokenizer_file is not None:
        copied = os.path.basename(tokenizer_file)  # read relative to the checkpoint
        shutil.copyfile(tokenizer_file, os.path.join(tag_dir, copied))
        files["tokenizer_model"] = copied
        config = os.path.join(os.path.dirname(tokenizer_file), HF_TOKENIZER_CONFIG)
        if os.path.isfile(config):  # the special tokens and chat template travel with it
            shutil.copyfile(config, os.path.join(tag_dir, HF_TOKENIZER_CONFIG))
    checkpoint_format.TokenizerRecord(
        vocab_size, tokenizer_type, files, special_token_ids or {}
    ).write(tag_dir)
    checkpoint_format.write_model_args(
        tag_dir, checkpoint_format.model_args(args, args.padded_vocab_size)
    )
    checkpoint_format.write_atomically(
        os.path.join(tag_dir, checkpoint_format.WEIGHTS_ONLY),
        json.dumps({"iteration": 0}, indent=1, sort_keys=True),
    )
    checkpoint_format.write_atomically(os.path.join(save_dir, checkpoint_format.LATEST), tag)


def native_model(arch: Architecture, weights: StateDict) -> torch.nn.Module:
    """The native Megatron-Core model (TP = 1, eval mode) holding `weights`.

    Needs torch.distributed and Megatron's parallel state for a world of one
    (`platform.init_distributed(1)`).
    """
    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model

    args = arch.native_args()
    platform.manual_seed(0)  # build_model initialises (then we overwrite) through Megatron's RNG
    model = build_model(args, arch.vocab_size)
    model.load_state_dict(layout.split(weights, 1, arch.swiglu, args.padded_vocab_size)[0])
    return model.eval()


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
    arch = read_architecture(tag_dir, vocab_size, focus_top_k, focus_attention_mode)
    model = native_model(arch, read_weights(tag_dir, arch, progress=False))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, None)[..., :vocab_size].float()
