"""Packed documents (`--reset-attention-mask`) under Focus: each document of a packed sequence
computes what it computes alone, in every path (the Sinkhorn, the soft gate, the hard rule with
gradients, the sparse dispatch, FlexAttention, the statistics). The reference is each document
run alone through the same functions, whose single-document results the other tests check
against dense references."""

import math

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from megatron_focus.model.documents import document_starts
from megatron_focus.model.focus.focus import group_stats
from megatron_focus.model.focus.focus_gate import focus_attention
from megatron_focus.model.focus.focus_sparse import sparse_focus_attention
from megatron_focus.model.focus.groups import Routing
from megatron_focus.model.focus.sinkhorn import causal_sinkhorn
from megatron_focus.model.kernels import kernels
from megatron_focus.model.kernels.flex import flex_soft_focus

# three packed rows of 64 tokens: documents of one token, shorter and longer than the window,
# and a row that is one document
LENGTHS = [[7, 1, 30, 12, 14], [64], [20, 3, 41]]
N = 64


def starts_of(lengths):
    """[rows, n] document start of every position, from each row's document lengths."""
    rows = []
    for row in lengths:
        starts, at = [], 0
        for length in row:
            starts += [at] * length
            at += length
        rows.append(starts)
    return torch.tensor(rows)


def documents():
    """(row, first, end) of every document."""
    for row, lengths in enumerate(LENGTHS):
        at = 0
        for length in lengths:
            yield row, at, at + length
            at += length


def test_document_starts_read_megatrons_mask():
    eod = 9
    tokens = torch.tensor([1, 2, eod, 3, eod, eod, 4, 5, 6, 7, 8, 1])
    mask, _, _ = _get_ltor_masks_and_position_ids(tokens, eod, True, True, False, True)
    starts = document_starts(mask[None], batch=2)
    expected = torch.tensor([0, 0, 0, 3, 3, 5, 6, 6, 6, 6, 6, 6])
    assert torch.equal(starts, expected.expand(2, -1))
    causal, _, _ = _get_ltor_masks_and_position_ids(tokens, eod, True, False, False, True)
    assert not document_starts(causal[None], batch=1).any()


def test_a_mask_is_read_once_until_it_changes():
    """The layers of a forward share the mask: read once; changed in place, read again."""
    tokens = torch.tensor([1, 2, 9, 3, 4, 9, 5])
    mask, _, _ = _get_ltor_masks_and_position_ids(tokens, 9, True, True, False, True)
    mask = mask[None]
    first = document_starts(mask, batch=1)
    assert document_starts(mask, batch=1) is first
    assert document_starts(mask, batch=2).shape == (2, 7)
    mask[..., 0, 1] = False  # token 0 sees token 1: no longer causal
    with pytest.raises(ValueError, match="per-document causal"):
        document_starts(mask, batch=2)


@pytest.mark.parametrize("which", ["window", "padding", "not causal", "not square"])
def test_other_masks_are_refused(which):
    n = 10
    positions = torch.arange(n)
    removed = positions[None, :] > positions[:, None]  # Megatron's causal mask: True = removed
    if which == "window":
        removed |= positions[:, None] - positions[None, :] > 3
    elif which == "padding":
        removed[:, 2] = True
    elif which == "not causal":
        removed[:] = False
    else:
        removed = removed[:6]
    with pytest.raises(ValueError, match="per-document causal"):
        document_starts(removed[None, None], batch=1)


def test_sinkhorn_restarts_at_each_document():
    """Large scores: masses down to e^-60, which a difference of running totals would lose."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(len(LENGTHS), N, 8, generator=gen) * 10
    packed = causal_sinkhorn(scores, 10, starts_of(LENGTHS))
    for row, first, end in documents():
        alone = causal_sinkhorn(scores[row : row + 1, first:end], 10)
        torch.testing.assert_close(packed[row, first:end], alone[0], rtol=1e-5, atol=1e-5)
    one_document = torch.zeros(len(LENGTHS), N, dtype=torch.long)
    torch.testing.assert_close(
        causal_sinkhorn(scores, 10, one_document), causal_sinkhorn(scores, 10)
    )


WINDOW, SINK, TOP_K, SCALE = 5, 2, 2, 8**-0.5


def chunked(gate="log", top_k=None):
    """focus_attention with the soft rule (`top_k` None) or the hard one, by chunks of 16."""

    def attend(q, k, v, routing):
        return focus_attention(
            q,
            k,
            v,
            routing,
            window=WINDOW,
            gate_scale=1.5,
            top_k=top_k,
            chunk_size=16,
            scale=SCALE,
            gate=gate,
            sink=SINK,
        )

    return attend


def sparse(q, k, v, routing):
    return sparse_focus_attention(
        q, k, v, routing, window=WINDOW, top_k=TOP_K, scale=SCALE, sink=SINK
    )


def flex(q, k, v, routing):
    return flex_soft_focus(
        q,
        k,
        v,
        routing.log_g,
        window=WINDOW,
        gate_scale=1.5,
        scale=SCALE,
        sink=SINK,
        doc_start=routing.doc_start,
    )


PATHS = {  # name: (attention, with gradients, kernel of the log-sum-exp calls)
    "soft gate": (chunked(), True, None),
    "sigmoid gate": (chunked("sigmoid"), True, None),
    "hard rule, masked": (chunked(top_k=TOP_K), True, None),
    "sparse dispatch": (sparse, True, kernels.CPU_FLASH_LSE),
    "sparse dispatch, FlexAttention": (sparse, False, kernels.FLEX_LSE),
    "soft gate, FlexAttention": (flex, False, None),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_each_document_attends_as_alone(monkeypatch, path):
    attend, grads, kernel = PATHS[path]
    if kernel is not None:
        monkeypatch.setattr(kernels, "lse_attention", lambda device: kernel)
    gen = torch.Generator().manual_seed(1)
    b, heads, kv, d, groups = len(LENGTHS), 4, 2, 8, 4
    q = torch.randn(b, heads, N, d, generator=gen, requires_grad=grads)
    k, v = (torch.randn(b, kv, N, d, generator=gen, requires_grad=grads) for _ in range(2))
    doc_start = starts_of(LENGTHS)
    log_g = causal_sinkhorn(torch.randn(b, N, groups, generator=gen) * 3, 5, doc_start)
    log_g.requires_grad_(grads)
    weights = torch.randn(b, heads, N, d, generator=gen)
    leaves = (q, k, v, log_g)
    with torch.set_grad_enabled(grads):
        packed = attend(q, k, v, Routing.of(log_g, doc_start))
        alone = torch.zeros_like(packed)
        for row, first, end in documents():
            part = (slice(row, row + 1), slice(None), slice(first, end))
            alone[part] = attend(
                q[part], k[part], v[part], Routing.of(log_g[row : row + 1, first:end])
            )
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    if grads:
        # (the hard rule sends no gradient to the assignments: None for both)
        packed_grads = torch.autograd.grad((packed * weights).sum(), leaves, allow_unused=True)
        alone_grads = torch.autograd.grad((alone * weights).sum(), leaves, allow_unused=True)
        for name, ours, reference in zip("q k v log_g".split(), packed_grads, alone_grads):
            if reference is None:
                assert ours is None, name
                continue
            torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5, msg=name)


def test_pairs_kept_counts_within_each_document():
    gen = torch.Generator().manual_seed(2)
    doc_start = starts_of(LENGTHS)
    log_g = causal_sinkhorn(torch.randn(len(LENGTHS), N, 4, generator=gen) * 3, 5, doc_start)
    packed = group_stats(Routing.of(log_g, doc_start), TOP_K, WINDOW, SINK)["pairs-kept"]
    kept = pairs = 0
    for row, first, end in documents():
        alone = group_stats(Routing.of(log_g[row : row + 1, first:end]), TOP_K, WINDOW, SINK)
        length_pairs = (end - first) * (end - first + 1) / 2
        kept += float(alone["pairs-kept"]) * length_pairs
        pairs += length_pairs
    assert math.isclose(float(packed), kept / pairs, rel_tol=1e-6)
