"""The GPU kernels (FlexAttention), checked on the CPU against the dense references.

FlexAttention runs forward on the CPU eagerly (a dense evaluation of the same score_mod and
masks; pytest.ini silences its warning that it is not compiled), so the outputs here test our
score_mod and masks, not the compiled Triton kernel; the block masks are checked block by block.
FlexAttention's backward does not run on the CPU: the gate's gradient is checked by
differentiating `gate_score_mod` on dense index grids, which is the function FlexAttention
differentiates. The sparse path on FlexAttention is tested in test_focus_sparse.py.
"""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from megatron_focus import platform
from megatron_focus.model.documents import segments
from megatron_focus.model.focus.focus_gate import attention_with_lse
from megatron_focus.model.focus.focus_sparse import _route
from megatron_focus.model.focus.groups import Routing
from megatron_focus.model.focus.sinkhorn import causal_sinkhorn
from megatron_focus.model.kernels import kernels
from megatron_focus.model.kernels.flex import (
    block_indices,
    causal_block_mask,
    document_block_mask,
    flex_attention_with_lse,
    flex_soft_focus,
    gate_score_mod,
    range_block_mask,
)

from reference import assignments, reference_focus

SOFT_CASES = [  # (b, heads, kv groups, n, d, K, window, sink tokens)
    (2, 4, 4, 37, 8, 4, 5, 0),  # n not a multiple of anything
    (1, 4, 2, 20, 8, 3, 64, 0),  # n < w, GQA
    (2, 4, 1, 33, 16, 1, 4, 0),  # K = 1, multi-query
    (2, 4, 2, 40, 8, 4, 5, 3),  # sinks
    (1, 2, 2, 300, 8, 8, 6, 2),  # several of FlexAttention's 128-blocks, the last partial
]


def soft_inputs(b, heads, kv, n, d, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, n, d, generator=gen)
    k, v = (torch.randn(b, kv, n, d, generator=gen) for _ in range(2))
    log_g = causal_sinkhorn(torch.randn(b, n, groups, generator=gen) * 3, 5)
    return q, k, v, log_g, gen


@pytest.mark.parametrize("gate", ["log", "sigmoid"])
@pytest.mark.parametrize("b, heads, kv, n, d, groups, window, sink", SOFT_CASES)
def test_flex_soft_focus_equals_dense_reference(b, heads, kv, n, d, groups, window, sink, gate):
    q, k, v, log_g, _ = soft_inputs(b, heads, kv, n, d, groups, n + window)
    kwargs = dict(window=window, gate_scale=0.7, scale=d**-0.5, gate=gate, sink=sink)
    out = flex_soft_focus(q, k, v, log_g, **kwargs)
    ref = reference_focus(q, k, v, log_g, top_k=None, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gate", ["log", "sigmoid"])
@pytest.mark.parametrize("b, heads, kv, n, d, groups, window, sink", SOFT_CASES[:4])
def test_gate_score_mod_gradients_equal_dense_reference(
    b, heads, kv, n, d, groups, window, sink, gate
):
    """Values and gradients (q, k, v, log g) of attention with gate_score_mod on dense grids."""
    q, k, v, log_g, gen = soft_inputs(b, heads, kv, n, d, groups, n * window)
    for t in (q, k, v, log_g):
        t.requires_grad_()
    kwargs = dict(window=window, gate_scale=0.7, scale=d**-0.5, gate=gate, sink=sink)
    score_mod = gate_score_mod(log_g.exp(), window, kwargs["gate_scale"], gate, sink)
    rep = heads // kv
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * kwargs["scale"]
    index = [
        torch.arange(size).view([-1 if i == dim else 1 for i in range(4)])
        for dim, size in enumerate(scores.shape)
    ]
    scores = score_mod(scores, *index).masked_fill(index[3] > index[2], float("-inf"))
    out = scores.softmax(-1) @ v.repeat_interleave(rep, 1)
    ref = reference_focus(q, k, v, log_g, top_k=None, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v, log_g), cotangent)
    ref_grads = torch.autograd.grad(ref, (q, k, v, log_g), cotangent)
    for name, got, want in zip("qkvg", grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("n", [1, 100, 128, 300, 513])
@pytest.mark.parametrize("window", [None, 1, 5, 128, 200])
def test_causal_block_mask_is_exact(n, window):
    """Blocks present == create_block_mask's (which evaluates every pair); a block marked full
    holds only kept pairs (FlexAttention skips the mask there)."""
    w = n if window is None else window
    ours = causal_block_mask(n, torch.device("cpu"), window)
    ref = create_block_mask(
        lambda b, h, q, kv: (q >= kv) & (q - kv < w), None, None, n, n, device="cpu"
    )
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert ours.seq_lengths == (n, n)
    pos = torch.arange(n)
    kept = (pos[:, None] >= pos) & (pos[:, None] - pos < w)
    block = ours.BLOCK_SIZE[0]
    for i in range(ours.full_kv_num_blocks.shape[-1]):
        for j in ours.full_kv_indices[0, 0, i, : int(ours.full_kv_num_blocks[0, 0, i])].tolist():
            assert kept[i * block : (i + 1) * block, j * block : (j + 1) * block].all(), (i, j)


def _packed_starts(b, n, gen, mean_length):
    """doc_start [b, n] of documents of random lengths (about `mean_length`)."""
    starts = torch.rand(b, n, generator=gen) < 1 / mean_length
    starts[:, 0] = True
    return torch.cummax(torch.where(starts, torch.arange(n), 0), dim=1).values


@pytest.mark.parametrize("n", [1, 100, 300, 513])
@pytest.mark.parametrize("mean_length", [10, 150, 10_000])
def test_document_block_mask_is_exact(n, mean_length):
    """Packed documents: the blocks present are create_block_mask's for the causal pairs within
    documents, one mask per sequence (blocks of other documents skipped); whole blocks hold only
    kept pairs."""
    doc_start = _packed_starts(3, n, torch.Generator().manual_seed(n + mean_length), mean_length)
    ours = document_block_mask(doc_start)
    ref = create_block_mask(
        lambda b, h, q, kv: (q >= kv) & (kv >= doc_start[b, q]), 3, None, n, n, device="cpu"
    )
    assert torch.equal(ours.to_dense(), ref.to_dense())
    pos = torch.arange(n)
    kept = (pos[:, None] >= pos) & (pos >= doc_start[..., None])
    for b in range(3):
        full = ours.full_kv_indices[b, 0]
        for i in range(full.shape[0]):
            for j in full[i, : int(ours.full_kv_num_blocks[b, 0, i])].tolist():
                assert kept[b, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].all()


@pytest.mark.parametrize(
    "n, groups, top_k, how",
    [
        (300, 4, 2, "random"),
        (700, 8, 3, "random"),
        (400, 4, 2, "lonely"),
        (129, 1, 1, "random"),
        (1000, 1, 1, "random"),
        (500, 8, 5, "coarse"),
    ],
)
@pytest.mark.parametrize("packed", [False, True])
def test_range_block_mask_covers_every_kept_pair(n, groups, top_k, how, packed):
    """The bucket part's ranges, as the sparse path makes them: no kept pair in a skipped block,
    only kept pairs in a block marked whole. `packed`: documents of 1-200 tokens."""
    gen = torch.Generator().manual_seed(n)
    groups_q = Routing.of(assignments(2, n, groups, gen, how)).top(top_k)
    doc_start = _packed_starts(2, n, gen, 50) if packed else torch.zeros(2, n, dtype=torch.long)
    documents = int(segments(doc_start)[-1, -1]) + 1
    route = _route(groups_q, doc_start, groups, documents, 0, 1, 0, blocks=True)
    assert len(route.ranges) == top_k
    for slot, ranged in enumerate(route.ranges):
        lo, hi = ranged.lo, ranged.hi
        mask = range_block_mask(lo, hi, 2 * n, indices=ranged.blocks)
        keys = torch.arange(2 * n)
        kept = (keys >= lo[:, None]) & (keys < hi[:, None])
        present = mask.to_dense()[0, 0].repeat_interleave(128, 0).repeat_interleave(128, 1)
        assert not (kept & ~present[: 2 * n, : 2 * n].bool()).any(), slot
        assert mask.seq_lengths == (2 * n, 2 * n)
        whole = 0
        for i in range(mask.full_kv_num_blocks.shape[-1]):
            for j in mask.full_kv_indices[0, 0, i, : int(mask.full_kv_num_blocks[0, 0, i])]:
                assert kept[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].all(), (slot, i, j)
                whole += 1
        # 2000 tokens in one group, one document: most blocks are whole
        assert whole > 0 or n < 1000 or packed


@pytest.mark.parametrize("batch", [1, 3])
def test_block_indices_by_query_block_are_torchs_transposition(batch):
    """The query-block side of flex.block_indices (FlexAttention's backward reads it) equals what
    BlockMask.from_kv_blocks transposes from the key-block side."""
    from torch.nn.attention.flex_attention import BlockMask

    gen = torch.Generator().manual_seed(batch)
    some = torch.rand(batch, 7, 5, generator=gen) < 0.6
    every = some & (torch.rand(batch, 7, 5, generator=gen) < 0.5)
    indices = block_indices(some, every)
    ref = BlockMask.from_kv_blocks(*indices[:4], BLOCK_SIZE=128, seq_lengths=(7 * 128, 5 * 128))
    for got, name in zip(indices[4:], ("q_num_blocks", "q_indices")):
        want = getattr(ref, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    for got, name in zip(indices[6:], ("full_q_num_blocks", "full_q_indices")):
        assert torch.equal(got, getattr(ref, name)), name


@pytest.mark.parametrize(
    "causal, mask_shape", [(True, None), (False, None), (True, "keys"), (False, "pairs")]
)
def test_flex_attention_with_lse_equals_cpu_kernel(causal, mask_shape):
    gen = torch.Generator().manual_seed(3)
    b, heads, kv, n, d = 3, 4, 2, 150, 16
    q = torch.randn(b, heads, n, d, generator=gen)
    k, v = (torch.randn(b, kv, n, d, generator=gen) for _ in range(2))
    mask = None
    if mask_shape is not None:
        shape = (b, 1, 1, n) if mask_shape == "keys" else (b, 1, n, n)
        mask = torch.zeros(shape).masked_fill_(
            torch.rand(shape, generator=gen) < 0.5, float("-inf")
        )
        mask[0, ..., :] = float("-inf")  # a sequence where no query has a key
    out, lse = flex_attention_with_lse(q, k, v, 0.25, causal, mask)
    want_out, want_lse = attention_with_lse(q, k, v, 0.25, causal, mask)
    has_key = torch.isfinite(lse)
    if mask is not None:
        keys = mask.isfinite().expand(b, heads, n, n)
        if causal:
            keys = keys.tril()
        torch.testing.assert_close(has_key, keys.any(-1))  # the CPU kernel says lse 0 there
    torch.testing.assert_close(lse[has_key], want_lse[has_key], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)


def test_soft_gate_kernel_choice(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def choice(*args, **kwargs):
        return kernels.soft_gate(*args, **kwargs).name

    assert choice("auto", cpu) == "chunked"
    assert choice("chunked", cuda) == "chunked"
    assert choice("auto", cuda, dropout_p=0.1) == "chunked"
    for fused in ("flex", "triton"):
        with pytest.raises(ValueError, match="needs --attention-dropout 0"):
            choice(fused, cuda, dropout_p=0.1)
    with pytest.raises(ValueError, match="unknown Focus kernel"):
        choice("fused", cpu)
    monkeypatch.setattr(kernels, "has_triton", lambda: True)
    assert choice("auto", cuda) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        choice("triton", cpu)
    monkeypatch.setattr(kernels, "has_triton", lambda: False)
    assert choice("auto", cuda) == "flex"
    with pytest.raises(ValueError, match="needs Triton"):
        choice("triton", cuda)
    # what each answers: dropout only by chunks, no FlexAttention backward on the CPU
    assert [kernels.soft_gate(k, cpu).dropout for k in ("chunked", "flex")] == [True, False]
    assert not kernels.soft_gate("flex", cpu).backward and kernels.soft_gate("flex", cuda).backward


def test_compiled_flex_takes_a_new_gate_closure_without_recompiling():
    """The GPU kernel is compiled once per shape: each call builds a new score_mod closure over
    new assignments, which must not count against dynamo's recompile limit (past it, calls fall
    back to eager FlexAttention and its n x n scores). Compiled here for the CPU, forward only."""
    from megatron_focus.model.kernels import flex

    compiled = flex._compiled_flex()
    assert torch._dynamo.config.recompile_limit >= platform.RECOMPILE_LIMIT
    mask = causal_block_mask(256, torch.device("cpu"))
    for seed in range(2):
        q, k, v, log_g, _ = soft_inputs(1, 2, 2, 256, 16, 4, seed)
        score_mod = gate_score_mod(log_g.exp(), 32, 0.7)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=seed > 0):
            out = compiled(q, k, v, score_mod=score_mod, block_mask=mask, scale=0.25)
        ref = reference_focus(q, k, v, log_g, window=32, gate_scale=0.7, top_k=None, scale=0.25)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# Inductor's own checks, traced on the CPU. A GPU compiles every FlexAttention call; the lowering
# of the backward first hands the score_mod's joint graph to `validate_joint_graph`, which refuses
# a gradient-requiring capture indexed more than once. Tracing through AOTAutograd on the CPU
# builds that same joint graph (FlexAttention refuses a CPU backward only at its entry check,
# which the trace skips here: the backward graph is inspected, not run).


def _flex_backward_joint_graphs(fn, *args):
    """The joint graphs of every flex_attention_backward that `fn(*args).sum()`'s backward
    traces, through AOTAutograd."""
    from torch._dynamo.backends.common import aot_autograd
    from torch.nn.attention import flex_attention as flex_module

    graphs = []

    def backward_compiler(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target is torch.ops.higher_order.flex_attention_backward:
                graphs.append(gm.get_submodule(node.args[8].target).graph)
        raise _Traced  # the graph is what is wanted; running it is FlexAttention's CPU refusal

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=backward_compiler)
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flex_module, "_validate_device", lambda *tensors: None)
        out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
        with pytest.raises(_Traced):
            out.sum().backward()
    return graphs


class _Traced(Exception):
    pass


@pytest.mark.parametrize("gate", ["log", "sigmoid"])
@pytest.mark.parametrize("groups, sink, packed", [(1, 0, False), (4, 0, False), (4, 2, True)])
def test_soft_gate_passes_inductors_backward_check(gate, groups, sink, packed):
    """Fails with a score_mod that reads one captured g at both q_idx and kv_idx."""
    from torch._inductor.kernel.flex.flex_attention import validate_joint_graph

    q, k, v, log_g, gen = soft_inputs(1, 4, 2, 256, 16, groups, groups)
    for t in (q, k, v, log_g):
        t.requires_grad_()
    doc_start = _packed_starts(1, 256, gen, 60) if packed else None

    def soft(q, k, v, log_g):
        return flex_soft_focus(
            q,
            k,
            v,
            log_g,
            window=16,
            gate_scale=0.7,
            scale=0.25,
            gate=gate,
            sink=sink,
            doc_start=doc_start,
        )

    graphs = _flex_backward_joint_graphs(soft, q, k, v, log_g)
    assert len(graphs) == 1
    validate_joint_graph(graphs[0])


@pytest.mark.slow
@pytest.mark.parametrize("gate, packed", [("log", True), ("sigmoid", False)])
def test_soft_gate_compiled_by_cpu_inductor_equals_eager(gate, packed, monkeypatch):
    """The forward as inductor compiles it (the CPU backend compiles FlexAttention's forward
    without the log-sum-exp) equals the eager evaluation of the same score_mod and block mask."""
    from megatron_focus.model.kernels import flex

    q, k, v, log_g, gen = soft_inputs(2, 4, 2, 300, 16, 4, 5)
    kwargs = dict(window=16, gate_scale=0.7, scale=0.25, gate=gate, sink=2)
    if packed:
        kwargs["doc_start"] = _packed_starts(2, 300, gen, 60)
    eager = flex_soft_focus(q, k, v, log_g, **kwargs)
    monkeypatch.setattr(flex, "compiled", lambda device: True)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = flex_soft_focus(q, k, v, log_g, **kwargs)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
