"""The kernels a GPU chooses (model/kernels/kernels.py), run on the CPU: the fused Triton kernels
under Triton's interpreter, through the whole model, against the CPU's choices; and the launches one
Focus layer's routing makes per training step as a GPU would make them."""

import pytest
import torch
from interpreted import skip_unless_kernels_run
from launches import count_launches

from megatron_focus.model.kernels import kernels

skip_unless_kernels_run()

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
SMALL += ["--seq-length", "40", "--hidden-dropout", "0", "--attention-dropout", "0"]
FOCUS = ["--focus-window", "4", "--focus-groups", "4", "--focus-chunk-size", "16"]
GQA = ["--group-query-attention", "--num-query-groups", "2"]
GQA_4 = ["--group-query-attention", "--num-query-groups", "1"]  # 4 query heads a key/value head
ROPE = ["--position-embedding-type", "rope"]  # K a new tensor, V a view of the fused QKV


def gpu_choices(monkeypatch):
    """Layers built from here on choose what a GPU with Triton chooses."""
    monkeypatch.setattr(kernels, "has_triton", lambda: True)
    # the interpreter runs the fused gate at its own small tiles in any dtype (which tiles fit
    # a GPU is test_kernel_fit.py's)
    monkeypatch.setattr(kernels, "gate_fits", lambda *args: True)
    cuda = torch.device("cuda")
    for name in ("xsa", "sinkhorn", "lse_attention"):
        monkeypatch.setattr(kernels, name, _on(cuda, getattr(kernels, name)))
    soft_gate = kernels.soft_gate
    monkeypatch.setattr(
        kernels,
        "soft_gate",
        lambda requested, device, *args, **kwargs: soft_gate(requested, cuda, *args, **kwargs),
    )


def _on(device, choose):
    """`choose`, asked for `device` whatever device it is given."""
    return lambda _, *args, **kwargs: choose(device, *args, **kwargs)


def model(argv):
    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args

    platform.manual_seed(1234)
    return build_model(parse_args(SMALL + argv), 256)


def loss_and_grads(net, tokens):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = net(tokens, positions, None)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    net.zero_grad()
    loss.backward()
    return loss, {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["--attention", "focus+xsa"] + FOCUS + GQA,
        ["--attention", "focus", "--focus-gate", "sigmoid"] + FOCUS,
        ["--attention", "focus+xsa"] + FOCUS + GQA_4 + ROPE,
        ["--attention", "focus", "--focus-gate", "sigmoid", "--qk-layernorm"] + FOCUS + GQA_4,
    ],
    ids=["focus+xsa-gqa", "focus-sigmoid", "focus+xsa-rope-gqa4", "focus-sigmoid-qknorm-gqa4"],
)
def test_a_training_step_on_the_gpu_kernels_equals_the_cpu_ones(single_process, monkeypatch, argv):
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    cpu_loss, cpu_grads = loss_and_grads(model(argv), tokens)
    gpu_choices(monkeypatch)
    net = model(argv)
    chosen = kernels.chosen(net)
    assert chosen.pop("sparse") == "flex+varlen" and set(chosen.values()) == {"triton"}, chosen
    gpu_loss, gpu_grads = loss_and_grads(net, tokens)
    torch.testing.assert_close(gpu_loss, cpu_loss, rtol=1e-5, atol=1e-5)
    assert gpu_grads.keys() == cpu_grads.keys() and any(".router." in n for n in gpu_grads)
    for name, grad in gpu_grads.items():
        torch.testing.assert_close(grad, cpu_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("varlen", [False, True], ids=["flex", "flex+varlen"])
def test_a_sparse_training_step_on_the_gpu_kernels_equals_the_cpu_ones(
    single_process, monkeypatch, request, varlen
):
    """Sparse mode trains through FlexAttention's parts on a GPU (recomputed in backward), and
    with inputs that torch's varlen flash kernel takes (half precision), slot 0 through it; here
    eager FlexAttention's CPU backward, let through its device check, stands in for the
    compiled one, and tests/varlen.py's CPU implementation for the varlen ops. The routers get
    no gradient in either."""
    import torch.nn.attention.flex_attention as flex_attention

    argv = ["--attention", "focus", "--focus-attention-mode", "sparse"] + FOCUS + GQA
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    cpu_loss, cpu_grads = loss_and_grads(model(argv), tokens)
    gpu_choices(monkeypatch)
    monkeypatch.setattr(flex_attention, "_validate_device", lambda *tensors: None)
    calls = request.getfixturevalue("cpu_varlen") if varlen else None
    net = model(argv)
    assert kernels.chosen(net)["sparse"] == "flex+varlen"
    gpu_loss, gpu_grads = loss_and_grads(net, tokens)
    if varlen:  # once per layer each way
        assert calls == {"forward": 2, "backward": 2}
    torch.testing.assert_close(gpu_loss, cpu_loss, rtol=1e-5, atol=1e-5)
    assert gpu_grads.keys() == cpu_grads.keys() and not any(".router." in n for n in gpu_grads)
    for name, grad in gpu_grads.items():
        torch.testing.assert_close(grad, cpu_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_later_tokens_change_no_earlier_logit_on_the_gpu_kernels(single_process, monkeypatch):
    gpu_choices(monkeypatch)
    net = model(["--attention", "focus+xsa"] + FOCUS).eval()
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 25:] = torch.randint(0, 256, (2, 15), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40).expand_as(tokens)
    with torch.no_grad():
        before, after = net(tokens, positions, None), net(changed, positions, None)
    assert torch.equal(before[:, :25], after[:, :25])
    assert not torch.equal(before[:, 25:], after[:, 25:])


def test_one_layers_routing_launches_within_budget(single_process, monkeypatch):
    """Router (projection, scores, Sinkhorn, group ranking), forward and backward, as a GPU
    launches it: the Sinkhorn's one per iteration and one more each way (22 at 10 iterations;
    PyTorch's scans: about 300), at most 10 others."""
    from megatron_focus.model.kernels import triton_sinkhorn

    argv = ["--attention", "focus"] + FOCUS + ["--focus-sinkhorn-iters", "10"]
    hidden = torch.randn(40, 2, 64, requires_grad=True)
    cotangent = torch.randn(2, 40, 4)

    def step(net):
        hidden.grad = None  # gradients are assigned, not accumulated, as in a first micro-batch
        net.decoder.layers[0].self_attention.core_attention.router(hidden).log_g.backward(cotangent)

    with count_launches() as eager:
        step(model(argv))
    gpu_choices(monkeypatch)
    net = model(argv)
    fused = (triton_sinkhorn._forward, triton_sinkhorn._backward)
    with count_launches(fused) as launches:
        step(net)
    sinkhorn = [name for name in launches if name in ("_forward", "_backward")]
    assert sinkhorn == ["_forward"] * 11 + ["_backward"] * 11, launches
    assert len(launches) - len(sinkhorn) <= 10, " ".join(launches)
    assert len(eager) > 200, len(eager)


def test_context_parallelism_takes_the_kernels_that_accept_a_query_offset(monkeypatch):
    """On a GPU with Triton, a context-parallel layer takes the fused soft gate (its queries at
    their offset; the Sinkhorn's kernels take the chunks whatever the parallelism); without a
    fitting tile the chunked gate, not FlexAttention's, which takes no offset and is refused by
    name."""
    monkeypatch.setattr(kernels, "has_triton", lambda: True)
    cuda = torch.device("cuda")
    assert kernels.soft_gate("auto", cuda).name == "triton"
    assert kernels.sinkhorn(cuda).name == "triton"
    assert kernels.soft_gate("auto", cuda, context_parallel=True).name == "triton"
    assert kernels.soft_gate("triton", cuda, context_parallel=True).name == "triton"
    monkeypatch.setattr(kernels, "gate_fits", lambda *args: False)
    assert kernels.soft_gate("auto", cuda, head_dim=64, context_parallel=True).name == "chunked"
    assert kernels.soft_gate("auto", cuda, head_dim=64).name == "flex"
    with pytest.raises(ValueError, match="FlexAttention's soft gate takes no query offset"):
        kernels.soft_gate("flex", cuda, context_parallel=True)
    # an A10/L40S at head dim 256 where the table had tiles for the whole sequence and none
    # for a chunk's keys pass (none is missing today: triton_launch's _CHUNK_TILES)
    from megatron_focus.model.kernels import triton_launch

    monkeypatch.undo()
    monkeypatch.setattr(kernels, "has_triton", lambda: True)
    monkeypatch.setattr(kernels, "device_capability", lambda device: (8, 6))
    bf16 = dict(head_dim=256, dtype=torch.bfloat16)
    assert kernels.soft_gate("auto", cuda, context_parallel=True, **bf16).name == "triton"
    monkeypatch.setitem(triton_launch._CHUNK_TILES, ("sm86", "log", 256, "keys"), None)
    assert kernels.soft_gate("auto", cuda, **bf16).name == "triton"
    assert kernels.soft_gate("auto", cuda, context_parallel=True, **bf16).name == "chunked"


def test_attention_dropout_on_a_gpu_says_in_a_warning_what_it_costs(single_process, monkeypatch):
    """The fused soft gate has no dropout: Megatron-LM's default --attention-dropout 0.1 runs
    Focus's layers on the chunked path, and the banner says so in a warning line."""
    gpu_choices(monkeypatch)
    net = model(["--attention", "focus", *FOCUS, "--attention-dropout", "0.1"])
    assert kernels.chosen(net)["soft gate"] == "chunked"
    (warning,) = kernels.warnings(net)
    assert warning.startswith("--attention-dropout 0.1: the fused Focus kernel has no attention")
    assert "--attention-dropout 0, as recent LLM recipes train, runs the fused kernel" in warning
    assert kernels.warnings(model(["--attention", "focus", *FOCUS])) == []
