"""The soft gate's fused Triton kernel (model/kernels/triton_gate.py), run by Triton's interpreter
on CPU tensors: the kernels exactly as a GPU compiles them, one program after another.

Outputs and the gradients of q, k, v and the log-assignments against the dense float64
reference (tests/reference.py; packed documents: each document alone through it) and against the
chunked path; sizes are small (the interpreter is slow) but cross every block edge: lengths not
a multiple of the block (16 here), one query block, GQA with a head count that is no power of
two, K = 1, sinks, many documents, both gates, tiles wholly inside the window beside tiles that
are not.
"""

import os

import pytest
import torch
from interpreted import gpu_launch_shapes, skip_unless_kernels_run

from megatron_focus.model.focus.focus_gate import focus_attention
from megatron_focus.model.focus.groups import Routing
from megatron_focus.model.focus.sinkhorn import causal_sinkhorn

from reference import reference_focus

skip_unless_kernels_run()
triton_gate = pytest.importorskip("megatron_focus.model.kernels.triton_gate")

CASES = [  # (b, heads, kv heads, n, d, K, window, sink, document lengths or None)
    (2, 4, 4, 37, 16, 4, 5, 0, None),  # MHA; n not a multiple of the block
    (1, 4, 2, 40, 8, 3, 64, 2, None),  # GQA; n < w; d padded to 16; sinks
    (2, 3, 1, 33, 16, 1, 4, 0, None),  # 3 query heads on one kv head (stacked as 4); K = 1
    (1, 2, 2, 12, 16, 4, 3, 1, None),  # one query block
    (1, 4, 2, 70, 16, 4, 6, 2, [9, 1, 30, 17, 13]),  # many documents, one of one token
    (1, 2, 1, 64, 16, 4, 37, 1, None),  # a window past a tile's span: tiles wholly inside it
    (1, 2, 1, 80, 16, 4, 31, 0, None),  # windows whose edge meets a tile's corner (one distant
    (1, 2, 2, 80, 16, 4, 48, 0, None),  # pair in the tile), in the keys and the queries passes
]


def inputs(b, heads, kv, n, d, groups, doc_lengths, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, n, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, kv, n, d, generator=gen).to(dtype) for _ in range(2))
    doc_start = None
    if doc_lengths is not None:
        firsts = torch.cumsum(torch.tensor([0] + doc_lengths[:-1]), 0)
        doc_start = firsts.repeat_interleave(torch.tensor(doc_lengths)).expand(b, n)
    log_g = causal_sinkhorn(torch.randn(b, n, groups, generator=gen) * 3, 5, doc_start)
    return [t.requires_grad_() for t in (q, k, v, log_g)], doc_start, gen


def reference(q, k, v, log_g, doc_start, **kwargs):
    """reference_focus, each document alone."""
    if doc_start is None:
        return reference_focus(q, k, v, log_g, top_k=None, **kwargs)
    parts, n = [], q.shape[2]
    firsts = sorted(set(doc_start[0].tolist())) + [n]
    for first, end in zip(firsts, firsts[1:]):
        part = slice(first, end)
        parts.append(
            reference_focus(
                q[:, :, part], k[:, :, part], v[:, :, part], log_g[:, part], top_k=None, **kwargs
            )
        )
    return torch.cat(parts, dim=2)


def grads(out, leaves, cotangent):
    return torch.autograd.grad(out, leaves, cotangent)


# the log gate at lambda 1 (no logarithm: weights scaled by the affinity), at another lambda,
# the paper's sigmoid gate
GATES = [("log", 1.0), ("log", 0.7), ("sigmoid", 0.7)]


@pytest.mark.parametrize("gate, gate_scale", GATES, ids=["log", "log-0.7", "sigmoid"])
@pytest.mark.parametrize("b, heads, kv, n, d, groups, window, sink, docs", CASES)
def test_kernel_equals_dense_float64_reference(
    b, heads, kv, n, d, groups, window, sink, docs, gate, gate_scale
):
    leaves, doc_start, gen = inputs(b, heads, kv, n, d, groups, docs, n + window)
    kwargs = dict(window=window, gate_scale=gate_scale, scale=d**-0.5, gate=gate, sink=sink)
    out = triton_gate.triton_soft_focus(*leaves, doc_start=doc_start, **kwargs)
    want = reference(*leaves, doc_start, **kwargs)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn(out.shape, generator=gen)
    for name, got, ref in zip(
        "qkvg", grads(out, leaves, cotangent), grads(want, leaves, cotangent)
    ):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=name)


GPU_BLOCKS = [  # at a GPU's block sizes: 64 x 64 (GQA: 2 x 64 stacked rows), 64 x 32 (d 256)
    (1, 4, 2, 150, 64, 8, 32, 2, None),
    (1, 2, 2, 150, 256, 4, 32, 0, [70, 80]),
]


@pytest.mark.parametrize(
    "b, heads, kv, n, d, groups, window, sink, docs, gpu_blocks",
    [case + (False,) for case in (CASES[1], CASES[4])] + [case + (True,) for case in GPU_BLOCKS],
)
def test_kernel_equals_the_chunked_path(
    b, heads, kv, n, d, groups, window, sink, docs, gpu_blocks, monkeypatch
):
    """Also on Megatron's layout: q, k, v handed as permuted views of [s, b, heads, d]."""
    if gpu_blocks:
        gpu_launch_shapes(monkeypatch, triton_gate)
    leaves, doc_start, gen = inputs(b, heads, kv, n, d, groups, docs, 7)
    q, k, v, log_g = (
        t.detach().permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3).requires_grad_()
        if t.dim() == 4
        else t
        for t in leaves
    )
    kwargs = dict(window=window, gate_scale=1.0 if gpu_blocks else 1.3, scale=d**-0.5, sink=sink)
    out = triton_gate.triton_soft_focus(q, k, v, log_g, doc_start=doc_start, **kwargs)
    routing = Routing.of(log_g, doc_start)
    chunked = focus_attention(
        q, k, v, routing, top_k=None, chunk_size=16, kernel="chunked", **kwargs
    )
    torch.testing.assert_close(out, chunked, rtol=1e-5, atol=1e-5)
    chosen = focus_attention(q, k, v, routing, top_k=None, chunk_size=16, kernel="triton", **kwargs)
    assert torch.equal(chosen, out)  # the kernel choice reaches it
    cotangent = torch.randn(out.shape, generator=gen)
    ours, theirs = (
        grads(out, (q, k, v, log_g), cotangent),
        grads(chunked, (q, k, v, log_g), cotangent),
    )
    for name, got, want in zip("qkvg", ours, theirs):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


def megatron_layout(s, b, kv, rep, d, gen, qk_norm):
    """q, k, v as Megatron's SelfAttention hands them to core attention: split from one fused
    QKV output [s, b, kv, (rep + 2) d], v a view of it, k a new contiguous tensor (RoPE's, or
    QK-norm's, which normalizes q too), permuted to [b, heads, s, d]."""
    qkv = torch.randn(s, b, kv, (rep + 2) * d, generator=gen)
    q, k, v = torch.split(qkv, [rep * d, d, d], dim=-1)
    q = q.reshape(s, b, kv * rep, d)
    if qk_norm:
        q, k = (torch.nn.functional.rms_norm(t, (d,)) for t in (q, k))
    else:  # a rotation of pairs of dims, as RoPE's output: contiguous
        angle = torch.arange(s)[:, None, None, None] * 0.1
        k = torch.cat([k[..., ::2] * angle.cos(), k[..., 1::2] * angle.sin()], dim=-1)
    q, k, v = (t.permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
    assert k.stride() != v.stride() and v.stride(2) == b * kv * (rep + 2) * d
    return q, k, v


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm"])
@pytest.mark.parametrize("gpu_blocks", [False, True], ids=["small-blocks", "gpu-blocks"])
def test_kernel_reads_each_input_by_its_own_strides(qk_norm, gpu_blocks, monkeypatch):
    """GQA 4:1 on Megatron's layout: outputs and gradients equal the chunked path's."""
    if gpu_blocks:
        gpu_launch_shapes(monkeypatch, triton_gate)
    gen = torch.Generator().manual_seed(5)
    s, b, kv, rep, d, groups = 70, 2, 2, 4, 16, 4
    q, k, v = megatron_layout(s, b, kv, rep, d, gen, qk_norm)
    log_g = causal_sinkhorn(torch.randn(b, s, groups, generator=gen) * 3, 5).requires_grad_()
    kwargs = dict(window=6, gate_scale=1.0, scale=d**-0.5, sink=1)
    out = triton_gate.triton_soft_focus(q, k, v, log_g, **kwargs)
    chunked = focus_attention(
        q, k, v, Routing.of(log_g), top_k=None, chunk_size=16, kernel="chunked", **kwargs
    )
    torch.testing.assert_close(out, chunked, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn(out.shape, generator=gen)
    leaves = (q, k, v, log_g)
    for name, got, want in zip(
        "qkvg", grads(out, leaves, cotangent), grads(chunked, leaves, cotangent)
    ):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


OFFSET_CASES = [  # (case of CASES, first query position, queries)
    (0, 13, 14),  # a chunk inside the sequence, not on a block edge
    (1, 20, 20),  # GQA, sinks: the last chunk
    (4, 30, 23),  # documents across the chunk's start
]


@pytest.mark.parametrize("gpu_blocks", [False, True], ids=["small-blocks", "gpu-blocks"])
@pytest.mark.parametrize("case, offset, queries", OFFSET_CASES)
@pytest.mark.parametrize("gate_scale", [1.0, 0.7])
def test_queries_at_an_offset_are_those_rows_of_the_whole_sequence(
    case, offset, queries, gpu_blocks, gate_scale, monkeypatch
):
    """Context parallelism's chunks: queries at positions [offset, offset + queries) against
    the keys before them give those rows of the dense float64 reference of the whole sequence,
    and its gradients (the cotangent zero on the other rows), keys past the chunk untouched."""
    if gpu_blocks:
        gpu_launch_shapes(monkeypatch, triton_gate)
    b, heads, kv, n, d, groups, window, sink, docs = CASES[case]
    leaves, doc_start, gen = inputs(b, heads, kv, n, d, groups, docs, offset)
    q, k, v, log_g = leaves
    end = offset + queries
    kwargs = dict(window=window, gate_scale=gate_scale, scale=d**-0.5, sink=sink)
    out = triton_gate.triton_soft_focus(
        q[:, :, offset:end], k[:, :, :end], v[:, :, :end], log_g,
        doc_start=doc_start, offset=offset, **kwargs,
    )  # fmt: skip
    want = reference(*leaves, doc_start, **kwargs)
    torch.testing.assert_close(out, want[:, :, offset:end], rtol=1e-5, atol=1e-5)
    cotangent = torch.zeros(want.shape)
    cotangent[:, :, offset:end] = torch.randn(out.shape, generator=gen)
    ours = grads(out, leaves, cotangent[:, :, offset:end])
    for name, got, ref in zip("qkvg", ours, grads(want, leaves, cotangent)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=name)


def test_an_offset_without_the_keys_before_it_is_refused():
    leaves, _, _ = inputs(1, 2, 2, 20, 16, 4, None, 0)
    q, k, v, log_g = leaves
    with pytest.raises(ValueError, match=r"queries at positions \[5, 25\) need the 25 keys"):
        triton_gate.triton_soft_focus(q, k, v, log_g, window=4, gate_scale=1.0, scale=0.25,
                                      offset=5)  # fmt: skip


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                INTERPRETED,
                reason="Triton 3.9's interpreter multiplies bf16 tl.dot operands as raw bits",
            ),
        ),
    ],
)
def test_half_precision_inputs_accumulate_in_float32(dtype):
    """Half-precision q, k, v: outputs and gradients in that dtype, within its rounding of the
    float64 reference on the same (rounded) inputs."""
    leaves, doc_start, gen = inputs(1, 4, 2, 40, 16, 4, None, 3, dtype)
    kwargs = dict(window=6, gate_scale=1.0, scale=0.25, sink=1)
    out = triton_gate.triton_soft_focus(*leaves, doc_start=doc_start, **kwargs)
    assert out.dtype == dtype
    wide = [t.detach().double().requires_grad_() for t in leaves]
    want = reference(*wide, doc_start, **kwargs)
    tolerance = (
        dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=3e-3, atol=3e-3)
    )
    torch.testing.assert_close(out.double(), want, **tolerance)
    cotangent = torch.randn(out.shape, generator=gen)
    got = grads(out, leaves, cotangent.to(dtype))
    ref = grads(want, wide, cotangent.double())
    for name, ours, theirs in zip("qkvg", got, ref):
        assert ours.dtype == leaves["qkvg".index(name)].dtype
        torch.testing.assert_close(ours.double(), theirs, **tolerance, msg=name)


def test_memory_kept_for_backward_is_linear_in_sequence_length():
    def saved_bytes(n):
        leaves, _, _ = inputs(1, 2, 2, n, 16, 4, None, 0)
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            triton_gate.triton_soft_focus(*leaves, window=8, gate_scale=1.0, scale=0.25)
        return sum(storages.values())

    small, large = saved_bytes(64), saved_bytes(256)
    assert large / small < 4.5  # 4x the tokens: linear; an n x n tensor would make it 16x


@pytest.mark.parametrize("gate_scale", [1.0, 0.7])
def test_a_huge_score_on_a_vanishing_affinity_neither_overflows_nor_underflows(gate_scale):
    """At lambda 1 the weights are exp2(raw - m) * a, m the largest raw score: a distant pair
    whose raw score dwarfs every other's but whose groups differ (affinity near the gate's
    floor) is where the largest weight falls furthest below 1. Outputs and gradients stay the
    float64 reference's."""
    gen = torch.Generator().manual_seed(11)
    b, heads, n, d, groups, window = 1, 2, 40, 16, 4, 4
    q = torch.randn(b, heads, n, d, generator=gen)
    k, v = (torch.randn(b, heads, n, d, generator=gen) for _ in range(2))
    q[:, :, 30] = 6.0  # query 30 (group 2) and key 3 (group 3) align: raw score 6 * 6 * 16 / 4
    k[:, :, 3] = 6.0
    # each token in one group: an affinity of ~3e-28 across groups, just above the gate's floor
    one_hot = torch.full((b, n, groups), -64.0)
    one_hot[0, torch.arange(n), torch.arange(n) % groups] = 0.0
    leaves = [t.requires_grad_() for t in (q, k, v, one_hot)]
    kwargs = dict(window=window, gate_scale=gate_scale, scale=d**-0.5)
    out = triton_gate.triton_soft_focus(*leaves, **kwargs)
    want = reference(*leaves, None, **kwargs)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn(out.shape, generator=gen)
    for name, got, ref in zip(
        "qkvg", grads(out, leaves, cotangent), grads(want, leaves, cotangent)
    ):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=name)
