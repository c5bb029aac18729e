"""Resuming at another layout (TP, DP, ZeRO stage): the run continues as if uninterrupted, with
the optimizer state carried tensor by tensor."""

import glob
import os

import torch

from tiny_runs import tiny_argv, train

TP2 = ["--tensor-model-parallel-size", "2"]
# fp32 sums in another order: a few ulps on the losses, somewhat more on the second moments.
NOISE = dict(rtol=1e-5, atol=1e-5)


def _universal(ckpt, tag, layout, tmp_path):
    """{(parameter, state): full tensor} of a checkpoint, through DeepSpeed's universal format."""
    from megatron_focus.checkpoint import universal

    out = str(tmp_path / f"universal-{os.path.basename(ckpt)}")
    trained = [[]]  # stage 0 sources name their states from the model's groups; unused here
    universal.to_universal(os.path.join(ckpt, tag), out, layout, trained, 1024, False)
    files = glob.glob(os.path.join(out, "zero", "*", "*.pt"))
    return {
        (f.split(os.sep)[-2], os.path.basename(f)): torch.load(f)["param"]
        for f in files
        if not f.endswith("step.pt")
    }


def _saved_layout(ckpt, tag):
    from megatron_focus.checkpoint.format import read_layout

    return read_layout(os.path.join(ckpt, tag))


def _chain(cache, ckpt, legs, iters_per_leg=2):
    """Histories of one run passed through `legs` (flag lists), `iters_per_leg` iterations each."""
    histories = []
    for i, flags in enumerate(legs):
        stop = (i + 1) * iters_per_leg
        load = ["--load", ckpt] if i else []
        histories.append(
            train(
                2,
                tiny_argv(
                    cache,
                    *flags,
                    "--save",
                    ckpt,
                    *load,
                    "--exit-interval",
                    str(stop),
                    iters=len(legs) * iters_per_leg,
                ),
            )
        )
    return histories


def test_tp2_resumes_at_tp1_dp2_with_its_optimizer_state(embedded_cache, tmp_path):
    swiglu = ["--swiglu"]
    straight_dir, chain_dir = str(tmp_path / "straight"), str(tmp_path / "chain")
    straight = train(
        2, tiny_argv(embedded_cache, *swiglu, *TP2, "--zero-stage", "1", "--save", straight_dir)
    )
    first, second = _chain(
        embedded_cache,
        chain_dir,
        [swiglu + TP2 + ["--zero-stage", "1"], swiglu + ["--zero-stage", "1"]],
    )
    torch.testing.assert_close(first["losses"] + second["losses"], straight["losses"], **NOISE)
    assert _saved_layout(chain_dir, "iter_0000004")["data_parallel_size"] == 2
    ours = _universal(chain_dir, "iter_0000004", _saved_layout(chain_dir, "iter_0000004"), tmp_path)
    theirs = _universal(
        straight_dir, "iter_0000004", _saved_layout(straight_dir, "iter_0000004"), tmp_path
    )
    assert ours.keys() == theirs.keys() and len(ours) > 20
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], **NOISE, msg=str(key))


def test_zero_stage_1_then_3_then_0_then_tp2(embedded_cache, tmp_path):
    """Every stage as source and target, ZeRO-3's partitioned weights and stage 0's plain AdamW
    state included; the last leg also changes TP and the data-parallel size."""
    straight_dir, chain_dir = str(tmp_path / "straight"), str(tmp_path / "chain")
    legs = [
        ["--zero-stage", "1"],
        ["--zero-stage", "3"],
        ["--zero-stage", "0"],
        ["--zero-stage", "2", *TP2],
    ]
    straight = train(
        2, tiny_argv(embedded_cache, "--zero-stage", "1", "--save", straight_dir, iters=8)
    )
    chain = _chain(embedded_cache, chain_dir, legs)
    torch.testing.assert_close(
        [loss for leg in chain for loss in leg["losses"]], straight["losses"], **NOISE
    )
    tag = "iter_0000008"
    ours = _universal(chain_dir, tag, _saved_layout(chain_dir, tag), tmp_path)
    theirs = _universal(straight_dir, tag, _saved_layout(straight_dir, tag), tmp_path)
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], **NOISE, msg=str(key))
