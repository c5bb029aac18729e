"""The optimizer: AdamW's parameter groups (no weight decay on biases and norms) and Megatron's
LR and weight-decay schedule, as the flags set them."""

import torch


def weight_decay_groups(model: torch.nn.Module) -> list:
    """[(name, parameter), ...] of the trained parameters, with weight decay then without, in the
    order the optimizer numbers them (a saved optimizer state is read back by that order)."""
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    matrix = {n for n, p in trained if len(getattr(p, "ds_shape", p.shape)) >= 2}  # ZeRO-3 keeps
    return [[(n, p) for n, p in trained if n in matrix],  # a partitioned parameter's shape there
            [(n, p) for n, p in trained if n not in matrix]]


def schedule(args) -> dict:
    """Megatron-Core `OptimizerParamScheduler`'s settings, named as its state records them."""
    return {"max_lr": args.lr, "min_lr": args.min_lr, "lr_warmup_steps": args.lr_warmup_iters,
            "lr_decay_steps": args.lr_decay_iters, "lr_decay_style": args.lr_decay_style,
            "start_wd": args.weight_decay, "end_wd": args.weight_decay,
            "wd_incr_steps": args.train_iters, "wd_incr_style": "constant"}
