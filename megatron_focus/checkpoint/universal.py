"""DeepSpeed's universal checkpoint: a checkpoint's shards merged into one full tensor per
parameter and state (fp32 master weights, Adam's moments and step), which the engine cuts again
for any layout (`training/layouts.py` loads it). Its converter (`ds_to_universal`) reads ZeRO
1-3 checkpoints; ZeRO stage 0's, which it does not read, go through the same per-parameter files
here, merged by its own functions. The folder is scratch beside the checkpoint
(`format.universal_dir`), removed once loaded.

Layout: `<out>/zero/<parameter>/{fp32,exp_avg,exp_avg_sq,step}.pt`, `<out>/zero/
optimizer_state.pt`, and the engine's records in one model-states file (`RECORDS`, renamed to
what the engine reads by `name_records`).
"""

import argparse
import contextlib
import glob
import io
import os
import shutil

import deepspeed
import torch
from deepspeed.checkpoint import constants as uc
from deepspeed.checkpoint import ds_to_universal

from megatron_focus.checkpoint.format import (
    is_model_states,
    model_file,
    model_state_file,
    read_model_file,
)
from megatron_focus.checkpoint.safe_load import load_file
from megatron_focus.variants import current_name

ZERO = "zero"
RECORDS = "model_states.pt"
OPTIMIZER = "optimizer_state.pt"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def parameter_folder(out: str, name: str) -> str:
    """Where one parameter's full tensors are (DeepSpeed's `load_hp_checkpoint_state` reads it)."""
    return os.path.join(out, ZERO, name)


def _model_states(out: str) -> list:
    return [os.path.join(out, name) for name in os.listdir(out) if is_model_states(name)]


def read_records(out: str, allow_unsafe: bool) -> dict:
    """The engine's records (schedule, steps, our client state) in the converted folder."""
    return load_file(_model_states(out)[0], allow_unsafe)


def name_records(out: str, name: str) -> None:
    """The records under `name`: the model-states file the engine would have written itself."""
    os.replace(os.path.join(out, RECORDS), os.path.join(out, name))


def _quietly(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*args)


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
    zero = os.path.join(out, ZERO)
    records = load_file(model_state_file(checkpoint_dir, 0, weights=False), allow_unsafe)
    for folder in glob.glob(os.path.join(zero, "*", "")):
        name = os.path.basename(os.path.dirname(folder))
        if current_name(name) != name:  # a checkpoint of an earlier version
            os.rename(folder, os.path.join(zero, current_name(name)))
    _write_optimizer_records(zero, records, allow_unsafe)
    for name in _VOCAB_PARAMS:
        if os.path.isdir(os.path.join(zero, name)):
            _fit_vocab(os.path.join(zero, name), padded_vocab)
    for path in _model_states(out):
        os.remove(path)
    # The engine's records and ours (iteration, data position), without the old layout's shards,
    # in the one file the engine will read.
    torch.save(
        {
            **{k: v for k, v in records.items() if k not in ("module", "optimizer")},
            "module": {},
            "mp_world_size": 1,
        },
        os.path.join(out, RECORDS),
    )


def _without_empty_entries(checkpoint_dir: str, source: str, allow_unsafe: bool) -> str:
    """The checkpoint as the converter can read it: Megatron-Core's layers save an empty
    (`None`) `_extra_state` beside their weights, which the converter takes for a tensor. The
    model-states files are rewritten without them; the optimizer files are linked."""
    shutil.rmtree(source, ignore_errors=True)
    os.makedirs(source)
    for name in os.listdir(checkpoint_dir):
        path = os.path.join(checkpoint_dir, name)
        if is_model_states(name):
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
            values = {"fp32": weight.float(), **{k: state[index][k] for k in STATES[1:]}}
            for key, value in values.items():
                _save(os.path.join(slices, name, str(tp), f"{key}.00"), value.flatten())
            _save(os.path.join(slices, name, str(tp), "step.00"), state[index]["step"])
    zero = os.path.join(out, ZERO)
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
    for key in STATES:
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
    path = os.path.join(zero, OPTIMIZER)
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
        for key in STATES:
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
