"""The exported model's sparse Focus attention computes only the pairs the hard rule keeps; here
it is compared with the rule as one dense masked softmax (tests/reference.py), pair for pair."""

import pytest
import torch

from reference import assignments, dense_hard_rule


def _hf():
    from megatron_focus.hf import modeling_megatron_focus

    return modeling_megatron_focus


def _inputs(b, heads, kv_heads, n, d, groups, how, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, kv_heads, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, assignments(b, n, groups, gen, how)


def _buckets(hf, k, v, ranked, sinks, real=None):
    """Every key in its bucket, as the model files them: the sinks', else its top-1 group's;
    padding in none."""
    buckets = hf.KeyBuckets(ranked.shape[-1])
    bucket = ranked[..., 0].masked_fill(sinks, buckets.sinks)
    if real is not None:
        bucket = bucket.masked_fill(~real, -1)
    buckets.append(k, v, torch.arange(k.shape[2]), bucket)
    return buckets


@pytest.mark.parametrize(
    "groups,top_k,window,sink,kv_heads,block,how",
    [
        (1, 1, 4, 0, 4, 512, "random"),
        (3, 1, 1, 0, 2, 5, "random"),
        (3, 2, 4, 2, 1, 7, "coarse"),
        (8, 1, 6, 0, 2, 16, "random"),
        (8, 3, 3, 3, 4, 4, "duplicated"),
        (8, 8, 5, 1, 2, 512, "random"),
        (4, 2, 80, 0, 4, 32, "one-group"),  # the window longer than the sequence
        (8, 2, 2, 0, 1, 8, "lonely"),
    ],
)
@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu", "explicit"])
def test_sparse_prefill_equals_the_dense_hard_rule(
    groups, top_k, window, sink, kv_heads, block, how, fused, monkeypatch
):
    """Each part on PyTorch's fused CPU attention and on explicit scores (other devices)."""
    hf = _hf()
    if not fused:
        monkeypatch.setattr(hf, "FUSED_CPU_ATTENTION", None)
    q, k, v, log_g = _inputs(2, 4, kv_heads, 45, 8, groups, how, seed=groups * 10 + top_k)
    n = q.shape[2]
    ranked = hf.rank_groups(log_g)
    pairs = hf.CausalPairs(n, 0, None, q.device)
    sinks = (torch.arange(n) < sink).expand(2, n)
    buckets = _buckets(hf, k, v, ranked, sinks)
    out = hf.sparse_rule_attention(q, k, v, pairs, ranked, buckets, window, top_k, block)
    ref = dense_hard_rule(q, k, v, log_g, window, top_k, 8**-0.5, sink)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [5, 6])  # 6: the last block of queries padded
def test_sparse_prefill_with_left_padding_equals_each_row_alone(window):
    """Padded keys are never attended to and the sinks are the first real tokens: each row's
    real tokens compute what the row computes unpadded."""
    hf = _hf()
    q, k, v, log_g = _inputs(2, 4, 2, 40, 8, 6, "random", seed=3)
    pad = [0, 9]
    attention_mask = torch.ones(2, 40, dtype=torch.long)
    attention_mask[1, : pad[1]] = 0
    real = attention_mask.bool()
    sinks = real & (real.long().cumsum(-1) <= 2)
    ranked = hf.rank_groups(log_g)
    pairs = hf.CausalPairs(40, 0, attention_mask, q.device)
    buckets = _buckets(hf, k, v, ranked, sinks, real)
    out = hf.sparse_rule_attention(q, k, v, pairs, ranked, buckets, window, 2, block=6)
    for row, start in enumerate(pad):
        alone = [t[row : row + 1, ..., start:, :] for t in (q, k, v)]
        ref = dense_hard_rule(*alone, log_g[row : row + 1, start:], window, 2, 8**-0.5, sink=2)
        torch.testing.assert_close(out[row : row + 1, :, start:], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("b,top_k", [(1, 1), (3, 2)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu", "explicit"])
def test_decoding_steps_equal_the_prefill(b, top_k, fused, monkeypatch):
    """One query at a time, its key filed before it attends, reading in position order only the
    window's keys (a cache's view): the prefill's rows. Without padding a step takes its own
    path (`decoding_rule_attention`), each row with its own groups."""
    hf = _hf()
    if not fused:
        monkeypatch.setattr(hf, "FUSED_CPU_ATTENTION", None)
    window = 3
    q, k, v, log_g = _inputs(b, 4, 2, 30, 8, 4, "random", seed=5)
    ranked = hf.rank_groups(log_g)
    sinks = (torch.arange(30) < 1).expand(b, 30)
    whole = hf.sparse_rule_attention(
        q,
        k,
        v,
        hf.CausalPairs(30, 0, None, q.device),
        ranked,
        _buckets(hf, k, v, ranked, sinks),
        window,
        top_k,
    )
    buckets = hf.KeyBuckets(4)
    bucket = ranked[..., 0].masked_fill(sinks, buckets.sinks)
    for i in range(30):
        buckets.append(
            k[:, :, i : i + 1], v[:, :, i : i + 1], torch.tensor([i]), bucket[:, i : i + 1]
        )
        held = slice(max(i - window + 1, 0), i + 1)
        step = hf.sparse_rule_attention(
            q[:, :, i : i + 1],
            k[:, :, held],
            v[:, :, held],
            hf.CausalPairs(1, i, None, q.device),
            ranked[:, i : i + 1],
            buckets,
            window,
            top_k,
        )
        torch.testing.assert_close(step, whole[:, :, i : i + 1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk,window,extra", [(7, 5, 0), (4, 9, 2), (16, 3, 5), (45, 6, 0)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu", "explicit"])
def test_chunked_prefill_equals_one_pass(chunk, window, extra, fused, monkeypatch):
    """A prompt prefilled in chunks through a cache (`generate()`'s long prompts): each chunk's
    queries see the keys before them only as the window's held keys (and `extra` more) and the
    buckets filled so far; the rows of one pass."""
    hf = _hf()
    if not fused:
        monkeypatch.setattr(hf, "FUSED_CPU_ATTENTION", None)
    q, k, v, log_g = _inputs(1, 4, 2, 45, 8, 4, "random", seed=chunk)
    ranked = hf.rank_groups(log_g)
    sinks = (torch.arange(45) < 2)[None]
    args = (window, 2)
    whole = hf.sparse_rule_attention(
        q,
        k,
        v,
        hf.CausalPairs(45, 0, None, q.device),
        ranked,
        _buckets(hf, k, v, ranked, sinks),
        *args,
    )
    buckets = hf.KeyBuckets(4)
    bucket = ranked[..., 0].masked_fill(sinks, buckets.sinks)
    for start in range(0, 45, chunk):
        end = min(start + chunk, 45)
        now = slice(start, end)
        buckets.append(k[:, :, now], v[:, :, now], torch.arange(start, end), bucket[:, now])
        held = slice(max(start - window + 1 - extra, 0), end)
        part = hf.sparse_rule_attention(
            q[:, :, now],
            k[:, :, held],
            v[:, :, held],
            hf.CausalPairs(end - start, start, None, q.device),
            ranked[:, now],
            buckets,
            *args,
        )
        torch.testing.assert_close(part, whole[:, :, now], rtol=1e-5, atol=1e-6)
