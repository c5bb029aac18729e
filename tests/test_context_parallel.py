"""Context parallelism gives one process's loss and every gradient (the routers' included), for
every variant, both Focus modes, with and without packed documents, and one process's Focus
statistics, the kept mass among them (CPU, gloo)."""

import pytest
import torch

from distributed import run_distributed
from tiny_runs import BATCH, FAMILIES, SEQ, VOCAB, full_weights, tiny_argv, train

FOCUS = ["--focus-window", "4", "--focus-groups", "4", "--focus-chunk-size", "6"]
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids"]
CASES = {
    "standard": FAMILIES["gpt2"],
    "standard-window-documents": FAMILIES["gpt2"] + ["--window-size", "5,0"] + DOCUMENTS,
    "xsa-rope-gqa": FAMILIES["llama-gqa"] + ["--attention", "xsa"],
    "focus": FAMILIES["gpt2"] + ["--attention", "focus"] + FOCUS,
    # the hard rule with gradients (masked chunks), on every rank's chunks
    "focus-sparse": FAMILIES["gpt2"]
    + ["--attention", "focus", "--focus-attention-mode", "sparse"]
    + FOCUS,
    # the Sinkhorn's scan restarts at each document, sinks count from it
    "focus-documents-sinks": FAMILIES["gpt2"]
    + ["--attention", "focus", "--focus-sink-tokens", "2"]
    + FOCUS
    + DOCUMENTS,
    "focus+xsa-rope-gqa": FAMILIES["llama-gqa"] + ["--attention", "focus+xsa"] + FOCUS,
    # the routers' distillation: each rank's queries against every key, its share of the loss
    "focus-distill-documents-sinks": FAMILIES["gpt2"]
    + ["--attention", "focus", "--focus-sink-tokens", "1", "--focus-distill-coeff", "1"]
    + FOCUS
    + DOCUMENTS,
    "focus+xsa-sparse-documents": FAMILIES["gpt2"]
    + ["--attention", "focus+xsa", "--focus-attention-mode", "sparse"]
    + FOCUS
    + DOCUMENTS,
}
EOD = 3
MASS_SAMPLE = 12  # the kept mass's last queries: every context-parallel rank holds some


def _tokens():
    tokens = torch.randint(EOD + 1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    tokens[0, 5] = tokens[0, 11] = tokens[1, 9] = EOD  # documents across chunk boundaries
    return tokens


def _loss_and_grads(argv, tokens):
    """The mean token loss, every gradient (whole, summed over the context-parallel ranks) and
    the Focus layers' statistics (TensorBoard's `focus/...`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from megatron_focus import platform
    from megatron_focus.model.focus.focus import focus_statistics, recording_statistics
    from megatron_focus.model.gpt import build_model
    from megatron_focus.parallel.context_parallel import batch_on_this_rank
    from megatron_focus.parallel.tensor_parallel import (
        gather_tensor_parallel,
        install_sequence_parallel_grad_allreduce,
    )
    from megatron_focus.training.arguments import parse_args

    args = parse_args(argv)
    platform.init_distributed(
        args.tensor_model_parallel_size, context_parallel_size=args.context_parallel_size
    )
    platform.manual_seed(1234)
    model = build_model(args, VOCAB)
    install_sequence_parallel_grad_allreduce(model)
    batch = {
        "tokens": tokens,
        "labels": tokens,
        "position_ids": torch.arange(SEQ).expand_as(tokens),
    }
    if args.reset_attention_mask:
        masks = [_get_ltor_masks_and_position_ids(t, EOD, True, True, False, True) for t in tokens]
        batch["attention_mask"] = torch.stack([m[0] for m in masks])
        batch["position_ids"] = torch.stack([m[2] for m in masks])
    batch = batch_on_this_rank(batch)
    with recording_statistics(model, MASS_SAMPLE):
        per_token = model(
            batch["tokens"],
            batch["position_ids"],
            batch.get("attention_mask"),
            labels=batch["labels"],
        )
    stats = {name: float(value) for name, value in focus_statistics(model).items()}
    loss = per_token.sum() / tokens.numel()  # this rank's share of the mean
    loss.backward()
    cp_group = parallel_state.get_context_parallel_group()
    dist.all_reduce(loss.detach(), group=cp_group)
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:  # the routers in sparse mode: a hard choice has no gradient
            continue
        grad = gather_tensor_parallel(param, param.grad)
        dist.all_reduce(grad, group=cp_group)
        grads[name] = grad
    parallel_state.destroy_model_parallel()
    return loss.item(), grads, stats


def _layouts(tokens, layouts, cases=CASES):
    return {
        case: {name: _loss_and_grads(argv + extra, tokens) for name, extra in layouts.items()}
        for case, argv in cases.items()
    }


CP2 = {"cp1": [], "cp2": ["--context-parallel-size", "2"]}
CP4 = {
    "cp4": ["--context-parallel-size", "4"],
    "tp2-cp2": ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"],
    "tp2-cp2-sp": [
        "--tensor-model-parallel-size",
        "2",
        "--context-parallel-size",
        "2",
        "--sequence-parallel",
    ],
}


@pytest.fixture(scope="module")
def results():
    tokens = _tokens()
    two = run_distributed(_layouts, 2, tokens, CP2)
    four = run_distributed(_layouts, 4, tokens, CP4)
    return {case: {**two[case], **four[case]} for case in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", ["cp2", "cp4", "tp2-cp2", "tp2-cp2-sp"])
def test_context_parallel_matches_one_process(results, case, layout):
    _assert_as_one_process(results[case]["cp1"], results[case][layout], case)
    routers = [name for name in results[case][layout][1] if ".router." in name]
    assert bool(routers) == ("focus" in case and "sparse" not in case)


def _assert_as_one_process(reference, run, case):
    """`run` (loss, gradients, statistics) is one process's `reference`."""
    (ref_loss, ref_grads, ref_stats), (loss, grads, stats) = reference, run
    assert abs(loss - ref_loss) < 1e-5, case
    assert grads.keys() == ref_grads.keys(), case
    for name, ref in ref_grads.items():
        assert grads[name].shape == ref.shape, name
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=name)
    assert stats.keys() == ref_stats.keys(), case
    assert any(name.endswith("kept-mass") for name in stats) == ("focus" in case), case
    assert stats == pytest.approx(ref_stats, rel=1e-5, abs=1e-6), case


FUSED = ["--focus-kernel", "triton"]  # interpreted on the CPU (tests/conftest.py)


@pytest.mark.slow
def test_the_fused_soft_gate_at_each_ranks_offsets_matches_one_process():
    """The Triton soft gate takes each rank's query chunks at their positions: cp2's loss,
    every gradient and statistic equal one process's chunked kernel (documents across chunk
    edges, sinks; RoPE and GQA with XSA on top)."""
    from interpreted import skip_unless_kernels_run

    skip_unless_kernels_run()  # Triton's interpreter runs the kernels on the CPU
    cases = {case: CASES[case] for case in ("focus-documents-sinks", "focus+xsa-rope-gqa")}
    layouts = {"cp1": [], "cp2-fused": ["--context-parallel-size", "2", *FUSED]}
    for case, runs in run_distributed(_layouts, 2, _tokens(), layouts, cases).items():
        _assert_as_one_process(runs["cp1"], runs["cp2-fused"], case)
        assert any(".router." in name for name in runs["cp2-fused"][1])


def _sinkhorn_across(scores, doc_start, iters, size, fused=False):
    """Each context-parallel rank's rows of the causal Sinkhorn (PyTorch's, or the Triton
    kernels interpreted), and the gradient of the scores (summed over ranks) for a fixed
    cotangent."""
    import torch.distributed as dist

    from megatron_focus import platform
    from megatron_focus.model.focus.sinkhorn import causal_sinkhorn
    from megatron_focus.parallel import context_parallel

    platform.init_distributed()
    group, rank = dist.group.WORLD, dist.get_rank()
    rows = context_parallel.positions(scores.shape[1] // size, rank, size)
    mine = scores[:, rows].clone().requires_grad_()
    docs = None if doc_start is None else doc_start[:, rows]
    if fused:
        from megatron_focus.model.kernels.triton_sinkhorn import (
            triton_causal_sinkhorn as causal_sinkhorn,
        )
    log_g = causal_sinkhorn(mine, iters, docs, (rows, group))
    cotangent = torch.linspace(-1, 1, scores.numel(), dtype=scores.dtype).view(scores.shape)
    (log_g * cotangent[:, rows]).sum().backward()
    full = torch.zeros_like(scores)
    full[:, rows] = mine.grad
    dist.all_reduce(full)
    values = torch.zeros_like(scores)
    values[:, rows] = log_g.detach()
    dist.all_reduce(values)
    return values, full


@pytest.mark.parametrize("documents", [False, True])
def test_the_sinkhorn_scan_across_ranks_is_the_one_process_sinkhorn(documents):
    """float64: the scan across 4 ranks (8 chunks) gives the whole sequence's assignments and
    gradient, with documents starting inside, at and across chunk boundaries."""
    from megatron_focus.model.focus.sinkhorn import causal_sinkhorn

    n, groups = 24, 5
    scores = torch.randn(
        2, n, groups, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    doc_start = None
    if documents:
        starts = [[0, 4, 9, 18], [0, 3, 6, 7, 15]]  # 3 and 6, 9 and 18: chunk starts (of 3)
        doc_start = torch.stack(
            [torch.tensor([max(s for s in row if s <= i) for i in range(n)]) for row in starts]
        )
    values, grad = run_distributed(_sinkhorn_across, 4, scores, doc_start, 6, 4)
    whole = scores.clone().requires_grad_()
    ref = causal_sinkhorn(whole, 6, doc_start)
    cotangent = torch.linspace(-1, 1, scores.numel(), dtype=scores.dtype).view(scores.shape)
    (ref * cotangent).sum().backward()
    torch.testing.assert_close(values, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, whole.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("documents", [False, True])
def test_the_sinkhorn_kernels_across_ranks_are_the_one_process_sinkhorn(documents):
    """The Triton kernels (interpreted; 16-token blocks, spans of two) on each rank's two
    chunks, what flows between chunks exchanged between launches: 2 ranks, chunks of 40 tokens
    (three spans each), documents inside a span, across spans and across chunk edges (one over
    three chunks), against the float64 PyTorch Sinkhorn of the whole sequence."""
    from interpreted import skip_unless_kernels_run

    from megatron_focus.model.focus.sinkhorn import causal_sinkhorn

    skip_unless_kernels_run()
    n, groups, iters = 160, 5, 4
    scores = torch.randn(2, n, groups, generator=torch.Generator().manual_seed(5)) * 3
    doc_start = None
    if documents:
        starts = [[0, 7, 45, 150], [0, 40, 52, 119, 120]]
        doc_start = torch.stack(
            [torch.tensor([max(s for s in row if s <= i) for i in range(n)]) for row in starts]
        )
    values, grad = run_distributed(_sinkhorn_across, 2, scores, doc_start, iters, 2, True)
    whole = scores.double().requires_grad_()
    ref = causal_sinkhorn(whole, iters, doc_start)
    cotangent = torch.linspace(-1, 1, scores.numel(), dtype=whole.dtype).view(scores.shape)
    (ref * cotangent).sum().backward()
    torch.testing.assert_close(values.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), whole.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_training_under_context_parallelism_resumes_at_another_size(embedded_cache, tmp_path):
    """pretrain_gpt.py: CP 2 trains as one process does; a run stopped under CP 2 with ZeRO-1
    resumes at CP 2, and at CP 1 (its optimizer shards through the universal checkpoint), with
    the uninterrupted run's losses, and its checkpoint exports the weights a run without CP
    trains; CP 2 with ZeRO-2 and DP 2 trains as DP 2 does, CP 2 with ZeRO-3 as one process."""
    focus = ["--attention", "focus", "--zero-stage", "1"] + FOCUS
    cp2 = ["--context-parallel-size", "2"]
    ckpt = str(tmp_path / "ckpt")
    straight = train(1, tiny_argv(embedded_cache, *focus, iters=4))
    first = train(
        2, tiny_argv(embedded_cache, *focus, *cp2, "--save", ckpt, "--exit-interval", "2", iters=4)
    )
    second = train(1, tiny_argv(embedded_cache, *focus, "--load", ckpt, iters=4))
    again = train(2, tiny_argv(embedded_cache, *focus, *cp2, "--load", ckpt, iters=4))
    alone = str(tmp_path / "alone")  # the same two iterations without CP
    train(1, tiny_argv(embedded_cache, *focus, "--save", alone, "--exit-interval", "2", iters=4))
    exported, reference = full_weights(ckpt), full_weights(alone)
    assert exported.keys() == reference.keys()
    for name, weight in exported.items():
        torch.testing.assert_close(weight, reference[name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(first["losses"], straight["losses"][:2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second["losses"], straight["losses"][2:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again["losses"], straight["losses"][2:], rtol=1e-5, atol=1e-5)

    zero2 = ["--zero-stage", "2"]
    dp2 = train(2, tiny_argv(embedded_cache, *zero2, iters=3))
    dp2_cp2 = train(4, tiny_argv(embedded_cache, *zero2, *cp2, iters=3))
    torch.testing.assert_close(dp2_cp2["losses"], dp2["losses"], rtol=1e-5, atol=1e-5)
    # ZeRO-3 partitions the weights themselves over the CP ranks
    zero3 = ["--attention", "xsa", "--zero-stage", "3"]
    alone3 = train(1, tiny_argv(embedded_cache, *zero3, iters=3))
    cp2_zero3 = train(2, tiny_argv(embedded_cache, *zero3, *cp2, iters=3))
    torch.testing.assert_close(cp2_zero3["losses"], alone3["losses"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cp-comm-type", "p2p"], "only allgather"),
        (["--context-parallel-size", "3"], "world size 2 is not divisible"),
        (["--seq-length", "30"], "cuts --seq-length 30 in 4 chunks"),
    ],
)
def test_unsupported_context_parallel_combinations_are_refused_by_name(flags, message, monkeypatch):
    from megatron_focus.training.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=message):
        parse_args(tiny_argv("/tmp", "--context-parallel-size", "2", *flags, iters=4))
