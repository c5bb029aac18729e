"""Tensor-parallel bookkeeping that DeepSpeed does not do for a Megatron-Core model.

Megatron's own optimizer path (`finalize_model_grads`) sums the gradients of parameters that are
replicated over tensor-parallel ranks but see only part of the sequence (norm weights and
row-parallel biases under sequence parallelism). DeepSpeed's engine only reduces over data
parallelism, so we sum them during backward, before any optimizer step can see them
(Megatron-DeepSpeed#170 forgot to).
"""

from typing import List

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def install_sequence_parallel_grad_allreduce(model: torch.nn.Module) -> None:
    """Make the gradients of `sequence_parallel`-flagged parameters whole during backward.

    A hook on the parameter sums each incoming gradient over the TP group *before* it is
    accumulated into `.grad`, so whatever consumes `.grad` next (DeepSpeed's ZeRO-2 reduce hooks
    during backward, or a plain optimizer step) sees the full gradient, with gradient accumulation
    or without.
    """
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()

    def allreduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.requires_grad:
            param.register_hook(allreduce)


class _SumGradOverTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        return grad


def sum_grad_over_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    """Identity forward; backward sums the gradient over the TP group.

    Megatron's `copy_to_tensor_model_parallel_region` means the same, but its backward all-reduces
    `grad.contiguous()` and returns the original: a non-contiguous gradient (as a transposed or
    sliced consumer produces) comes back unsummed, silently (megatron-core 0.16.1).
    """
    return _SumGradOverTensorParallel.apply(x)


def merge_shards(shards: List[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The full tensor from its TP shards: with stride s, each shard holds a slice of each part.

    Column-parallel weights are split on dim 0, row-parallel on dim 1, vocab-parallel embeddings
    on dim 0; a strided parameter (SwiGLU's fused `[gate; up]`, stride 2) holds `[gate_r; up_r]`.
    """
    parts = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([parts[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def split_tensor(full: torch.Tensor, tp: int, dim: int, stride: int = 1) -> List[torch.Tensor]:
    """Inverse of `merge_shards`."""
    parts = [part.chunk(tp, dim=dim) for part in full.chunk(stride, dim=dim)]
    return [
        torch.cat([parts[s][r] for s in range(stride)], dim=dim).contiguous() for r in range(tp)
    ]


def gather_tensor_parallel(param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (the parameter itself or its gradient) at the parameter's full, unsharded shape.

    Megatron records on the parameter how it is split (`partition_dim`, `partition_stride`).
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(
        shards, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return merge_shards(shards, param.partition_dim, getattr(param, "partition_stride", 1))


def params_norm(model: torch.nn.Module) -> torch.Tensor:
    """L2 norm of all weights, each counted once whatever the layout (Megatron-LM's
    `calc_params_l2_norm`): tensor-parallel shards summed over the TP group, ZeRO-3's partitions
    over the data-parallel group, replicated weights once."""
    device = next(model.parameters()).device
    sums = {
        kind: torch.zeros((), dtype=torch.float64, device=device)
        for kind in ("shards", "partitions", "whole")
    }
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):  # ZeRO-3: this rank's partition
            sums["partitions"] += p.ds_tensor.double().square().sum()
        else:
            kind = "shards" if getattr(p, "tensor_model_parallel", False) else "whole"
            sums[kind] += p.detach().double().square().sum()
    dist.all_reduce(sums["shards"], group=parallel_state.get_tensor_model_parallel_group())
    dist.all_reduce(sums["partitions"], group=parallel_state.get_data_parallel_group())
    return sum(sums.values()).sqrt().float()


def num_zeros_in_grad(model: torch.nn.Module) -> torch.Tensor:
    """Zeros in the gradients the optimizer is about to apply (Megatron-LM's `count_zeros_fp32`),
    each element counted once whatever the layout: tensor-parallel shards summed over the TP
    group, replicated weights once. Called between the last backward of a step and the step:
    DeepSpeed's `safe_get_full_grad` reads ZeRO's reduced partitions (collective under ZeRO)."""
    from deepspeed.utils import safe_get_full_grad

    device = next(model.parameters()).device
    zeros = {
        kind: torch.zeros((), dtype=torch.float64, device=device) for kind in ("shards", "whole")
    }
    for p in model.parameters():
        if not p.requires_grad:
            continue
        grad = safe_get_full_grad(p)
        if grad is None:
            continue
        kind = "shards" if getattr(p, "tensor_model_parallel", False) else "whole"
        zeros[kind] += grad.numel() - torch.count_nonzero(grad)
    dist.all_reduce(zeros["shards"], group=parallel_state.get_tensor_model_parallel_group())
    return zeros["shards"] + zeros["whole"]
