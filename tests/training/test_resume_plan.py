"""What a run starts from is decided once (`training/resume.py`): each kind of start, from the
flags and the checkpoint folders, before any data or model is built."""

import os

import pytest

from tiny_runs import tiny_argv, train

FOCUS = ["--attention", "focus", "--focus-window", "4", "--focus-groups", "4"]


@pytest.fixture(scope="module")
def checkpoints(embedded_cache, tmp_path_factory):
    """A standard run's checkpoint, and a retrofit's trained-only checkpoint over it."""
    root = tmp_path_factory.mktemp("plans")
    base, retro = str(root / "base"), str(root / "retro")
    train(1, tiny_argv(embedded_cache, "--save", base, iters=3))
    train(
        1,
        tiny_argv(embedded_cache, *FOCUS, "--retrofit", "--load", base, "--save", retro, iters=3),
    )
    return embedded_cache, base, retro


def _plan(cache, *flags):
    from megatron_focus.training import resume
    from megatron_focus.training.arguments import parse_args

    return resume.plan(parse_args(tiny_argv(cache, *flags)))


def test_each_kind_of_start_is_decided_from_the_flags_and_folders(
    checkpoints, single_process, tmp_path
):
    from megatron_focus.checkpoint.saved import DEEPSPEED
    from megatron_focus.training import resume

    cache, base, retro = checkpoints
    base_tag = os.path.join(base, "iter_0000003")
    assert _plan(cache) == resume.ResumePlan()
    own = str(tmp_path / "own")  # --load equal to --save before the first checkpoint: fresh
    assert _plan(cache, "--load", own, "--save", own).kind == resume.FRESH

    resumed = _plan(cache, "--load", base)
    assert (resumed.kind, resumed.checkpoint.path, resumed.base) == (resume.RESUME, base_tag, None)
    assert resumed.checkpoint.format == DEEPSPEED  # decided once, here
    assert resumed.layout is None and resumed.load_optimizer and resumed.load_rng
    assert resumed.checkpoint.model_args["attention"] == "standard"
    assert resumed.retrofit_base is None
    assert not _plan(cache, "--load", base, "--no-load-rng").load_rng
    assert not _plan(cache, "--load", base, "--no-load-optim").load_optimizer

    assert _plan(cache, "--load", base, "--finetune").kind == resume.WEIGHTS
    pretrained = _plan(cache, "--pretrained-checkpoint", base)
    assert (pretrained.kind, pretrained.checkpoint.path) == (resume.WEIGHTS, base_tag)

    adding = _plan(cache, *FOCUS, "--retrofit", "--load", base)
    assert adding.kind == resume.ADDING
    assert adding.retrofit_base == {"load": base, "tag": "iter_0000003"}
    name = "decoder.layers.0.self_attention.core_attention.router.centroids"
    assert adding.may_miss(name) and not adding.may_miss("embedding.word_embeddings.weight")
    assert _plan(cache, *FOCUS, "--retrofit", "--save-full", "--load", base).retrofit_base is None

    # The retrofit's trained-only checkpoint: its base first, then its routers.
    trained_only = _plan(cache, *FOCUS, "--retrofit", "--load", retro)
    assert (trained_only.kind, trained_only.base.path) == (resume.RESUME, base_tag)
    assert trained_only.base.format == DEEPSPEED
    assert trained_only.retrofit_base == adding.retrofit_base
    assert trained_only.may_miss("embedding.word_embeddings.weight")
    assert not trained_only.may_miss(name)


def test_a_load_without_a_checkpoint_is_refused_unless_it_is_the_runs_own(
    checkpoints, single_process, tmp_path
):
    cache, base, _ = checkpoints
    empty = str(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no checkpoint there"):
        _plan(cache, "--load", empty)
    with pytest.raises(FileNotFoundError, match="no checkpoint there"):
        _plan(cache, "--load", empty, "--save", empty, "--finetune")
