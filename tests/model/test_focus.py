"""Focus: causal Sinkhorn, the pair rule, chunked attention vs a dense reference, model-level
checks."""

import math

import pytest
import torch

from megatron_focus.model.focus.focus import group_stats
from megatron_focus.model.focus.focus_gate import focus_attention
from megatron_focus.model.focus.groups import Routing, rank_groups
from megatron_focus.model.focus.sinkhorn import causal_sinkhorn

from reference import assignments, reference_focus, reference_ranking


def whole_sequence_sinkhorn(scores, iters):
    """The paper's Sinkhorn: each group's column normalised over *all* tokens (leaks the future)."""
    log_g = scores
    for _ in range(iters):
        log_g = log_g - torch.logsumexp(log_g, dim=-2, keepdim=True)
        log_g = torch.log_softmax(log_g, dim=-1)
    return log_g


def skewed_scores(n=2048, groups=8, seed=0):
    """Raw softmax sends >90% of tokens' argmax to group 0."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, groups, generator=g)
    scores[:, 0] += 3.0
    assert (scores.softmax(-1).argmax(-1) == 0).float().mean() > 0.9
    return scores


def test_sinkhorn_rows_are_distributions():
    log_g = causal_sinkhorn(torch.randn(3, 100, 8) * 5, 10)
    torch.testing.assert_close(log_g.exp().sum(-1), torch.ones(3, 100))


def test_sinkhorn_is_causal_and_the_papers_is_not():
    scores = skewed_scores()
    later = scores.clone()
    later[1000:] = torch.randn(scores.shape[0] - 1000, scores.shape[1]) * 5
    ours = causal_sinkhorn(scores, 10), causal_sinkhorn(later, 10)
    assert torch.equal(ours[0][:1000], ours[1][:1000])
    papers = whole_sequence_sinkhorn(scores, 10), whole_sequence_sinkhorn(later, 10)
    assert (papers[0][:1000].exp() - papers[1][:1000].exp()).abs().max() > 0.05


def test_sinkhorn_one_token_at_a_time_equals_full_sequence():
    scores = torch.randn(2, 64, 4) * 3
    full = causal_sinkhorn(scores, 10)
    for t in (1, 2, 17, 63):
        assert torch.equal(causal_sinkhorn(scores[:, :t], 10), full[:, :t])


def test_sinkhorn_balances_a_collapsed_assignment():
    """Bound tested: the largest group holds at most 1/K + 2% of the soft mass and of argmaxes."""
    log_g = causal_sinkhorn(skewed_scores(), 10)
    soft_share = log_g.exp().mean(0).max()
    argmax_share = torch.bincount(log_g.argmax(-1), minlength=8).max() / log_g.shape[0]
    assert soft_share < 1 / 8 + 0.02
    assert argmax_share < 1 / 8 + 0.02


@pytest.mark.parametrize("how", ["random", "uniform", "duplicated", "coarse"])
def test_groups_rank_ties_to_the_lowest_index(how):
    log_g = assignments(3, 50, 8, torch.Generator().manual_seed(0), how)
    assert torch.equal(rank_groups(log_g), reference_ranking(log_g))


def test_token_zero_is_uniform_and_ranks_its_groups_in_order():
    log_g = causal_sinkhorn(torch.randn(2, 10, 8) * 3, 10)
    assert torch.equal(log_g[:, 0], torch.full((2, 8), log_g[0, 0, 0].item()))
    assert torch.equal(rank_groups(log_g)[:, 0], torch.arange(8).expand(2, 8))


# --- the pair rule and the chunked attention, against the dense reference (tests/reference.py) ---

CASES = [  # (b, heads, kv groups, n, d, K, window, chunk, top_k, sink tokens)
    (2, 4, 4, 37, 8, 4, 5, 16, None, 0),  # n not a multiple of the chunk
    (1, 4, 2, 20, 8, 3, 64, 8, None, 0),  # n < w, GQA
    (2, 4, 1, 33, 16, 1, 4, 7, None, 0),  # K = 1, multi-query
    (1, 2, 2, 48, 8, 8, 6, 48, None, 0),  # one chunk
    (2, 4, 2, 37, 8, 4, 5, 16, 1, 0),  # hard, top-1
    (1, 4, 4, 40, 8, 4, 3, 9, 2, 0),  # hard, top-2
    (1, 2, 1, 30, 8, 4, 3, 8, 4, 0),  # hard, top-k = K: full causal attention
    (2, 4, 2, 45, 8, 4, 5, 16, None, 3),  # sinks, soft
    (1, 4, 4, 40, 8, 4, 3, 9, None, 12),  # more sinks than the window and the chunk
    (2, 4, 2, 37, 8, 4, 5, 16, 1, 4),  # sinks, hard
]


@pytest.mark.parametrize("b, heads, kv, n, d, groups, window, chunk, top_k, sink", CASES)
def test_chunked_focus_attention_matches_dense_reference(
    b, heads, kv, n, d, groups, window, chunk, top_k, sink
):
    gen = torch.Generator().manual_seed(n * groups + window)
    q = torch.randn(b, heads, n, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(b, kv, n, d, generator=gen, requires_grad=True) for _ in range(2))
    log_g = causal_sinkhorn(torch.randn(b, n, groups, generator=gen) * 3, 5).requires_grad_()
    kwargs = dict(window=window, gate_scale=0.7, top_k=top_k, scale=d**-0.5, sink=sink)
    out = focus_attention(q, k, v, Routing.of(log_g), chunk_size=chunk, **kwargs)
    ref = reference_focus(q, k, v, log_g, **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if top_k == groups:
        full = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=d**-0.5, enable_gqa=kv != heads
        )
        torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    if top_k is None:
        cotangent = torch.randn(out.shape, generator=gen)
        grads = torch.autograd.grad(out, (q, k, v, log_g), cotangent)
        ref_grads = torch.autograd.grad(ref, (q, k, v, log_g), cotangent)
        for name, got, want in zip("qkvg", grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "b, heads, kv, n, d, groups, window, chunk, top_k, sink", CASES[:3] + CASES[7:8]
)
def test_sigmoid_gate_matches_dense_reference(
    b, heads, kv, n, d, groups, window, chunk, top_k, sink
):
    """The paper's gate (an ablation option): values and gradients of the chunked path."""
    gen = torch.Generator().manual_seed(n + groups)
    q = torch.randn(b, heads, n, d, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (
        torch.randn(b, kv, n, d, dtype=torch.float64, generator=gen, requires_grad=True)
        for _ in range(2)
    )
    log_g = causal_sinkhorn(
        torch.randn(b, n, groups, generator=gen, dtype=torch.float64) * 3, 5
    ).requires_grad_()
    kwargs = dict(
        window=window, gate_scale=2.5, top_k=None, scale=d**-0.5, gate="sigmoid", sink=sink
    )
    out = focus_attention(
        q.float(), k.float(), v.float(), Routing.of(log_g.float()), chunk_size=chunk, **kwargs
    )
    ref = reference_focus(q, k, v, log_g, **kwargs)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    cotangent = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v, log_g), cotangent)
    ref_grads = torch.autograd.grad(ref, (q, k, v, log_g), cotangent.double())
    for name, got, want in zip("qkvg", grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="unknown Focus gate"):
        focus_attention(q, k, v, Routing.of(log_g), chunk_size=chunk, **{**kwargs, "gate": "tanh"})


def test_open_gate_is_standard_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 50, 8, generator=gen) for _ in range(3))
    log_g = causal_sinkhorn(torch.randn(2, 50, 4, generator=gen) * 3, 5)
    out = focus_attention(
        q,
        k,
        v,
        Routing.of(log_g),
        window=4,
        gate_scale=0.0,
        top_k=None,
        chunk_size=16,
        scale=8**-0.5,
    )
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=8**-0.5)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sink", [0, 3, 20])
def test_pairs_kept_statistic_counts_the_hard_rule(sink):
    gen = torch.Generator().manual_seed(1)
    n, groups, window, top_k = 60, 4, 7, 2
    log_g = causal_sinkhorn(torch.randn(3, n, groups, generator=gen) * 3, 5)
    tops = reference_ranking(log_g)[..., :top_k]
    kept = 0
    for bi in range(3):
        for i in range(n):
            for j in range(i + 1):
                kept += i - j < window or j < sink or bool((tops[bi, i] == tops[bi, j, 0]).any())
    stats = group_stats(Routing.of(log_g), top_k, window, sink)
    assert math.isclose(float(stats["pairs-kept"]), kept / (3 * n * (n + 1) / 2), rel_tol=1e-6)
    top1_share = torch.stack([torch.bincount(t, minlength=groups).max() for t in tops[..., 0]])
    assert math.isclose(
        float(stats["largest-group"]), float(top1_share.float().mean()) / n, rel_tol=1e-6
    )


def _saved_bytes(fn, *inputs):
    """Bytes of distinct storages autograd keeps for backward (what training memory holds)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def test_soft_gate_memory_is_linear_in_sequence_length():
    def run(n):
        q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for _ in range(3))
        log_g = causal_sinkhorn(torch.randn(1, n, 4), 3).requires_grad_()
        return _saved_bytes(
            lambda: focus_attention(
                q,
                k,
                v,
                Routing.of(log_g),
                window=16,
                gate_scale=1.0,
                top_k=None,
                chunk_size=64,
                scale=0.3,
            )
        )

    small, large = run(512), run(2048)
    assert large / small < 4.5  # 4x the tokens: linear; an n x n tensor would make it 16x
    assert large < 2048 * 2048 * 4  # less than one fp32 score matrix of one head


# --- model level ---

SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "48",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]
FOCUS = ["--focus-window", "4", "--focus-groups", "4", "--focus-chunk-size", "16"]


def _model(argv, vocab=256):
    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args

    platform.manual_seed(1234)
    return build_model(parse_args(argv), vocab).eval()


def _logits(model, tokens):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)


@pytest.mark.parametrize(
    "argv",
    [
        ["--attention", "standard"],
        ["--attention", "xsa"],
        ["--attention", "focus"] + FOCUS,
        ["--attention", "focus+xsa"] + FOCUS,
        ["--attention", "focus"] + FOCUS + ["--focus-attention-mode", "sparse"],
        ["--attention", "focus+xsa", "--position-embedding-type", "rope"]
        + FOCUS
        + ["--focus-attention-mode", "sparse", "--focus-top-k", "1"],
    ],
    ids=lambda a: "-".join(x.strip("-") for x in a[1:2] + a[-1:]),
)
def test_later_tokens_change_no_earlier_logit(single_process, argv):
    model = _model(SMALL + argv)
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 30:] = torch.randint(0, 256, (2, 18), generator=torch.Generator().manual_seed(1))
    before, after = _logits(model, tokens), _logits(model, changed)
    if "sparse" in argv:
        # Same pairs, but the packed buckets' length (hence the kernel's tiling and summation
        # order) depends on later tokens: equal up to float rounding, not bit for bit.
        torch.testing.assert_close(before[:, :30], after[:, :30], rtol=0, atol=1e-5)
    else:
        assert torch.equal(before[:, :30], after[:, :30])
    assert not torch.equal(before[:, 30:], after[:, 30:])


def test_focus_model_with_open_gate_equals_standard(single_process):
    standard = _model(SMALL)
    focus = _model(SMALL + ["--attention", "focus", "--focus-gate-scale", "0"] + FOCUS)
    missing, unexpected = focus.load_state_dict(standard.state_dict(), strict=False)
    assert unexpected == [] and all(".router." in name for name in missing)
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        _logits(focus, tokens), _logits(standard, tokens), rtol=1e-5, atol=1e-5
    )


def test_router_parameters_per_layer(single_process):
    model = _model(SMALL + ["--attention", "focus"] + FOCUS)
    router = {n: p.numel() for n, p in model.named_parameters() if ".router." in n}
    assert sum(router.values()) == 2 * (64 * 16 + 4 * 16)  # layers x (d x d_g + K x d_g)
