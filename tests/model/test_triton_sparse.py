"""Sparse Focus's fused Triton kernel (model/kernels/triton_sparse.py) against the float64 dense
hard rule, forward and backward, run by Triton's interpreter on CPU tensors laid out as the model
lays them out; its launches counted; the kernel choice and its fallback."""

import time
import warnings

import pytest
import torch
from interpreted import skip_unless_kernels_run

from megatron_focus.model.focus import focus_sparse
from megatron_focus.model.focus.focus_sparse import sparse_focus_attention
from megatron_focus.model.focus.groups import Routing
from megatron_focus.model.kernels import graphs, kernels

from reference import assignments, dense_hard_rule

skip_unless_kernels_run()
triton_sparse = pytest.importorskip("megatron_focus.model.kernels.triton_sparse")

CASES = {  # b, heads, kv heads, n, d, K, w, top_k, sink, documents (lengths per row), assignment
    "top-1, sinks, documents, gqa": (2, 4, 2, 64, 8, 4, 5, 1, 2, [[7, 1, 30, 26], [20, 3, 41]],
                                     "random"),
    "top-2, documents, empty buckets": (2, 2, 2, 64, 8, 4, 5, 2, 0, [[64], [33, 31]],
                                        "one-group"),
    "top-1, mqa, d 12": (2, 4, 1, 70, 12, 4, 8, 1, 0, None, "random"),
    "top-3 of 8, ties, sinks": (1, 4, 2, 150, 8, 8, 8, 3, 4, None, "coarse"),
    "top-k = K: full causal": (1, 2, 2, 90, 8, 4, 8, 4, 0, None, "random"),
    "wide window, documents": (1, 2, 2, 260, 8, 4, 70, 2, 0, [[90, 170]], "lonely"),
    "a single-token group": (2, 2, 2, 64, 8, 4, 4, 2, 0, None, "lonely"),
    "sinks past the sequence": (1, 2, 2, 12, 8, 4, 4, 1, 20, None, "random"),
    "top-2 of 40, sinks: bits past 32": (1, 2, 1, 48, 8, 40, 5, 2, 3, [[20, 28]], "random"),
}  # fmt: skip
QUICK = [
    "top-1, sinks, documents, gqa",
    "top-2, documents, empty buckets",
    "top-2 of 40, sinks: bits past 32",
]


def _megatron_layout(b, heads, kv, n, d, gen):
    """q, k, v as the model hands them: views of one fused QKV output [n, b, kv, (rep + 2) d]
    permuted to [b, heads, n, d], k a tensor of its own (RoPE's)."""
    rep = heads // kv
    qkv = torch.randn(n, b, kv, (rep + 2) * d, generator=gen)
    q, _, v = torch.split(qkv, [rep * d, d, d], dim=-1)
    k = torch.randn(n, b, kv, d, generator=gen)
    q = q.reshape(n, b, heads, d)
    return [t.permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize(
    "case, whole",
    [pytest.param(c, False, marks=[] if c in QUICK else pytest.mark.slow) for c in CASES]
    + [pytest.param(c, True, marks=[] if c == QUICK[0] else pytest.mark.slow) for c in CASES],
)
def test_fused_kernel_equals_the_dense_hard_rule(monkeypatch, case, whole):
    """Output and the gradients of q, k and v: those of one masked softmax over all pairs; by
    the sparse parts, and by the whole rule as one part (`whole`: what a GPU takes below the
    measured crossover)."""
    from test_documents import starts_of

    monkeypatch.setattr(focus_sparse, "_dense_is_faster", lambda *args: whole)

    b, heads, kv, n, d, groups, window, top_k, sink, lengths, how = CASES[case]
    gen = torch.Generator().manual_seed(n + top_k)
    q, k, v = _megatron_layout(b, heads, kv, n, d, gen)
    doc_start = None if lengths is None else starts_of(lengths)
    log_g = assignments(b, n, groups, gen, how)
    weights = torch.randn(b, heads, n, d, generator=gen)
    routing = Routing.of(log_g, doc_start)
    out = sparse_focus_attention(q, k, v, routing, window=window, top_k=top_k, scale=0.3,
                                 sink=sink, kernel=kernels.TRITON_SPARSE)  # fmt: skip
    ref = dense_hard_rule(q, k, v, log_g, window, top_k, 0.3, sink, doc_start)
    torch.testing.assert_close(out, ref.float(), rtol=2e-5, atol=2e-5)
    ours = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want = torch.autograd.grad((ref * weights.double()).sum(), (q, k, v))
    for name, got, reference in zip("qkv", ours, want):
        torch.testing.assert_close(got, reference.float(), rtol=2e-5, atol=2e-5, msg=name)


def test_a_rows_sequence_is_found_by_one_multiply():
    """The kernel's row // n (`_quotient`, a magic number in place of a division) against
    floor division, for n of every bit length, its powers of two and their neighbours, and
    rows at the edges of n's multiples up to 2^31 - 1."""
    import triton
    import triton.language as tl

    @triton.jit
    def quotients(X, Y, n, size: tl.constexpr):
        at = tl.arange(0, size)
        tl.store(Y + at, triton_sparse._quotient(tl.load(X + at), n))

    gen = torch.Generator().manual_seed(0)
    divisors = {1, 2**31 - 1} | {2**k + e for k in range(1, 31) for e in (-1, 0, 1)}
    divisors |= set(torch.randint(1, 2**31 - 1, (12,), generator=gen).tolist())
    for n in sorted(divisors):
        last = (2**31 - 1) // n
        multiples = torch.tensor([1, 2, last // 2, last - 1, last]).clamp(min=0) * n
        x = (multiples[:, None] + torch.tensor([-1, 0, 1])).flatten()
        x = torch.cat([x, torch.randint(0, 2**31 - 1, (49,), generator=gen)])
        x = x.clamp(0, 2**31 - 1)[:64].to(torch.int32)
        y = torch.empty_like(x)
        quotients[(1,)](x, y, n, size=64)
        assert torch.equal(y, x // n), n


def test_layouts_the_kernel_cannot_address_by_rows_are_copied_or_refused():
    """Strides that are not whole rows of the head dim (a slice of a wider last dim) give a
    copy; a batch of one steps nowhere, whatever its stride; more than 2^31 rows: an error."""
    wide = torch.randn(2, 3, 10, 12)
    sliced = wide[..., :8]
    copied = triton_sparse.addressable(sliced)
    assert copied.is_contiguous() and torch.equal(copied, sliced)
    single = torch.randn(5, 3, 10, 8).permute(1, 0, 2, 3)[:1]  # s_b 80, s_n 8: kept as it is
    assert triton_sparse.addressable(single) is single
    huge = torch.empty_strided((2, 1, 4, 8), (2**31 * 8, 32, 8, 1), device="meta")
    with pytest.raises(ValueError, match="more than 2\\^31 rows"):
        triton_sparse.addressable(huge)


def test_launches_are_the_routing_and_one_a_part_forward_two_backward():
    """Top-1 forward and backward: the routing (one compiled region on a GPU), the band's and
    the buckets' launch forward, their queries and keys passes backward, and nothing else (no
    gather, scatter, merge, cast or delta of its own): 7, against the parts' path's 54."""
    from launches import count_launches

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 48, 16, generator=gen, requires_grad=True) for _ in range(3))
    routing = Routing.of(assignments(1, 48, 4, gen))
    cotangent = torch.randn(q.shape, generator=gen)
    kernels_counted = (triton_sparse._forward, triton_sparse._backward_queries,
                       triton_sparse._backward_keys)  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(focus_sparse, "_routed", lambda device, *inputs: focus_sparse._route(*inputs))
        with count_launches(kernels_counted, regions=[(focus_sparse, "_route")]) as launches:
            out = sparse_focus_attention(q, k, v, routing, window=8, top_k=1, scale=0.25,
                                         kernel=kernels.TRITON_SPARSE)  # fmt: skip
            out.backward(cotangent)
    routing_launches = launches.index("_route")
    assert launches[routing_launches:] == [
        "_route", "_forward", "_forward", "_backward_queries", "_backward_queries",
        "_backward_keys", "_backward_keys",
    ]  # fmt: skip
    assert routing_launches <= 5, launches  # the ranking of the routing's groups (Routing.top)


# what reads a tensor back to the host: a value, or a size that depends on values
HOST_READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "bincount",
              "unique_consecutive", "_unique2", "unique_dim", "repeat_interleave"}  # fmt: skip


@pytest.mark.parametrize(
    "top_k, documents", [pytest.param(1, None, marks=pytest.mark.slow), (2, [[20, 28], [48]])]
)
def test_the_fused_path_never_waits_for_the_device(monkeypatch, top_k, documents):
    """Routing, forward and backward read nothing back to the host: on a GPU the host runs
    ahead of the device, and the launches can be captured in a CUDA graph. Every aten op is
    seen (the routing's too, run eagerly here), and the package's own calls of the tensor
    methods that copy to the host."""
    import sys

    from launches import count_launches
    from test_documents import starts_of

    copies = []
    for method in ("tolist", "item", "cpu", "numpy"):

        def recorded(self, *args, _method=method, _original=getattr(torch.Tensor, method),
                     **kwargs):  # fmt: skip
            if sys._getframe(1).f_globals.get("__name__", "").startswith("megatron_focus"):
                copies.append(_method)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, recorded)
    monkeypatch.setattr(
        focus_sparse, "_routed", lambda device, *inputs: focus_sparse._route(*inputs)
    )
    gen = torch.Generator().manual_seed(top_k)
    q, k, v = (torch.randn(2, 2, 48, 16, generator=gen, requires_grad=True) for _ in range(3))
    doc_start = None if documents is None else starts_of(documents)
    routing = Routing.of(assignments(2, 48, 4, gen), doc_start)
    kernels_counted = (triton_sparse._forward, triton_sparse._backward_queries,
                       triton_sparse._backward_keys)  # fmt: skip
    with count_launches(kernels_counted) as launches:
        out = sparse_focus_attention(q, k, v, routing, window=8, top_k=top_k, scale=0.25,
                                     sink=2, kernel=kernels.TRITON_SPARSE)  # fmt: skip
        out.backward(torch.randn(q.shape, generator=gen))
    assert launches.count("_forward") == top_k + 2, launches  # the fused path ran
    assert not HOST_READS & set(launches), launches
    assert not copies


def test_a_repeated_inference_shape_replays_one_graph(monkeypatch):
    """Outside autograd on a GPU, the routing and the launches of a shape met before are one
    CUDA graph's replay (here its stand-in, test_graphs.py): each call's result is its own
    inputs' hard rule."""
    from test_graphs import replayed_capture

    captured = []

    def capture(function, static):
        captured.append(static[0].shape)
        return replayed_capture(function, static)

    monkeypatch.setattr(focus_sparse, "_host_bound", lambda *args: True)  # a GPU's choice
    monkeypatch.setattr(focus_sparse, "_dense_is_faster", lambda *args: False)
    monkeypatch.setattr(
        focus_sparse, "_routed", lambda device, *inputs: focus_sparse._route(*inputs)
    )
    monkeypatch.setattr(focus_sparse, "_GRAPHS", graphs.Graphs(capture=capture))
    gen = torch.Generator().manual_seed(0)
    for call in range(3):
        q, k, v = _megatron_layout(1, 4, 2, 40, 8, gen)
        log_g = assignments(1, 40, 4, gen)
        routing = Routing.of(log_g)
        with torch.no_grad():
            out = sparse_focus_attention(q, k, v, routing, window=5, top_k=2, scale=0.3, sink=2,
                                         kernel=kernels.TRITON_SPARSE)  # fmt: skip
        ref = dense_hard_rule(q, k, v, log_g, 5, 2, 0.3, 2)
        torch.testing.assert_close(out, ref.float(), rtol=2e-5, atol=2e-5, msg=f"call {call}")
    assert captured == [q.shape]


def test_a_repeated_training_shape_replays_a_forward_and_a_backward_graph(monkeypatch):
    """Training at a shape bound by the host: its forward (routing, launches) and its backward
    (the routing made again, launches) each one graph's replay (the stand-in). Two layers of one
    shape a step, two steps: every output and gradient is its own inputs' hard rule, so no
    replay overwrote an earlier layer's result or what its backward keeps."""
    from test_graphs import replayed_capture

    captured = []

    def capture(function, static):
        captured.append(len(static))
        return replayed_capture(function, static)

    monkeypatch.setattr(focus_sparse, "_host_bound", lambda *args: True)
    monkeypatch.setattr(focus_sparse, "_dense_is_faster", lambda *args: False)
    monkeypatch.setattr(
        focus_sparse, "_routed", lambda device, *inputs: focus_sparse._route(*inputs)
    )
    monkeypatch.setattr(focus_sparse, "_GRAPHS", graphs.Graphs(capture=capture))
    gen = torch.Generator().manual_seed(3)
    for step in range(2):  # the first step captures; every call of the second replays
        layers = [(_megatron_layout(1, 2, 1, 32, 8, gen), assignments(1, 32, 4, gen))
                  for _ in range(2)]  # fmt: skip
        weights = [torch.randn(1, 2, 32, 8, generator=gen) for _ in layers]
        outs = [sparse_focus_attention(q, k, v, Routing.of(log_g), window=5, top_k=1, scale=0.3,
                                       sink=2, kernel=kernels.TRITON_SPARSE)
                for (q, k, v), log_g in layers]  # fmt: skip
        leaves = [t for qkv, _ in layers for t in qkv]
        grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), leaves)
        for layer, ((q, k, v), log_g) in enumerate(layers):
            ref = dense_hard_rule(q, k, v, log_g, 5, 1, 0.3, 2)
            want = torch.autograd.grad((ref * weights[layer].double()).sum(), (q, k, v))
            where = f"step {step}, layer {layer}"
            torch.testing.assert_close(outs[layer], ref.float(), rtol=2e-5, atol=2e-5, msg=where)
            for name, got, reference in zip("qkv", grads[3 * layer :], want):
                torch.testing.assert_close(got, reference.float(), rtol=2e-5, atol=2e-5,
                                           msg=f"{where}, d{name}")  # fmt: skip
    assert captured == [5, 8]  # the forward's q, k, v, top, doc_start; the backward's 8


def test_the_fused_kernel_is_chosen_where_it_has_tiles(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "has_triton", lambda: True)
    monkeypatch.setattr(kernels, "device_capability", lambda device: (9, 0))
    assert kernels.sparse(cuda, 128, torch.bfloat16) is kernels.TRITON_SPARSE
    assert kernels.sparse(cuda, 128, None) is kernels.FLEX_VARLEN_LSE  # fp32
    assert kernels.sparse(cuda, 512, torch.bfloat16) is kernels.FLEX_VARLEN_LSE
    monkeypatch.setattr(kernels, "device_capability", lambda device: (7, 5))
    assert kernels.sparse(cuda, 64, torch.float16) is kernels.FLEX_VARLEN_LSE
    assert kernels.sparse(torch.device("cpu"), 64, torch.bfloat16) is kernels.CPU_FLASH_LSE


def test_a_failing_fused_kernel_falls_back_to_the_parts_once(monkeypatch):
    """On a GPU whose Triton cannot build the kernel: the parts' path, the same result, said
    once (under the interpreter, tests see the error itself)."""

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(focus_sparse, "_fused_failed", False)
    monkeypatch.setattr(kernels, "triton_interpreted", lambda: False)
    monkeypatch.setattr(triton_sparse, "triton_sparse_attention", broken)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=gen) for _ in range(3))
    log_g = assignments(1, 40, 4, gen)
    with pytest.warns(UserWarning, match="fused Triton kernel failed.*PTX assembly failed"):
        out = sparse_focus_attention(q, k, v, Routing.of(log_g), window=4, top_k=1, scale=0.3,
                                     kernel=kernels.TRITON_SPARSE)  # fmt: skip
    torch.testing.assert_close(out, dense_hard_rule(q, k, v, log_g, 4, 1, 0.3).float())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sparse_focus_attention(q, k, v, Routing.of(log_g), window=4, top_k=1, scale=0.3,
                               kernel=kernels.TRITON_SPARSE)  # fmt: skip


def test_the_faster_way_is_measured_once_per_shape_and_said(monkeypatch, capsys):
    """On a GPU the first call of a shape times the sparse parts and the whole rule in one
    part, keeps the faster, and says so; later calls of that shape, or of a length up to the
    same power of two, reuse the choice. A shape whose forward took under GRAPH_BELOW_MS (1 ms:
    the host's time, mostly) is replayed as a CUDA graph."""
    times = iter([2.0, 0.5, 1.5, 3.0])  # sparse, dense at 64 tokens; then at 96
    monkeypatch.setattr(focus_sparse, "_DENSE_FASTER", {})
    monkeypatch.setattr(kernels, "compiled", lambda device: True)
    monkeypatch.setattr(focus_sparse, "_median_ms", lambda run, device: next(times))
    gen = torch.Generator().manual_seed(0)
    chosen, graphed = [], []
    for n in (64, 64, 96, 128):
        q, k = torch.randn(1, 2, n, 8), torch.randn(1, 1, n, 8)
        routing = Routing.of(assignments(1, n, 4, gen))
        chosen.append(focus_sparse._dense_is_faster(q, k, routing, 1, 0, None))
        graphed.append(focus_sparse._host_bound(q, k, routing, 1, 0))
    assert chosen == [True, True, False, False]
    assert graphed == [True, True, False, False]
    said = capsys.readouterr().out.splitlines()
    assert said == [
        "sparse Focus at 64 tokens, kept for 33 to 64 (batch 1, top-1): the masked rule in one "
        "call (0.50 ms a forward) over the sparse parts (2.00 ms)",
        "sparse Focus at 96 tokens, kept for 65 to 128 (batch 1, top-1): the sparse parts (1.50 "
        "ms a forward) over the masked rule in one call (3.00 ms)",
    ]


def test_the_timing_is_a_median_after_a_warm_up():
    """`_median_ms` on the CPU's clock (a GPU's: CUDA events): the warm-up call not counted."""
    calls, delays = [], iter([0.2, 0.0, 0.03, 0.0])

    def run():
        calls.append(1)
        time.sleep(next(delays))

    ms = focus_sparse._median_ms(run, torch.device("cpu"))
    assert len(calls) == 4 and 0 <= ms < 25  # 0, 30, 0 ms: the median, not the warm-up's 200
