"""XSA: the projection's properties, whole models against a plain-PyTorch reference, --xsa-layers.

Tensor- and sequence-parallel parity for XSA runs with the other families in test_parallel.py.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_focus import platform
from megatron_focus.model.xsa import exclusive_projection
from megatron_focus.training.arguments import parse_args

from tiny_runs import BATCH, FAMILIES, SEQ, VOCAB

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def attention_outputs(draw, dtypes=DTYPES):
    """`(y, v, heads per group)`: attention outputs and values of any shape and GQA ratio."""
    b, groups, per_group, s = (draw(st.integers(1, n)) for n in (2, 3, 4, 5))
    hn = draw(st.integers(8, 64))  # y nearly parallel to v is then vanishingly rare
    dtype = draw(st.sampled_from(dtypes))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = draw(st.sampled_from([1e-2, 1.0, 30.0]))
    y = (scale * torch.randn(b, groups * per_group, s, hn, generator=g)).to(dtype)
    v = (scale * torch.randn(b, groups, s, hn, generator=g)).to(dtype)
    return y, v, per_group


def _per_head(v, per_group):
    """Each query head's value vector, as Megatron's DotProductAttention repeats them."""
    return v.repeat_interleave(per_group, dim=1)


SWEEP = settings(max_examples=60, deadline=None, derandomize=True)  # the same sweep every run


@SWEEP
@given(attention_outputs(dtypes=[torch.float32]))
def test_every_head_is_orthogonal_to_its_own_value(case):
    y, v, per_group = case
    z = exclusive_projection(y, v)
    cos = F.cosine_similarity(z.double(), _per_head(v, per_group).double(), dim=-1)
    assert cos.abs().max() < 1e-5


@SWEEP
@given(attention_outputs(dtypes=[torch.float32, torch.float64]), st.floats(-3, 3))
def test_the_part_orthogonal_to_the_value_is_kept(case, a):
    """y = w + a v with w orthogonal to v: the output is w, whatever a."""
    y, v, per_group = case
    v_heads = _per_head(v, per_group).double()
    along = (y.double() * v_heads).sum(-1, keepdim=True) / v_heads.square().sum(-1, keepdim=True)
    w = y.double() - along * v_heads  # SPEC's formula, in float64
    z = exclusive_projection((w + a * v_heads).to(y.dtype), v)
    torch.testing.assert_close(z.double(), w, rtol=1e-4, atol=1e-5 * w.abs().max().item())


@SWEEP
@given(attention_outputs())
def test_dtype_is_kept_and_half_precision_is_computed_in_fp32(case):
    y, v, _ = case
    z = exclusive_projection(y, v)
    assert z.dtype == y.dtype
    assert torch.equal(z, exclusive_projection(y.float(), v.float()).to(y.dtype))


@SWEEP
@given(attention_outputs())
def test_a_zero_value_leaves_the_output_unchanged(case):
    y, v, _ = case
    y.requires_grad_()
    v = torch.zeros_like(v, requires_grad=True)
    z = exclusive_projection(y, v)
    assert torch.equal(z, y)
    z.float().square().sum().backward()
    assert torch.isfinite(y.grad).all() and torch.isfinite(v.grad).all()


# --- whole models -------------------------------------------------------------------------------

TOKENS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
POSITIONS = torch.arange(SEQ).expand(BATCH, SEQ)


def _build(argv):
    from megatron_focus.model.gpt import build_model

    args = parse_args(argv)
    platform.manual_seed(1234)
    return args, build_model(args, VOCAB).eval()


def _rope(t, base):
    """Megatron's (non-interleaved) rotary embedding of `[b, heads, s, hn]`, positions 0.. s-1."""
    hn = t.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, hn, 2, dtype=torch.float32) / hn)
    angles = torch.outer(torch.arange(t.shape[2], dtype=torch.float32), inv_freq).repeat(1, 2)
    t1, t2 = t.chunk(2, dim=-1)
    return t * angles.cos() + torch.cat((-t2, t1), dim=-1) * angles.sin()


def _reference_logits(args, model, tokens):
    """The GPT forward written out in plain PyTorch, reading the Megatron model's weights."""
    w = dict(model.named_parameters())
    heads, groups, hn = args.num_attention_heads, args.num_query_groups, args.kv_channels
    per_group = heads // groups
    b, s = tokens.shape
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)

    def norm(x, name):
        if args.normalization == "RMSNorm":
            return F.rms_norm(x, x.shape[-1:], w[f"{name}.weight"], args.norm_epsilon)
        return F.layer_norm(
            x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], args.norm_epsilon
        )

    def linear(x, name):
        return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))

    x = w["embedding.word_embeddings.weight"][tokens]
    if args.position_embedding_type == "learned_absolute":
        x = x + w["embedding.position_embeddings.weight"][:s]
    for i in range(args.num_layers):
        layer = f"decoder.layers.{i}"
        # Megatron's fused QKV: per query group, that group's query heads, then its key, its value.
        qkv = linear(norm(x, f"{layer}.input_layernorm"), f"{layer}.self_attention.linear_qkv")
        qkv = qkv.view(b, s, groups, per_group + 2, hn)
        q = qkv[..., :per_group, :].reshape(b, s, heads, hn).transpose(1, 2)
        k, v = (qkv[..., j, :].transpose(1, 2) for j in (per_group, per_group + 1))
        if args.position_embedding_type == "rope":
            q, k = _rope(q, args.rotary_base), _rope(k, args.rotary_base)
        k, v = _per_head(k, per_group), _per_head(v, per_group)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hn)).masked_fill(causal, -math.inf)
        y = scores.softmax(-1) @ v
        if args.attention == "xsa" and (args.xsa_layers is None or i + 1 in args.xsa_layers):
            y = y - (y * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True) * v
        y = y.transpose(1, 2).reshape(b, s, heads * hn)
        x = x + linear(y, f"{layer}.self_attention.linear_proj")
        h = linear(norm(x, f"{layer}.pre_mlp_layernorm"), f"{layer}.mlp.linear_fc1")
        if args.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        x = x + linear(h, f"{layer}.mlp.linear_fc2")
    x = norm(x, "decoder.final_layernorm")
    out = w[
        "output_layer.weight"
        if args.untie_embeddings_and_output_weights
        else "embedding.word_embeddings.weight"
    ]
    return x @ out.T


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("attention", ["standard", "xsa"])
def test_model_matches_plain_pytorch_reference(single_process, family, attention):
    args, model = _build(FAMILIES[family] + ["--attention", attention])
    with torch.no_grad():
        logits = model(TOKENS, POSITIONS, None)
        torch.testing.assert_close(
            logits, _reference_logits(args, model, TOKENS), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("family", ["gpt2", "llama-gqa"])
def test_xsa_adds_no_parameters_and_changes_the_logits(single_process, family):
    _, standard = _build(FAMILIES[family])
    _, xsa = _build(FAMILIES[family] + ["--attention", "xsa"])
    assert standard.state_dict().keys() == xsa.state_dict().keys()
    for name, tensor in standard.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, xsa.state_dict()[name]), name
    with torch.no_grad():
        assert not torch.allclose(standard(TOKENS, POSITIONS, None), xsa(TOKENS, POSITIONS, None))


def _layer_outputs(model):
    """Each transformer layer's output hidden state for TOKENS."""
    outputs = []
    hooks = [
        layer.register_forward_hook(lambda _m, _i, out: outputs.append(out[0]))
        for layer in model.decoder.layers
    ]
    with torch.no_grad():
        logits = model(TOKENS, POSITIONS, None)
    for hook in hooks:
        hook.remove()
    return outputs, logits


def test_xsa_layers_applies_xsa_only_on_the_listed_layers(single_process):
    from megatron_focus.model.core_attention import CoreAttention
    from megatron_focus.model.xsa import XSAAttention

    three = FAMILIES["gpt2"] + ["--num-layers", "3"]
    _, standard = _build(three)
    _, second = _build(three + ["--attention", "xsa", "--xsa-layers", "2"])
    kinds = [type(layer.self_attention.core_attention) for layer in second.decoder.layers]
    assert kinds == [CoreAttention, XSAAttention, CoreAttention]
    assert [layer.layer_number for layer in second.decoder.layers] == [1, 2, 3]

    (ref1, ref2, _), ref_logits = _layer_outputs(standard)
    (out1, out2, _), logits = _layer_outputs(second)
    assert torch.equal(out1, ref1)  # layer 1 is standard attention on the same weights
    assert not torch.allclose(out2, ref2)  # layer 2 is where XSA acts
    assert not torch.allclose(logits, ref_logits)

    _, listed = _build(three + ["--attention", "xsa", "--xsa-layers", "1", "2", "3"])
    _, every = _build(three + ["--attention", "xsa"])
    assert torch.equal(_layer_outputs(listed)[1], _layer_outputs(every)[1])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--xsa-layers", "1"], "needs --attention xsa or focus\\+xsa, not standard"),
        (
            ["--attention", "xsa", "--num-layers", "4", "--xsa-layers", "0", "2", "5"],
            "--xsa-layers 0 5: no such layer; layers are numbered 1 to --num-layers 4",
        ),
    ],
)
def test_bad_xsa_layers_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_args(argv)
