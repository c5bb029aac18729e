"""routing_quality.kept_mass: the dense attention's probability mass the hard rule keeps, against
a dense fp64 reference that builds the probabilities and the rule's mask pair by pair."""

import pytest
import torch

from megatron_focus.model.groups import Routing
from megatron_focus.model.routing_quality import kept_mass

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
