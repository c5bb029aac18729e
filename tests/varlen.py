"""torch's varlen flash ops (torch_attn::_varlen_attn and its backward), which run on CUDA only,
given a CPU implementation for a test: each packed sequence by explicit scores, in the layout
torch's own fake (meta) implementation declares (output like q, log-sum-exp [heads, total]).
The sparse path's CUDA branch then runs here as it would on a GPU, the calls counted."""

import contextlib

import torch
import torch.nn.attention.varlen  # noqa: F401  (registers the ops)

from megatron_focus.model.kernels import kernels
from megatron_focus.model.kernels.lse_merge import attention_backward


def _sequences(cu_seqlens):
    bounds = cu_seqlens.tolist()
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _heads_first(x):  # [T, h, d] -> [1, h, T, d]
    return x.transpose(0, 1)[None]


def _forward(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None, *rest):
    assert torch.equal(cu_q, cu_k) and is_causal and cu_q.dtype == torch.int32
    assert max_q >= int((cu_q[1:] - cu_q[:-1]).max())
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32))
    for rows in _sequences(cu_q):
        o, s = kernels.explicit_attention_with_lse(
            *(_heads_first(x[rows]) for x in (q, k, v)), scale, causal=True
        )
        out[rows], lse[rows] = o[0].transpose(0, 1), s[0].transpose(0, 1)
    return out, lse.transpose(0, 1).contiguous(), torch.zeros(2, dtype=torch.uint64)


def _backward(
    d_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, rng, scale=None, *rest
):
    assert torch.equal(cu_q, cu_k) and is_causal and lse.shape == q.shape[1::-1]
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for rows in _sequences(cu_q):
        parts = attention_backward(
            *(_heads_first(x[rows]) for x in (d_out, q, k, v, out)),
            lse[:, rows][None],
            scale,
            causal=True,
        )
        for total, part in zip(grads, parts):
            total[rows] = part[0].transpose(0, 1)
    return tuple(grads)


@contextlib.contextmanager
def varlen_on_the_cpu(monkeypatch):
    """Within: the varlen ops run on CPU tensors and every input fits them (kernels.varlen_fits);
    yields the count of forward and backward calls."""
    calls = {"forward": 0, "backward": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    lib = torch.library.Library("torch_attn", "IMPL")
    try:
        lib.impl("_varlen_attn", counted("forward", _forward), "CPU")
        lib.impl("_varlen_attn_backward", counted("backward", _backward), "CPU")
        monkeypatch.setattr(kernels, "varlen_fits", lambda q: True)
        yield calls
    finally:
        lib._destroy()
