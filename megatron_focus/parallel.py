"""Tensor-parallel bookkeeping that DeepSpeed does not do for a Megatron-Core model.

Megatron's own optimizer path (`finalize_model_grads`) sums the gradients of parameters that are
replicated over tensor-parallel ranks but see only part of the sequence (norm weights and
row-parallel biases under sequence parallelism). DeepSpeed's engine only reduces over data
parallelism, so we do this before every optimizer step (Megatron-DeepSpeed#170 forgot to).
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def allreduce_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """Sum the gradients of `sequence_parallel`-flagged parameters over the TP group."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [
        p.grad for p in model.parameters()
        if getattr(p, "sequence_parallel", False) and p.grad is not None
    ]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def gather_tensor_parallel(param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (the parameter itself or its gradient) at the parameter's full, unsharded shape.

    Column-parallel weights are split on dim 0, row-parallel on dim 1, vocab-parallel embeddings
    on dim 0; Megatron records which on the parameter (`partition_dim`). A strided parameter
    (SwiGLU's fused `[gate; up]`, `partition_stride` 2) holds a slice of each part on every rank.
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(
        shards, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    parts = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([parts[r][s] for s in range(stride) for r in range(tp)], dim=dim)
