"""Focus's GPU kernels on a GPU: the fused Triton kernels and compiled FlexAttention against the
chunked path and the dense references, in fp32 (values and gradients) and bf16, and their memory
growth in n.

Skipped without CUDA (CI has none); `benchmarks/gpu_session.sh` runs them on a lent GPU.
"""

import pytest
import torch

from megatron_focus.model.focus.focus_gate import focus_attention
from megatron_focus.model.focus.focus_sparse import sparse_focus_attention
from megatron_focus.model.focus.groups import Routing
from megatron_focus.model.focus.sinkhorn import causal_sinkhorn

from reference import assignments, dense_hard_rule, reference_focus

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def inputs(b, heads, kv, n, d, groups, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, n, d, generator=gen)
    k, v = (torch.randn(b, kv, n, d, generator=gen) for _ in range(2))
    log_g = causal_sinkhorn(torch.randn(b, n, groups, generator=gen) * 3, 5)
    return [t.cuda().to(dtype).requires_grad_() for t in (q, k, v)] + [
        log_g.cuda().requires_grad_()
    ]


def assert_same_grads(out, ref, inputs):
    """The gradients of q, k, v and the assignments through `out` and `ref`, for one cotangent."""
    cotangent = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, cotangent)
    want = torch.autograd.grad(ref, inputs, cotangent)
    for name, got, expected in zip("qkvg", grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("gate", ["log", "sigmoid"])
@pytest.mark.parametrize(
    "b, heads, kv, n, d, groups, window, sink",
    [
        (2, 4, 2, 777, 64, 8, 128, 0),  # GQA, n not a multiple of the 128-block
        (1, 4, 4, 300, 64, 1, 64, 0),  # K = 1
        (1, 4, 2, 500, 64, 4, 64, 4),  # sinks
    ],
)
def test_flex_soft_focus_equals_chunked_path_fp32(b, heads, kv, n, d, groups, window, sink, gate):
    q, k, v, log_g = inputs(b, heads, kv, n, d, groups)
    kwargs = dict(
        window=window,
        gate_scale=0.7,
        top_k=None,
        chunk_size=128,
        scale=d**-0.5,
        gate=gate,
        sink=sink,
    )
    chunked = focus_attention(q, k, v, Routing.of(log_g), kernel="chunked", **kwargs)
    out = focus_attention(q, k, v, Routing.of(log_g), kernel="flex", **kwargs)
    torch.testing.assert_close(out, chunked, rtol=1e-4, atol=1e-4)
    assert_same_grads(out, chunked, (q, k, v, log_g))
    with pytest.raises(ValueError, match="no tile"):  # fp32: none fits (kernel_fit.py)
        focus_attention(q, k, v, Routing.of(log_g), kernel="triton", **kwargs)


@pytest.mark.parametrize("kernel", ["triton", "flex"])
@pytest.mark.parametrize("heads, kv, d", [(4, 4, 64), (6, 6, 256), (8, 2, 128)])
def test_fused_soft_focus_bf16_is_close_to_the_dense_reference(kernel, heads, kv, d):
    """bf16 (Triton's interpreter cannot check it on the CPU), at the recipes' head sizes."""
    q, k, v, log_g = inputs(1, heads, kv, 512, d, 8, dtype=torch.bfloat16)
    kwargs = dict(window=64, gate_scale=1.0, scale=d**-0.5)
    out = focus_attention(
        q, k, v, Routing.of(log_g), kernel=kernel, top_k=None, chunk_size=128, **kwargs
    )
    ref = reference_focus(
        *(t.detach().float().cpu() for t in (q, k, v, log_g)), top_k=None, **kwargs
    )
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)


def test_fused_xsa_bf16_is_close_to_the_pytorch_projection():
    from megatron_focus.model.kernels.triton_xsa import triton_exclusive_projection
    from megatron_focus.model.xsa import exclusive_projection

    y = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, 1000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = triton_exclusive_projection(y, v)
    ref = exclusive_projection(y.float(), v.float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    dz = torch.randn_like(out)
    for got, want in zip(
        torch.autograd.grad(out, (y, v), dz), torch.autograd.grad(ref, (y, v), dz.float())
    ):
        torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize(
    "n, top_k, how, dtype, sink",
    [
        (3000, 1, "random", torch.float32, 0),
        (3000, 2, "random", torch.float32, 0),
        (600, 2, "lonely", torch.float32, 0),
        (512, 4, "random", torch.float32, 0),
        (700, 3, "coarse", torch.float32, 0),  # exact ties between groups everywhere
        (3000, 2, "random", torch.bfloat16, 0),
        (1000, 2, "random", torch.float32, 4),  # sinks
    ],
)
def test_sparse_dispatch_on_gpu_equals_dense(n, top_k, how, dtype, sink):
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(2, 4, n, 64, generator=gen)
    k, v = (torch.randn(2, 2, n, 64, generator=gen) for _ in range(2))
    log_g = assignments(2, n, 4, gen, how)
    out = sparse_focus_attention(
        *(t.cuda().to(dtype) for t in (q, k, v)),
        Routing.of(log_g.cuda()),
        window=128,
        top_k=top_k,
        scale=0.125,
        sink=sink,
    )
    assert out.dtype == dtype
    ref = dense_hard_rule(*(t.to(dtype).float() for t in (q, k, v)), log_g, 128, top_k, 0.125, sink)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "top_k, sink, dtype, documents",
    [
        (1, 0, torch.float32, True),
        (2, 4, torch.float32, True),
        (1, 0, torch.bfloat16, False),  # slot 0 through torch's varlen flash kernel
        (2, 4, torch.bfloat16, False),
    ],
)
def test_sparse_training_on_gpu_equals_the_dense_hard_rule(top_k, sink, dtype, documents):
    """Gradients of q, k, v through the compiled FlexAttention parts (recomputed in backward,
    given the merge's gradients), and in bf16 through the varlen kernel's backward given the
    merged output and log-sum-exp, against the dense masked hard rule."""
    n = 1500
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(2, 4, n, 64, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, n, 64, generator=gen).to(dtype) for _ in range(2))
    log_g = assignments(2, n, 8, gen)
    doc_start = torch.zeros(2, n, dtype=torch.long)
    doc_start[1, 600:] = 600
    doc_start = doc_start if documents else None
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    out = sparse_focus_attention(
        *leaves, Routing.of(log_g.cuda(), None if doc_start is None else doc_start.cuda()),
        window=128, top_k=top_k, scale=0.125, sink=sink,
    )  # fmt: skip
    references = [t.float().requires_grad_() for t in (q, k, v)]
    ref = dense_hard_rule(*references, log_g, 128, top_k, 0.125, sink, doc_start)
    cotangent = torch.randn(ref.shape, generator=gen)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float().cpu(), ref, rtol=tol, atol=tol)
    grads = torch.autograd.grad(out, leaves, cotangent.cuda().to(dtype))
    want = torch.autograd.grad(ref, references, cotangent)
    for name, got, reference in zip("qkv", grads, want):
        torch.testing.assert_close(got.float().cpu(), reference, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize(
    "top_k, sink, documents, d", [(1, 0, False, 128), (2, 4, True, 64), (3, 0, True, 128)]
)
def test_fused_sparse_kernel_on_gpu_equals_the_dense_hard_rule(top_k, sink, documents, d):
    """The fused kernel (triton_sparse.py) compiled for this GPU, bf16, q, k, v laid out as
    Megatron hands them: output and gradients against the dense masked hard rule. Its fallback
    to the parts (a warning) fails the test."""
    import warnings

    from megatron_focus.model.kernels import kernels

    n, heads, kv = 1500, 4, 2
    gen = torch.Generator().manual_seed(n + top_k)
    qkv = torch.randn(n, 2, kv, (heads // kv + 2) * d, generator=gen).to(torch.bfloat16)
    q, _, v = torch.split(qkv, [heads // kv * d, d, d], dim=-1)
    q = q.reshape(n, 2, heads, d).permute(1, 2, 0, 3)
    v = v.permute(1, 2, 0, 3)
    k = torch.randn(2, kv, n, d, generator=gen).to(torch.bfloat16)
    log_g = assignments(2, n, 8, gen)
    doc_start = torch.zeros(2, n, dtype=torch.long)
    doc_start[1, 600:] = 600
    doc_start = doc_start if documents else None
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sparse_focus_attention(
            *leaves, Routing.of(log_g.cuda(), None if doc_start is None else doc_start.cuda()),
            window=128, top_k=top_k, scale=d**-0.5, sink=sink, kernel=kernels.TRITON_SPARSE,
        )  # fmt: skip
    references = [t.float().requires_grad_() for t in (q, k, v)]
    ref = dense_hard_rule(*references, log_g, 128, top_k, d**-0.5, sink, doc_start)
    cotangent = torch.randn(ref.shape, generator=gen)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=3e-2, atol=3e-2)
    grads = torch.autograd.grad(out, leaves, cotangent.cuda().to(torch.bfloat16))
    want = torch.autograd.grad(ref, references, cotangent)
    for name, got, reference in zip("qkv", grads, want):
        torch.testing.assert_close(got.float().cpu(), reference, rtol=3e-2, atol=3e-2, msg=name)


@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "documents"])
def test_sparse_forward_replayed_as_a_cuda_graph_equals_the_eager_call(monkeypatch, documents):
    """Outside autograd a repeated shape is captured at its second call and replayed (forced
    here whatever its time): each call's output equals the same call without a graph, and no
    capture fails (a warning fails the test)."""
    import warnings

    from megatron_focus.model.focus import focus_sparse
    from megatron_focus.model.kernels import graphs, kernels

    monkeypatch.setattr(focus_sparse, "_host_bound", lambda *args: True)
    monkeypatch.setattr(focus_sparse, "_GRAPHS", graphs.Graphs())
    gen = torch.Generator().manual_seed(1)
    doc_start = torch.zeros(2, 1000, dtype=torch.long)
    doc_start[1, 400:] = 400
    for call in range(4):
        q = torch.randn(2, 4, 1000, 64, generator=gen).cuda().to(torch.bfloat16)
        k, v = (torch.randn(2, 2, 1000, 64, generator=gen).cuda().to(torch.bfloat16)
                for _ in range(2))  # fmt: skip
        routing = Routing.of(
            assignments(2, 1000, 8, gen).cuda(), doc_start.cuda() if documents else None
        )
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            out = sparse_focus_attention(q, k, v, routing, window=128, top_k=2, scale=0.125,
                                         sink=4, kernel=kernels.TRITON_SPARSE)  # fmt: skip
            focus_sparse._GRAPHS.capacity = 0
            eager = sparse_focus_attention(q, k, v, routing, window=128, top_k=2, scale=0.125,
                                           sink=4, kernel=kernels.TRITON_SPARSE)  # fmt: skip
            focus_sparse._GRAPHS.capacity = 4
        torch.testing.assert_close(out, eager, rtol=0, atol=0, msg=f"call {call}")
    assert len(focus_sparse._GRAPHS.graphs) == 1


def test_sparse_training_replayed_as_cuda_graphs_equals_the_eager_step(monkeypatch):
    """A training shape bound by the host (forced here): its forward and its backward each
    captured at their second call and replayed. Two layers a step, three steps: outputs and
    gradients equal the same step without graphs bit for bit, and no capture fails."""
    import warnings

    from megatron_focus.model.focus import focus_sparse
    from megatron_focus.model.kernels import graphs, kernels

    monkeypatch.setattr(focus_sparse, "_host_bound", lambda *args: True)
    monkeypatch.setattr(focus_sparse, "_GRAPHS", graphs.Graphs())
    gen = torch.Generator().manual_seed(2)

    def leaf(heads):
        x = torch.randn(1000, 2, heads, 64, generator=gen).cuda().to(torch.bfloat16)
        return x.permute(1, 2, 0, 3).requires_grad_()  # the model's layout

    for step in range(3):
        layers = [((leaf(4), leaf(2), leaf(2)), Routing.of(assignments(2, 1000, 8, gen).cuda()))
                  for _ in range(2)]  # fmt: skip
        weights = [torch.randn(2, 4, 1000, 64, generator=gen).cuda() for _ in layers]

        def run():
            outs = [sparse_focus_attention(*qkv, routing, window=128, top_k=2, scale=0.125,
                                           sink=4, kernel=kernels.TRITON_SPARSE)
                    for qkv, routing in layers]  # fmt: skip
            loss = sum((o.float() * w).sum() for o, w in zip(outs, weights))
            return outs, torch.autograd.grad(loss, [t for qkv, _ in layers for t in qkv])

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            graphed = run()
        focus_sparse._GRAPHS.capacity = 0
        eager = run()
        focus_sparse._GRAPHS.capacity = 4
        for got, want in zip((*graphed[0], *graphed[1]), (*eager[0], *eager[1])):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step}")
    assert len(focus_sparse._GRAPHS.graphs) == 2  # one forward, one backward


def test_packed_documents_on_gpu_equal_the_chunked_path():
    """--reset-attention-mask: FlexAttention's soft gate (values, gradients) and the sparse
    dispatch on the GPU against the chunked paths (checked per document on the CPU,
    tests/model/test_documents.py)."""
    n, window = 700, 64
    q, k, v, log_g = inputs(2, 4, 2, n, 64, 8)
    starts = torch.zeros(2, n, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, [100, 101, 451]] = True  # documents of 100, 1, 350 and 249 tokens; one of 700
    doc_start = torch.cummax(torch.where(starts, torch.arange(n), 0), dim=1).values.cuda()
    routing = Routing.of(log_g, doc_start)
    kwargs = dict(window=window, gate_scale=0.7, chunk_size=128, scale=0.125, sink=4)
    flex = focus_attention(q, k, v, routing, kernel="flex", top_k=None, **kwargs)
    chunked = focus_attention(q, k, v, routing, kernel="chunked", top_k=None, **kwargs)
    torch.testing.assert_close(flex, chunked, rtol=1e-4, atol=1e-4)
    assert_same_grads(flex, chunked, (q, k, v, log_g))
    with torch.no_grad():
        sparse = sparse_focus_attention(
            q, k, v, routing, window=window, top_k=2, scale=0.125, sink=4
        )
        masked = focus_attention(q, k, v, routing, kernel="chunked", top_k=2, **kwargs)
    torch.testing.assert_close(sparse, masked, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "documents"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_dispatch_on_gpu_does_not_wait_for_the_host(training, documents, dtype):
    """The GPU sparse path queues its kernels without a host synchronisation (any would stall
    the GPU once per layer), with packed documents too, forward and backward; bf16 with one
    document runs slot 0 through the varlen kernel."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1000, 64, generator=gen).cuda().to(dtype).requires_grad_(training)
    k, v = (
        torch.randn(2, 2, 1000, 64, generator=gen).cuda().to(dtype).requires_grad_(training)
        for _ in range(2)
    )
    doc_start = torch.zeros(2, 1000, dtype=torch.long)
    doc_start[0, 300:] = 300
    routing = Routing.of(
        assignments(2, 1000, 8, gen, "random").cuda(), doc_start.cuda() if documents else None
    )

    def attend():
        out = sparse_focus_attention(q, k, v, routing, window=128, top_k=2, scale=0.125)
        if training:
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    attend()  # compiles FlexAttention first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attend()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def test_soft_and_sparse_memory_grow_linearly_on_gpu():
    def soft_step(n):
        q, k, v, log_g = inputs(1, 8, 8, n, 64, 8, dtype=torch.bfloat16)
        return lambda: (
            focus_attention(
                q,
                k,
                v,
                Routing.of(log_g),
                kernel="flex",
                window=128,
                gate_scale=1.0,
                top_k=None,
                chunk_size=128,
                scale=0.125,
            )
            .sum()
            .backward()
        )

    def sparse_call(n):
        q, k, v, log_g = (t.detach() for t in inputs(1, 8, 8, n, 64, 8, dtype=torch.bfloat16))
        return lambda: sparse_focus_attention(
            q, k, v, Routing.of(log_g), window=128, top_k=2, scale=0.125
        )

    for make, small, large in ((soft_step, 8192, 32768), (sparse_call, 16384, 65536)):
        make(small)()  # compile first
        ratio = _peak_bytes(make(large)) / _peak_bytes(make(small))
        assert ratio < 1.5 * large / small, (make.__name__, ratio)


def test_focus_model_step_on_flex_equals_chunked(single_process):
    """The GPT model as the trainer builds it (Megatron's permuted q, k, v views, the router's
    gathered assignments): one step's loss and gradients, flex against chunked, fp32."""
    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args

    argv = [
        "--num-layers",
        "2",
        "--hidden-size",
        "128",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "600",
        "--max-position-embeddings",
        "600",
        "--attention",
        "focus+xsa",
        "--focus-window",
        "64",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
    ]
    tokens = torch.randint(0, 256, (2, 600), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(600, device="cuda").expand_as(tokens)
    results = {}
    for kernel in ("flex", "chunked"):
        platform.manual_seed(1)
        model = build_model(parse_args(argv + ["--focus-kernel", kernel]), 256)
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        results[kernel] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(results["flex"][0], results["chunked"][0], rtol=1e-5, atol=1e-5)
    for name, grad in results["chunked"][1].items():
        assert grad is not None, name
        torch.testing.assert_close(results["flex"][1][name], grad, rtol=1e-3, atol=1e-5, msg=name)
    assert any(".router." in name for name in results["flex"][1])


@pytest.mark.parametrize("extra", [["--position-embedding-type", "rope"], ["--qk-layernorm"]],
                         ids=["rope", "qk-norm"])  # fmt: skip
def test_rope_gqa_model_on_the_fused_kernels_equals_chunked_bf16(single_process, extra):
    """The model as the recipes build it (RoPE or QK-norm: K a new tensor, V a view of the
    fused QKV output; GQA 4:1), bf16, on the kernels this GPU chooses (fused Triton gate, XSA
    and Sinkhorn) against the chunked gate: one step's loss and gradients within bf16's
    rounding."""
    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model
    from megatron_focus.model.kernels import kernels
    from megatron_focus.training.arguments import parse_args

    argv = (
        "--num-layers 2 --hidden-size 256 --num-attention-heads 8 --group-query-attention "
        "--num-query-groups 2 --seq-length 700 --max-position-embeddings 700 --attention "
        "focus+xsa --focus-window 64 --hidden-dropout 0 --attention-dropout 0 --bf16"
    ).split() + extra
    tokens = torch.randint(0, 256, (2, 700), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(700, device="cuda").expand_as(tokens)
    results = {}
    for kernel in ("auto", "chunked"):
        platform.manual_seed(1)
        model = build_model(parse_args(argv + ["--focus-kernel", kernel]), 256).bfloat16()
        if kernel == "auto":
            assert kernels.chosen(model)["soft gate"] == "triton", kernels.chosen(model)
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        results[kernel] = (loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()})
    torch.testing.assert_close(results["auto"][0], results["chunked"][0], rtol=1e-2, atol=1e-2)
    # Relative to the gradient, but never to less than a thousandth of the largest one: some are
    # zero in exact arithmetic (QK-norm's K bias shifts every logit of a row alike, and softmax
    # is blind to that), so there both paths hold bf16's rounding noise, not a gradient.
    grads = results["chunked"][1]
    floor = 1e-3 * max(grad.norm() for grad in grads.values())
    for name, grad in grads.items():
        error = (results["auto"][1][name] - grad).norm() / torch.maximum(grad.norm(), floor)
        assert error < 3e-2, f"{name}: relative error {error:.3g}"


def test_exported_models_sparse_prefill_on_the_fused_kernel_equals_its_own_path(monkeypatch):
    """The HF export in sparse mode, bf16: a whole prompt's prefill on megatron-focus's fused
    kernel gives the logits of the export's own path (bf16's rounding differs between the two:
    greedy tokens may part at a near tie), and generate() runs through it."""
    import os

    from megatron_focus.hf import modeling_megatron_focus as hf

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "hf"))
    from test_sparse_prefill_kernel import _model

    model = _model(2).cuda().to(torch.bfloat16)
    ids = torch.randint(4, 96, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    assert hf.fused_sparse_kernel(torch.zeros(1, 4, 8, 16, device="cuda", dtype=torch.bfloat16))
    with torch.no_grad():
        fused = model(ids).logits.float()
        tokens = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
        monkeypatch.setattr(hf, "fused_sparse_kernel", lambda q: None)
        own = model(ids).logits.float()
        own_tokens = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(fused, own, rtol=5e-2, atol=5e-2)
    assert tokens.shape == own_tokens.shape == (1, 308)


@pytest.mark.parametrize("mode", ["sparse", "soft"])
def test_exported_models_decoding_steps_as_cuda_graphs_equal_the_eager_steps(monkeypatch, mode):
    """generate() with a StaticCache on a GPU compiles its decoding step as transformers does
    by default (inductor, "reduce-overhead": CUDA graphs), none skipped: the tokens and scores
    of the eager default cache."""
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "hf"))
    from test_static_cache import _generate, _model, _prompt

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _model().cuda()
    ids, mask = (t.cuda() for t in _prompt())
    graphed = _generate(model, ids, mask, focus_attention_mode=mode, cache_implementation="static")
    eager = _generate(model, ids, mask, focus_attention_mode=mode)
    assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    assert torch.equal(graphed.sequences, eager.sequences)
    for a, b in zip(graphed.scores, eager.scores):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_decoding_kernel_on_gpu_equals_the_dense_hard_rule(monkeypatch, dtype):
    """The static cache's decoding step (triton_decode.py) compiled for this GPU, every layout
    case of its interpreter test, against the float64 rule."""
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "model"))
    from test_triton_decode import CASES, _dense_rule, _static_cache

    for name, case in CASES.items():
        inputs = _static_cache(case, dtype, torch.Generator().manual_seed(len(name)))
        inputs = tuple(t.cuda() if torch.is_tensor(t) else t for t in inputs)
        q, k, v, bucket, chosen, position, window, groups = inputs
        out = torch.ops.megatron_focus.slot_decode(q, k, v, bucket, chosen, position, window,
                                                   groups, q.shape[-1] ** -0.5)  # fmt: skip
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), _dense_rule(*inputs), rtol=tolerance,
                                   atol=tolerance, msg=name)  # fmt: skip


def test_exported_models_bf16_decoding_graph_takes_the_sparse_kernel(monkeypatch):
    """bf16 on a GPU with megatron-focus: each graphed decoding step takes the kernel that
    reads the kept slots alone; its logits are the slot mask's (bf16's rounding differs)."""
    import os

    from megatron_focus.hf import modeling_megatron_focus as hf

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "hf"))
    from test_static_cache import _generate, _model, _prompt

    torch._dynamo.reset()
    model = _model().cuda().to(torch.bfloat16)
    ids, mask = (t.cuda() for t in _prompt())
    assert hf.slot_decode_kernel(torch.zeros(1, 4, 1, 16, device="cuda", dtype=torch.bfloat16))
    graphed = _generate(model, ids, mask, focus_attention_mode="sparse",
                        cache_implementation="static")  # fmt: skip
    monkeypatch.setattr(hf, "slot_decode_kernel", lambda q: None)
    masked = _generate(model, ids, mask, focus_attention_mode="sparse",
                       cache_implementation="static", disable_compile=True)  # fmt: skip
    # the prompt is the same eager path in both: the first step reads the same cache
    assert torch.equal(
        graphed.sequences[:, : ids.shape[1] + 1], masked.sequences[:, : ids.shape[1] + 1]
    )
    torch.testing.assert_close(graphed.scores[1], masked.scores[1], rtol=5e-2, atol=5e-2)
