"""Resuming at another layout: another tensor-parallel, data-parallel or context-parallel size,
or ZeRO stage.

Every rank saves its own shards, so a checkpoint fits the layout that wrote it, which
`layout.json` records. A run whose layout differs loads the checkpoint through DeepSpeed's
universal format: its converter (`ds_to_universal`) merges every rank's shards into one full
tensor per parameter and state (fp32 master weights, Adam's moments and step), in a scratch
folder beside the checkpoint, and the engine cuts them again for its own ranks. What the
converter needs from us is how each parameter is split over tensor-parallel ranks
(`tensor_parallel_splits`, read from Megatron-Core's own marks on the parameters), which the
model carries into every checkpoint.

ZeRO stage 0, whose checkpoints the converter does not read and whose optimizer the engine does
not load from that format, goes through the same per-parameter files here, merged and cut by
DeepSpeed's own functions. bf16 and fp16 at stage 0 keep their layout (DeepSpeed's mixed-precision
optimizers there have no such path).
"""

import argparse
import contextlib
import glob
import io
import os
import re
import shutil
import types
from typing import Optional

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint import constants as uc
from deepspeed.checkpoint import ds_to_universal
from deepspeed.checkpoint.universal_checkpoint import load_hp_checkpoint_state
from deepspeed.utils.tensor_fragment import fragment_address
from megatron.core import parallel_state

from megatron_focus.checkpoint.format import (
    current_name,
    model_file,
    model_state_file,
    read_layout,
    read_model_file,
)
from megatron_focus.checkpoint.safe_load import load_file

# The model-args keys that follow the layout rather than the model.
LAYOUT_KEYS = ("tensor_model_parallel_size", "padded_vocab_size")
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def current(args: argparse.Namespace) -> dict:
    return {
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        # ZeRO's shards are split over data-parallel x context-parallel ranks
        "context_parallel_size": args.context_parallel_size,
        "zero_stage": args.zero_stage,
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
    }


def record(args: argparse.Namespace, padded_vocab_size: int) -> dict:
    """`layout.json` of this run's checkpoints: its layout and the vocabulary padded for it."""
    return {**current(args), "padded_vocab_size": padded_vocab_size}


def change(args: argparse.Namespace, checkpoint_dir: str) -> Optional[dict]:
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
    tensor-parallel ranks: replicated, split along rows (dim 1), split along columns (dim 0, the
    converter's default), or, for SwiGLU's fused fc1, two halves each split along dim 0."""
    info = {
        uc.TP_REPLICATED_PARAMETER_PATTERNS: [],
        uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [],
        uc.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: [],
        uc.UNIVERSAL_CHECKPOINT_VERSION_KEY: uc.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    }
    gated = getattr(getattr(model, "config", None), "gated_linear_unit", False)
    for name, param in model.named_parameters():
        pattern = re.escape(name) + "$"
        if not getattr(param, "tensor_model_parallel", False):
            info[uc.TP_REPLICATED_PARAMETER_PATTERNS].append(pattern)
        elif param.partition_dim == 1:
            info[uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(pattern)
        elif gated and ".mlp.linear_fc1." in name:
            info[uc.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0].append(pattern)
    return info


def describe_model(model: torch.nn.Module) -> None:
    """Attach the split description, which DeepSpeed saves with every checkpoint."""
    setattr(model, uc.UNIVERSAL_CHECKPOINT_INFO, tensor_parallel_splits(model))


def _quietly(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*args)


# --- the checkpoint, as one full tensor per parameter -------------------------------------------


def to_universal(
    checkpoint_dir: str,
    out: str,
    layout: dict,
    trained: list,
    padded_vocab: int,
    allow_unsafe: bool,
) -> None:
    """Write `out/zero/<parameter>/{fp32,exp_avg,exp_avg_sq,step}.pt` and the engine's records.

    `trained`: this model's trained parameter names per optimizer group, in order (they name a
    stage-0 optimizer's numbered states)."""
    shutil.rmtree(out, ignore_errors=True)
    if layout["zero_stage"] == 0:
        _stage0_to_universal(
            checkpoint_dir, out, layout["tensor_model_parallel_size"], trained, allow_unsafe
        )
    else:
        source = _without_empty_entries(checkpoint_dir, out + ".source", allow_unsafe)
        _quietly(
            ds_to_universal.main,
            argparse.Namespace(
                input_folder=source,
                output_folder=out,
                num_extract_workers=1,
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=False,
            ),
        )
        shutil.rmtree(source)
    zero = os.path.join(out, "zero")
    records = load_file(model_state_file(checkpoint_dir, 0, weights=False), allow_unsafe)
    for folder in glob.glob(os.path.join(zero, "*", "")):
        name = os.path.basename(os.path.dirname(folder))
        if current_name(name) != name:  # a checkpoint of an earlier version
            os.rename(folder, os.path.join(zero, current_name(name)))
    _write_optimizer_records(zero, records, allow_unsafe)
    for name in _VOCAB_PARAMS:
        if os.path.isdir(os.path.join(zero, name)):
            _fit_vocab(os.path.join(zero, name), padded_vocab)
    for path in glob.glob(os.path.join(out, "*model_states.pt")):
        os.remove(path)
    # The engine's records and ours (iteration, data position), without the old layout's shards,
    # in the one file the engine will read.
    torch.save(
        {
            **{k: v for k, v in records.items() if k not in ("module", "optimizer")},
            "module": {},
            "mp_world_size": 1,
        },
        os.path.join(out, "model_states.pt"),
    )


def _without_empty_entries(checkpoint_dir: str, source: str, allow_unsafe: bool) -> str:
    """The checkpoint as the converter can read it: Megatron-Core's layers save an empty
    (`None`) `_extra_state` beside their weights, which the converter takes for a tensor. The
    model-states files are rewritten without them; the optimizer files are linked."""
    shutil.rmtree(source, ignore_errors=True)
    os.makedirs(source)
    for name in os.listdir(checkpoint_dir):
        path = os.path.join(checkpoint_dir, name)
        if name.endswith("model_states.pt"):
            records = load_file(path, allow_unsafe)
            records["module"] = {k: v for k, v in records["module"].items() if v is not None}
            torch.save(records, os.path.join(source, name))
        else:
            os.symlink(os.path.abspath(path), os.path.join(source, name))
    return source


def _stage0_to_universal(
    checkpoint_dir: str, out: str, tp_size: int, trained: list, allow_unsafe: bool
) -> None:
    """A stage-0 checkpoint (whole weights and a torch AdamW state per tensor-parallel rank) as
    the converter's per-rank slices, merged by the converter's own `merge_tp_slices`."""
    slices, shapes, info = os.path.join(out, "tmp"), {}, None
    names = [name for group in trained for name in group]
    for tp in range(tp_size):
        saved = read_model_file(model_file(checkpoint_dir, tp), allow_unsafe)
        info = saved[uc.UNIVERSAL_CHECKPOINT_INFO]
        state, module = saved["optimizer"]["state"], saved["module"]
        for index, name in enumerate(names):
            weight = module[name]
            shapes.setdefault(name, []).append(weight.shape)
            values = {"fp32": weight.float(), **{k: state[index][k] for k in _STATES[1:]}}
            for key, value in values.items():
                _save(os.path.join(slices, name, str(tp), f"{key}.00"), value.flatten())
            _save(os.path.join(slices, name, str(tp), "step.00"), state[index]["step"])
    zero = os.path.join(out, "zero")
    for name in names:
        _quietly(ds_to_universal.merge_tp_slices, info, zero, slices, tp_size, (name, shapes[name]))
    for tp in range(tp_size):  # untrained weights (a retrofit's frozen base): value only
        module = read_model_file(model_file(checkpoint_dir, tp), allow_unsafe)["module"]
        for name, weight in module.items():
            if name not in shapes and not name.endswith("_extra_state"):
                _save(os.path.join(slices, name, str(tp), "fp32.00"), weight.float().flatten())
                shapes.setdefault(name, []).append(weight.shape)
    for name in set(shapes) - set(names):
        _quietly(ds_to_universal.merge_tp_slices, info, zero, slices, tp_size, (name, shapes[name]))
    shutil.rmtree(slices)


def _save(path: str, value) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(value, path)


def _fit_vocab(folder: str, padded_vocab: int) -> None:
    """The embedding and output rows padded for this run's tensor-parallel size: rows past the
    checkpoint's padding start at zero, rows past this run's are dropped (padding only)."""
    for key in _STATES:
        path = os.path.join(folder, f"{key}.pt")
        if not os.path.isfile(path):
            continue
        record = load_file(path)
        full = record[uc.PARAM]
        if full.shape[0] != padded_vocab:
            fitted = full.new_zeros((padded_vocab,) + tuple(full.shape[1:]))
            rows = min(padded_vocab, full.shape[0])
            fitted[:rows] = full[:rows]
            record[uc.PARAM] = fitted
            torch.save(record, path)


def _write_optimizer_records(zero: str, records: dict, allow_unsafe: bool) -> None:
    """One shape whichever stage wrote the checkpoint: every state file a record holding the
    full tensor (ZeRO-3's converter writes bare flat tensors), a step beside every trained
    parameter (ZeRO-3 keeps one for all), and `optimizer_state.pt` as both of DeepSpeed's
    universal loaders read it (ZeRO 1-2 the top level, ZeRO-3 the nested optimizer state)."""
    path = os.path.join(zero, "optimizer_state.pt")
    state = load_file(path, allow_unsafe) if os.path.isfile(path) else {}
    groups = state.get(uc.PARAM_GROUPS) or records["optimizer"][uc.PARAM_GROUPS]
    steps = glob.glob(os.path.join(zero, "*", "step.pt"))
    step = load_file(steps[0]) if steps else state[uc.OPTIMIZER_STATE_DICT]["state"][0]["step"]
    shapes = {
        current_name(name): shape
        for group in records.get(uc.PARAM_SHAPES) or []
        for name, shape in group.items()
    }
    for folder in glob.glob(os.path.join(zero, "*", "")):
        name = os.path.basename(os.path.dirname(folder))
        for key in _STATES:
            value = (
                load_file(os.path.join(folder, f"{key}.pt"))
                if os.path.isfile(os.path.join(folder, f"{key}.pt"))
                else None
            )
            if torch.is_tensor(value):
                torch.save({uc.PARAM: value.view(shapes[name])}, os.path.join(folder, f"{key}.pt"))
        if os.path.isfile(os.path.join(folder, "exp_avg.pt")) and not os.path.isfile(
            os.path.join(folder, "step.pt")
        ):
            torch.save(step, os.path.join(folder, "step.pt"))
    nested = state.get(uc.OPTIMIZER_STATE_DICT) or {
        "state": {0: {"step": step}},
        uc.PARAM_GROUPS: groups,
    }
    torch.save(
        {
            "ds_version": deepspeed.__version__,
            **state,
            uc.PARAM_GROUPS: groups,
            uc.OPTIMIZER_STATE_DICT: nested,
        },
        path,
    )


# --- loading it at this run's layout ------------------------------------------------------------


def load(
    engine,
    args: argparse.Namespace,
    checkpoint_dir: str,
    layout: dict,
    trained_names: list,
    padded_vocab_size: int,
) -> dict:
    """Load `checkpoint_dir`, written at `layout`, at this run's; returns the client state."""
    root = os.path.join(
        args.save or os.path.dirname(checkpoint_dir),
        os.path.basename(checkpoint_dir) + ".universal",
    )
    tag = os.path.basename(checkpoint_dir)
    out = os.path.join(root, tag)
    if dist.get_rank() == 0:
        print(
            f"resuming {checkpoint_dir}, written at {_describe(layout)}, at "
            f"{_describe(current(args))}: converting it through DeepSpeed's universal "
            f"checkpoint in {root}",
            flush=True,
        )
        to_universal(
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
    name = os.path.basename(engine._get_ckpt_name(out, "", mp_placeholder="00", pp_placeholder="0"))
    os.replace(os.path.join(out, "model_states.pt"), os.path.join(out, name))


def _load_stage0(engine, out: str, allow_unsafe: bool) -> dict:
    """Weights and AdamW state from the universal files, cut for this tensor-parallel rank by
    DeepSpeed's own `load_hp_checkpoint_state`; then the engine's records."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    zero = os.path.join(out, "zero")
    optimizer = engine.optimizer
    trained = {p for group in optimizer.param_groups for p in group["params"]}
    for name, param in engine.module.named_parameters():
        folder = os.path.join(zero, name)
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
                **{k: mapping.optim_fragment[k].view_as(param) for k in _STATES[1:]},
            }
    records = load_file(glob.glob(os.path.join(out, "*model_states.pt"))[0], allow_unsafe)
    engine.lr_scheduler.load_state_dict(records["lr_scheduler"])
    engine.global_steps = records["global_steps"]
    engine.global_samples = records.get("global_samples", 0)
    engine.skipped_steps = records["skipped_steps"]
    return records
