"""Focus's router controls (`--focus-router random|random-centroids`): the control's parts keep
the values drawn from the seed while everything else trains, the choice is recorded, refused on a
mismatch when resumed, and carried into the exported HF model and back."""

import json
import os

import pytest
import torch

from megatron_focus.hf.export import export_to_hf

from tiny_runs import tiny_argv, train

FOCUS = ["--attention", "focus", "--focus-window", "4", "--focus-groups", "4", "--lr", "1e-2"]


def _module(ckpt, tag):
    shard = os.path.join(ckpt, tag, "mp_rank_00_model_states.pt")
    module = torch.load(shard, map_location="cpu", weights_only=False)["module"]
    return {k: v for k, v in module.items() if "_extra_state" not in k}


def _trained(embedded_cache, tmp_path, router, seed="1234"):
    """(weights after the first step, weights after the third) of a run with `router`."""
    ckpt = str(tmp_path / router)
    argv = [*FOCUS, "--focus-router", router, "--seed", seed, "--save", ckpt]
    train(1, tiny_argv(embedded_cache, *argv, "--save-interval", "1", iters=3))
    return ckpt, _module(ckpt, "iter_0000001"), _module(ckpt, "iter_0000003")


@pytest.mark.parametrize(
    "router, frozen",
    [("learned", ()), ("random", (".proj.", ".centroids")), ("random-centroids", (".centroids",))],
)
def test_a_control_keeps_its_draw_while_the_rest_trains(embedded_cache, tmp_path, router, frozen):
    _, first, last = _trained(embedded_cache, tmp_path, router)
    routers = [name for name in first if ".router." in name]
    assert len(routers) == 4  # two layers: W_g and the centroids
    for name in routers:
        kept = any(part in name for part in frozen)
        assert torch.equal(first[name], last[name]) == kept, name
    others = [name for name in first if ".router." not in name and "weight" in name]
    assert all(not torch.equal(first[name], last[name]) for name in others)


def test_the_control_is_recorded_refused_on_a_mismatch_and_exported(embedded_cache, tmp_path):
    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig
    from megatron_focus.hf.families import from_hf_config

    ckpt, _, last = _trained(embedded_cache, tmp_path, "random")
    with open(os.path.join(ckpt, "iter_0000003", "model_args.json")) as f:
        assert json.load(f)["focus_router"] == "random"
    learned = tiny_argv(embedded_cache, *FOCUS, "--load", ckpt, iters=4)
    with pytest.raises(Exception, match=r"focus_router: checkpoint 'random', this run 'learned'"):
        train(1, learned)
    hf = str(tmp_path / "hf")
    export_to_hf(ckpt, hf, progress=False)
    config = MegatronFocusConfig.from_pretrained(hf)
    assert config.focus_router == "random"
    assert from_hf_config(config)[1].settings.router == "random"


def test_a_retrofit_of_a_random_router_is_refused_before_any_compute():
    """A retrofit trains the routers alone: with both parts frozen nothing would train."""
    from megatron_focus.training.arguments import parse_args

    argv = ["--attention", "focus", "--retrofit", "--load", "/nonexistent"]
    with pytest.raises(ValueError, match="--focus-router random freezes: nothing would train"):
        parse_args(argv + ["--focus-router", "random"])
