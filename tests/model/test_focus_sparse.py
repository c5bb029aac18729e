"""Sparse Focus dispatch (buckets + local window, merged by log-sum-exp) == the dense hard rule."""

import math
import warnings

import pytest
import torch

from megatron_focus.model.focus import focus_sparse
from megatron_focus.model.focus.focus_gate import focus_attention
from megatron_focus.model.focus.focus_sparse import sparse_focus_attention
from megatron_focus.model.focus.groups import Routing
from megatron_focus.model.kernels import kernels
from megatron_focus.model.kernels.lse_merge import merge_by_lse

from reference import assignments, dense_hard_rule

NO_SINK = [  # b, heads, kv heads, n, d, K, w, top_k, assignment
    (1, 2, 2, 1, 8, 4, 4, 1, "random"),
    (2, 4, 4, 37, 8, 4, 5, 1, "random"),
    (1, 4, 2, 40, 8, 4, 64, 2, "random"),  # n < w
    (2, 4, 1, 300, 16, 8, 16, 2, "random"),  # multi-query, batch with other group sizes
    (2, 4, 2, 257, 8, 4, 8, 4, "random"),  # top-k = K: full causal attention
    (1, 2, 2, 90, 8, 1, 8, 1, "random"),  # K = 1
    (2, 2, 2, 64, 8, 4, 4, 1, "one-group"),  # all tokens in one group, the others empty
    (2, 2, 2, 64, 8, 4, 4, 2, "lonely"),  # a single-token group
    (1, 4, 2, 2500, 32, 8, 128, 2, "random"),  # several thousand tokens
    # exact ties everywhere (tests/reference.py): K = 8 with every top-k, GQA, n a multiple of
    # no block size
    *[
        (1, 4, 2, 150, 8, 8, 8, top_k, how)
        for how in ("uniform", "duplicated", "coarse")
        for top_k in range(1, 9)
    ],
]
CASES = [case + (0,) for case in NO_SINK] + [  # ..., the first s tokens kept for every query
    (2, 4, 2, 200, 8, 4, 16, 1, "random", 4),
    (1, 4, 1, 100, 8, 8, 8, 2, "coarse", 1),  # token 0 alone, ties
    (1, 2, 2, 60, 8, 4, 70, 2, "random", 3),  # n < w
    (2, 4, 4, 150, 8, 4, 8, 4, "random", 20),  # top-k = K: full causal attention
    (1, 2, 2, 50, 8, 4, 4, 1, "one-group", 10),
    (1, 2, 2, 12, 8, 4, 4, 1, "random", 20),  # s > n: every pair
    (1, 4, 2, 300, 8, 4, 8, 2, "random", 32),  # s > w
]


def _gpu_kernel(kernel, monkeypatch, request):
    """The sparse path's calls as a GPU makes them: "flex", every call through FlexAttention
    (here eagerly: a dense evaluation, so only up to a few hundred tokens); "varlen", slot 0
    through torch's varlen flash ops instead (given a CPU implementation: tests/varlen.py).
    Returns the varlen ops' call counts for "varlen"."""
    if kernel == "varlen":
        monkeypatch.setattr(kernels, "lse_attention", lambda device: kernels.FLEX_VARLEN_LSE)
        return request.getfixturevalue("cpu_varlen")
    monkeypatch.setattr(kernels, "lse_attention", lambda device: kernels.FLEX_LSE)


def _cpu_kernel(kernel, monkeypatch):
    """ "cpu-causal": slot 0 as one causal call however short its buckets (not by strips);
    "explicit": the CPU path where a torch lacks the fused kernel's private ops."""
    if kernel == "cpu-causal":
        monkeypatch.setattr(focus_sparse, "_STRIPS_BELOW", 0)
    elif kernel == "explicit":
        monkeypatch.setattr(kernels, "_CPU_FLASH", None)
        monkeypatch.setattr(kernels, "_CPU_FLASH_BACKWARD", None)


@pytest.mark.parametrize("kernel", ["cpu-flash", "cpu-causal", "flex", "varlen"])
@pytest.mark.parametrize("b, heads, kv, n, d, groups, window, top_k, how, sink", CASES)
def test_sparse_dispatch_equals_dense_hard_rule(
    monkeypatch, request, kernel, b, heads, kv, n, d, groups, window, top_k, how, sink
):
    varlen = None
    _cpu_kernel(kernel, monkeypatch)
    if kernel in ("flex", "varlen"):
        if n > 300:
            pytest.skip("eager FlexAttention on the CPU evaluates every pair")
        varlen = _gpu_kernel(kernel, monkeypatch, request)
    gen = torch.Generator().manual_seed(n + groups)
    q = torch.randn(b, heads, n, d, generator=gen)
    k, v = (torch.randn(b, kv, n, d, generator=gen) for _ in range(2))
    log_g = assignments(b, n, groups, gen, how)
    out = sparse_focus_attention(
        q, k, v, Routing.of(log_g), window=window, top_k=top_k, scale=d**-0.5, sink=sink
    )
    ref = dense_hard_rule(q, k, v, log_g, window, top_k, d**-0.5, sink)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if varlen is not None:  # slot 0 was the one varlen call
        assert varlen == {"forward": 1, "backward": 0}
    if n <= 300 and kernel == "cpu-flash":  # the masked path (used with gradients): same rule
        masked = focus_attention(
            q,
            k,
            v,
            Routing.of(log_g),
            window=window,
            gate_scale=1.0,
            top_k=top_k,
            chunk_size=32,
            scale=d**-0.5,
            sink=sink,
        )
        torch.testing.assert_close(out, masked, rtol=1e-5, atol=1e-5)
    if top_k == groups or sink >= n:
        full = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=d**-0.5, enable_gqa=heads != kv
        )
        torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)


def test_bf16_slot_0_by_strips_merges_as_the_causal_call(monkeypatch):
    """In bf16 the strips' log-sum-exp stays float32, as the causal call's does: rounded to bf16
    it would shift the merge's weights."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (3 * torch.randn(1, 4, 600, 32, generator=gen) for _ in range(3))
    routing = Routing.of(assignments(1, 600, 4, gen))

    def sparse():
        return sparse_focus_attention(
            *(x.bfloat16() for x in (q, k, v)), routing, window=16, top_k=2, scale=0.2
        ).float()

    by_strips = sparse()
    monkeypatch.setattr(focus_sparse, "_STRIPS_BELOW", 0)
    torch.testing.assert_close(by_strips, sparse(), rtol=0, atol=1e-2)


@pytest.mark.parametrize("sizes", [[600, 5, 3, 700, 1, 260], [3] * 100, [1000]])
def test_range_blocks_end_at_far_bucket_starts_and_merge_small_buckets(sizes):
    """Blocks of queries over buckets (lo: the bucket's start, hi: lo + the query's place in it):
    each query in one block; no block reaches a bucket that starts a block's worth of keys or
    more past its first query's lo (its later queries would compute those keys in vain); small
    buckets share blocks."""
    block = focus_sparse._RANGE_BLOCK
    starts = torch.tensor([0] + sizes[:-1]).cumsum(0)
    lo = torch.cat([torch.full((size,), int(start)) for start, size in zip(starts, sizes)])
    bounds = list(focus_sparse._block_bounds(lo, lo.tolist(), block))
    assert [start for start, _ in bounds] == [0] + [end for _, end in bounds[:-1]]
    assert bounds[-1][1] == lo.numel()
    for start, end in bounds:
        assert 0 < end - start <= block
        assert lo[end - 1] - lo[start] < block, (start, end)
    if len(sizes) == 100:
        assert len(bounds) == 2


def test_merge_by_lse_is_the_softmax_of_the_union():
    gen = torch.Generator().manual_seed(0)
    scores, values = torch.randn(3, 10, generator=gen), torch.randn(10, 4, generator=gen)
    parts = [slice(0, 3), slice(3, 3), slice(3, 10)]  # one of them empty
    outs, lses = [], []
    for part in parts:
        s = scores[:, part]
        lse = s.logsumexp(-1) if s.shape[1] else torch.full((3,), float("-inf"))
        outs.append((s - lse[:, None]).exp() @ values[part] if s.shape[1] else torch.zeros(3, 4))
        lses.append(lse)
    merged, lse = merge_by_lse(outs, lses)
    torch.testing.assert_close(merged, scores.softmax(-1) @ values)
    torch.testing.assert_close(lse, scores.logsumexp(-1))


@pytest.mark.parametrize("attention", ["focus", "focus+xsa"])
def test_model_in_sparse_mode_dispatch_equals_masked_rule(single_process, forbid_topk, attention):
    """The model's two hard-rule paths, for every top-k of K = 8, with duplicated centroids (exact
    ties between groups 2j and 2j + 1 for every token) and the statistics computed alongside."""
    from megatron_focus import platform
    from megatron_focus.model.focus.focus import (
        focus_statistics,
        recording_statistics,
        set_focus_mode,
    )
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args

    platform.manual_seed(0)
    args = parse_args(
        [
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "96",
            "--attention",
            attention,
            "--focus-window",
            "8",
            "--focus-groups",
            "8",
            "--focus-chunk-size",
            "32",
            "--focus-attention-mode",
            "sparse",
            "--attention-dropout",
            "0",
            "--group-query-attention",
            "--num-query-groups",
            "2",
        ]
    )
    model = build_model(args, 256).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("router.centroids"):
                param[1::2] = param[0::2]
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(96).expand(2, 96)
    forbid_topk()
    mass = []  # the first layer's q and k do not depend on top-k
    for top_k in range(1, 9):
        set_focus_mode(model, "sparse", top_k)
        with torch.no_grad(), recording_statistics(model):
            dispatched = model(tokens, positions, None)
        masked = model(tokens, positions, None)  # with gradients: the masked-chunk path
        torch.testing.assert_close(dispatched, masked.detach(), rtol=1e-5, atol=1e-5)
        assert 0 < focus_statistics(model)["focus/layer01/pairs-kept"] <= 1
        mass.append(float(focus_statistics(model)["focus/layer01/kept-mass"]))
    assert mass == sorted(mass) and 0 < mass[0] < 1 and abs(mass[-1] - 1) < 1e-6


EVAL = ["--eval-iters", "2", "--micro-batch-size", "2"]


def test_eval_ppl_reports_every_top_k_at_every_length(embedded_cache, tmp_path, run_tool):
    """tools/eval_ppl.py on a trained Focus checkpoint (RoPE, trained at 32 tokens): soft, then
    top-k = 1..K in sparse mode, at 16, 32 and 64 tokens (beyond the training length)."""
    import json

    from tiny_runs import tiny_argv, train

    ckpt, report = str(tmp_path / "ckpt"), str(tmp_path / "ppl.json")
    train(
        1,
        tiny_argv(
            embedded_cache,
            "--attention",
            "focus",
            "--focus-window",
            "4",
            "--focus-groups",
            "3",
            "--position-embedding-type",
            "rope",
            "--save",
            ckpt,
            iters=3,
        ),
    )
    out = run_tool(
        "tools/eval_ppl.py",
        "--load",
        ckpt,
        "--data-cache-path",
        embedded_cache,
        *EVAL,
        "--seq-lengths",
        "16",
        "32",
        "64",
        "--json",
        report,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ppl@64" in out.stdout and "mass@64" in out.stdout
    result = json.load(open(report))
    assert result["kernels"] == {
        "sinkhorn": "torch",
        "soft gate": "chunked",
        "sparse": "cpu-flash",
    }
    rows = result["rows"]
    assert [(r["mode"], r["top_k"], r["seq_length"]) for r in rows] == [
        (mode, top_k, n)
        for mode, top_k in [("soft", None), ("sparse", 1), ("sparse", 2), ("sparse", 3)]
        for n in (16, 32, 64)
    ]
    for n in (16, 32, 64):
        kept = [r["pairs_kept"] for r in rows if r["mode"] == "sparse" and r["seq_length"] == n]
        assert kept == sorted(kept) and kept[0] < 1.0 and abs(kept[-1] - 1.0) < 1e-6  # K: all
        # the dense attention's mass the rule keeps: grows with top-k, all of it at K
        mass = [r["kept_mass"] for r in rows if r["mode"] == "sparse" and r["seq_length"] == n]
        assert all(0 <= m <= 1 + 1e-6 for m in mass) and mass[0] < 1.0
        assert all(a <= b + 1e-6 for a, b in zip(mass, mass[1:])) and abs(mass[-1] - 1) < 1e-6
        for r in rows:
            if r["mode"] == "sparse":
                layers = r["kept_mass_layers"]
                assert sorted(layers) == ["layer01", "layer02"]
                assert r["kept_mass"] == pytest.approx(sum(layers.values()) / 2)
            else:
                assert r["kept_mass"] is None and r["kept_mass_layers"] is None
    longest = [r["pairs_kept"] for r in rows if r["top_k"] == 1]
    assert longest[0] > longest[-1]  # a window of 4 keeps less of a longer sequence
    assert all(math.isfinite(r["loss"]) for r in rows)


def test_eval_ppl_refuses_lengths_beyond_learned_positions(embedded_cache, tmp_path, run_tool):
    from tiny_runs import tiny_argv, train

    ckpt = str(tmp_path / "ckpt")
    train(1, tiny_argv(embedded_cache, "--save", ckpt, iters=3))  # learned positions, 32 of them
    out = run_tool(
        "tools/eval_ppl.py",
        "--load",
        ckpt,
        "--data-cache-path",
        embedded_cache,
        *EVAL,
        "--seq-lengths",
        "16",
        "64",
    )
    assert out.returncode != 0
    assert "error: --seq-lengths 64: the model's learned position table has 32" in out.stderr


def _produced(fn):
    """fn()'s result and, for each tensor its operations produced, (its elements, a weak
    reference to it)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    made = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            made.extend((t.numel(), weakref.ref(t)) for t in tensors)
            return out

    with Record():
        return fn(), made


def _largest_intermediate(fn, *args) -> int:
    """Elements of the largest tensor any operation of `fn` produces."""
    return max(numel for numel, _ in _produced(lambda: fn(*args))[1])


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "training"])
def test_sparse_memory_is_linear_in_sequence_length(backward):
    """No n x n tensor: 4x the tokens make every intermediate at most ~4x larger (16x if any
    tensor held all pairs), and the largest stays a few times q's own size; in training too
    (forward and backward)."""
    gen = torch.Generator().manual_seed(0)
    largest = {}

    def step(q, k, v, routing):
        out = sparse_focus_attention(q, k, v, routing, window=32, top_k=2, scale=0.25)
        if backward:
            out.backward(torch.ones_like(out))

    for n in (512, 2048):
        q, k, v = (
            torch.randn(1, 2, n, 16, generator=gen).requires_grad_(backward) for _ in range(3)
        )
        routing = Routing.of(assignments(1, n, 4, gen))
        largest[n] = _largest_intermediate(step, q, k, v, routing)
        assert largest[n] < 8 * q.numel()
    assert largest[2048] / largest[512] < 4.5


def _kept_bytes(fn) -> int:
    """Bytes of the storages that `fn`'s operations made and that are still alive once it
    returned: its result and what autograd keeps for the backward."""
    import gc

    result, made = _produced(fn)
    gc.collect()
    alive = (ref() for _, ref in made)
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive if t is not None
    }
    del result
    return sum(storages.values())


def test_sparse_training_keeps_linear_memory_for_backward():
    """What a training forward keeps for its backward (the parts' layouts, masks and indices)
    grows linearly in n: each block mask of the range parts is made again in backward, where
    keeping them all would hold O(n^2 / K) entries a layer."""
    gen = torch.Generator().manual_seed(0)
    kept = {}
    for n in (512, 2048):
        q, k, v = (torch.randn(1, 2, n, 16, generator=gen).requires_grad_() for _ in range(3))
        routing = Routing.of(assignments(1, n, 4, gen))
        kept[n] = _kept_bytes(
            lambda: sparse_focus_attention(q, k, v, routing, window=32, top_k=2, scale=0.25)
        )
    assert kept[2048] / kept[512] < 4.5, kept


GRADIENT_CASES = {  # b, heads, kv heads, n, K, w, top_k, sink, documents (lengths per row)
    "top-1": (2, 4, 4, 70, 4, 8, 1, 0, None),
    "top-2, gqa": (2, 4, 2, 90, 4, 8, 2, 0, None),
    "top-2, sinks, mqa": (1, 4, 1, 80, 8, 6, 2, 3, None),
    "top-1, sinks, documents": (2, 4, 2, 64, 4, 5, 1, 2, [[7, 1, 30, 26], [20, 3, 41]]),
    "top-2, documents": (2, 2, 2, 64, 4, 5, 2, 0, [[64], [33, 31]]),
    # a window wider than the local part's query block, not a multiple of it
    "top-2, wide window, documents": (1, 2, 2, 260, 4, 70, 2, 0, [[90, 170]]),
}
SPARSE_KERNELS = ["cpu-flash", "cpu-causal", "explicit", "flex", "varlen"]


@pytest.mark.parametrize("kernel", SPARSE_KERNELS)
@pytest.mark.parametrize("case", list(GRADIENT_CASES))
def test_sparse_gradients_equal_the_dense_hard_rule(monkeypatch, request, kernel, case):
    """Gradients of q, k and v through the merge (fp64), each part's backward run with the
    merged output and log-sum-exp: those of one masked softmax over all pairs. "flex" and
    "varlen" train as on a GPU (FlexAttention recomputed in backward; eager FlexAttention has a
    backward on the CPU, a dense evaluation, that torch refuses only by a device check)."""
    import torch.nn.attention.flex_attention as flex_attention
    from test_documents import starts_of

    b, heads, kv, n, groups, window, top_k, sink, lengths = GRADIENT_CASES[case]
    varlen = None
    if kernel in ("flex", "varlen"):
        monkeypatch.setattr(flex_attention, "_validate_device", lambda *tensors: None)
        varlen = _gpu_kernel(kernel, monkeypatch, request)
    _cpu_kernel(kernel, monkeypatch)
    gen = torch.Generator().manual_seed(n + top_k)
    q = torch.randn(b, heads, n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(b, kv, n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    doc_start = None if lengths is None else starts_of(lengths)
    log_g = assignments(b, n, groups, gen).double().requires_grad_()
    weights = torch.randn(b, heads, n, 8, generator=gen, dtype=torch.float64)
    out = sparse_focus_attention(
        q, k, v, Routing.of(log_g, doc_start), window=window, top_k=top_k, scale=0.3, sink=sink
    )
    ref = dense_hard_rule(q, k, v, log_g, window, top_k, 0.3, sink, doc_start)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    ours = torch.autograd.grad((out * weights).sum(), (q, k, v, log_g), allow_unused=True)
    want = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for name, got, reference in zip("qkv", ours, want):
        torch.testing.assert_close(got, reference, rtol=1e-10, atol=1e-10, msg=name)
    assert ours[3] is None  # the routing: a hard choice, no gradient
    if varlen is not None:  # packed documents keep FlexAttention's ranges (no host sync)
        calls = 0 if lengths else 1
        assert varlen == {"forward": calls, "backward": calls}


ROUTE_CASES = {  # b, n, K, top_k, sink, documents (lengths per row), first slot attended as ranges
    "top-1, varlen slot 0": (2, 200, 8, 1, 0, None, 1),
    "top-2": (1, 300, 4, 2, 0, None, 0),
    "top-3, sinks": (2, 150, 8, 3, 4, None, 0),
    "top-2, sinks, documents": (2, 64, 4, 2, 2, [[7, 1, 30, 26], [20, 3, 41]], 0),
}


def _route_inputs(case):
    from test_documents import starts_of

    b, n, groups, top_k, sink, lengths, first_slot = ROUTE_CASES[case]
    gen = torch.Generator().manual_seed(n + top_k)
    groups_q = Routing.of(assignments(b, n, groups, gen)).top(top_k)
    doc_start = torch.zeros(b, n, dtype=torch.long) if lengths is None else starts_of(lengths)
    documents = b if lengths is None else b * n  # a GPU's bound with packed documents
    return groups_q, doc_start, groups, documents, sink, 8, first_slot, True


@pytest.mark.parametrize("case", list(ROUTE_CASES))
def test_gpu_routing_is_one_graph_with_no_host_synchronisation(case):
    """On a GPU the sparse path's routing (buckets, key ranges, block masks) is one compiled
    region (focus_sparse._compiled_route): traced here as a GPU traces it, it is one graph (a
    host synchronisation would break it, and fullgraph refuses a break), and it computes what
    the eager routing computes, bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.utils._pytree import tree_leaves

    inputs = _route_inputs(case)
    eager = focus_sparse._route(*inputs)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    traced = torch.compile(focus_sparse._route, fullgraph=True, dynamic=False, backend=counter)
    got = traced(*inputs)
    assert counter.frame_count == 1
    assert type(got) is type(eager) and len(got.ranges) == len(eager.ranges)
    pairs = list(zip(tree_leaves(got), tree_leaves(eager), strict=True))
    assert all(torch.equal(ours, want) for ours, want in pairs)


@pytest.mark.slow
def test_gpu_routing_compiles_once_for_every_length():
    """The compiled routing as a GPU compiles it (a quick backend here), its sizes symbolic: a
    sweep of lengths compiles it once, and once more with packed documents (their own graph)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.utils._pytree import tree_leaves

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    focus_sparse._compiled_route.cache_clear()
    compiled = focus_sparse._compiled_route(counter)
    for n in (300, 517, 1000, 2000):
        gen = torch.Generator().manual_seed(n)
        groups_q = Routing.of(assignments(2, n, 8, gen)).top(2)
        doc_start = torch.zeros(2, n, dtype=torch.long)
        doc_start[1, n // 3 :] = n // 3
        for starts, documents in ((None, 2), (doc_start, 2 * n)):
            inputs = (groups_q, starts, 8, documents, 3, 16, 0, True)
            got, want = compiled(*inputs), focus_sparse._route(*inputs)
            assert all(map(torch.equal, tree_leaves(got), tree_leaves(want)))
    assert counter.frame_count == 2
    focus_sparse._compiled_route.cache_clear()


def test_gpu_routing_runs_eagerly_if_its_compile_fails(monkeypatch, request):
    """A compiler that fails on the routing (a torch whose inductor cannot lower an op) costs
    launches, not the run: the routing runs eagerly from then on, said once."""
    import torch.nn.attention.flex_attention as flex_attention

    def broken():
        def compiled(*inputs):
            raise RuntimeError("inductor cannot lower this op")

        return compiled

    monkeypatch.setattr(flex_attention, "_validate_device", lambda *tensors: None)
    _gpu_kernel("flex", monkeypatch, request)
    monkeypatch.setattr(kernels, "compiled", lambda device: True)
    monkeypatch.setattr(focus_sparse, "_compiled_route", broken)
    monkeypatch.setattr(focus_sparse, "_compile_failed", False)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 80, 8, generator=gen) for _ in range(3))
    log_g = assignments(1, 80, 4, gen)
    with pytest.warns(UserWarning, match="compiling the routing failed.*cannot lower"):
        out = sparse_focus_attention(q, k, v, Routing.of(log_g), window=8, top_k=2, scale=0.3)
    ref = dense_hard_rule(q, k, v, log_g, 8, 2, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        sparse_focus_attention(q, k, v, Routing.of(log_g), window=8, top_k=2, scale=0.3)
    assert not [w for w in said if "compiling the routing" in str(w.message)]  # said once


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["flex", "varlen"])
@pytest.mark.parametrize("case", ["top-1, sinks, documents", "top-2, gqa"])
def test_sparse_attention_with_compiled_routing_equals_the_dense_hard_rule(
    monkeypatch, request, kernel, case
):
    """The GPU's sparse path whole, its routing compiled by inductor (for the CPU here): output
    and gradients equal the dense hard rule's, and the routing compiles once for all calls."""
    import torch.nn.attention.flex_attention as flex_attention
    from test_documents import starts_of

    b, heads, kv, n, groups, window, top_k, sink, lengths = GRADIENT_CASES[case]
    monkeypatch.setattr(flex_attention, "_validate_device", lambda *tensors: None)
    _gpu_kernel(kernel, monkeypatch, request)
    monkeypatch.setattr(kernels, "compiled", lambda device: True)
    torch._dynamo.reset()
    focus_sparse._compiled_route.cache_clear()
    gen = torch.Generator().manual_seed(n)
    doc_start = None if lengths is None else starts_of(lengths)
    for call in range(2):
        q = torch.randn(b, heads, n, 8, generator=gen, requires_grad=True)
        k, v = (torch.randn(b, kv, n, 8, generator=gen, requires_grad=True) for _ in range(2))
        log_g = assignments(b, n, groups, gen)
        routing = Routing.of(log_g, doc_start)
        with torch._dynamo.config.patch(error_on_recompile=call > 0):
            out = sparse_focus_attention(
                q, k, v, routing, window=window, top_k=top_k, scale=0.3, sink=sink
            )
        ref = dense_hard_rule(q, k, v, log_g, window, top_k, 0.3, sink, doc_start)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        cotangent = torch.randn(out.shape, generator=gen)
        ours = torch.autograd.grad(out, (q, k, v), cotangent)
        want = torch.autograd.grad(ref, (q, k, v), cotangent)
        for name, got, reference in zip("qkv", ours, want):
            torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-5, msg=name)
    assert focus_sparse._compiled_route.cache_info().currsize == 1  # it was the compiled one
    focus_sparse._compiled_route.cache_clear()


@pytest.mark.parametrize("top_k, budget", [(1, 54), (2, 90), (3, 126)])
def test_gpu_sparse_attention_launches_within_budget(top_k, budget):
    """One sparse attention call, forward and backward, as a GPU launches it
    (tests/launches.py): the routing one compiled region, made once (the backward reuses its
    block masks); each FlexAttention part one launch forward, one recomputed and one backward.
    Eager, the routing alone is some 25 launches at top-1 and 50 more per further slot."""
    from launches import gpu_sparse_attention_launches

    launches = gpu_sparse_attention_launches(top_k, compiled_routing=True)
    assert launches.count("_route") == 1
    assert launches.count("_attend_with_lse") == 2 * top_k  # the local part's and top_k - 1
    assert launches.count("flex_attention_backward") == top_k
    assert launches.count("_varlen_attn") == launches.count("_varlen_attn_backward") == 1
    assert len(launches) <= budget, " ".join(launches)
    eager = gpu_sparse_attention_launches(top_k, compiled_routing=False)
    assert len(eager) - len(launches) >= 20 + 45 * (top_k - 1), (len(eager), len(launches))


def test_the_merges_backward_is_its_chain_rule():
    """lse_merge.part_gradients: what autograd gives each part's output and log-sum-exp through
    merge_by_lse, an empty part included."""
    from megatron_focus.model.kernels.lse_merge import part_gradients

    gen = torch.Generator().manual_seed(3)
    outs = [torch.randn(2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    lses = [torch.randn(2, 5, generator=gen, dtype=torch.float64) for _ in range(3)]
    lses[1][0, 2] = float("-inf")  # a query with no key in part 1
    outs[1][0, 2] = 0.0
    leaves = [x.clone().requires_grad_() for x in outs + lses]
    out, lse = merge_by_lse(leaves[:3], leaves[3:])
    d_out = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * d_out).sum(), leaves)
    for p in range(3):
        d_part_out, d_part_lse = part_gradients(d_out, out.detach(), lse.detach(), outs[p], lses[p])
        torch.testing.assert_close(d_part_out, grads[p], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(d_part_lse, grads[3 + p], rtol=1e-12, atol=1e-12)


SPARSE_RUN = ["--attention", "focus", "--focus-window", "4", "--focus-groups", "3"]
SPARSE_RUN += ["--position-embedding-type", "rope"]


@pytest.mark.slow
def test_sparse_training_continues_soft_at_a_longer_sequence_and_resumes(embedded_cache, tmp_path):
    """pretrain_gpt: 3 soft steps at 32 tokens, then sparse (top-1) at 64 from those weights:
    4 sparse steps straight equal 2 and 2 resumed; the routers stay as soft training left them
    (frozen), every other weight learns."""
    from tiny_runs import full_weights, tiny_argv, train

    soft, sparse = str(tmp_path / "soft"), str(tmp_path / "sparse")
    train(1, tiny_argv(embedded_cache, *SPARSE_RUN, "--save", soft, iters=3))
    continued = SPARSE_RUN + ["--focus-attention-mode", "sparse", "--focus-top-k", "1"]
    continued += ["--seq-length", "64", "--pretrained-checkpoint", soft]
    straight = train(1, tiny_argv(embedded_cache, *continued, iters=4))
    resumable = continued + ["--save", sparse, "--load", sparse]
    first = train(1, tiny_argv(embedded_cache, *resumable, "--exit-interval", "2", iters=4))
    second = train(1, tiny_argv(embedded_cache, *resumable, iters=4))
    assert len(straight["losses"]) == 4 and all(math.isfinite(x) for x in straight["losses"])
    assert first["losses"] + second["losses"] == straight["losses"]
    before, after = full_weights(soft), full_weights(sparse)
    routers = [name for name in before if ".router." in name]
    assert routers and all(torch.equal(before[name], after[name]) for name in routers)
    assert all(not torch.equal(before[n], after[n]) for n in before if n not in routers)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_sparse_training_runs_under_zero_with_frozen_routers(embedded_cache, stage):
    """ZeRO partitions and steps only the trained weights: the frozen routers of sparse mode
    are left out without complaint, over two ranks."""
    from tiny_runs import tiny_argv, train

    argv = SPARSE_RUN + ["--focus-attention-mode", "sparse", "--zero-stage", str(stage)]
    history = train(2, tiny_argv(embedded_cache, *argv, iters=3))
    assert len(history["losses"]) == 3 and all(math.isfinite(x) for x in history["losses"])
