"""Documents packed in one sequence (`--reset-attention-mask`), as Focus sees them.

Megatron-Core's dataset marks the documents of a packed sequence in the attention mask it builds
(True where a pair is removed: every pair across documents, every future pair). Focus needs them
as one number per token, the position where its document starts: its Sinkhorn restarts there,
its window, sinks and groups count from there, and no pair crosses it. Each document then
computes exactly what it computes alone.
"""

import weakref
from typing import Optional

import torch

# Every Focus layer of a forward (and its recompute) gets the same mask: it is read once, and
# read again only when another mask, or this one changed in place, comes. (A weak reference to
# the mask, its version and the batch size, the starts.)
_last_read = (lambda: None, None, None)


def document_starts(
    mask: torch.Tensor, batch: int, rows: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """[b, n] position of each token's document start, from Megatron's mask [b or 1, 1, n, n].

    `rows`: the positions of the mask's rows when they are some of the sequence's (a
    context-parallel rank's chunks: the mask [.., 1, n_local, n]). Any other mask (a window,
    padding, a non-causal pair) is refused: Focus keeps its own rule and the documents'
    boundaries, nothing else.
    """
    global _last_read
    read, seen, start = _last_read
    # (a rank's rows are the same for every mask of a length)
    key = (mask._version, batch, None if rows is None else len(rows))
    if read() is mask and seen == key:
        return start
    start = _read(mask, batch, rows)
    _last_read = (weakref.ref(mask), key, start)
    return start


def _read(mask: torch.Tensor, batch: int, rows: Optional[torch.Tensor]) -> torch.Tensor:
    refusal = ValueError(
        "Focus attention takes no attention mask but Megatron's per-document causal one "
        f"(--reset-attention-mask); got one of shape {tuple(mask.shape)}"
    )
    n = mask.shape[-1]
    positions = torch.arange(n, device=mask.device)
    rows = positions if rows is None else rows.to(mask.device)
    if mask.dim() != 4 or mask.shape[1:3] != (1, len(rows)) or mask.shape[0] not in (1, batch):
        raise refusal
    kept = ~mask[:, 0].expand(batch, -1, -1)
    start = kept.int().argmax(-1)  # the first kept key of each query
    documents = (positions[None, None, :] >= start[..., None]) & (
        positions[None, None, :] <= rows[None, :, None]
    )
    # a token starts a document, or is in the one of the token before it (where that is a row)
    next_row = rows[1:] == rows[:-1] + 1
    continues = (start[:, 1:] == start[:, :-1]) | (start[:, 1:] == rows[1:]) | ~next_row
    if not (torch.equal(kept, documents) and continues.all()):
        raise refusal
    return start


def segments(doc_start: torch.Tensor) -> torch.Tensor:
    """[b, n] index of each token's document among all documents of the batch, 0, 1, ...
    (sequence by sequence: every sequence starts a document)."""
    n = doc_start.shape[-1]
    starts = doc_start == torch.arange(n, device=doc_start.device)
    return starts.flatten().cumsum(0).sub_(1).view(doc_start.shape)
