"""A native checkpoint from the HF side: the model it records as the HF bridge sees it
(`read_architecture`), and a weights-only checkpoint written from an imported model
(`write_checkpoint`, which `pretrain_gpt.py --load` starts from). Reading a checkpoint's weights
and running its native model are `checkpoint/native.py`'s, shared with the evaluation tools.
"""

import json
import os
import shutil
from typing import Optional

import torch
from tqdm import tqdm

from megatron_focus.checkpoint import format as checkpoint_format
from megatron_focus.checkpoint import tp_layout
from megatron_focus.checkpoint.native import StateDict
from megatron_focus.data.tokenizer import HF_TOKENIZER_CONFIG
from megatron_focus.hf.architecture import check_exportable
from megatron_focus.model.config import ModelConfig
from megatron_focus.outputs import fresh_folder


def recorded_special_tokens(tag_dir: str) -> dict:
    """The bos/eos/pad ids an imported model's HF config gave (`{"bos_token_id": 1, ...}`), for
    exporting a checkpoint that has no tokenizer."""
    return checkpoint_format.TokenizerRecord.read(tag_dir).special_token_ids


def read_architecture(tag_dir: str, vocab_size: int, **settings) -> ModelConfig:
    """The model of a checkpoint, refused by name where the HF model cannot compute it;
    `settings`: the variant's unrecorded ones by key (a Focus model's `focus_top_k`, ...)."""
    model = ModelConfig.from_record(
        checkpoint_format.saved_model_args(tag_dir), vocab_size, **settings
    )
    check_exportable(model)
    return model


def write_checkpoint(
    save_dir: str,
    model: ModelConfig,
    weights: StateDict,
    tensor_model_parallel_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
    tokenizer_type: Optional[str] = None,
    tokenizer_file: Optional[str] = None,
    special_token_ids: Optional[dict] = None,
    progress: bool = True,
    overwrite: bool = False,
) -> str:
    """A weights-only checkpoint (iteration 0) of `model` (its `vocab_size` rows) for
    `pretrain_gpt.py --load`, split over `tensor_model_parallel_size` ranks.

    `model_args.json` is the model's record, as a training run of the same model writes it
    (its sequence length: the model's positions). The weight files are what
    DeepSpeed's `load_checkpoint(load_module_only=True)` reads; the `weights_only` marker tells
    `training/checkpointing.py` to start the run's optimizer and schedule fresh. The tokenizer file,
    if any, is copied in (with an HF tokenizer's config) and recorded by its name, so the checkpoint
    does not depend on where it came from, nor on where it is moved. The folder is written whole or
    not at all (`outputs.fresh_folder`).
    """
    with fresh_folder(save_dir, overwrite) as partial:
        model.check_tensor_parallel(tensor_model_parallel_size)
        _write_checkpoint(
            partial,
            model,
            weights,
            tensor_model_parallel_size,
            make_vocab_size_divisible_by,
            tokenizer_type,
            tokenizer_file,
            special_token_ids,
            progress,
        )
    return os.path.join(save_dir, checkpoint_format.tag_for(0))


def _write_checkpoint(
    save_dir,
    model,
    weights,
    tp,
    make_vocab_size_divisible_by,
    tokenizer_type,
    tokenizer_file,
    special_token_ids,
    progress,
) -> None:
    import deepspeed

    from megatron_focus.model.gpt import padded_vocab_size

    vocab_size = model.vocab_size
    padded = padded_vocab_size(vocab_size, make_vocab_size_divisible_by, tp)
    tag = checkpoint_format.tag_for(0)
    tag_dir = os.path.join(save_dir, tag)
    os.makedirs(tag_dir)
    splits = tp_layout.declared_splits(model) if tp > 1 else None
    shards = tp_layout.split(weights, tp, splits, padded)
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
        beside = os.path.join(os.path.dirname(tokenizer_file), HF_TOKENIZER_CONFIG)
        if os.path.isfile(beside):  # the special tokens and chat template travel with it
            shutil.copyfile(beside, os.path.join(tag_dir, HF_TOKENIZER_CONFIG))
    checkpoint_format.TokenizerRecord(
        vocab_size, tokenizer_type, files, special_token_ids or {}
    ).write(tag_dir)
    record = model.record(padded, tp, seq_length=model.max_position_embeddings)
    checkpoint_format.write_model_args(tag_dir, record)
    checkpoint_format.write_atomically(
        os.path.join(tag_dir, checkpoint_format.WEIGHTS_ONLY),
        json.dumps({"iteration": 0}, indent=1, sort_keys=True),
    )
    checkpoint_format.write_atomically(os.path.join(save_dir, checkpoint_format.LATEST), tag)
