"""Sparse Focus's decoding step over a static cache's slots, as one Triton kernel: the hard rule
for one new token per sequence, reading only the keys it keeps, in a launch whose grid and
arguments never change from step to step (a CUDA graph replays it).

A static cache keeps keys and values in position order, and beside them each slot's bucket (its
key's top-1 group, the sinks', -1 none: the HF export's `FocusStaticLayer`). Whether the rule
keeps a slot (in the query's window, in the sinks' bucket, or in one of its top-k groups) is
decided from those few bytes before the key's row is read: the row is loaded under that mask, so
a step over n cached tokens reads about (window + sinks) / n + top_k / K of their bytes, where
one mask over every slot (`slot_rule_pairs`) reads them all.

* one program per (sequence, key/value head, run of slots): the query heads sharing the key/value
  head stacked on the tile's rows (at least 16, a tensor-core dot's), the runs split so the GPU
  fills at batch 1 (flash-decoding), merged by log-sum-exp afterwards in torch;
* the query's position is read on the device, so the grid is the cache's length and a run past
  the position does nothing;
* registered as a torch op (`megatron_focus::slot_decode`, an opaque custom op with its
  output's shape declared), so torch.compile keeps it in the step's graph and a CUDA graph
  captures its launch.

Under TRITON_INTERPRET=1 it runs on CPU tensors (tests check it against the slot mask's
attention); on a GPU it compiles with `triton_launch.decode_tile`.
"""

import math

import torch
import triton
import triton.language as tl

from megatron_focus.model.kernels import triton_launch
from megatron_focus.model.kernels.triton_launch import Launch

PROGRAMS = 264  # enough to fill an H100's 132 SMs twice; fewer runs past it at larger batches


@triton.jit
def _slot_decode(
    Q, K, V, BUCKET, CHOSEN, POSITION, OUT, LSE,
    kv_heads, rep, per_run, top_k, window, sinks, head_dim,
    sq_b, sq_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sb_b, sc_b, so_b, so_h, so_r, qk_scale,
    ROWS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, CHOICES: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One sequence's key/value head over one run of slots: its query heads' normalised output
    and log-sum-exp (base 2) over the kept slots of the run, in float32."""
    sequence = tl.program_id(0) // kv_heads
    kv_head = tl.program_id(0) - sequence * kv_heads
    run = tl.program_id(1)
    wide = tl.int64
    rows = tl.arange(0, ROWS)
    heads = kv_head * rep + rows
    dims = tl.arange(0, D)
    dim_ok = dims < head_dim
    q_at = Q + sequence.to(wide) * sq_b + heads.to(wide)[:, None] * sq_h + dims[None, :]
    q = tl.load(q_at, mask=(rows < rep)[:, None] & dim_ok[None, :], other=0.0)
    picks = tl.arange(0, CHOICES)
    chosen = tl.load(CHOSEN + sequence.to(wide) * sc_b + picks, mask=picks < top_k, other=-2)
    position = tl.load(POSITION).to(tl.int32)
    start = run * per_run
    stop = tl.minimum(start + per_run, position + 1)
    keys = K + sequence.to(wide) * sk_b + kv_head.to(wide) * sk_h
    values = V + sequence.to(wide) * sv_b + kv_head.to(wide) * sv_h
    buckets = BUCKET + sequence.to(wide) * sb_b
    running_max = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    for first in range(start, stop, BN):
        slots = first + tl.arange(0, BN)
        bucket = tl.load(buckets + slots, mask=slots < stop, other=-1).to(tl.int32)
        asked = tl.sum((bucket[:, None] == chosen[None, :].to(tl.int32)).to(tl.int32), 1) > 0
        near = position - slots < window
        keep = (slots < stop) & (bucket >= 0) & (near | asked | (bucket == sinks))
        load = keep[:, None] & dim_ok[None, :]  # a row the rule drops is never read
        at = slots.to(wide)[:, None]
        k = tl.load(keys + at * sk_n + dims[None, :], mask=load, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        scores = tl.where(keep[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(scores - shift[:, None])
        alpha = tl.exp2(running_max - shift)
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(values + at * sv_n + dims[None, :], mask=load, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    lse = tl.where(total == 0.0, float("-inf"), running_max + tl.log2(total))
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    at = sequence.to(wide) * so_b + heads.to(wide) * so_h + run.to(wide) * so_r
    tl.store(OUT + at[:, None] * D + dims[None, :], out, mask=(rows < rep)[:, None])
    tl.store(LSE + at, lse, mask=rows < rep)


def plan(q, k, v, bucket, chosen, position, *, window: int, sinks: int, scale: float,
         capability) -> tuple:  # fmt: skip
    """(the launch, its outputs' per-run rows [b, h, runs, D] and log-sum-exps [b, h, runs]) of
    a step on a GPU of `capability` (None: the interpreter's tiles): q [b, h, 1, d], k/v [b, g,
    slots, d] (the last dim contiguous), bucket [b, slots], chosen [b, top_k] the query's
    groups, position [1] its slot."""
    b, heads, _, head_dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    tile = triton_launch.decode_tile(capability, head_dim)
    per_run = 2 * tile.keys  # the interpreter's: tests cross runs and blocks
    if capability is not None:
        runs = max(1, min(triton.cdiv(PROGRAMS, b * kv_heads), triton.cdiv(slots, tile.keys)))
        per_run = triton.cdiv(triton.cdiv(slots, runs), tile.keys) * tile.keys
    runs = triton.cdiv(slots, per_run)
    D = triton_launch.padded(head_dim)
    out = torch.empty(b, heads, runs, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(b, heads, runs, device=q.device, dtype=torch.float32)
    rep = heads // kv_heads
    args = (
        q, k, v, bucket, chosen, position, out, lse,
        kv_heads, rep, per_run, chosen.shape[1], window, sinks, head_dim,
        q.stride(0), q.stride(1), *k.stride()[:3], *v.stride()[:3], bucket.stride(0),
        chosen.stride(0), heads * runs, runs, 1, scale * math.log2(math.e),
    )  # fmt: skip
    constants = dict(
        ROWS=triton_launch.padded(rep), BN=tile.keys, D=D,
        CHOICES=triton.next_power_of_2(chosen.shape[1]),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    options = dict(num_warps=tile.warps, num_stages=tile.stages)
    return Launch(_slot_decode, (b * kv_heads, runs), args, constants, options), out, lse


def merged(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The runs' softmaxes as one (lse_merge.py's rule over the runs' axis): [b, h, runs, D] and
    base-2 log-sum-exps [b, h, runs] -> [b, h, D]. The run holding the query's own slot has a
    finite one."""
    weights = torch.exp2(lse - lse.amax(-1, keepdim=True))
    return (out * weights[..., None]).sum(-2) / weights.sum(-1)[..., None]


@torch.library.custom_op("megatron_focus::slot_decode", mutates_args=())
def slot_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bucket: torch.Tensor,
    chosen: torch.Tensor,
    position: torch.Tensor,
    window: int,
    sinks: int,
    scale: float,
) -> torch.Tensor:
    """The hard rule's attention of one new token per sequence over a static cache's slots
    (`plan`'s arguments) -> [b, h, 1, d] in q's dtype."""
    launch, out, lse = plan(q, k, v, bucket, chosen, position, window=window, sinks=sinks,
                            scale=scale, capability=triton_launch.capability_of(q))  # fmt: skip
    launch()
    return merged(out, lse)[..., : q.shape[-1]].unsqueeze(2).to(q.dtype)


@slot_decode.register_fake
def _(q, k, v, bucket, chosen, position, window, sinks, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
