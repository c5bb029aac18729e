"""Multi-query associative recall (MQAR), a synthetic task that tells whether an attention keeps
the distant pairs that matter (`pretrain_gpt.py --mqar`, `tools/eval_mqar.py`).

A sequence of L tokens opens with P key-value pairs, `k_1 v_1 ... k_P v_P`; the rest is a filler
token, except that every key is asked once more, in random order at random later positions, each
followed by its value. The loss counts only the predictions of those values (the token after a
queried key), so the task is recall: from a query, attend back to its pair, at least
`min_distance` tokens away (beyond a local window by construction). Zoology's MQAR (Arora et al.,
2023) with the queries spread over the sequence instead of following the pairs at once.

Vocabulary of V ids: 0 the filler, keys 1 .. V/2 - 1, values V/2 .. V - 1. Sample i of a split is
a pure function of (seed, split, i): datasets of any length, resumable at any sample.
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


def check_mqar(seq_length: int, pairs: int, vocab_size: int, min_distance: int) -> None:
    """Refuses settings that cannot make a sequence, before anything is built."""
    if pairs < 1 or vocab_size < 2 * pairs + 2:
        raise ValueError(f"--mqar-pairs {pairs} needs --mqar-vocab-size >= {2 * pairs + 2} "
                         f"(distinct keys and values), not {vocab_size}")
    room = seq_length - 2 * pairs - min_distance  # positions where a query and its value fit
    if min_distance < 1 or room < 2 * pairs:
        raise ValueError(
            f"--seq-length {seq_length} holds {pairs} pairs, then {pairs} queries at least "
            f"--mqar-min-distance {min_distance} tokens after them: it needs --seq-length >= "
            f"{4 * pairs + min_distance}")


class MQARDataset(Dataset):
    """`num_samples` MQAR sequences of `seq_length` tokens (GPTDataset's sample format)."""

    def __init__(self, num_samples: int, seq_length: int, pairs: int, vocab_size: int,
                 min_distance: int, seed: int, split: str = "train"):
        check_mqar(seq_length, pairs, vocab_size, min_distance)
        self.num_samples, self.seq_length, self.pairs = num_samples, seq_length, pairs
        self.vocab_size, self.min_distance = vocab_size, min_distance
        self.seed = (seed, SPLITS[split])

    def __len__(self) -> int:
        return self.num_samples

    def sequence(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(L + 1 tokens, the positions whose next token is a recalled value)."""
        rng = np.random.default_rng([*self.seed, index])
        p, half = self.pairs, self.vocab_size // 2
        keys = rng.choice(np.arange(1, half), size=p, replace=False)
        values = rng.integers(half, self.vocab_size, size=p)
        tokens = np.full(self.seq_length + 1, FILLER, dtype=np.int64)
        tokens[0:2 * p:2], tokens[1:2 * p:2] = keys, values
        # Query slots: pairs of positions (query, value) after the minimum distance, as many
        # non-overlapping ones as fit, P of them chosen at random, in increasing order.
        first = 2 * p + self.min_distance
        slots = np.sort(rng.choice((self.seq_length - first) // 2, size=p, replace=False))
        queries = first + 2 * slots
        order = rng.permutation(p)
        tokens[queries], tokens[queries + 1] = keys[order], values[order]
        return tokens, queries

    def __getitem__(self, index: int) -> dict:
        tokens, queries = self.sequence(index)
        loss_mask = torch.zeros(self.seq_length)
        loss_mask[queries] = 1.0
        text = torch.from_numpy(tokens)
        return {"tokens": text[:-1], "labels": text[1:], "loss_mask": loss_mask,
                "position_ids": torch.arange(self.seq_length)}
