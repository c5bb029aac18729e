"""The exported model with a static cache (`generate(..., cache_implementation="static")`, or a
StaticCache passed in): the tokens and scores of the default cache, and a decoding step that
torch.compile takes whole, as one graph for every step (what CUDA graphs replay)."""

import pytest
import torch

from reference import assignments, dense_hard_rule

pytestmark = pytest.mark.skipif(
    int(__import__("transformers").__version__.split(".")[0]) < 5,
    reason="a static cache needs transformers 5",
)

SMALL = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, normalization="RMSNorm",
    activation="swiglu", position_embedding_type="rope", bias=False, tie_word_embeddings=False,
    max_position_embeddings=256, layer_attention=["focus", "standard", "focus+xsa"],
    focus_groups=4, focus_window=6, focus_tau=0.5, focus_sinkhorn_iters=3,
    focus_sink_tokens=2, focus_top_k=2,
)  # fmt: skip
GPT2 = dict(
    SMALL, normalization="LayerNorm", activation="gelu", position_embedding_type="learned_absolute",
    bias=True, num_key_value_heads=4, layer_attention=["xsa", "focus"], num_hidden_layers=2,
)  # fmt: skip


def _hf():
    from megatron_focus.hf import modeling_megatron_focus

    return modeling_megatron_focus


def _model(**overrides):
    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig

    torch.manual_seed(0)
    config = MegatronFocusConfig(**{**SMALL, **overrides})
    return _hf().MegatronFocusForCausalLM(config).eval()


def _prompt(b=2, n=21, pad=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (b, n), generator=gen)
    mask = torch.ones_like(ids)
    mask[1:, :pad] = 0  # left padding: sinks and Sinkhorn sums count real tokens only
    return ids, mask


def _generate(model, ids, mask, **kwargs):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=False, output_scores=True,
        return_dict_in_generate=True, pad_token_id=0, **kwargs,
    )  # fmt: skip


def _one_graph_config(graphs: list):
    """generate()'s compile_config: fullgraph on the CPU too, each graph's code into `graphs`
    (a backend that runs it as traced)."""
    from transformers import CompileConfig

    def backend(graph_module, inputs):
        graphs.append(graph_module.code)
        return graph_module.forward

    torch._dynamo.reset()
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True
    return config


def _assert_same(static, dynamic):
    assert torch.equal(static.sequences, dynamic.sequences)
    for a, b in zip(static.scores, dynamic.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "mode,overrides",
    [
        ("sparse", {}),
        ("sparse", dict(focus_top_k=1, focus_sink_tokens=0)),
        ("soft", {}),
        ("soft", dict(focus_gate="sigmoid")),
        ("sparse", GPT2),
        ("soft", GPT2),
    ],
    ids=["sparse", "sparse-top1-no-sinks", "soft", "soft-sigmoid", "gpt2-sparse", "gpt2-soft"],
)
def test_a_static_cache_generates_what_the_default_cache_does(mode, overrides):
    """Prefill (sparse: the rule's own parts over the filled slots) and every decoding step
    (one mask over all slots), left-padded, GQA, XSA and a standard layer beside."""
    model = _model(**overrides)
    ids, mask = _prompt()
    dynamic = _generate(model, ids, mask, focus_attention_mode=mode)
    static = _generate(model, ids, mask, focus_attention_mode=mode, cache_implementation="static")
    assert isinstance(static.cache, _hf().StaticCache)
    _assert_same(static, dynamic)


@pytest.mark.parametrize("mode", ["sparse", "soft"])
def test_beams_reorder_a_static_cache_s_routing(mode):
    """Beam search reorders every slot's routing state with the keys (sparse: a wrong bucket
    changes the beams)."""
    model = _model()
    ids, mask = _prompt()
    beams = [
        model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False,
                       pad_token_id=0, focus_attention_mode=mode, **static)
        for static in ({}, dict(cache_implementation="static"))
    ]  # fmt: skip
    assert torch.equal(*beams)


def test_a_static_cache_passed_in_and_chunks_through_it():
    """A StaticCache made by hand, longer than needed, filled by two chunks and then single
    tokens (the chunk after the first reads the slots filled before it): the default cache's
    logits at every position."""
    from transformers import StaticCache

    model = _model()
    model.set_focus_mode("sparse")
    ids, mask = _prompt(n=30)
    whole = model(ids, attention_mask=mask).logits
    cache = StaticCache(config=model.config, max_cache_len=64)
    parts = []
    for start, end in [(0, 12), (12, 25), *((i, i + 1) for i in range(25, 30))]:
        out = model(ids[:, start:end], attention_mask=mask[:, :end], cache=cache, use_cache=True)
        parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["sparse", "soft"])
def test_a_decoding_step_is_one_graph(mode):
    """generate()'s own compiled decoding (a compile_config) with fullgraph=True: a host read or
    a shape that moves would break or recompile it; one graph serves every step, and its tokens
    and scores are the eager default cache's."""
    graphs = []
    model = _model()
    ids, mask = _prompt()
    compiled = _generate(model, ids, mask, focus_attention_mode=mode, cache_implementation="static",
                         compile_config=_one_graph_config(graphs))  # fmt: skip
    assert len(graphs) == 1  # 9 decoding steps, one graph
    _assert_same(compiled, _generate(model, ids, mask, focus_attention_mode=mode))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "one-graph"])
def test_decoding_steps_by_megatron_focus_kernel(monkeypatch, compiled):
    """On a GPU with megatron-focus installed a sparse step takes its Triton kernel
    (triton_decode.py, here interpreted), which reads the kept slots alone: the default cache's
    tokens and scores, eagerly and as one compiled graph for every step."""
    from interpreted import skip_unless_kernels_run

    skip_unless_kernels_run()
    from megatron_focus.model.kernels import triton_decode

    hf, calls, graphs = _hf(), [], []

    def kernel(q, *args):  # counted where it runs eagerly (a graph would guard on the count)
        calls.append(q.shape)
        return triton_decode.slot_decode(q, *args)

    step = triton_decode.slot_decode if compiled else kernel
    monkeypatch.setattr(hf, "slot_decode_kernel", lambda q: step)
    model = _model()
    ids, mask = _prompt()
    kwargs = dict(focus_attention_mode="sparse", cache_implementation="static")
    if compiled:
        kwargs["compile_config"] = _one_graph_config(graphs)
    by_kernel = _generate(model, ids, mask, **kwargs)
    _assert_same(by_kernel, _generate(model, ids, mask, focus_attention_mode="sparse"))
    if compiled:  # one graph for every step, the kernel in it once per Focus layer
        assert len(graphs) == 1 and graphs[0].count("megatron_focus.slot_decode") == 2
    else:  # the steps' alone, both Focus layers
        assert calls and set(calls) == {(2, 4, 1, 16)}


@pytest.mark.parametrize(
    "groups,top_k,window,sink,how",
    [(4, 1, 3, 0, "random"), (4, 2, 5, 2, "coarse"), (8, 3, 2, 1, "duplicated"),
     (8, 2, 4, 0, "lonely"), (3, 3, 40, 2, "random")],
)  # fmt: skip
def test_the_slot_mask_is_the_dense_hard_rule(groups, top_k, window, sink, how):
    """`slot_rule_pairs` over more slots than tokens (the free ones hold stale buckets): the
    hard rule's softmax, every query (a prompt's or a step's)."""
    hf = _hf()
    gen = torch.Generator().manual_seed(groups * 7 + top_k)
    b, n, slots = 2, 33, 48
    q, k, v = (torch.randn(b, 4, n, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    log_g = assignments(b, n, groups, gen, how)
    ranked = hf.rank_groups(log_g)
    bucket = torch.randint(-1, groups + 1, (b, slots), generator=gen)  # stale past the tokens
    bucket[:, :n] = ranked[..., 0].masked_fill(torch.arange(n) < sink, groups)
    k_slots, v_slots = (torch.cat([t, torch.randn(b, 4, slots - n, 8, dtype=t.dtype)], 2)
                        for t in (k, v))  # fmt: skip
    pairs = hf.CausalPairs(n, 0, None, q.device, slots=slots)
    keep = hf.slot_rule_pairs(pairs, ranked[..., :top_k], bucket, window, groups)
    scores = (q @ k_slots.transpose(-1, -2) * 8**-0.5).masked_fill(~keep, float("-inf"))
    out = scores.softmax(-1) @ v_slots
    ref = dense_hard_rule(q, k, v, log_g, window, top_k, 8**-0.5, sink)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_a_static_cache_too_short_is_refused_before_any_compute():
    from transformers import StaticCache

    model = _model()
    ids, mask = _prompt(n=30)
    cache = StaticCache(config=model.config, max_cache_len=32)
    model(ids, attention_mask=mask, cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="holds 32 tokens; this call would make it 33"):
        model(ids[:, :3], cache=cache, use_cache=True)


def test_a_static_cache_refuses_a_sliding_window_before_any_compute():
    from transformers import StaticCache

    model = _model(layer_attention=["standard"] * 3, sliding_window=8)
    ids, mask = _prompt()
    with pytest.raises(ValueError, match="sliding_window"):
        model(ids, cache=StaticCache(config=model.config, max_cache_len=32), use_cache=True)
