"""Tensor and sequence parallelism give the same loss and gradients as one process (CPU, gloo)."""

import pytest
import torch

from distributed import run_distributed
from tiny_runs import BATCH, FAMILIES, SEQ, VOCAB

# XSA on the plainest family and on one with RoPE and GQA (under TP=2: one key/value group per
# rank, shared by that rank's two query heads).
XSA = ["--attention", "xsa"]
FOCUS = [
    "--attention",
    "focus",
    "--focus-window",
    "4",
    "--focus-groups",
    "4",
    "--focus-chunk-size",
    "6",
]
CASES = {
    **FAMILIES,
    "gpt2-xsa": FAMILIES["gpt2"] + XSA,
    "llama-gqa-xsa": FAMILIES["llama-gqa"] + XSA,
    # Focus: router parameters replicated over TP, routing input gathered under SP
    "gpt2-focus": FAMILIES["gpt2"] + FOCUS,
    "llama-gqa-focus+xsa": FAMILIES["llama-gqa"] + FOCUS + ["--attention", "focus+xsa"],
    # packed documents: the routing restarts at each one, from the full mask under SP too
    "gpt2-focus-documents": FAMILIES["gpt2"]
    + FOCUS
    + ["--reset-attention-mask", "--reset-position-ids"],
    # sparse mode trains through the kept pairs only, on each rank's heads (routers frozen)
    "llama-gqa-focus-sparse-documents": FAMILIES["llama-gqa"]
    + FOCUS
    + ["--focus-attention-mode", "sparse", "--reset-attention-mask", "--reset-position-ids"],
    # the routers' distillation: each rank's heads' share of the target summed, the routers'
    # gradients from it those of one process (W_g's summed over the sequence's slices under SP)
    "llama-gqa-focus-distill-documents": FAMILIES["llama-gqa"]
    + FOCUS
    + ["--focus-distill-coeff", "1", "--reset-attention-mask", "--reset-position-ids"],
    # fewer key/value groups than TP ranks: Megatron gives each rank a copy of the one group
    "llama-mqa-xsa": FAMILIES["llama"]
    + ["--group-query-attention", "--num-query-groups", "1"]
    + XSA,
    # query/key norms see only their rank's heads: their gradients are summed over TP, SP or not
    "llama-gqa-qk-norm-1p": FAMILIES["llama-gqa"] + ["--qk-layernorm", "--apply-layernorm-1p"],
    "gpt2-qk-norm-relu2-nope": FAMILIES["gpt2"]
    + ["--qk-layernorm", "--squared-relu", "--position-embedding-type", "none"],
}
EOD = 3  # the documents' end in the tokens (each sequence has one)


def _loss_and_grads(argv, tokens):
    from megatron.core import parallel_state
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from megatron_focus import platform
    from megatron_focus.model.focus.focus import focus_statistics, recording_statistics
    from megatron_focus.model.gpt import build_model
    from megatron_focus.parallel.tensor_parallel import (
        gather_tensor_parallel,
        install_sequence_parallel_grad_allreduce,
    )
    from megatron_focus.training.arguments import parse_args

    args = parse_args(argv)
    platform.init_distributed(args.tensor_model_parallel_size)
    platform.manual_seed(1234)
    model = build_model(args, VOCAB)
    positions, mask = torch.arange(SEQ).expand(BATCH, SEQ), None
    if args.reset_attention_mask:
        masks = [_get_ltor_masks_and_position_ids(t, EOD, True, True, False, True) for t in tokens]
        mask = torch.stack([m[0] for m in masks])
        positions = torch.stack([m[2] for m in masks])

    def backward():
        model.zero_grad()
        loss = model(tokens, positions, mask, labels=tokens).mean()
        loss.backward()
        return loss

    with recording_statistics(model):
        backward()  # without the sequence-parallel hooks: norm gradients stay partial
    mass = {k: float(v) for k, v in focus_statistics(model).items() if k.endswith("kept-mass")}
    # (no gradient: the routers in sparse mode, whose groups are a hard choice)
    trained = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    unsynced = {n: p.grad.clone() for n, p in trained if getattr(p, "sequence_parallel", False)}
    install_sequence_parallel_grad_allreduce(model)
    loss = backward()
    grads = {n: gather_tensor_parallel(p, p.grad) for n, p in trained}
    parallel_state.destroy_model_parallel()
    return loss.item(), grads, unsynced, mass


def _compare_parallel_layouts(tokens):
    """On 2 ranks: TP=1 (data-parallel replicas), TP=2, TP=2 with SP, for every case."""
    out = {}
    for family, argv in CASES.items():
        out[family] = {
            layout: _loss_and_grads(argv + extra, tokens)
            for layout, extra in {
                "tp1": [],
                "tp2": ["--tensor-model-parallel-size", "2"],
                "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
            }.items()
        }
    return out


def _dropout_streams():
    """What each rank draws inside Megatron's TP stream (the one attention dropout uses)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_focus import platform

    draws = {}
    for tp in (1, 2):
        platform.init_distributed(tp)
        platform.manual_seed(1234)
        with get_cuda_rng_tracker().fork():
            mine = torch.rand(4)
        both = [torch.empty(4) for _ in range(2)]
        dist.all_gather(both, mine)
        draws[tp] = both
        parallel_state.destroy_model_parallel()
    return draws


def _compare_all(tokens):
    return _compare_parallel_layouts(tokens), _dropout_streams()


@pytest.fixture(scope="module")
def results():
    tokens = torch.randint(EOD + 1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    tokens[:, SEQ // 3] = EOD
    layouts, streams = run_distributed(_compare_all, 2, tokens)
    return dict(layouts, dropout_streams=streams)


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("layout", ["tp2", "tp2-sp"])
def test_tensor_parallel_matches_one_process(results, family, layout):
    ref_loss, ref_grads, _, _ = results[family]["tp1"]
    loss, grads, _, _ = results[family][layout]
    assert abs(loss - ref_loss) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert grads[name].shape == ref.shape, name
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", list(CASES))
def test_sequence_parallel_norm_grads_need_the_allreduce(results, family):
    """Under SP each rank's norm gradient is partial; only the TP all-reduce makes it whole."""
    _, ref_grads, _, _ = results[family]["tp1"]
    _, _, unsynced, _ = results[family]["tp2-sp"]
    norms = [
        n
        for n in unsynced
        if n.endswith("layernorm.weight")
        and not n.endswith(("q_layernorm.weight", "k_layernorm.weight"))
    ]
    assert len(norms) == 2 * 2 + 1  # two per layer and the final norm
    for name in norms:
        assert not torch.allclose(unsynced[name], ref_grads[name], rtol=1e-3, atol=1e-5), name
    # Query/key norms see only their rank's heads: partial under TP alone too.
    _, _, unsynced, _ = results[family]["tp2"]
    qk_norms = [n for n in unsynced if n.endswith(("q_layernorm.weight", "k_layernorm.weight"))]
    assert len(qk_norms) == (4 if "--qk-layernorm" in CASES[family] else 0)
    for name in qk_norms:
        assert not torch.allclose(unsynced[name], ref_grads[name], rtol=1e-3, atol=1e-5), name


@pytest.mark.parametrize("family", [f for f in CASES if "focus" in f])
@pytest.mark.parametrize("layout", ["tp2", "tp2-sp"])
def test_kept_mass_is_the_mean_over_every_ranks_heads(results, family, layout):
    """Each TP rank measures its heads' kept mass; the statistic is that of all heads."""
    want, got = results[family]["tp1"][3], results[family][layout][3]
    assert len(want) == 2 and got.keys() == want.keys()
    for name, value in want.items():
        assert 0 < value <= 1 and abs(got[name] - value) < 1e-5, name


def test_dropout_streams_differ_across_tp_ranks_only(results):
    streams = results["dropout_streams"]
    assert torch.equal(streams[1][0], streams[1][1])  # TP=1: two data-parallel replicas agree
    assert not torch.equal(streams[2][0], streams[2][1])  # TP=2: each rank its own heads' stream


def _params_norm(argv):
    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model
    from megatron_focus.parallel.tensor_parallel import params_norm
    from megatron_focus.training.arguments import parse_args

    args = parse_args(argv)
    platform.init_distributed(args.tensor_model_parallel_size)
    platform.manual_seed(args.seed)
    model = build_model(args, 200)
    direct = sum(p.double().square().sum() for p in model.parameters()).sqrt().item()
    return params_norm(model).item(), direct


def test_params_norm_counts_each_weight_once_at_any_tensor_parallel_size():
    """`--log-params-norm`: the same model (weights built on the CPU, split by TP) has one norm."""
    argv = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--swiglu",
    ]
    tp1, direct = run_distributed(_params_norm, 1, argv)
    tp2, _ = run_distributed(_params_norm, 2, argv + ["--tensor-model-parallel-size", "2"])
    assert tp1 == pytest.approx(direct, rel=1e-6) and tp2 == pytest.approx(tp1, rel=1e-6)
