"""The optimizer: AdamW's parameter groups (no weight decay on biases and norms) and Megatron's
LR and weight-decay schedule, as the flags set them."""

import torch


def param_groups(model: torch.nn.Module, args) -> list:
    """[(options, [(name, parameter), ...]), ...]: the trained parameters in the optimizer's
    groups and order (a saved optimizer state is read back by that order): with weight decay,
    then without; with `--decoupled-lr`, the embedding and output weights in groups of their own
    with that peak LR and `--decoupled-min-lr` (Megatron's scheduler reads a group's own)."""
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    # ZeRO-3 keeps a partitioned parameter's shape in ds_shape
    matrix = {n for n, p in trained if len(getattr(p, "ds_shape", p.shape)) >= 2}
    decoupled = {
        n
        for n, p in trained
        if args.decoupled_lr is not None and getattr(p, "is_embedding_or_output_parameter", False)
    }
    groups = []
    for options, members in (
        ({}, lambda n: n not in decoupled),
        ({"max_lr": args.decoupled_lr, "min_lr": args.decoupled_min_lr}, lambda n: n in decoupled),
    ):
        for wd_mult, wanted in ((1.0, lambda n: n in matrix), (0.0, lambda n: n not in matrix)):
            group = [(n, p) for n, p in trained if members(n) and wanted(n)]
            if group or not options:  # the first two always, as before decoupled LRs
                groups.append(({"wd_mult": wd_mult, **options}, group))
    return groups


def schedule(args) -> dict:
    """Megatron-Core `OptimizerParamScheduler`'s settings, named as its state records them, in
    the unit the run counts (`steps_in`): iterations, or samples with --train-samples, as
    Megatron-LM (whose per-sample schedule is the per-iteration one at a constant batch)."""
    if args.train_samples:
        warmup, decay, total = args.lr_warmup_samples, args.lr_decay_samples, args.train_samples
    else:
        warmup, decay, total = args.lr_warmup_iters, args.lr_decay_iters, args.train_iters
    return {
        "max_lr": args.lr,
        "min_lr": args.min_lr,
        "lr_warmup_steps": warmup,
        "lr_decay_steps": decay,
        "lr_decay_style": args.lr_decay_style,
        "start_wd": args.weight_decay,
        "end_wd": args.weight_decay,
        "wd_incr_steps": total,
        "wd_incr_style": "constant",
    }


# The scheduler state's counts, saved in the unit the run counted (checkpoints without
# "steps_in" counted iterations).
COUNTS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def steps_in(args) -> str:
    return "samples" if args.train_samples else "iters"


def in_unit(state: dict, unit: str, global_batch: int) -> dict:
    """A saved scheduler state counted in `unit`: a run that switches between --train-iters
    and --train-samples (at a constant --global-batch-size) resumes where it was."""
    saved = state.get("steps_in", "iters")
    if saved == unit:
        return state
    factor = global_batch if unit == "samples" else 1 / global_batch
    return {**state, **{k: state[k] * factor for k in COUNTS}, "steps_in": unit}
