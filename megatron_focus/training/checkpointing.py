"""Saving and resuming a run through DeepSpeed's engine: checkpoints that are either complete or
invisible, and that refuse a model of another shape.

What a checkpoint folder holds is `checkpoint/format.py`; beside it, DeepSpeed's client state
carries the iteration, consumed samples and every RNG state. A checkpoint written at another
layout (TP / DP size, ZeRO stage, precision) resumes through `layouts.py`.

A retrofit run (`--retrofit`) saves, unless `--save-full`, only what it trains (the routers, and
their optimizer state) plus `base_checkpoint.json`, naming the complete checkpoint that holds the
frozen weights: loading, resuming and the HF export read the base first, then the routers.

A save is written under `iter_XXXXXXX.partial`, renamed once every rank has finished, and only
then does `latest` move (itself written to a temporary file and renamed). A crash mid-save leaves
the previous checkpoint as latest and nothing that looks complete.
"""

import argparse
import contextlib
import errno
import json
import os
import random
import re
import shutil
import tempfile
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.parallel_state import get_tensor_model_parallel_rank
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megatron_focus import cli, platform
from megatron_focus.checkpoint import integrity
from megatron_focus.checkpoint.format import (
    ARGS_FILE,
    BASE_FILE,
    FOCUS_KEYS,
    LATEST,
    NO_OPTIMIZER,
    TOKENIZER_FILE,
    WEIGHTS_ONLY,
    base_checkpoint,
    check_compatible,
    complete_tags,
    current_names,
    latest_tag,
    model_args,
    resume_tag,
    saved_model_args,
    tag_for,
    write_atomically,
)
from megatron_focus.checkpoint.safe_load import check_safe_to_load, load_file
from megatron_focus.training import layouts
from megatron_focus.training.optimizer import param_groups, schedule


def rng_state() -> dict:
    name, keys, position, has_gauss, gauss = np.random.get_state()
    state = {
        "random": random.getstate(),
        # as a tensor: a numpy array would need pickle to load
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if platform.has_cuda():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    name, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


class SaveFailed(cli.Stopped):
    """A save that could not be written: the run stops, its previous checkpoint still latest."""


def save(engine, args: argparse.Namespace, iteration: int, consumed_samples: int) -> str:
    """Save on every rank; returns the checkpoint directory.

    Written under `<tag>.partial`, checksummed, then renamed and made `latest`. A write that
    fails on any rank (a full disk, a lost permission) removes the partial folder and raises
    `SaveFailed` on every rank, the previous checkpoint still `latest`.
    """
    tag = tag_for(iteration)
    partial, final = os.path.join(args.save, f"{tag}.partial"), os.path.join(args.save, tag)
    rank0 = dist.get_rank() == 0
    if rank0:
        os.makedirs(args.save, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # debris of an earlier crashed save
    dist.barrier()
    client_state = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        **({} if args.no_save_rng else {"rng": rng_state()}),
    }
    trained_only = args.retrofit and not args.save_full
    optimizer = _optimizer_left_out(engine) if args.no_save_optim else contextlib.nullcontext()
    with optimizer, _failures_named(engine):
        failure = _attempt(
            lambda: engine.save_checkpoint(
                args.save,
                tag=f"{tag}.partial",
                client_state=client_state,
                save_latest=False,
                exclude_frozen_parameters=trained_only,
            )
        )
    if failure:
        dist.barrier()  # the one DeepSpeed's save ends with, which the other ranks are in
    _agree(failure, partial, args.save)
    _agree(
        _attempt(lambda: _write_records(args, partial, trained_only)) if rank0 else None,
        partial,
        args.save,
    )
    digests = integrity.digests(partial)
    _agree(
        _attempt(lambda: integrity.write(partial, digests)) if rank0 else None,
        partial,
        args.save,
    )
    _agree(
        _attempt(lambda: _publish(partial, final, args.save)) if rank0 else None,
        partial,
        args.save,
    )
    return final


def _publish(partial: str, final: str, save_dir: str) -> None:
    """The complete checkpoint under its own name, then `latest` naming it."""
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    write_atomically(os.path.join(save_dir, LATEST), os.path.basename(final))


@contextlib.contextmanager
def _optimizer_left_out(engine):
    """--no-save-optim: DeepSpeed writes the weights but no optimizer state (ZeRO's shards are
    skipped, stage 0's state is not asked for); the LR schedule's position stays, as it is small."""
    optimizer, zero_files = engine.optimizer, engine.save_zero_checkpoint
    engine.save_zero_checkpoint = False
    if not engine.zero_optimization():
        engine.optimizer = None
    try:
        yield
    finally:
        engine.optimizer, engine.save_zero_checkpoint = optimizer, zero_files


# Bytes free below which a write that failed was a full disk: torch's writer reports one as
# `RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos ...`, without an errno.
_FULL = 1 << 20


@contextlib.contextmanager
def _failures_named(engine):
    """DeepSpeed's files written so that a failed write raises an OSError naming the file."""
    writer = engine.checkpoint_engine
    save = writer.save

    def named(state_dict, path):
        try:
            save(state_dict, path)
        except (OSError, RuntimeError) as e:
            raise _write_error(e, path) from e

    writer.save = named
    try:
        yield
    finally:
        writer.save = save


def _write_error(error: Exception, path: str) -> OSError:
    """`error`, raised writing `path`, as an OSError naming the file and, when torch's writer
    hides it, the cause: a full disk is told by the space left."""
    if isinstance(error, OSError):
        return error if error.filename else OSError(error.errno, error.strerror or str(error), path)
    if shutil.disk_usage(os.path.dirname(path)).free < _FULL:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return OSError(errno.EIO, f"torch could not write it ({str(error).splitlines()[0]})", path)


def _attempt(write) -> Optional[OSError]:
    try:
        write()
    except OSError as e:
        return e
    return None


# A failed write's cause in words, and what the user can do about it.
_CAUSES = {
    errno.ENOSPC: ("the disk is full", "free space on that disk"),
    errno.EDQUOT: ("the disk quota is used up", "free some of the quota"),
    errno.EACCES: ("no permission to write there", "make the folder writable"),
    errno.EPERM: ("no permission to write there", "make the folder writable"),
    errno.EROFS: ("the file system is read-only", "mount it writable"),
}


def described(failure: OSError, folder: str) -> tuple:
    """(what failed, naming the file; what to do) for a write into `folder` that failed."""
    cause, remedy = _CAUSES.get(failure.errno, ("the write failed", "fix that"))
    what = failure.strerror or str(failure)
    return f"{cause} ({what}: {failure.filename or folder})", remedy


def _agree(failure: Optional[OSError], partial: str, save_dir: str) -> None:
    """Collective: if the save failed on any rank, every rank raises `SaveFailed`."""
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure and described(failure, partial))
    failed = [(rank, what) for rank, what in enumerate(failures) if what]
    if not failed:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    previous = latest_tag(save_dir) if os.path.isfile(os.path.join(save_dir, LATEST)) else None
    rank, (what, remedy) = failed[0]
    raise SaveFailed(
        f"saving {os.path.basename(partial)[: -len('.partial')]} failed on rank "
        f"{rank}: {what}; "
        + (f"{previous} stays the latest checkpoint" if previous else "no checkpoint was saved")
        + f": {remedy} or give --save another folder, then rerun"
        + (" with --load to resume" if previous else "")
    )


def _write_records(args: argparse.Namespace, folder: str, trained_only: bool) -> None:
    """Our files beside DeepSpeed's: the model's shape, layout, tokenizer, retrofit base."""
    if trained_only:
        write_atomically(os.path.join(folder, BASE_FILE), json.dumps(args.retrofit_base))
    if args.no_save_optim:
        write_atomically(os.path.join(folder, NO_OPTIMIZER), "saved with --no-save-optim\n")
    write_atomically(
        os.path.join(folder, ARGS_FILE), json.dumps(model_args(args), indent=1, sort_keys=True)
    )
    layouts.write(args, folder)
    write_atomically(
        os.path.join(folder, TOKENIZER_FILE),
        json.dumps(
            {
                "tokenizer_type": args.tokenizer_type,  # none for synthetic data (--mqar)
                "tokenizer_model": args.tokenizer_model and os.path.abspath(args.tokenizer_model),
                **{
                    key: getattr(args, key) and os.path.abspath(getattr(args, key))
                    for key in ("vocab_file", "merge_file")
                },
                "vocab_size": args.tokenizer_vocab_size,
            },
            indent=1,
        ),
    )


def _check_writable(flag: str, folder: str) -> None:
    """That `folder` can be created and written, without creating it (the first save will)."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {folder}: cannot write there ({e.strerror})") from None


# What an interrupted save or layout conversion leaves: never complete, never `latest`.
_DEBRIS = re.compile(r"iter_\d{7}\.(partial|universal)|latest\.tmp")


def _remove_debris(folder: str) -> None:
    debris = sorted(name for name in os.listdir(folder) if _DEBRIS.fullmatch(name))
    for name in debris:
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    if debris:
        print(f"removed what an interrupted run left in {folder}: {', '.join(debris)}", flush=True)


def preflight(args: argparse.Namespace) -> None:
    """What would fail at the first save or at load, refused before any compute: a signal
    handler with nowhere to save, a `--save` that cannot be written, a folder of complete
    checkpoints whose `latest` is gone (which would otherwise start from scratch and overwrite
    them), and a damaged checkpoint to resume.
    Megatron's `--pretrained-checkpoint` becomes a weights-only `--load` while `--load` is empty."""
    if args.pretrained_checkpoint and (not args.load or resume_tag(args) is None):
        args.load, args.finetune, args.ckpt_step = args.pretrained_checkpoint, True, None
    if args.exit_signal_handler and not args.save:
        raise ValueError(
            "--exit-signal-handler saves a checkpoint when a signal stops the run: give --save "
            "(without one, the stopped run would look finished)"
        )
    if args.save:
        _check_writable("--save", args.save)
        if os.path.isdir(args.save) and dist.get_rank() == 0:
            _remove_debris(args.save)
    for folder in {args.load, args.save} - {None}:
        if (
            not os.path.isdir(folder)
            or os.path.isfile(os.path.join(folder, LATEST))
            or args.ckpt_step is not None
        ):
            continue
        complete = complete_tags(folder)
        if complete:
            raise ValueError(
                f"{folder} holds checkpoints {', '.join(complete)} but no '{LATEST}' file: "
                f"resume from one with --ckpt-step (e.g. {int(complete[-1][len('iter_') :])}), "
                "or save this run elsewhere"
            )
    tag = resume_tag(args) if args.load else None
    if tag is not None:
        integrity.verify(os.path.join(args.load, tag))
        base = base_checkpoint(os.path.join(args.load, tag))
        if base is not None:
            integrity.verify(base)


def _adds_focus(args, checkpoint_dir: str) -> bool:
    return args.retrofit and saved_model_args(checkpoint_dir)["attention"] != args.attention


def _module_file(checkpoint_dir: str, weights: bool, tp: Optional[int] = None) -> str:
    """This TP rank's model file (or TP rank `tp`'s): `mp_rank_XX_model_states.pt`, or under
    ZeRO-3, whose weights are partitioned over the optimizer files, data-parallel rank 0's (every
    name, no values)."""
    tp = get_tensor_model_parallel_rank() if tp is None else tp
    shard = os.path.join(checkpoint_dir, f"mp_rank_{tp:02d}_model_states.pt")
    zero3 = os.path.join(checkpoint_dir, f"zero_pp_rank_0_mp_rank_{tp:02d}_model_states.pt")
    if os.path.isfile(shard):
        return shard
    if not os.path.isfile(zero3):
        raise FileNotFoundError(f"{shard} is missing: not a complete checkpoint")
    if weights:
        raise ValueError(
            f"{checkpoint_dir} is a ZeRO-3 checkpoint, whose weights are "
            "partitioned: resume it as it is, or export it (tools/convert_to_hf.py) "
            "and import that to load its weights alone"
        )
    return zero3


def _checked_file(
    engine,
    checkpoint_dir: str,
    may_miss,
    allow_unsafe: bool,
    weights: bool = True,
    tp: Optional[int] = None,
) -> dict:
    """This rank's model file (or TP rank `tp`'s), refused unless its weights are this model's
    (bar `may_miss(name)`); `weights=False`: only their names are checked (a ZeRO-3 checkpoint
    holds no values there)."""
    saved_file = load_file(_module_file(checkpoint_dir, weights, tp), allow_unsafe, mmap=True)
    saved = saved_file["module"] = current_names(saved_file["module"])
    ours = engine.module.state_dict().keys()
    missing = [k for k in ours - saved.keys() if not may_miss(k) and not k.endswith("_extra_state")]
    unexpected = [k for k in saved.keys() - ours if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(
            f"{checkpoint_dir} does not fit this model: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    return saved_file


# Megatron's OptimizerParamScheduler state: the flag that sets each value.
SCHEDULE_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters",
    "lr_decay_steps": "--lr-decay-iters",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay",
    "end_wd": "--weight-decay",
    "wd_incr_steps": "--train-iters",
}


def _shown(value):
    return f"{value:.6g}" if isinstance(value, float) else value


def check_schedule(saved: dict, args: argparse.Namespace, checkpoint_dir: str) -> None:
    """Refuse, as Megatron-LM does, a resume whose schedule flags differ from the checkpoint's,
    unless the user chose whose values win (which Megatron's scheduler then applies)."""
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    ours = schedule(args)
    differ = sorted(
        {
            f"{flag} {_shown(ours[key])} (checkpoint: {_shown(saved[key])})"
            for key, flag in SCHEDULE_FLAGS.items()
            if key in saved and saved[key] != ours[key]
        }
    )
    if differ:
        raise ValueError(
            f"{checkpoint_dir}: this run's schedule differs from the checkpoint's: "
            f"{', '.join(differ)}; pass --override-opt_param-scheduler to use this "
            "run's values, or --use-checkpoint-opt_param-scheduler to keep the "
            "checkpoint's"
        )


def _load_weights_only(engine, args, checkpoint_dir: str, may_miss) -> None:
    """Model weights only (no optimizer, schedule or run state), checked before they are read.

    Loaded here rather than by DeepSpeed's `load_module_only`, which under ZeRO-2 copies frozen
    weights from the checkpoint's own list of frozen weights: empty when the checkpoint froze
    nothing, as a retrofit's base did.
    """
    saved = _checked_file(engine, checkpoint_dir, may_miss, args.allow_unsafe_checkpoints)
    engine.module.load_state_dict(saved["module"], strict=False)
    if hasattr(engine.optimizer, "refresh_fp32_params"):  # ZeRO's and bf16's fp32 master copies
        engine.optimizer.refresh_fp32_params()


def _is_router(name: str) -> bool:
    return ".router." in name


def check_resume(args: argparse.Namespace) -> None:
    """Everything `load` would refuse, refused before the data, model and engine are built: no
    checkpoint where one is needed, a model of another shape, a changed schedule, pickled code."""
    if not args.load:
        return
    tag = resume_tag(args)
    if tag is None:
        if not _resuming_own_run(args) or args.retrofit or args.finetune:
            raise FileNotFoundError(f"--load {args.load}: no checkpoint there (no '{LATEST}' file)")
        return
    checkpoint_dir = os.path.join(os.path.abspath(args.load), tag)
    base_dir = base_checkpoint(checkpoint_dir)
    for folder in (base_dir, checkpoint_dir):
        if folder is not None:
            check_safe_to_load(folder, args.allow_unsafe_checkpoints)
    if base_dir is not None:
        _check_weights_fit(args, base_dir)
    if _weights_only(args, checkpoint_dir):
        _check_weights_fit(args, checkpoint_dir)
        return
    layout = layouts.change(args, checkpoint_dir)
    no_optimizer = os.path.isfile(os.path.join(checkpoint_dir, NO_OPTIMIZER))
    if no_optimizer and (layout or not args.no_load_optim):
        raise ValueError(
            f"{checkpoint_dir} was saved with --no-save-optim: it resumes with "
            "--no-load-optim (or --finetune), at its own layout"
        )
    if layout and (args.retrofit or base_dir is not None):
        raise ValueError(
            f"{checkpoint_dir} is a retrofit's, written at another layout: resume "
            "it at its own (" + ", ".join(f"{k} {v}" for k, v in layout.items()) + ")"
        )
    if layout and args.no_load_optim:
        raise ValueError(
            f"{checkpoint_dir} was written at another layout, which resumes with "
            "its optimizer state: drop --no-load-optim, or resume at its layout"
        )
    check_compatible(args, checkpoint_dir, ignore=layouts.LAYOUT_KEYS if layout else ())
    if not args.no_load_optim:  # the schedule comes from the checkpoint with the optimizer
        saved = load_file(
            _module_file(checkpoint_dir, weights=False, tp=0),
            args.allow_unsafe_checkpoints,
            mmap=True,
        )
        check_schedule(saved["lr_scheduler"], args, checkpoint_dir)


def _resuming_own_run(args: argparse.Namespace) -> bool:
    return os.path.abspath(args.load) == os.path.abspath(args.save or "")


def _weights_only(args: argparse.Namespace, checkpoint_dir: str) -> bool:
    """An imported model, --finetune, or a retrofit adding Focus to a model without it: weights
    only, and this run's optimizer and schedule start at iteration 0."""
    return (
        os.path.isfile(os.path.join(checkpoint_dir, WEIGHTS_ONLY))
        or args.finetune
        or _adds_focus(args, checkpoint_dir)
    )


def _check_weights_fit(args: argparse.Namespace, checkpoint_dir: str) -> None:
    ignore = ("attention",) + FOCUS_KEYS if _adds_focus(args, checkpoint_dir) else ()
    if args.position_embedding_type != "learned_absolute":  # no position table to outgrow
        # Context extension: fine-tune the weights at a longer --seq-length.
        ignore += ("max_position_embeddings",)
    check_compatible(args, checkpoint_dir, ignore=ignore)
    if args.zero_stage == 3:
        raise ValueError(
            "loading weights only (an imported model, --finetune, --retrofit) is not "
            "supported under ZeRO stage 3: use --zero-stage 2 or lower for this run"
        )


def load(engine, args: argparse.Namespace) -> tuple[int, int]:
    """Restore model, optimizer, scheduler, RNG and data position; returns (iteration, samples).

    With `--load` equal to `--save`, a folder with no checkpoint yet starts from scratch, so the
    same command both starts and resumes a run; any other `--load` must hold a checkpoint. What
    `check_resume` refuses has been refused before.
    """
    tag = resume_tag(args)
    if tag is None:
        return 0, 0
    checkpoint_dir = os.path.join(os.path.abspath(args.load), tag)
    base_dir = base_checkpoint(checkpoint_dir)
    if args.retrofit:  # what this run's trained-only checkpoints will name as their base
        load_dir, base_tag = os.path.split(base_dir or checkpoint_dir)
        args.retrofit_base = {"load": load_dir, "tag": base_tag}
    if base_dir is not None:  # frozen weights from the base, then the routers from here
        _load_weights_only(engine, args, base_dir, may_miss=_is_router)
    # This checkpoint may lack the routers (adding Focus) or hold nothing else (trained-only).
    adding_focus = _adds_focus(args, checkpoint_dir)
    may_miss = (
        (lambda k: not _is_router(k))
        if base_dir is not None
        else (lambda k: adding_focus and _is_router(k))
    )
    if _weights_only(args, checkpoint_dir):
        _load_weights_only(engine, args, checkpoint_dir, may_miss)
        return 0, 0
    layout = layouts.change(args, checkpoint_dir)
    _checked_file(
        engine,
        checkpoint_dir,
        may_miss,
        args.allow_unsafe_checkpoints,
        weights=False,
        tp=0 if layout else None,
    )
    if layout:
        trained = [[name for name, _ in group] for _, group in param_groups(engine.module, args)]
        client_state = layouts.load(engine, args, checkpoint_dir, layout, trained)
    else:
        path, client_state = engine.load_checkpoint(
            args.load,
            tag=tag,
            load_module_strict=base_dir is None,
            load_optimizer_states=not args.no_load_optim,
            load_lr_scheduler_states=not args.no_load_optim,
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load {checkpoint_dir}")
    if layout or args.no_load_rng or "rng" not in client_state:
        # Random states that belong to a rank of another layout, or that were not saved or are
        # not wanted: start afresh, as Megatron seeds a run, from the seed and the iteration.
        platform.manual_seed(args.seed + client_state["iteration"])
    else:
        set_rng_state(client_state["rng"])
    return client_state["iteration"], client_state["consumed_samples"]


def layout_change(args: argparse.Namespace) -> Optional[dict]:
    """The layout of the checkpoint this run resumes, if it is not this run's."""
    if not args.load or args.finetune:
        return None
    tag = resume_tag(args)
    if tag is None or os.path.isfile(os.path.join(args.load, tag, WEIGHTS_ONLY)):
        return None
    return layouts.change(args, os.path.join(args.load, tag))
