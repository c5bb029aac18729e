"""Documents packed in one sequence (`--reset-attention-mask`), as Focus sees them.

Megatron-Core's dataset marks the documents of a packed sequence in the attention mask it builds
(True where a pair is removed: every pair across documents, every future pair). Focus needs them
as one number per token, the position where its document starts: its Sinkhorn restarts there,
its window, sinks and groups count from there, and no pair crosses it. Each document then
computes exactly what it computes alone.
"""

import weakref

import torch

# Every Focus layer of a forward (and its recompute) gets the same mask: it is read once, and
# read again only when another mask, or this one changed in place, comes. (A weak reference to
# the mask, its version and the batch size, the starts.)
_last_read = (lambda: None, None, None)


def document_starts(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """[b, n] position of each token's document start, from Megatron's mask [b or 1, 1, n, n].

    Any other mask (a window, padding, a non-causal pair) is refused: Focus keeps its own rule
    and the documents' boundaries, nothing else.
    """
    global _last_read
    read, seen, start = _last_read
    if read() is mask and seen == (mask._version, batch):
        return start
    start = _read(mask, batch)
    _last_read = (weakref.ref(mask), (mask._version, batch), start)
    return start


def _read(mask: torch.Tensor, batch: int) -> torch.Tensor:
    refusal = ValueError(
        "Focus attention takes no attention mask but Megatron's per-document causal one "
        f"(--reset-attention-mask); got one of shape {tuple(mask.shape)}"
    )
    n = mask.shape[-1]
    if mask.dim() != 4 or mask.shape[1:3] != (1, n) or mask.shape[0] not in (1, batch):
        raise refusal
    kept = ~mask[:, 0].expand(batch, -1, -1)
    start = kept.int().argmax(-1)  # the first kept key of each query
    positions = torch.arange(n, device=mask.device)
    documents = (positions[None, None, :] >= start[..., None]) & (
        positions[None, None, :] <= positions[None, :, None]
    )
    # a token starts a document, or is in the one of the token before it
    continues = (start[:, 1:] == start[:, :-1]) | (start[:, 1:] == positions[1:])
    if not (torch.equal(kept, documents) and continues.all()):
        raise refusal
    return start


def segments(doc_start: torch.Tensor) -> torch.Tensor:
    """[b, n] index of each token's document among all documents of the batch, 0, 1, ...
    (sequence by sequence: every sequence starts a document)."""
    n = doc_start.shape[-1]
    starts = doc_start == torch.arange(n, device=doc_start.device)
    return starts.flatten().cumsum(0).sub_(1).view(doc_start.shape)
