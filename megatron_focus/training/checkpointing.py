"""Saving and resuming a run through DeepSpeed's engine: checkpoints that are either complete or
invisible, and that refuse a model of another shape, in DeepSpeed's format or Megatron-LM's.

The trainer goes through two objects. `CheckpointStart` settles, before any compute, what the
run starts from and where it saves: `CheckpointStart.held(args)` (the `--save` folder's preflight,
the folder held for this job alone until the block ends (`checkpoint/lock.py`), and the resume
plan, before the data), `check` (this run's records, and everything loading would refuse, before
the data is built) and `engine_config` (the built model against the checkpoint, before the
engine). `CheckpointManager`, built on the engine, is called twice: `load()` at the start and
`save(iteration, consumed)` after every step, which decides when a checkpoint is due.

What a checkpoint folder holds is `checkpoint/format.py`; beside it, DeepSpeed's client state
carries the iteration, consumed samples and every RNG state. A checkpoint written at another
layout (TP / DP size, ZeRO stage, precision) resumes through `layouts.py`.

What a run starts from, and which format the folder holds, is decided once, before the data or
the model (`resume.py`); `load` executes that plan, through the folder's format's reader
(`saved_formats.py`); what a save writes beside DeepSpeed's files is the `--ckpt-format`'s
(`FORMATS`). A retrofit run (`--retrofit`) saves, unless
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
import functools
import json
import os
import shutil
from typing import Iterator, Optional

import torch.distributed as dist

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
    partial_tag,
    tag_for,
    tag_of_partial,
    write_atomically,
    write_layout,
    write_model_args,
    write_schedule,
)
from megatron_focus.checkpoint.lock import FolderInUse, FolderLock, FolderLost
from megatron_focus.config.run_config import RunConfig
from megatron_focus.data.sources import tokenizer_choice
from megatron_focus.model.flops import flops_per_token
from megatron_focus.model.gpt import padded_vocab_size
from megatron_focus.outputs import check_writable
from megatron_focus.training import layouts, resume
from megatron_focus.training.optimizer import in_unit
from megatron_focus.training.resume import ResumePlan
from megatron_focus.training.saved_formats import reader
from megatron_focus.variants import added_weight


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


class CheckpointStart:
    """What the run starts from and the folder it saves into, settled before any compute:
    `held(args)` holds the `--save` folder for this job and decides the resume plan (before the
    data); `check` refuses what loading would refuse (once the tokenizer is known, before the
    data is built); `engine_config` checks the built model against the checkpoint and tells
    DeepSpeed's engine what it must know (before the engine)."""

    def __init__(self, args: RunConfig, plan: ResumePlan, lock: Optional[FolderLock], job):
        self.args, self.plan = args, plan
        self.lock = lock  # rank 0's
        self.job = job  # the lock's job identity, on every rank
        self.records: Optional[Records] = None

    @classmethod
    @contextlib.contextmanager
    def held(cls, args: RunConfig) -> Iterator["CheckpointStart"]:
        """The `--save` folder's preflight, held for this job until the block ends however it
        ends (`checkpoint/lock.py`), then the resume plan."""
        lock, job = _preflight(args)
        try:
            yield cls(args, resume.plan(args), lock, job)
        finally:
            if lock is not None:
                lock.release()

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

    def engine_config(self, model, config: dict) -> None:
        """Before DeepSpeed's engine is built on `model` (frozen where this run does not train)
        with `config`: a resume refused if its optimizer state covers other weights than this
        run trains, or a checkpoint that lacks (or adds) weights; which weights train and how
        each is split over TP ranks, which every save records; for a checkpoint of another
        layout at ZeRO 1-3, DeepSpeed's loading of the universal format."""
        trained = [name for name, param in model.named_parameters() if param.requires_grad]
        resume.check_trained(self.plan, self.args, trained)
        _check_fit(self.plan, self.args, model)
        layout = {**self.records.layout, "trained": trained}
        self.records = dataclasses.replace(self.records, layout=layout)
        if self.args.zero_stage > 0 and self.plan.layout:
            config.setdefault("checkpoint", {})["load_universal"] = True
        layouts.describe_model(model)


class CheckpointManager:
    """The run's checkpoints once its engine is built, called twice: `load()` at the start,
    `save(iteration, consumed)` after every step, which saves when one is due. `ready` is
    entered around each save (the trainer's: the step's losses read, so that no checkpoint
    follows a non-finite one, and the save's time kept out of the step times)."""

    def __init__(self, start: CheckpointStart, engine, ready=contextlib.nullcontext):
        self.start, self.engine, self.ready = start, engine, ready
        self.args = start.args
        self.saved_at: Optional[int] = None

    def load(self) -> tuple:
        """Execute the plan: (iteration, consumed samples) to resume from, (0, 0) for a start at
        iteration 0."""
        return _load(self.engine, self.args, self.start.plan, self.start.padded_vocab_size)

    def save(self, iteration: int, consumed: int, exiting: bool = False) -> Optional[str]:
        """Collective, after every step: a checkpoint every `--save-interval` iterations, at the
        last, and when the run `exiting` stops early; returns its folder (None: none due, or no
        --save). Refused (`FolderLost`, on every rank, nothing written) if the folder is no
        longer this job's; an exit after a save at the same step still asks that."""
        if not self.args.save:
            return None
        due = self.args.at_interval(self.args.save_interval, iteration)
        if self.saved_at == iteration or not (exiting or due):
            if exiting:  # a job whose folder was taken over does not end as done
                _agree(None, None, self.args.save, self.start.lock)
            return None
        with self.ready():
            _agree(None, None, self.args.save, self.start.lock)
            path = _save(self.engine, self.args, self.start, iteration, consumed)
        self.saved_at = iteration
        if dist.get_rank() == 0:
            print(f" saved checkpoint {path}", flush=True)
        return path


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


def _save(engine, args: RunConfig, start: CheckpointStart, iteration: int, consumed: int) -> str:
    """Save on every rank; returns the checkpoint directory.

    Written under a partial name of this job's own, checksummed, then renamed and made
    `latest`. A write that fails on any rank (a full disk, a lost permission) removes the partial
    folder and raises `SaveFailed` on every rank, the previous checkpoint still `latest`; a folder
    that is no longer this job's (`start.lock`, rank 0's) raises `FolderLost` before the rename.
    """
    records = start.records
    tag = tag_for(iteration)
    partial = os.path.join(args.save, partial_tag(tag, start.job))
    final = os.path.join(args.save, tag)
    rank0 = dist.get_rank() == 0
    written = FORMATS[args.ckpt_format]
    if rank0:
        written.begin(partial)
    dist.barrier()
    client_state = {
        "iteration": iteration,
        "consumed_samples": consumed,
        **({} if args.no_save_rng else {"rng": platform.rng_state()}),
    }

    def agree(failure):
        _agree(failure, partial, args.save, start.lock)

    agree(_attempt(lambda: written.write(engine, args, records, iteration, consumed, partial)))
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
    publish = functools.partial(_publish, partial, final, args.save, written, start.lock)
    agree(_attempt(publish) if rank0 else None)
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


def _check_fit(plan: ResumePlan, args: RunConfig, model) -> None:
    """Before the engine, with the built model: the checkpoints the plan loads hold its weights,
    bar what it lets them miss, as loading will check; a start adding a variant says in one line
    which weights start as initialised."""
    if plan.kind == resume.FRESH:
        return
    allow = args.allow_unsafe_checkpoints
    if plan.base is not None:
        reader(plan.base).fresh(model, plan.base, added_weight, allow)
    tp = 0 if plan.layout else None  # another layout's names are TP rank 0's
    fresh = reader(plan.checkpoint).fresh(model, plan.checkpoint, plan.may_miss, allow, tp)
    if plan.kind == resume.ADDING and fresh and dist.get_rank() == 0:
        print(
            f"--attention {args.attention} from {plan.checkpoint.path} "
            f"({plan.checkpoint.model_args['attention']}): its {len(fresh)} weights of its own "
            f"start as initialised ({fresh[0]}{', ...' if len(fresh) > 1 else ''})",
            flush=True,
        )


def _load(engine, args: RunConfig, plan: ResumePlan, padded_vocab_size: int) -> tuple:
    """Execute `plan`: restore model, optimizer, scheduler, RNG and data position; returns
    (iteration, consumed samples), (0, 0) where the run starts at iteration 0. What
    `resume.check` and `_check_fit` refuse has been refused before."""
    if plan.kind == resume.FRESH:
        return 0, 0
    allow = args.allow_unsafe_checkpoints
    if plan.base is not None:  # frozen weights from the base, then the routers from here
        reader(plan.base).load_weights(engine, plan.base, added_weight, allow)
    if plan.kind != resume.RESUME:
        reader(plan.checkpoint).load_weights(engine, plan.checkpoint, plan.may_miss, allow)
        return 0, 0
    return reader(plan.checkpoint).resume(engine, args, plan, padded_vocab_size)
