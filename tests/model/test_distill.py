"""The routers' distillation (model/focus/distill.py): its target against a dense float64
reference, a loss that trains the routers alone, a router that learns from it to keep the
attention's mass where a random one does not, and the dense warm-up's layers equal to standard
attention."""

import pytest
import torch

from megatron_focus.model.focus.distill import distant_groups, distillation_loss


def dense_reference(q, k, g, window, scale, sink=0, doc_start=None, offset=0):
    """distant_groups from the whole [nq, n] softmax, in float64, head by head."""
    q, k, g = q.double(), k.double(), g.double()
    b, h, nq, _ = q.shape
    n, rep = k.shape[2], h // k.shape[1]
    i = torch.arange(offset, offset + nq)[:, None]
    j = torch.arange(n)[None, :]
    first = torch.zeros(b, n, dtype=torch.long) if doc_start is None else doc_start
    sums = torch.zeros(b, nq, g.shape[-1], dtype=torch.float64)
    masses = torch.zeros(b, nq, dtype=torch.float64)
    for s in range(b):
        f = first[s, offset : offset + nq, None]
        visible = (j <= i) & (j >= f)
        distant = visible & (i - j >= window) & (j >= f + sink)
        for head in range(h):
            scores = q[s, head] @ k[s, head // rep].T * scale
            p = scores.masked_fill(~visible, float("-inf")).softmax(-1) * distant
            sums[s] += p @ g[s]
            masses[s] += p.sum(-1)
    return sums, masses


@pytest.mark.parametrize(
    "heads, kv_heads, n, window, sink, documents, offset",
    [
        (4, 4, 30, 4, 0, None, 0),
        (4, 2, 33, 3, 2, [10, 1, 22], 0),  # GQA, sinks, documents (one of one token)
        (2, 1, 40, 5, 1, [17, 23], 12),  # a context-parallel chunk: queries from position 12
    ],
)
def test_distant_groups_equal_the_dense_softmax(
    heads, kv_heads, n, window, sink, documents, offset
):
    gen = torch.Generator().manual_seed(n)
    b, d, groups = 2, 8, 4
    q = torch.randn(b, heads, n - offset, d, generator=gen)
    k = torch.randn(b, kv_heads, n, d, generator=gen)
    g = torch.randn(b, n, groups, generator=gen).softmax(-1)
    doc_start = None
    if documents is not None:
        firsts = torch.cumsum(torch.tensor([0] + documents[:-1]), 0)
        doc_start = firsts.repeat_interleave(torch.tensor(documents)).expand(b, n)
    kwargs = dict(window=window, scale=d**-0.5, sink=sink, doc_start=doc_start, offset=offset)
    sums, masses = distant_groups(q, k, g, chunk_elements=300, **kwargs)  # several chunks
    want_sums, want_masses = dense_reference(q, k, g, **kwargs)
    torch.testing.assert_close(sums.double(), want_sums, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(masses.double(), want_masses, rtol=1e-5, atol=1e-6)
    assert masses.max() <= heads + 1e-5 and (masses[:, : max(0, window - offset)] == 0).all()


def test_the_loss_is_the_weighted_kl_to_the_attended_groups():
    gen = torch.Generator().manual_seed(0)
    log_g = torch.randn(1, 5, 3, generator=gen).log_softmax(-1).requires_grad_()
    target = torch.randn(1, 5, 3, generator=gen).softmax(-1)
    masses = torch.tensor([[0.0, 0.5, 1.0, 2.0, 0.25]])  # summed over 2 heads
    loss = distillation_loss(log_g, target * masses[..., None], masses, heads=2)
    kl = (target * (target.log() - log_g)).sum(-1)
    weight = masses / 2
    torch.testing.assert_close(loss, (weight * kl).sum() / weight.sum())
    (grad,) = torch.autograd.grad(loss, log_g)
    torch.testing.assert_close(grad, -target * weight[..., None] / weight.sum())


def _router(seed, groups=4, hidden=32):
    from megatron.core.transformer import TransformerConfig

    from megatron_focus import platform
    from megatron_focus.model.focus.focus import Router
    from megatron_focus.variants import FocusConfig

    platform.manual_seed(seed)
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, init_method_std=0.02
    )
    return Router(config, FocusConfig(groups=groups, window=4, distill_coeff=1.0))


def test_a_distilled_router_keeps_the_attention_a_random_one_loses(single_process):
    """Tokens of 4 kinds, each query attending the keys of its kind; the hidden state carries
    the kind under noise of its size. A router trained by the distillation loss alone learns
    to give each kind its group: at top-1 the hard rule then keeps most of the dense attention's
    mass, where the same router untrained keeps little more than the share of pairs it keeps."""
    from megatron_focus.model.focus.groups import Routing
    from megatron_focus.model.focus.routing_quality import kept_mass

    gen = torch.Generator().manual_seed(3)
    b, n, kinds, hidden, d, window = 4, 96, 4, 32, 16, 4
    kind = torch.randint(0, kinds, (b, n), generator=gen)
    signal = torch.randn(kinds, hidden, generator=gen)
    h = (signal[kind] + torch.randn(b, n, hidden, generator=gen)).transpose(0, 1)  # [s, b, h]
    directions = torch.nn.functional.normalize(torch.randn(kinds, d, generator=gen), dim=-1)
    qk = (4 * directions[kind])[:, None]  # [b, 1, n, d]: one head
    scale = d**-0.5 * 4

    def mass_at_top1(router):
        with torch.no_grad():
            return float(kept_mass(qk, qk, router(h), window, scale)[0])

    untrained = _router(seed=7)
    trained = _router(seed=7)
    optimizer = torch.optim.Adam(trained.parameters(), lr=3e-2)
    for _ in range(200):
        log_g = trained(h).log_g
        keys = torch.nn.functional.one_hot(Routing.of(log_g.detach()).groups[..., 0], kinds)
        sums, masses = distant_groups(qk, qk, keys.float(), window, scale)
        loss = distillation_loss(log_g, sums, masses, heads=1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    before, after = mass_at_top1(untrained), mass_at_top1(trained)
    assert after > before + 0.15 and after > 0.6, (before, after)


SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
SMALL += ["--seq-length", "40", "--hidden-dropout", "0", "--attention-dropout", "0"]
FOCUS = ["--focus-window", "4", "--focus-groups", "4", "--focus-chunk-size", "16"]


def _model(argv):
    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args

    platform.manual_seed(1234)
    return build_model(parse_args(SMALL + argv), 256)


def _tokens():
    return torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


def _logits(net, tokens):
    return net(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)


@pytest.mark.parametrize("mode", ["soft", "sparse"])
def test_the_distillation_trains_the_routers_alone(single_process, mode):
    """With the language-modelling loss weighing nothing, the distillation's gradient reaches
    every router's W_g and centroids and no other weight; the logits are those of the run
    without it."""
    from megatron_focus.model.auxiliary import AuxiliaryLoss
    from megatron_focus.model.focus.focus import focus_statistics, recording_statistics

    flags = ["--attention", "focus", *FOCUS, "--focus-attention-mode", mode]
    plain = _logits(_model(flags), _tokens())
    net = _model(flags + ["--focus-distill-coeff", "0.5"])
    AuxiliaryLoss.scale = 1.0
    with recording_statistics(net):
        logits = _logits(net, _tokens())
    torch.testing.assert_close(logits, plain)
    (logits.float().sum() * 0).backward()
    grads = {n: p.grad for n, p in net.named_parameters()}
    routers = {n: g for n, g in grads.items() if ".router." in n}
    assert len(routers) == 4 and all(g is not None and g.abs().sum() > 0 for g in routers.values())
    assert all(g is None or not g.any() for n, g in grads.items() if n not in routers)
    losses = [v for k, v in focus_statistics(net).items() if k.endswith("distill-loss")]
    assert len(losses) == 2 and all(v > 0 for v in losses)


def test_a_dense_warm_up_attends_as_standard_attention(single_process):
    """A Focus layer in the warm-up computes standard causal attention: a Focus model there
    gives the logits of the standard model with its weights."""
    from megatron_focus.model.focus.focus import FocusHooks
    from megatron_focus.variants import FocusConfig

    focus = _model(["--attention", "focus", *FOCUS])
    standard = _model([])
    missing, unexpected = standard.load_state_dict(focus.state_dict(), strict=False)
    assert not missing and all(".router." in name for name in unexpected)
    tokens = _tokens()
    hooks = FocusHooks(FocusConfig(groups=4, window=4, distill_coeff=1.0, dense_warmup_iters=3))
    with hooks.training(focus, 2, start=0):
        dense = _logits(focus, tokens)
    torch.testing.assert_close(dense, _logits(standard, tokens))
    with hooks.training(focus, 3, start=0):  # the warm-up is over: Focus's rule again
        assert not torch.allclose(_logits(focus, tokens), dense)
    with hooks.training(focus, 2, start=5):  # a warm-up that begins at iteration 5
        assert not torch.allclose(_logits(focus, tokens), dense)
