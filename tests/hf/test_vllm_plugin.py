"""The vLLM plugin's Focus layer (megatron_focus/vllm_plugin.py) without vLLM: a sequence served
in steps of any sizes, each step's earlier tokens read back from their page rows into the
export's own Focus cache, gives what the export's layer computes over the whole sequence at
once, in soft and sparse mode (GQA, RoPE, sinks, a window shorter than the sequence). vLLM
itself serves the exports in CI's vLLM leg (examples/serve_with_vllm.py); here its modules are
stand-ins, as the plugin's Focus step never calls them."""

import importlib
import sys
import types

import pytest
import torch

from megatron_focus.hf import modeling_megatron_focus as modeling
from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig

# What the plugin imports of vLLM, by module
VLLM_NAMES = {
    "vllm": ["ModelRegistry"],
    "vllm.forward_context": ["get_forward_context"],
    "vllm.model_executor.layers.attention": ["Attention"],
    "vllm.model_executor.layers.attention_layer_base": ["AttentionLayerBase"],
    "vllm.v1.attention.backend": ["AttentionBackend", "AttentionMetadataBuilder"],
    "vllm.v1.kv_cache_interface": ["FullAttentionSpec"],
}


@pytest.fixture
def plugin(monkeypatch):
    for name, names in VLLM_NAMES.items():
        module = types.ModuleType(name)
        for attribute in names:
            setattr(module, attribute, type(attribute, (), {}))
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "megatron_focus.vllm_plugin", raising=False)
    yield importlib.import_module("megatron_focus.vllm_plugin")
    sys.modules.pop("megatron_focus.vllm_plugin", None)


@pytest.mark.parametrize("mode", ["soft", "sparse"])
@pytest.mark.parametrize("kind", ["focus", "focus+xsa"])
def test_steps_over_page_rows_give_the_whole_sequences_output(plugin, mode, kind):
    n = 23
    config = MegatronFocusConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, normalization="RMSNorm",
        position_embedding_type="rope", layer_attention=[kind], focus_groups=4, focus_dim=8,
        focus_window=4, focus_sink_tokens=2, focus_top_k=1, focus_attention_mode=mode,
    )  # fmt: skip
    torch.manual_seed(0)
    attention = modeling.ATTENTION[kind](config, 0).eval()
    with torch.no_grad():  # every weight drawn here (a layer alone: no model's init), routing
        for param in attention.parameters():  # far from uniform
            param.normal_(0.0, 0.2)
    x = torch.randn(1, n, 64)
    rope = modeling.rotary(torch.arange(n)[None], config, x.dtype)
    row = plugin.Row(2, config.head_dim, config.focus_groups, config.focus_sinkhorn_iters)
    with torch.no_grad():
        whole = attention(x, rope, modeling.CausalPairs(n, 0, None, x.device), None)
        held, outputs, start = torch.zeros(0, row.width), [], 0
        for size in (5, 1, 1, 7, 1, 1, 2, 5):  # a prefill in chunks, decoding steps
            step = slice(start, start + size)
            step_rope = tuple(t[..., step, :] for t in rope)
            out, written = plugin.focus_step(attention, modeling, row, x[:, step], step_rope, held)
            outputs.append(out)
            held = torch.cat([held, row.join(*written)])
            start += size
    assert start == n and held.shape == (n, row.width)
    torch.testing.assert_close(torch.cat(outputs, dim=1), whole, rtol=1e-5, atol=1e-5)
    if mode == "sparse":  # the rule dropped pairs: it is not the dense layer's output
        config.focus_attention_mode = "soft"
        with torch.no_grad():
            soft = attention(x, rope, modeling.CausalPairs(n, 0, None, x.device), None)
        assert not torch.allclose(soft, whole, atol=1e-3)


def test_a_row_holds_a_tokens_state_exactly(plugin):
    row = plugin.Row(kv_heads=2, head_dim=3, groups=4, iters=2)
    k, v = torch.randn(1, 2, 5, 3), torch.randn(1, 2, 5, 3)
    log_g, sums = torch.randn(1, 5, 4), torch.randn(1, 5, 2, 4)
    rows = row.join(k, v, log_g, sums)
    assert rows.shape == (5, row.width) and row.width % 2 == 0
    for mine, theirs in zip(row.split(rows), (k, v, log_g, sums)):
        assert torch.equal(mine, theirs)
