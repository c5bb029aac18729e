"""The exported model's sparse prefill through megatron-focus's fused kernel (a GPU's path, here
run by Triton's interpreter on the CPU): the logits and the greedy tokens of the export's own
path, the decoding steps after it reading the cache the prefill filled; which GPU takes it (and
a static cache's decoding kernel)."""

import pytest
import torch
from interpreted import skip_unless_kernels_run

skip_unless_kernels_run()
pytest.importorskip("megatron_focus.model.kernels.triton_sparse")


def _model(top_k: int):
    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig
    from megatron_focus.hf.modeling_megatron_focus import MegatronFocusForCausalLM

    torch.manual_seed(top_k)
    config = MegatronFocusConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, normalization="RMSNorm",
        activation="swiglu", bias=False, position_embedding_type="rope",
        tie_word_embeddings=False, layer_attention=["focus", "focus+xsa"], focus_groups=4,
        focus_window=5, focus_sink_tokens=2, focus_tau=0.5, focus_sinkhorn_iters=3,
        focus_attention_mode="sparse", focus_top_k=top_k,
    )  # fmt: skip
    model = MegatronFocusForCausalLM(config).eval()
    with torch.no_grad():  # routers off their initialisation: groups of every size
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("top_k", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_prefill_by_the_fused_kernel_equals_the_exports_own_path(monkeypatch, top_k):
    from megatron_focus.hf import modeling_megatron_focus as hf
    from megatron_focus.model.focus import focus_sparse
    from megatron_focus.model.kernels import kernels

    model = _model(top_k)
    ids = torch.randint(4, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = model(ids).logits
        own_tokens = model.generate(ids[:1, :30], max_new_tokens=6, do_sample=False)

    calls = []
    monkeypatch.setattr(focus_sparse, "_dense_is_faster", lambda *args: False)
    monkeypatch.setattr(hf, "fused_sparse_kernel", lambda q: calls.append(q.shape) or
                        kernels.TRITON_SPARSE)  # fmt: skip
    with torch.no_grad():
        fused = model(ids).logits
        assert calls == [(2, 4, 40, 16)] * 2  # both Focus layers, the whole prompt
        fused_tokens = model.generate(ids[:1, :30], max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(fused, own, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused_tokens, own_tokens)
    # the prefill only: each decoding step takes the export's path over the cache
    assert calls[2:] == [(1, 4, 30, 16)] * 2


@pytest.mark.parametrize("choice", ["fused_sparse_kernel", "slot_decode_kernel"])
def test_the_kernel_is_taken_on_a_gpu_that_has_its_tiles_only(monkeypatch, choice):
    """A GPU's choice, with q standing for a CUDA tensor: the prefill's fused kernel and a
    static cache's decoding kernel where Triton has a tile (bf16 on sm_90), none for fp32 or
    before Ampere, none without megatron-focus, none on the CPU."""
    import sys
    import types

    from megatron_focus.hf import modeling_megatron_focus as hf
    from megatron_focus.model.kernels import kernels, triton_decode

    chooser = getattr(hf, choice)
    expected = {"fused_sparse_kernel": kernels.TRITON_SPARSE,
                "slot_decode_kernel": triton_decode.slot_decode}[choice]  # fmt: skip

    def on_gpu(dtype):
        return types.SimpleNamespace(device=torch.device("cuda"), shape=(1, 4, 8, 64), dtype=dtype)

    monkeypatch.setattr(kernels, "has_triton", lambda: True)
    monkeypatch.setattr(kernels, "device_capability", lambda device: (9, 0))
    assert chooser(on_gpu(torch.bfloat16)) is expected
    assert chooser(on_gpu(torch.float32)) is None
    assert chooser(torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)) is None
    monkeypatch.setattr(kernels, "device_capability", lambda device: (7, 5))
    assert chooser(on_gpu(torch.bfloat16)) is None
    monkeypatch.setattr(kernels, "device_capability", lambda device: (9, 0))
    monkeypatch.setitem(sys.modules, "megatron_focus.model.kernels", None)  # not installed
    assert chooser(on_gpu(torch.bfloat16)) is None
