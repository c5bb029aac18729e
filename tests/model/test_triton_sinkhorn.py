"""The causal Sinkhorn's Triton kernels (model/kernels/triton_sinkhorn.py) under Triton's
interpreter on CPU tensors, against the PyTorch version (sinkhorn.causal_sinkhorn, itself tested
for causality and balance in test_focus.py and for documents in test_documents.py): values and
the gradient of the scores, in float64 for the reference; blocks of 16 tokens and spans of two
blocks (one program each, carried from launch to launch) here, so lengths cross both."""

import pytest
import torch
from interpreted import gpu_launch_shapes, skip_unless_kernels_run

from megatron_focus.model.focus.sinkhorn import causal_sinkhorn

skip_unless_kernels_run()
triton_sinkhorn = pytest.importorskip("megatron_focus.model.kernels.triton_sinkhorn")


def starts(lengths, b):
    firsts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
    return firsts.repeat_interleave(torch.tensor(lengths)).expand(b, sum(lengths)).contiguous()


@pytest.mark.parametrize(
    "b, n, groups, iters, docs, spread",
    [
        (2, 37, 8, 10, None, 3.0),  # n off the block
        (1, 16, 4, 3, None, 1.0),  # one block
        (2, 50, 3, 5, [9, 1, 24, 16], 3.0),  # documents across blocks, one of one token
        (1, 40, 1, 2, None, 1.0),  # K = 1
        (1, 33, 4, 0, [20, 13], 1.0),  # no iteration: a log-softmax
        (2, 45, 8, 10, [30, 15], 40.0),  # skewed scores: masses far below float32's range
        (1, 150, 8, 10, [100, 50], 3.0),  # (with a GPU's 64-token blocks)
        (2, 130, 4, 4, [3, 90, 37], 3.0),  # a document across four spans, each way
        (3, 100, 2, 6, None, 3.0),  # spans carried the whole sequence
    ],
)
def test_kernel_equals_the_pytorch_sinkhorn(b, n, groups, iters, docs, spread, monkeypatch):
    if n > 100:
        gpu_launch_shapes(monkeypatch, triton_sinkhorn)
    gen = torch.Generator().manual_seed(n + groups)
    scores = (torch.randn(b, n, groups, generator=gen) * spread).requires_grad_()
    doc_start = None if docs is None else starts(docs, b)
    got = triton_sinkhorn.triton_causal_sinkhorn(scores, iters, doc_start)
    wide = scores.detach().double().requires_grad_()
    want = causal_sinkhorn(wide, iters, doc_start)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn(b, n, groups, generator=gen)
    (ours,) = torch.autograd.grad(got, scores, cotangent)
    (theirs,) = torch.autograd.grad(want, wide, cotangent.double())
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-5)
