"""Saving and resuming a run through DeepSpeed's engine: checkpoints that are either complete or
invisible, and that refuse a model of another shape, in DeepSpeed's format or Megatron-LM's.

The trainer goes through one object, `Checkpointer`: `prepare` (the `--save` folder's preflight,
which holds the folder for this job alone until `release` (`checkpoint/lock.py`), and the resume
plan, before the data), `check` (this run's records, and everything loading would refuse, before
any compute), `prepare_engine`, `load`, `save` and `release`.

What a checkpoint folder holds is `checkpoint/format.py`; beside it, DeepSpeed's client state
carries the iteration, consumed samples and every RNG state. A checkpoint written at another
layout (TP / DP size, ZeRO stage, precision) resumes through `layouts.py`.

What a run starts from, and which format the folder holds, is decided once, before the data or
the model (`resume.py`); `load` executes that plan. A retrofit run (`--retrofit`) saves, unless
`--save-full`, only what it trains (the routers, and their optimizer state) plus a record naming
the complete checkpoint that holds the frozen weights (`format.BASE_FILE`): loading, resuming and
the HF export read the base first, then the routers.

A save is written under a partial name (`format.partial_tag`), renamed once every rank has
finished, and only then does `latest` move (itself written to a temporary file and renamed). A
crash mid-save leaves the previous checkpoint as latest and nothing that looks complete.
"""

import contextlib
import dataclasses
import errno
import json
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.parallel_state import get_tensor_model_parallel_rank
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megatron_focus import cli, platform
from megatron_focus.checkpoint import integrity, torch_dist
from megatron_focus.checkpoint.format import (
    BASE_FILE,
    DEBRIS,
    LATEST,
    MEGATRON_TRACKER,
    NO_OPTIMIZER,
    TokenizerRecord,
    iteration_of,
    latest_tag,
    model_state_file,
    partial_tag,
    read_model_file,
    tag_for,
    tag_of_partial,
    write_atomically,
    write_layout,
    write_model_args,
    write_schedule,
)
from megatron_focus.checkpoint.lock import FolderInUse, FolderLock, FolderLost
from megatron_focus.checkpoint.saved import SavedCheckpoint
from megatron_focus.config.run_config import RunConfig
from megatron_focus.data.sources import tokenizer_choice
from megatron_focus.model.flops import flops_per_token
from megatron_focus.model.gpt import padded_vocab_size
from megatron_focus.outputs import check_writable
from megatron_focus.training import layouts, resume
from megatron_focus.training.optimizer import in_unit, param_groups
from megatron_focus.training.resume import ResumePlan
from megatron_focus.variants import added_weight


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


@dataclasses.dataclass(frozen=True)
class Records:
    """Our files beside DeepSpeed's in every checkpoint this run saves: the model's args, its
    tokenizer, the layout that wrote it and, for a retrofit's trained-only checkpoints, where
    their frozen weights are (`ResumePlan.retrofit_base`)."""

    model_args: dict
    tokenizer: TokenizerRecord
    layout: dict
    retrofit_base: Optional[dict] = None
    schedule: Optional[dict] = None  # a variant's (resume.variant_schedule)

    @property
    def padded_vocab_size(self) -> int:
        return self.model_args["padded_vocab_size"]

    def write(self, folder: str, no_optimizer: bool) -> None:
        if self.retrofit_base is not None:
            write_atomically(os.path.join(folder, BASE_FILE), json.dumps(self.retrofit_base))
        if no_optimizer:
            write_atomically(os.path.join(folder, NO_OPTIMIZER), "saved with --no-save-optim\n")
        write_model_args(folder, self.model_args)
        write_layout(folder, self.layout)
        if self.schedule is not None:
            write_schedule(folder, self.schedule)
        self.tokenizer.write(folder)


class Checkpointer:
    """The run's checkpoints: what it starts from (`plan`), what it records (`records`, known
    once the tokenizer is), loading and saving. Built by `prepare`."""

    def __init__(self, args: RunConfig, plan: ResumePlan):
        self.args, self.plan = args, plan
        self.records: Optional[Records] = None
        self.lock: Optional[FolderLock] = None  # rank 0's
        self.job: Optional[str] = None  # the lock's job identity, on every rank

    @classmethod
    def prepare(cls, args: RunConfig) -> "Checkpointer":
        """Before the data is built: the `--save` folder's preflight (which holds it for this
        job until `release`), then the resume plan."""
        lock, job = _preflight(args)
        try:
            checkpointer = cls(args, resume.plan(args))
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        checkpointer.lock, checkpointer.job = lock, job
        return checkpointer

    def release(self) -> None:
        """The `--save` folder free for the next job (rank 0, which holds it)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def lost(self) -> bool:
        """Whether this job's lock was taken over, as its renewal last saw (rank 0's answer;
        False elsewhere): the run stops, and its save refuses to write."""
        return self.lock is not None and self.lock.lost

    def check(self, vocab_size: int) -> None:
        """Once the tokenizer's vocabulary is known: this run's records, and, before any
        compute, everything loading the plan's checkpoint would refuse."""
        self.records = _records(self.args, self.plan, vocab_size)
        resume.check(self.plan, self.args, self.records.model_args)

    @property
    def padded_vocab_size(self) -> int:
        return self.records.padded_vocab_size

    def prepare_engine(self, model, config: dict) -> None:
        """Before DeepSpeed's engine is built on `model` (frozen where this run does not train)
        with `config`: a resume refused if its optimizer state covers other weights than this
        run trains; which weights train and how each is split over TP ranks, which every save
        records; for a checkpoint of another layout at ZeRO 1-3, DeepSpeed's loading of the
        universal format."""
        trained = [name for name, param in model.named_parameters() if param.requires_grad]
        resume.check_trained(self.plan, self.args, trained)
        _check_fit(self.plan, self.args, model.state_dict().keys())
        layout = {**self.records.layout, "trained": trained}
        self.records = dataclasses.replace(self.records, layout=layout)
        if self.args.zero_stage > 0 and self.plan.layout:
            config.setdefault("checkpoint", {})["load_universal"] = True
        layouts.describe_model(model)

    def load(self, engine) -> tuple:
        """Execute the plan: (iteration, consumed samples) to resume from, (0, 0) for a start at
        iteration 0."""
        return _load(engine, self.args, self.plan, self.padded_vocab_size)

    def confirm(self) -> None:
        """Collective: raises `FolderLost` on every rank if the `--save` folder is no longer
        this job's."""
        _agree(None, None, self.args.save, self.lock)

    def save(self, engine, iteration: int, consumed_samples: int) -> str:
        """Save on every rank (collective); returns the checkpoint directory. Refused
        (`FolderLost`, on every rank, nothing written) if the folder is no longer this job's."""
        self.confirm()
        return _save(engine, self.args, self.records, iteration, consumed_samples, self)


def _records(args: RunConfig, plan: ResumePlan, vocab_size: int) -> Records:
    """This run's records, once its tokenizer's vocabulary is known."""
    padded = padded_vocab_size(
        vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
    return Records(
        args.model_config.record(padded, args.tensor_model_parallel_size, args.seq_length),
        TokenizerRecord.of_run(vocab_size, *tokenizer_choice(args)),
        layouts.record(args, padded),
        plan.retrofit_base,
        resume.variant_schedule(plan, args),
    )


def _save(
    engine, args: RunConfig, records: Records, iteration: int, consumed_samples: int, held
) -> str:
    """Save on every rank; returns the checkpoint directory.

    Written under a partial name of this job's own, checksummed, then renamed and made
    `latest`. A write that fails on any rank (a full disk, a lost permission) removes the partial
    folder and raises `SaveFailed` on every rank, the previous checkpoint still `latest`; a folder
    that is no longer this job's (`held.lock`, rank 0's) raises `FolderLost` before the rename.
    """
    tag = tag_for(iteration)
    partial = os.path.join(args.save, partial_tag(tag, held.job))
    final = os.path.join(args.save, tag)
    rank0 = dist.get_rank() == 0
    written = FORMATS[args.ckpt_format]
    if rank0:
        written.begin(partial)
    dist.barrier()
    client_state = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        **({} if args.no_save_rng else {"rng": rng_state()}),
    }

    def agree(failure):
        _agree(failure, partial, args.save, held.lock)

    agree(
        _attempt(lambda: written.write(engine, args, records, iteration, consumed_samples, partial))
    )
    trained_only = records.retrofit_base is not None
    optimizer = _optimizer_left_out(engine) if args.no_save_optim else contextlib.nullcontext()
    with optimizer, _failures_named(engine):
        failure = _attempt(
            lambda: engine.save_checkpoint(
                args.save,
                tag=os.path.basename(partial),
                client_state=client_state,
                save_latest=False,
                exclude_frozen_parameters=trained_only,
            )
        )
    if failure:
        dist.barrier()  # the one DeepSpeed's save ends with, which the other ranks are in
    agree(failure)
    agree(_attempt(lambda: records.write(partial, args.no_save_optim)) if rank0 else None)
    digests = integrity.digests(partial)
    agree(_attempt(lambda: integrity.write(partial, digests)) if rank0 else None)
    agree(
        _attempt(lambda: _publish(partial, final, args.save, written, held.lock)) if rank0 else None
    )
    return final


class DeepSpeedFiles:
    """`--ckpt-format torch`: DeepSpeed's files and this trainer's records, nothing beside them.
    A format is what a save writes beyond those, at three points of it."""

    def begin(self, partial: str) -> None:
        """Rank 0, before any rank writes into the `partial` folder."""

    def write(self, engine, args, records: Records, iteration: int, consumed: int, partial: str):
        """Every rank (collective), before DeepSpeed's files."""

    def publish(self, save_dir: str, tag: str) -> None:
        """Rank 0, once `latest` names the complete checkpoint `tag`."""


class TorchDist(DeepSpeedFiles):
    """`--ckpt-format torch_dist`: also Megatron-Core's distributed checkpoint of the model in the
    same folder, and Megatron-LM's pointer beside `latest` (docs/design.md, Checkpoints)."""

    def begin(self, partial: str) -> None:
        os.makedirs(partial)  # Megatron's part first, into an empty folder

    def write(self, engine, args, records: Records, iteration: int, consumed: int, partial: str):
        padded = records.padded_vocab_size
        try:
            torch_dist.save(
                engine.module,
                partial,
                torch_dist.megatron_args(args, padded, consumed),
                iteration,
                # Megatron-LM counts its schedule in samples (this run's may already)
                in_unit(engine.lr_scheduler.state_dict(), "samples", args.global_batch_size),
                flops=consumed * args.seq_length * flops_per_token(args, padded),
            )
        except (OSError, RuntimeError) as e:  # torch's writer wraps the cause
            raise _write_error(e, os.path.join(partial, torch_dist.CONFIG_FNAME)) from e

    def publish(self, save_dir: str, tag: str) -> None:
        write_atomically(os.path.join(save_dir, MEGATRON_TRACKER), str(iteration_of(tag)))


# --ckpt-format's choices (config/flags.py declares the flag; tests/training hold them equal).
FORMATS = {"torch": DeepSpeedFiles(), "torch_dist": TorchDist()}


def _publish(
    partial: str, final: str, save_dir: str, written: DeepSpeedFiles, lock: Optional[FolderLock]
) -> None:
    """The complete checkpoint under its own name, then `latest` (and the format's own pointers)
    naming it; each step only while the folder is still this job's."""
    lock.confirm()
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    tag = os.path.basename(final)
    lock.confirm()
    write_atomically(os.path.join(save_dir, LATEST), tag)
    written.publish(save_dir, tag)


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


def _attempt(write) -> Optional[Exception]:
    """What `write` raised, if it failed writing (or found the folder another job's)."""
    try:
        write()
    except (OSError, FolderLost) as e:
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


def _agree(
    failure: Optional[Exception], partial: Optional[str], save_dir: str, lock: Optional[FolderLock]
) -> None:
    """Collective, after each step of a save (and before its first): if the folder is no
    longer this job's (rank 0 asks `lock`), every rank raises `FolderLost`; if the step failed
    on any rank, `SaveFailed`. Either way this save's own partial folder is removed."""
    if isinstance(failure, FolderLost):
        failure, lost = None, str(failure)
    else:
        lost = _lost_message(lock)
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, (lost, failure and described(failure, partial)))
    lost = failures[0][0]
    failed = [(rank, what) for rank, (_, what) in enumerate(failures) if what]
    if not (lost or failed):
        return
    if dist.get_rank() == 0 and partial is not None:
        shutil.rmtree(partial, ignore_errors=True)  # this job's own, whoever holds the folder
    if lost:
        raise cli.agreed(FolderLost(lost))
    previous = latest_tag(save_dir) if os.path.isfile(os.path.join(save_dir, LATEST)) else None
    rank, (what, remedy) = failed[0]
    raise cli.agreed(
        SaveFailed(
            f"saving {tag_of_partial(os.path.basename(partial))} failed on rank {rank}: {what}; "
            + (f"{previous} stays the latest checkpoint" if previous else "no checkpoint was saved")
            + f": {remedy} or give --save another folder, then rerun"
            + (" with --load to resume" if previous else "")
        )
    )


def _lost_message(lock: Optional[FolderLock]) -> Optional[str]:
    """Why the folder is no longer this job's, or None while it is (or where `lock` is None:
    ranks other than 0)."""
    try:
        if lock is not None:
            lock.confirm()
    except FolderLost as e:
        return str(e)
    return None


def _remove_debris(folder: str) -> None:
    debris = sorted(name for name in os.listdir(folder) if DEBRIS.fullmatch(name))
    for name in debris:
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    if debris:
        print(f"removed what an interrupted run left in {folder}: {', '.join(debris)}", flush=True)


def _hold(folder: str) -> tuple:
    """Collective: rank 0 takes `folder`'s lock, one per job, and says so if it took over a
    stale one; returns (the lock: rank 0's, None on the other ranks; its job identity, on every
    rank). If another job holds it, every rank raises, naming that job."""
    lock, told = None, [None, None]
    if dist.get_rank() == 0:
        try:
            lock = FolderLock.take(folder)
            told = [None, lock.job]
            if lock.took_over:
                print(lock.took_over, flush=True)
        except FolderInUse as e:
            told = [str(e), None]
    dist.broadcast_object_list(told, src=0)
    refusal, job = told
    if refusal:
        raise cli.agreed(FolderInUse(refusal))
    return lock, job


def _preflight(args: RunConfig) -> tuple:
    """What would fail at the first save, refused before any compute: a signal handler with
    nowhere to save, a `--save` that cannot be written or that another job saves into, a folder
    of complete checkpoints whose `latest` is gone (which would otherwise start from scratch and
    overwrite them). Returns the `--save` folder's lock (rank 0's; None elsewhere) and its job
    identity (None without --save)."""
    if args.exit_signal_handler and not args.save:
        raise ValueError(
            "--exit-signal-handler saves a checkpoint when a signal stops the run: give --save "
            "(without one, the stopped run would look finished)"
        )
    if not args.save:
        return None, None
    check_writable("--save", args.save)
    lock, job = _hold(args.save)  # before the debris: a live job's save is not debris
    try:
        if lock is not None:
            _remove_debris(args.save)
        resume.refuse_lost_latest(args.save, args.ckpt_step)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock, job


def _checked_file(
    ours,
    checkpoint_dir: str,
    may_miss,
    allow_unsafe: bool,
    weights: bool = True,
    tp: Optional[int] = None,
) -> dict:
    """This rank's model file (or TP rank `tp`'s), refused unless its weights are this model's
    (`ours`: their names), bar `may_miss(name)`; `weights=False`: only their names are checked (a
    ZeRO-3 checkpoint holds no values there)."""
    tp = get_tensor_model_parallel_rank() if tp is None else tp
    saved_file = read_model_file(
        model_state_file(checkpoint_dir, tp, weights), allow_unsafe, mmap=True
    )
    saved = saved_file["module"]
    missing = [k for k in ours - saved.keys() if not may_miss(k) and not k.endswith("_extra_state")]
    unexpected = [k for k in saved.keys() - ours if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(
            f"{checkpoint_dir} does not fit this model: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    return saved_file


def _check_fit(plan: ResumePlan, args: RunConfig, ours) -> None:
    """Before the engine, with the names `ours` of the built model's weights: the checkpoints the
    plan loads hold them, bar what it lets them miss, as loading will check; a start adding a
    variant says in one line which weights start as initialised."""
    if plan.kind == resume.FRESH:
        return
    if plan.base is not None and not plan.base.megatron_lm:  # Megatron-LM's: checked as they load
        _checked_file(ours, plan.base.path, added_weight, args.allow_unsafe_checkpoints, False)
    if plan.checkpoint.megatron_lm:
        return
    saved = _checked_file(
        ours,
        plan.checkpoint.path,
        plan.may_miss,
        args.allow_unsafe_checkpoints,
        weights=False,
        tp=0 if plan.layout else None,
    )["module"]
    fresh = sorted(k for k in ours - saved.keys() if plan.may_miss(k))
    if plan.kind == resume.ADDING and fresh and dist.get_rank() == 0:
        print(
            f"--attention {args.attention} from {plan.checkpoint.path} "
            f"({plan.checkpoint.model_args['attention']}): its {len(fresh)} weights of its own "
            f"start as initialised ({fresh[0]}{', ...' if len(fresh) > 1 else ''})",
            flush=True,
        )


def _load_weights_only(engine, args, checkpoint: SavedCheckpoint, may_miss) -> None:
    """Model weights only (no optimizer, schedule or run state), checked before they are read.

    Loaded here rather than by DeepSpeed's `load_module_only`, which under ZeRO-2 copies frozen
    weights from the checkpoint's own list of frozen weights: empty when the checkpoint froze
    nothing, as a retrofit's base did.
    """
    if checkpoint.megatron_lm:
        torch_dist.load_model(engine.module, checkpoint.path, may_miss)
    else:
        ours = engine.module.state_dict().keys()
        saved = _checked_file(ours, checkpoint.path, may_miss, args.allow_unsafe_checkpoints)
        engine.module.load_state_dict(saved["module"], strict=False)
    if hasattr(engine.optimizer, "refresh_fp32_params"):  # ZeRO's and bf16's fp32 master copies
        engine.optimizer.refresh_fp32_params()


def _resume_megatron_lm(engine, args: RunConfig, checkpoint: SavedCheckpoint) -> tuple:
    """A Megatron-LM run continued (`--no-load-optim`): its weights, iteration and consumed
    samples; the optimizer and LR schedule start afresh, the random states from the seed."""
    _load_weights_only(engine, args, checkpoint, may_miss=lambda name: False)
    state = torch_dist.common_state(checkpoint.path, args.allow_unsafe_checkpoints)
    iteration = state["iteration"]
    consumed = getattr(state.get("args"), "consumed_train_samples", None)
    platform.manual_seed(args.seed + iteration)
    return iteration, iteration * args.global_batch_size if consumed is None else consumed


def _load(engine, args: RunConfig, plan: ResumePlan, padded_vocab_size: int) -> tuple:
    """Execute `plan`: restore model, optimizer, scheduler, RNG and data position; returns
    (iteration, consumed samples), (0, 0) where the run starts at iteration 0. What
    `resume.check` refuses has been refused before."""
    if plan.kind == resume.FRESH:
        return 0, 0
    if plan.base is not None:  # frozen weights from the base, then the routers from here
        _load_weights_only(engine, args, plan.base, may_miss=added_weight)
    if plan.kind != resume.RESUME:
        _load_weights_only(engine, args, plan.checkpoint, plan.may_miss)
        return 0, 0
    if plan.checkpoint.megatron_lm:
        return _resume_megatron_lm(engine, args, plan.checkpoint)
    checkpoint, layout = plan.checkpoint.path, plan.layout  # its names checked (_check_fit)
    if layout:
        trained = [[name for name, _ in group] for _, group in param_groups(engine.module, args)]
        client_state = layouts.load(engine, args, checkpoint, layout, trained, padded_vocab_size)
    else:
        load_dir, tag = os.path.split(checkpoint)
        path, client_state = engine.load_checkpoint(
            load_dir,
            tag=tag,
            load_module_strict=plan.base is None,
            load_optimizer_states=plan.load_optimizer,
            load_lr_scheduler_states=plan.load_optimizer,
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load {checkpoint}")
    if plan.load_rng and "rng" in client_state:
        set_rng_state(client_state["rng"])
    else:
        # Random states that belong to a rank of another layout, or that were not saved or are
        # not wanted: start afresh, as Megatron seeds a run, from the seed and the iteration.
        platform.manual_seed(args.seed + client_state["iteration"])
    return client_state["iteration"], client_state["consumed_samples"]
