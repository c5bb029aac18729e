"""What a run starts from, decided once: `plan(args)` reads the checkpoint folders before the
data or the model is built and returns a `ResumePlan`; `check` refuses, before any compute, a
checkpoint the plan cannot use. The run's `CheckpointStart` (`checkpointing.py`) makes the plan
and checks it, and has the DeepSpeed engine read its layout change; its `CheckpointManager`
executes it, through the folder's format's reader (`saved_formats.py`), and names in its saves
the retrofit base it holds.

The kinds of start:

- fresh: no `--load`, or `--load` equal to `--save` before the run's first checkpoint (so the same
  command both starts and resumes a run);
- resume: model, optimizer, schedule, RNG and data position, at this run's layout or another
  (`layouts.py`);
- weights only: an imported model (`weights_only` marker), `--finetune` or Megatron's
  `--pretrained-checkpoint`; this run's optimizer and schedule start at iteration 0;
- adding a variant: `--retrofit` from a checkpoint without routers, or `--finetune` (or
  `--pretrained-checkpoint`) of a standard model's as another variant's run: weights only, the
  weights the variant adds (`variants.added_weight`: Focus's routers, any variant's own) as
  initialised, said in one line.

The plan opens each folder it names once (`checkpoint/saved.py`), which decides its format:
this trainer's, or a Megatron-LM `torch_dist` checkpoint (no DeepSpeed files), which starts a run
as weights only or adding a variant, or resumes with `--no-load-optim` (weights, iteration, data
position); its model args are read from Megatron-LM's args record.

A retrofit's trained-only checkpoint (`base_checkpoint.json`) resumes or fine-tunes with its base
loaded first (`base`): its frozen weights, then the routers.

`check` refuses before any compute what loading would refuse: the names a plan lets a checkpoint
miss (`ResumePlan.may_miss`) are the ones the load lets it miss.
"""

import dataclasses
import os
from typing import Optional

from megatron_focus.checkpoint import format as checkpoint_format
from megatron_focus.checkpoint import integrity
from megatron_focus.checkpoint.format import (
    LATEST,
    MEGATRON_TRACKER,
    WEIGHTS_ONLY,
    base_checkpoint,
    check_compatible,
    complete_tags,
    iteration_of,
    read_schedule,
    resume_tag,
)
from megatron_focus.checkpoint.safe_load import check_safe_to_load
from megatron_focus.checkpoint.saved import SavedCheckpoint
from megatron_focus.config.run_config import RunConfig
from megatron_focus.training import layouts
from megatron_focus.training.saved_formats import reader, refuse_weights_only_under_zero3
from megatron_focus.variants import added_weight, variant

FRESH, RESUME, WEIGHTS, ADDING = "fresh", "resume", "weights only", "adding a variant"


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """`checkpoint`: the tag folder this run starts from, its format and model args (None:
    fresh); `base`: a retrofit's frozen weights, loaded before it; `layout`: the layout that wrote
    it, when not this run's; `retrofit_base`: what this run's trained-only checkpoints name as the
    folder holding their frozen weights (None: its checkpoints are complete)."""

    kind: str = FRESH
    checkpoint: Optional[SavedCheckpoint] = None
    base: Optional[SavedCheckpoint] = None
    layout: Optional[dict] = None
    load_optimizer: bool = True
    load_rng: bool = True
    retrofit_base: Optional[dict] = None
    # The iteration a variant's schedule counts from (Focus's dense warm-up): a resumed
    # checkpoint's record's, else where this run starts.
    schedule_start: int = 0

    def may_miss(self, name: str) -> bool:
        """A weight the checkpoint need not hold: the variant's own when adding it; every other
        weight in a trained-only checkpoint (they come from `base`)."""
        added = added_weight(name)
        return not added if self.base is not None else added and self.kind == ADDING


def plan(args: RunConfig) -> ResumePlan:
    """The start `--load` (or `--pretrained-checkpoint`) asks for, its files verified; refuses a
    `--load` that holds no checkpoint where one is needed, and pickled code."""
    # Megatron's --pretrained-checkpoint: weights only, while --load holds no checkpoint.
    pretrained = bool(args.pretrained_checkpoint) and (not args.load or resume_tag(args) is None)
    load = args.pretrained_checkpoint if pretrained else args.load
    finetune = args.finetune or pretrained
    if load:
        refuse_lost_latest(load, args.ckpt_step if not pretrained else None)
    if pretrained:
        tag = checkpoint_format.latest_tag(load) if os.path.isdir(load) else None
    else:
        tag = resume_tag(args) if load else None
    if tag is None:
        if load and (not _own_run(args) or args.retrofit or finetune):
            raise FileNotFoundError(f"--load {load}: no checkpoint there (no '{LATEST}' file)")
        return ResumePlan()
    path = os.path.join(os.path.abspath(load), tag)
    integrity.verify(path)
    base_path = base_checkpoint(path)
    if base_path is not None:
        integrity.verify(base_path)
    for folder in (base_path, path):
        if folder is not None:
            check_safe_to_load(folder, args.allow_unsafe_checkpoints)
    checkpoint = SavedCheckpoint.open(path, args.allow_unsafe_checkpoints)
    saved = checkpoint.model_args
    # A standard model's weights start any variant's run (--finetune): its own weights fresh.
    from_standard = finetune and saved["attention"] == "standard" != args.attention
    if (args.retrofit and saved["attention"] != args.attention) or from_standard:
        kind = ADDING
    elif finetune or os.path.isfile(os.path.join(path, WEIGHTS_ONLY)):
        kind = WEIGHTS
    else:
        kind = RESUME
    retrofit_base = None
    if args.retrofit and not args.save_full:
        base_load, base_tag = os.path.split(base_path or path)
        retrofit_base = {"load": base_load, "tag": base_tag}
    layout = layouts.change(args, path) if kind == RESUME else None
    start = 0
    if kind == RESUME:
        start = read_schedule(path).get("start", iteration_of(os.path.basename(path)))
    return ResumePlan(
        kind,
        checkpoint,
        SavedCheckpoint.open(base_path, args.allow_unsafe_checkpoints) if base_path else None,
        layout,
        load_optimizer=not args.no_load_optim,
        load_rng=not args.no_load_rng and layout is None,
        retrofit_base=retrofit_base,
        schedule_start=start,
    )


def variant_schedule(plan: ResumePlan, args: RunConfig) -> Optional[dict]:
    """The schedule this run's checkpoints record (None: it has none): Focus's dense warm-up."""
    settings = variant(args.attention).settings_from(args)
    iters = getattr(settings, "dense_warmup_iters", 0)
    return {"start": plan.schedule_start, "dense_warmup_iters": iters} if iters else None


def _check_warmup(plan: ResumePlan, args: RunConfig) -> None:
    """A resume that would change the dense warm-up its checkpoint is in (or has ahead of it):
    refused, so that a resume neither skips nor stretches it."""
    saved = read_schedule(plan.checkpoint.path)
    if not saved.get("dense_warmup_iters"):
        return  # a schedule the run adds begins at the checkpoint's iteration
    iteration = iteration_of(os.path.basename(plan.checkpoint.path))
    ours = (variant_schedule(plan, args) or {}).get("dense_warmup_iters", 0)
    start, theirs = saved["start"], saved["dense_warmup_iters"]

    def ahead(iters):  # the warm-up's iterations from the checkpoint on
        return range(max(iteration, start), start + iters)

    if ahead(ours) != ahead(theirs) and (len(ahead(ours)) or len(ahead(theirs))):
        raise ValueError(
            f"{plan.checkpoint.path} is at iteration {iteration} of a run with a dense warm-up "
            f"of {theirs} iterations from iteration {start}; this run asks "
            f"--focus-dense-warmup-iters {ours}: resume with --focus-dense-warmup-iters "
            f"{theirs}, or start anew from its weights with --finetune"
        )


def refuse_lost_latest(folder: str, ckpt_step: Optional[int]) -> None:
    """A folder of complete checkpoints whose `latest` is gone, which would otherwise start from
    scratch (and, as `--save`, overwrite them)."""
    pointers = (os.path.join(folder, name) for name in (LATEST, MEGATRON_TRACKER))
    if not os.path.isdir(folder) or any(os.path.isfile(p) for p in pointers):
        return
    complete = complete_tags(folder)
    if complete and ckpt_step is None:
        raise ValueError(
            f"{folder} holds checkpoints {', '.join(complete)} but no '{LATEST}' file: "
            f"resume from one with --ckpt-step (e.g. {iteration_of(complete[-1])}), "
            "or save this run elsewhere"
        )


def _own_run(args: RunConfig) -> bool:
    return os.path.abspath(args.load) == os.path.abspath(args.save or "")


def check(plan: ResumePlan, args: RunConfig, ours: dict) -> None:
    """Everything loading would refuse, refused before the data, model and engine are built: a
    model of another shape (`ours`: this run's model args), a layout change the checkpoint or the
    flags do not allow, a changed schedule."""
    if plan.base is not None:
        _check_weights_fit(args, ours, plan.base)
    if plan.kind in (WEIGHTS, ADDING):
        _check_weights_fit(args, ours, plan.checkpoint)
    if plan.kind != RESUME:
        return
    _check_warmup(plan, args)
    reader(plan.checkpoint).check_resume(plan, args, ours)


# The flags that freeze weights, and which.
_FREEZING = (
    "--focus-attention-mode sparse freezes the routers, --retrofit all but the routers, "
    "--focus-router random the routers' projection and centroids"
)


def check_trained(plan: ResumePlan, args: RunConfig, trained: list) -> None:
    """Once the model is built and frozen, before the engine: refused, a resume whose
    checkpoint's optimizer state covers other parameters than this run trains (`trained`, their
    names), e.g. a soft-trained run continued in sparse mode, which freezes the routers:
    DeepSpeed's flat optimizer state of the checkpoint does not fit this run's, and would fail
    to load only once the engine is built, in its own words."""
    if plan.kind != RESUME:
        return
    saved = reader(plan.checkpoint).trained(plan.checkpoint, args.allow_unsafe_checkpoints)
    if saved is None or set(saved) == set(trained):
        return
    frozen, thawed = sorted(set(saved) - set(trained)), sorted(set(trained) - set(saved))
    differ = "; ".join(
        f"{what} {len(names)}: {', '.join(names[:2])}{', ...' if len(names) > 2 else ''}"
        for what, names in (("this run freezes", frozen), ("this run trains", thawed))
        if names
    )
    if plan.load_optimizer:
        # which side froze them, and so which flags continue the checkpoint as it was
        froze = "this run's flags freeze" if frozen else "the run that saved it froze"
        same = "drop that flag" if frozen else "resume with that run's flag"
        raise ValueError(
            f"{plan.checkpoint.path}: its optimizer state covers other weights than this run "
            f"trains ({differ}): {froze} them ({_FREEZING}). To continue it as it was, {same}; "
            "else start from its weights with --finetune (or --pretrained-checkpoint), or "
            "continue its iteration and data position with --no-load-optim, the optimizer and "
            "LR schedule starting afresh"
        )
    if args.zero_stage == 3:
        raise ValueError(
            f"{plan.checkpoint.path}: this run trains other weights than it did ({differ}), "
            "which ZeRO stage 3 cannot load without their optimizer state: continue at "
            "--zero-stage 2 or lower, then resume that run's checkpoints at stage 3"
        )


def _check_weights_fit(args: RunConfig, ours: dict, checkpoint: SavedCheckpoint) -> None:
    # A retrofit adding Focus, or a standard model's weights starting a variant's run: the
    # checkpoint has neither its attention nor its settings.
    saved = checkpoint.model_args
    adding = saved["attention"] != ours["attention"] and (
        args.retrofit or saved["attention"] == "standard"
    )
    ignore = ("attention",) + variant(ours["attention"]).recorded_keys() if adding else ()
    if args.position_embedding_type != "learned_absolute":  # no position table to outgrow
        # Context extension: fine-tune the weights at a longer --seq-length.
        ignore += ("max_position_embeddings",)
    check_compatible(ours, saved, checkpoint.path, ignore + reader(checkpoint).reshards)
    refuse_weights_only_under_zero3(args)
