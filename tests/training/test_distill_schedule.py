"""The routers' distillation in a run: a dense warm-up, then Focus's rule; the schedule recorded
in every checkpoint, a run stopped inside the warm-up resuming as if never stopped, a resume that
would change the warm-up refused before any compute, the router loss in the log line."""

import json
import os

import pytest
import torch

from tiny_runs import full_weights, tiny_argv, train

FOCUS = ["--attention", "focus", "--focus-window", "4", "--focus-groups", "4"]
DISTILL = ["--focus-distill-coeff", "1", "--focus-dense-warmup-iters", "3"]


def test_a_run_stopped_in_its_warm_up_resumes_as_if_never_stopped(embedded_cache, tmp_path, capfd):
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    argv = tiny_argv(embedded_cache, *FOCUS, *DISTILL, iters=6)
    train(1, [*argv, "--save", straight])
    out = capfd.readouterr().out
    assert "routers distilled (x1), dense warm-up of 3 iterations" in out
    assert "focus router loss:" in out and "focus kept mass:" in out
    train(1, [*argv, "--save", stopped, "--exit-interval", "2"])
    with open(os.path.join(stopped, "iter_0000002", "schedule.json")) as f:
        assert json.load(f) == {"start": 0, "dense_warmup_iters": 3}
    train(1, [*argv, "--save", stopped, "--load", stopped])
    ours, theirs = full_weights(stopped), full_weights(straight)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


@pytest.mark.parametrize("warmup", ["0", "5"])
def test_a_resume_that_would_change_the_warm_up_is_refused(embedded_cache, tmp_path, warmup):
    ckpt = str(tmp_path / "ckpt")
    argv = tiny_argv(embedded_cache, *FOCUS, *DISTILL, iters=6)
    train(1, [*argv, "--save", ckpt, "--exit-interval", "2"])
    changed = [*argv, "--focus-dense-warmup-iters", warmup]  # the last one counts
    with pytest.raises(
        Exception,
        match=rf"iter_0000002 is at iteration 2 of a run with a dense warm-up of 3 iterations "
        rf"from iteration 0; this run asks --focus-dense-warmup-iters {warmup}: resume with "
        r"--focus-dense-warmup-iters 3, or start anew from its weights with --finetune",
    ):
        train(1, [*changed, "--save", ckpt, "--load", ckpt])


def test_distillation_without_warm_up_trains_the_routers_in_sparse_mode(embedded_cache, tmp_path):
    """Sparse mode keeps the routers out of the optimizer (a hard choice has no gradient) unless
    they are distilled: then they learn, from the distillation alone."""
    ckpt = str(tmp_path / "ckpt")
    argv = [*FOCUS, "--focus-attention-mode", "sparse", "--focus-distill-coeff", "1"]
    train(1, tiny_argv(embedded_cache, *argv, "--save", ckpt, "--save-interval", "1", iters=3))
    first, last = (
        torch.load(os.path.join(ckpt, tag, "mp_rank_00_model_states.pt"), weights_only=False)[
            "module"
        ]
        for tag in ("iter_0000001", "iter_0000003")
    )
    routers = [name for name in first if ".router." in name]
    assert routers and all(not torch.equal(first[name], last[name]) for name in routers)


def test_a_retrofit_distils_its_routers_alone(embedded_cache, tmp_path, capfd):
    """`--retrofit` with distillation: the routers learn from the base model's attention (a
    dense warm-up, then the soft gate), every weight of the base stays bit for bit."""
    base, retrofit = str(tmp_path / "base"), str(tmp_path / "retrofit")
    train(1, tiny_argv(embedded_cache, "--save", base, iters=3))
    argv = [*FOCUS, *DISTILL, "--retrofit", "--load", base, "--save", retrofit]
    train(1, tiny_argv(embedded_cache, *argv, "--lr", "1e-2", iters=5))
    assert "focus router loss:" in capfd.readouterr().out
    before, after = full_weights(base), full_weights(retrofit)
    routers = [name for name in after if ".router." in name]
    assert len(routers) == 4 and set(after) - set(routers) == set(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
