"""The optimizer's parameter groups: AdamW without weight decay on biases and norms."""

import torch


def weight_decay_groups(model: torch.nn.Module) -> list:
    """[(name, parameter), ...] of the trained parameters, with weight decay then without, in the
    order the optimizer numbers them (a saved optimizer state is read back by that order)."""
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    matrix = {n for n, p in trained if len(getattr(p, "ds_shape", p.shape)) >= 2}  # ZeRO-3 keeps
    return [[(n, p) for n, p in trained if n in matrix],  # a partitioned parameter's shape there
            [(n, p) for n, p in trained if n not in matrix]]
