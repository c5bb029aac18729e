"""routing_quality.kept_mass: the dense attention's probability mass the hard rule keeps, against
a dense fp64 reference that builds the probabilities and the rule's mask pair by pair."""

import pytest
import torch

from megatron_focus.model.focus.groups import Routing
from megatron_focus.model.focus.routing_quality import kept_mass

from reference import assignments, reference_ranking

B, H, HK, N, D, K = 2, 4, 2, 48, 8, 4
SCALE = D**-0.5


def inputs(seed=0, how="random"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(B, HK, N, D, generator=gen, dtype=torch.float64) * 2
    return q, k, assignments(B, N, K, gen, how).double()


def starts(lengths):
    return torch.tensor(
        [[sum(row[:d]) for d, n in enumerate(row) for _ in range(n)] for row in lengths]
    )


def reference_mass(q, k, log_g, window, sink, doc_start, nq):
    """[K]: the mean over heads and the last nq queries beyond the window (in their document)."""
    b, h, n, _ = q.shape
    kk = k.repeat_interleave(h // k.shape[1], 1)
    ranked = reference_ranking(log_g).tolist()
    first = torch.zeros(b, n, dtype=torch.long) if doc_start is None else doc_start
    out = []
    for top_k in range(1, K + 1):
        masses = []
        for bi in range(b):
            for i in range(n - nq, n):
                if i - first[bi, i] < window:
                    continue
                visible = torch.zeros(n, dtype=torch.bool)
                keep = torch.zeros(n, dtype=torch.bool)
                for j in range(first[bi, i], i + 1):
                    visible[j] = True
                    keep[j] = (
                        i - j < window
                        or j - first[bi, j] < sink
                        or ranked[bi][j][0] in ranked[bi][i][:top_k]
                    )
                for hi in range(h):
                    scores = (q[bi, hi, i] @ kk[bi, hi].T) * SCALE
                    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
                    masses.append(float(p[keep].sum()))
        out.append(sum(masses) / len(masses) if masses else 1.0)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize(
    "window, sink, lengths, nq, how",
    [
        (4, 0, None, N, "random"),
        (6, 2, None, 20, "coarse"),  # ties in the ranking; a sample of the last queries
        (5, 1, [[7, 1, 30, 10], [48]], N, "duplicated"),  # packed documents
    ],
)
def test_kept_mass_matches_a_dense_reference(window, sink, lengths, nq, how):
    q, k, log_g = inputs(how=how)
    doc_start = None if lengths is None else starts(lengths)
    routing = Routing.of(log_g, doc_start)
    # a chunk smaller than the queries: the chunks' sums add up
    got = kept_mass(
        q[:, :, N - nq :], k, routing, window, SCALE, sink, chunk_elements=B * H * N * 7
    )
    want = reference_mass(q, k, log_g, window, sink, doc_start, nq)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert (got >= 0).all() and (got <= 1 + 1e-12).all()
    assert (got.diff() >= -1e-12).all()  # a larger top-k keeps a superset
    assert abs(float(got[-1]) - 1.0) < 1e-12  # top-k = K: every key's group is in the top-K
    assert float(got[0]) < 1.0


def test_a_window_over_the_whole_sequence_keeps_everything():
    q, k, log_g = inputs()
    got = kept_mass(q, k, Routing.of(log_g), N, SCALE)
    assert torch.equal(got, torch.ones(K, dtype=torch.float64))


def test_low_precision_inputs_are_measured_in_fp32():
    q, k, log_g = inputs(seed=1)
    got = kept_mass(q.bfloat16(), k.bfloat16(), Routing.of(log_g.float()), 4, SCALE, sink=1)
    assert got.dtype == torch.float32
    want = kept_mass(q.bfloat16().double(), k.bfloat16().double(), Routing.of(log_g), 4, SCALE, 1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_layers_statistic_is_kept_mass_on_its_sample(single_process):
    """`recording_statistics`: each Focus layer's `kept-mass` at its top-k is kept_mass on the
    last `mass_sample` queries of the first sequence, of the q and k (GQA, RoPE, documents) the
    layer attends."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from megatron_focus import platform
    from megatron_focus.model.documents import document_starts
    from megatron_focus.model.focus.focus import (
        FocusAttention,
        focus_statistics,
        recording_statistics,
    )
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args

    platform.manual_seed(0)
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    argv += ["--group-query-attention", "--num-query-groups", "2", "--seq-length", "40"]
    argv += ["--position-embedding-type", "rope", "--attention", "focus", "--focus-window", "3"]
    argv += ["--focus-groups", "4", "--focus-top-k", "2", "--focus-sink-tokens", "1"]
    model = build_model(parse_args(argv), 64).eval()
    tokens = torch.randint(1, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    tokens[0, [9, 30]] = tokens[1, 20] = 0  # packed documents, different in each sequence
    masks = [_get_ltor_masks_and_position_ids(t, 0, True, True, False, True) for t in tokens]
    mask = torch.stack([m[0] for m in masks])
    positions = torch.stack([m[2] for m in masks])
    seen = {}
    for layer in (m for m in model.modules() if isinstance(m, FocusAttention)):
        layer.register_forward_pre_hook(lambda m, args: seen.setdefault(m, args))
    with torch.no_grad(), recording_statistics(model, mass_sample=17):
        model(tokens, positions, mask)
    stats = focus_statistics(model)
    assert len(seen) == 2
    for layer, (query, key, _, mask, hidden) in seen.items():
        routing = layer.router(hidden, document_starts(mask, 2))
        want = kept_mass(
            query[-17:, :1].permute(1, 2, 0, 3),
            key[:, :1].permute(1, 2, 0, 3),
            Routing(routing.log_g[:1], routing.groups[:1], routing.doc_start[:1]),
            3,
            layer.softmax_scale,
            sink=1,
        )[1]
        got = stats[f"focus/layer{layer.layer_number:02d}/kept-mass"]
        torch.testing.assert_close(got, want)
        assert 0 < float(got) < 1
