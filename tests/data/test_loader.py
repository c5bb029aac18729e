"""data/loader.py: each rank's micro-batches are the sample stream's, with or without workers,
and a loader started at a checkpoint's consumed-sample count continues the same stream."""

import pytest
import torch
from torch.utils.data import Dataset

from megatron_focus.data.loader import micro_batches


class Numbered(Dataset):
    """Sample i is {"tokens": [i, i, i]}: which samples a batch holds can be read off it."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return {"tokens": torch.full((3,), i)}


def stream(size, consumed, total, mbs, dp, rank, accumulation):
    """The definition (the trainer's, as Megatron's): global batch t is samples [t G, (t + 1) G),
    G = accumulation x mbs x dp, modulo the size; its micro-batch m on rank r takes the slice
    [(m dp + r) mbs, + mbs)."""
    g = accumulation * mbs * dp
    return [
        [(t * g + (m * dp + rank) * mbs + i) % size for i in range(mbs)]
        for t in range(consumed // g, total // g)
        for m in range(accumulation)
    ]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dp, rank", [(1, 0), (2, 0), (2, 1)])
def test_micro_batches_follow_the_sample_stream(workers, dp, rank):
    size, mbs, total = 37, 3, 3 * 2 * dp * 9  # 9 iterations of 2 micro-batches, past one epoch
    batches = list(micro_batches(Numbered(size), 0, total, mbs, dp, rank, workers))
    expected = stream(size, 0, total, mbs, dp, rank, accumulation=2)
    assert [b["tokens"][:, 0].tolist() for b in batches] == expected
    assert all(b["tokens"].shape == (mbs, 3) for b in batches)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_from_consumed_samples_continues_the_stream(workers):
    size, mbs, dp, total = 50, 2, 2, 2 * 2 * 20
    whole = [b["tokens"] for b in micro_batches(Numbered(size), 0, total, mbs, dp, 1, workers)]
    for consumed in (0, 8, 36):
        resumed = [
            b["tokens"] for b in micro_batches(Numbered(size), consumed, total, mbs, dp, 1, workers)
        ]
        skipped = consumed // (mbs * dp)
        assert len(resumed) == len(whole) - skipped
        assert all(torch.equal(a, b) for a, b in zip(resumed, whole[skipped:]))


def test_loader_leaves_the_global_rng_alone():
    """Dropout draws from the global RNG: starting a loader must not advance it (exact resume)."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    for workers in (0, 2):
        next(iter(micro_batches(Numbered(10), 0, 8, 2, 1, 0, workers)))
    assert torch.equal(torch.get_rng_state(), before)


def test_gpt_dataset_through_workers_equals_indexing(embedded_cache):
    """Megatron's GPTDataset read by worker processes: the samples per-sample indexing gives."""
    import os

    from megatron_focus.data.datasets import build_datasets
    from megatron_focus.data.embedded import ensure_embedded_data
    from megatron_focus.data.tokenizer import build_tokenizer

    prefix, model = ensure_embedded_data(embedded_cache)
    tokenizer = build_tokenizer("SentencePieceTokenizer", model)
    train, _, _ = build_datasets(
        [prefix], "98,2,0", 64, 1234, tokenizer, (64, 0, 0), os.path.join(embedded_cache, "indices")
    )
    for batch, indices in zip(
        micro_batches(train, 8, 40, 4, 1, 0, num_workers=2),
        stream(len(train), 8, 40, 4, 1, 0, accumulation=2),
    ):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            want = torch.stack([torch.as_tensor(train[i][key]) for i in indices])
            assert torch.equal(batch[key], want), key
