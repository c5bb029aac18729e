"""Sparse Focus's decoding step over a static cache's slots (model/kernels/triton_decode.py)
against the hard rule as one float64 masked softmax, run by Triton's interpreter on CPU tensors
laid out as the HF export's static cache holds them; the op in a compiled graph."""

import pytest
import torch
from interpreted import skip_unless_kernels_run

skip_unless_kernels_run()
triton_decode = pytest.importorskip("megatron_focus.model.kernels.triton_decode")

CASES = {  # b, heads, kv heads, slots, d, K, window, top_k, position, sink slots, padded slots
    "top-1, gqa 2, sinks, padding": (2, 4, 2, 90, 16, 4, 5, 1, 61, 2, 6),
    "top-2 of 8, mha, d 24": (1, 3, 3, 70, 24, 8, 8, 2, 69, 0, 0),
    "top-3, gqa 5 (rows padded), early position": (2, 5, 1, 64, 8, 4, 6, 3, 3, 1, 0),
    "top-k = K, wide window": (1, 2, 1, 40, 16, 3, 50, 3, 37, 0, 4),
}  # fmt: skip


def _static_cache(case, dtype, gen):
    """q [b, h, 1, d] as the layer's projection hands it (a transposed view), the cache's k, v
    [b, g, slots, d], every slot's bucket (stale ones past the position, -1 on padding), the
    query's top-k groups (a slice of its ranking) and its position."""
    b, heads, kv, slots, d, groups, window, top_k, position, sinks, padded = case
    q = torch.randn(b, 1, heads, d, generator=gen, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(b, kv, slots, d, generator=gen, dtype=dtype) for _ in range(2))
    bucket = torch.randint(0, groups, (b, slots), generator=gen)
    bucket[:, :sinks] = groups  # the sinks' bucket
    bucket[-1, sinks : sinks + padded] = -1  # the last row left-padded after its sinks
    ranking = torch.stack([torch.randperm(groups, generator=gen) for _ in range(b)])
    return q, k, v, bucket, ranking[:, :top_k], torch.tensor([position]), window, groups


def _dense_rule(q, k, v, bucket, chosen, position, window, groups):
    """The rule over every slot as one masked softmax, in float64: a slot up to the position,
    not padding, in the window, the sinks' or one of the query's groups."""
    slot = torch.arange(k.shape[2])
    pos = int(position)
    asked = (bucket[:, :, None] == chosen[:, None, :]).any(-1) | (bucket == groups)
    keep = (slot <= pos) & (bucket >= 0) & ((pos - slot < window) | asked)  # [b, slots]
    rep = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(rep, 1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~keep[:, None, None], float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("case", CASES)
def test_a_decoding_step_equals_the_dense_hard_rule(case):
    gen = torch.Generator().manual_seed(len(case))
    inputs = _static_cache(CASES[case], torch.float32, gen)
    q, k, v, bucket, chosen, position, window, groups = inputs
    out = triton_decode.slot_decode(q, k, v, bucket, chosen, position, window, groups,
                                    q.shape[-1] ** -0.5)  # fmt: skip
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), _dense_rule(*inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_step_is_one_op_of_a_compiled_graph(backend):
    """torch.compile(fullgraph=True) keeps the op in the graph; the position is a tensor, so a
    step at the next position takes the same graph."""
    torch._dynamo.reset()
    graphs = []

    def counting(graph_module, inputs):
        graphs.append(graph_module)
        return torch._dynamo.lookup_backend(backend)(graph_module, inputs)

    gen = torch.Generator().manual_seed(1)
    q, k, v, bucket, chosen, position, window, groups = _static_cache(
        CASES["top-2 of 8, mha, d 24"], torch.float32, gen
    )

    def step(q, position):
        return torch.ops.megatron_focus.slot_decode(q, k, v, bucket, chosen, position, window,
                                                    groups, 0.2)  # fmt: skip

    compiled = torch.compile(step, fullgraph=True, backend=counting)
    for at in (40, 41, 69):
        position = torch.tensor([at])
        torch.testing.assert_close(compiled(q, position), step(q, position))
    assert len(graphs) == 1


@pytest.mark.parametrize("b, kv_heads, slots", [(1, 8, 32768), (1, 1, 100), (64, 8, 4096)])
def test_a_gpu_step_splits_its_slots_into_runs_that_fill_the_gpu(b, kv_heads, slots):
    """On a GPU (the launch planned for sm_90 on meta tensors): every slot in one run of whole
    blocks, no run empty, and enough runs that batch 1 has about `PROGRAMS` programs."""
    q = torch.empty(b, 1, 4 * kv_heads, 128, device="meta", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.empty(b, kv_heads, slots, 128, device="meta", dtype=torch.bfloat16)
    bucket = torch.empty(b, slots, device="meta", dtype=torch.int64)
    chosen = torch.empty(b, 8, device="meta", dtype=torch.int64)[:, :2]
    position = torch.empty(1, device="meta", dtype=torch.int64)
    launch, out, _ = triton_decode.plan(q, k, k, bucket, chosen, position, window=128, sinks=8,
                                        scale=0.1, capability=(9, 0))  # fmt: skip
    programs, runs = launch.grid
    per_run = launch.args[launch.kernel.arg_names.index("per_run")]
    block = launch.constants["BN"]
    assert programs == b * kv_heads and out.shape[2] == runs
    assert per_run % block == 0 and (runs - 1) * per_run < slots <= runs * per_run
    wanted = min(triton_decode.PROGRAMS, b * kv_heads * -(-slots // block))
    assert 0.75 * wanted <= programs * runs <= max(triton_decode.PROGRAMS, b * kv_heads)
