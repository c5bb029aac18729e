"""Resuming at another layout: another tensor-parallel, data-parallel or context-parallel size,
or ZeRO stage.

Every rank saves its own shards, so a checkpoint fits the layout that wrote it, which its layout
record holds (`record`; its file: `checkpoint/format.py`). A run whose layout differs loads the
checkpoint through DeepSpeed's universal format (`checkpoint/universal.py`): every rank's shards
merged into one full tensor per parameter and state, in a scratch folder beside the checkpoint,
and the engine cuts them again for its own ranks. What the converter needs from us is how each
parameter is split over tensor-parallel ranks (`tensor_parallel_splits`, read from
Megatron-Core's own marks on the parameters), which the model carries into every checkpoint.

ZeRO stage 0, whose optimizer the engine does not load from that format, is cut here by
DeepSpeed's own functions. bf16 and fp16 at stage 0 keep their layout (DeepSpeed's
mixed-precision optimizers there have no such path).
"""

import os
import re
import shutil
import types
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.checkpoint import constants as uc
from deepspeed.checkpoint.universal_checkpoint import load_hp_checkpoint_state
from deepspeed.utils.tensor_fragment import fragment_address
from megatron.core import parallel_state

from megatron_focus.checkpoint import tp_layout, universal
from megatron_focus.checkpoint.format import read_layout, universal_dir
from megatron_focus.config.run_config import RunConfig


def current(args: RunConfig) -> dict:
    return {
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        # ZeRO's shards are split over data-parallel x context-parallel ranks
        "context_parallel_size": args.context_parallel_size,
        "zero_stage": args.zero_stage,
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
    }


def record(args: RunConfig, padded_vocab_size: int) -> dict:
    """The layout record of this run's checkpoints: its layout and the vocabulary padded for it."""
    return {**current(args), "padded_vocab_size": padded_vocab_size}


def change(args: RunConfig, checkpoint_dir: str) -> Optional[dict]:
    """The checkpoint's layout if it differs from this run's, refused where no path exists."""
    layout = read_layout(checkpoint_dir)
    ours = current(args)
    if layout is None or all(layout[k] == v for k, v in ours.items()):
        return None
    for side, stage, precision in (
        ("checkpoint", layout["zero_stage"], layout["precision"]),
        ("this run", ours["zero_stage"], ours["precision"]),
    ):
        if stage == 0 and precision != "fp32":
            raise ValueError(
                f"{checkpoint_dir} was written at {_describe(layout)}; this run is at "
                f"{_describe(ours)}: a {precision} run at ZeRO stage 0 ({side}) resumes only at "
                "its "
                "own layout; resume at that layout, or use ZeRO stage 1 or higher on both sides"
            )
    return layout


def _describe(layout: dict) -> str:
    cp = layout["context_parallel_size"]
    return (
        f"TP {layout['tensor_model_parallel_size']}, DP {layout['data_parallel_size']}, "
        + (f"CP {cp}, " if cp > 1 else "")
        + f"ZeRO stage {layout['zero_stage']}, {layout['precision']}"
    )


def tensor_parallel_splits(model: torch.nn.Module) -> dict:
    """DeepSpeed's universal-checkpoint description of how each parameter is split over
    tensor-parallel ranks, as the parameters declare it (`tp_layout.split_of`): replicated, split
    along rows (dim 1), split along columns (dim 0, the converter's default), or, with stride 2
    (SwiGLU's fused fc1), two halves each split along dim 0."""
    info = {
        uc.TP_REPLICATED_PARAMETER_PATTERNS: [],
        uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [],
        uc.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: [],
        uc.UNIVERSAL_CHECKPOINT_VERSION_KEY: uc.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    }
    for name, param in model.named_parameters():
        pattern, split = re.escape(name) + "$", tp_layout.split_of(param)
        if split is None:
            info[uc.TP_REPLICATED_PARAMETER_PATTERNS].append(pattern)
        elif split == (1, 1):
            info[uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(pattern)
        elif split == (0, 2):
            info[uc.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0].append(pattern)
        elif split != (0, 1):
            raise NotImplementedError(
                f"{name}: split {split} (dim, stride) over TP ranks, which DeepSpeed's universal "
                "checkpoint cannot convert"
            )
    return info


def describe_model(model: torch.nn.Module) -> None:
    """Attach the split description, which DeepSpeed saves with every checkpoint."""
    setattr(model, uc.UNIVERSAL_CHECKPOINT_INFO, tensor_parallel_splits(model))


def load(
    engine,
    args: RunConfig,
    checkpoint_dir: str,
    layout: dict,
    trained_names: list,
    padded_vocab_size: int,
) -> dict:
    """Load `checkpoint_dir`, written at `layout`, at this run's; returns the client state."""
    tag = os.path.basename(checkpoint_dir)
    root = universal_dir(args.save or os.path.dirname(checkpoint_dir), tag)
    out = os.path.join(root, tag)
    if dist.get_rank() == 0:
        print(
            f"resuming {checkpoint_dir}, written at {_describe(layout)}, at "
            f"{_describe(current(args))}: converting it through DeepSpeed's universal "
            f"checkpoint in {root}",
            flush=True,
        )
        universal.to_universal(
            checkpoint_dir,
            out,
            layout,
            trained_names,
            padded_vocab_size,
            args.allow_unsafe_checkpoints,
        )
        _name_for_engine(engine, out)
    dist.barrier()
    try:
        if args.zero_stage == 0:
            client_state = _load_stage0(engine, out, args.allow_unsafe_checkpoints)
        else:
            groups = [
                {k: v for k, v in g.items() if k != "params"}
                for g in engine.optimizer.optimizer.param_groups
            ]
            path, client_state = engine.load_checkpoint(root, tag=tag)
            if path is None:
                raise RuntimeError(f"DeepSpeed could not load {out}")
            for group, ours in zip(engine.optimizer.optimizer.param_groups, groups):
                # ZeRO-3 gives every group the first's settings
                group.update({k: ours[k] for k in ("wd_mult", "max_lr", "min_lr") if k in ours})
            for state in engine.optimizer.optimizer.state.values():
                # ZeRO-3 gives every group one shared step tensor, which AdamW then advances
                # once per group and step
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).clone()
            engine.lr_scheduler.step(0)  # this run's LR and weight decay on every group
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return client_state


def _name_for_engine(engine, out: str) -> None:
    """The engine reads its records from the model-states file it would have written itself."""
    name = engine._get_ckpt_name(out, "", mp_placeholder="00", pp_placeholder="0")
    universal.name_records(out, os.path.basename(name))


def _load_stage0(engine, out: str, allow_unsafe: bool) -> dict:
    """Weights and AdamW state from the universal files, cut for this tensor-parallel rank by
    DeepSpeed's own `load_hp_checkpoint_state`; then the engine's records."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    optimizer = engine.optimizer
    trained = {p for group in optimizer.param_groups for p in group["params"]}
    for name, param in engine.module.named_parameters():
        folder = universal.parameter_folder(out, name)
        mapping = types.SimpleNamespace(
            lp_fragment_address=fragment_address(start=0, numel=param.numel()),
            get_hp_fragment=lambda p=param: p.data.view(-1),
            optim_fragment={},
        )
        view = types.SimpleNamespace(shape=param.shape, numel=param.numel, _hp_mapping=mapping)
        with torch.no_grad():
            step = load_hp_checkpoint_state(view, folder, tp_rank, tp_size)
        if param in trained and mapping.optim_fragment:
            optimizer.state[param] = {
                "step": torch.tensor(float(step if step is not None else 0)),
                **{k: mapping.optim_fragment[k].view_as(param) for k in universal.STATES[1:]},
            }
    records = universal.read_records(out, allow_unsafe)
    engine.lr_scheduler.load_state_dict(records["lr_scheduler"])
    engine.global_steps = records["global_steps"]
    engine.global_samples = records.get("global_samples", 0)
    engine.skipped_steps = records["skipped_steps"]
    return records
