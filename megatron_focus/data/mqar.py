"""Multi-query associative recall (MQAR), a synthetic task that tells whether an attention keeps
the distant pairs that matter (`pretrain_gpt.py --mqar`, `tools/eval_ppl.py --mqar`).

A sequence of L tokens opens with a start token (the filler, as a BOS would be) and P key-value
pairs, `k_1 v_1 ... k_P v_P`; the rest is the filler, except for Q queries (Q >= P, default P)
at random later positions: every key once, in random order, then random keys again, each query
followed by its value. The loss counts only the predictions of those values (the token after a
queried key), so the task is recall: from a query, attend back to its pair, at least
`min_distance` tokens away (beyond a local window by construction). Zoology's MQAR (Arora et al.,
2023) with the queries spread over the sequence instead of following the pairs at once.

Vocabulary of V ids: 0 the filler, keys 1 .. V/2 - 1, values V/2 .. V - 1. Sample i of a split is
a pure function of (seed, split, i): datasets of any length, resumable at any sample.

`packed`: each pair is one token, an id for (key, value), so recall is one attention hop (a query
finds the token of its key and reads the value off it) instead of two (a previous-token head,
then the match): a tiny model learns it in minutes on a CPU, where the two-token form needs
training far beyond a CPU's budget. With n = floor(sqrt(V)) - 1 keys and as many values: ids
1 .. n are keys (queries), then n x n pair ids, then n value ids.
"""

import numpy as np
import torch
from torch.utils.data import Dataset

FILLER = 0
SPLITS = {"train": 0, "valid": 1, "test": 2}


class MQARVocabulary:
    """What the trainer needs of a tokenizer for MQAR: its size (no text, no end of document)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size


def check_mqar(
    seq_length: int,
    pairs: int,
    vocab_size: int,
    min_distance: int,
    queries: int = None,
    packed: bool = False,
) -> None:
    """Refuses settings that cannot make a sequence, before anything is built."""
    queries = pairs if queries is None else queries
    needed = (pairs + 1) ** 2 if packed else 2 * pairs + 2
    if pairs < 1 or vocab_size < needed:
        raise ValueError(
            f"--mqar-pairs {pairs} needs --mqar-vocab-size >= {needed} "
            f"(distinct keys{' x values' if packed else ' and values'}), not "
            f"{vocab_size}"
        )
    if queries < pairs:
        raise ValueError(f"--mqar-queries {queries}: at least one per pair ({pairs})")
    width = 1 if packed else 2  # tokens per pair
    room = seq_length - 1 - width * pairs - min_distance  # where a query and its value fit
    if min_distance < 1 or room < 2 * queries:
        raise ValueError(
            f"--seq-length {seq_length} holds {pairs} pairs, then {queries} queries at least "
            f"--mqar-min-distance {min_distance} tokens after them: it needs --seq-length >= "
            f"{1 + width * pairs + 2 * queries + min_distance}"
        )


class MQARDataset(Dataset):
    """`num_samples` MQAR sequences of `seq_length` tokens (GPTDataset's sample format)."""

    def __init__(
        self,
        num_samples: int,
        seq_length: int,
        pairs: int,
        vocab_size: int,
        min_distance: int,
        seed: int,
        split: str = "train",
        queries: int = None,
        packed: bool = False,
    ):
        check_mqar(seq_length, pairs, vocab_size, min_distance, queries, packed)
        self.num_samples, self.seq_length, self.pairs = num_samples, seq_length, pairs
        self.queries = pairs if queries is None else queries
        self.packed = packed
        self.vocab_size, self.min_distance = vocab_size, min_distance
        self.seed = (seed, SPLITS[split])

    def __len__(self) -> int:
        return self.num_samples

    def sequence(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(L + 1 tokens, the positions whose next token is a recalled value)."""
        rng = np.random.default_rng([*self.seed, index])
        p = self.pairs
        tokens = np.full(self.seq_length + 1, FILLER, dtype=np.int64)
        if self.packed:
            n = int(np.sqrt(self.vocab_size)) - 1
            keys = rng.choice(np.arange(1, n + 1), size=p, replace=False)
            choice = rng.integers(0, n, size=p)
            tokens[1 : p + 1] = n + 1 + (keys - 1) * n + choice  # the (key, value) ids
            values = n + 1 + n * n + choice
        else:
            half = self.vocab_size // 2
            keys = rng.choice(np.arange(1, half), size=p, replace=False)
            values = rng.integers(half, self.vocab_size, size=p)
            tokens[1 : 2 * p + 1 : 2], tokens[2 : 2 * p + 2 : 2] = keys, values
        # Query slots: pairs of positions (query, value) after the minimum distance, as many
        # non-overlapping ones as fit, Q of them chosen at random, in increasing order.
        first = 1 + (1 if self.packed else 2) * p + self.min_distance
        slots = np.sort(
            rng.choice((self.seq_length - first) // 2, size=self.queries, replace=False)
        )
        queries = first + 2 * slots
        order = np.concatenate([rng.permutation(p), rng.integers(0, p, self.queries - p)])
        tokens[queries], tokens[queries + 1] = keys[order], values[order]
        return tokens, queries

    def __getitem__(self, index: int) -> dict:
        tokens, queries = self.sequence(index)
        loss_mask = torch.zeros(self.seq_length)
        loss_mask[queries] = 1.0
        text = torch.from_numpy(tokens)
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": loss_mask,
            "position_ids": torch.arange(self.seq_length),
        }
