"""Resuming a run: exact continuation, refused mismatches, checkpoints of earlier versions."""

import glob
import json
import os
import shutil

import pytest
import torch

from tiny_runs import TINY, full_weights, tiny_argv, train


def _straight_stopped_resumed(world_size, cache, ckpt, flags, iters, stop):
    """The histories of a run of `iters` iterations, and of the same run stopped at `stop` and
    resumed from its checkpoint."""
    straight = train(world_size, tiny_argv(cache, *flags, iters=iters))
    first = train(
        world_size,
        tiny_argv(cache, *flags, "--save", ckpt, "--exit-interval", str(stop), iters=iters),
    )
    second = train(
        world_size, tiny_argv(cache, *flags, "--save", ckpt, "--load", ckpt, iters=iters)
    )
    return straight, first, second


def test_resume_is_exact_with_dropout(embedded_cache, tmp_path):
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--eval-interval", "3"]
    ckpt = str(tmp_path / "ckpt")
    straight, first, second = _straight_stopped_resumed(1, embedded_cache, ckpt, dropout, 6, 3)
    assert first["losses"] + second["losses"] == straight["losses"]
    assert first["validation"] + second["validation"] == straight["validation"]
    entries = os.listdir(ckpt)
    assert sorted(e for e in entries if e.startswith("iter_")) == ["iter_0000003", "iter_0000006"]
    assert open(os.path.join(ckpt, "latest")).read() == "iter_0000006"


def test_zero3_resume_is_exact_over_two_ranks(embedded_cache, tmp_path):
    """ZeRO-3's weights live partitioned in its optimizer files: a run stopped at 3 continues as
    if uninterrupted, as every other stage does."""
    straight, first, second = _straight_stopped_resumed(
        2, embedded_cache, str(tmp_path / "ckpt"), ["--zero-stage", "3"], 5, 3
    )
    assert first["losses"] + second["losses"] == straight["losses"]


def test_a_changed_schedule_on_resume_is_refused_unless_chosen(embedded_cache, tmp_path):
    """As Megatron-LM: --lr or --train-iters changed on resume is an error, unless
    --override-opt_param-scheduler (this run's values) or --use-checkpoint-opt_param-scheduler
    (the checkpoint's); the LR the resumed run logs shows which won."""
    ckpt = str(tmp_path / "ckpt")
    base = [
        "--save",
        ckpt,
        "--lr-decay-style",
        "constant",
        "--lr-warmup-iters",
        "0",
        "--min-lr",
        "0",
    ]
    train(1, tiny_argv(embedded_cache, *base, "--lr", "1e-3", "--exit-interval", "2"))
    with pytest.raises(
        Exception,
        match=r"schedule differs from the checkpoint's: --lr 0.002 "
        r"\(checkpoint: 0.001\), --lr-decay-iters 6",
    ):
        train(1, tiny_argv(embedded_cache, *base, "--lr", "2e-3", "--load", ckpt, iters=6))
    runs = {}
    for choice in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        shutil.copytree(ckpt, tmp_path / choice)
        runs[choice] = train(
            1,
            tiny_argv(
                embedded_cache,
                *base[2:],
                "--save",
                str(tmp_path / choice),
                "--load",
                str(tmp_path / choice),
                "--lr",
                "2e-3",
                choice,
                iters=3,
            ),
        )
    assert runs["--override-opt_param-scheduler"]["lr"] == [2e-3]
    assert runs["--use-checkpoint-opt_param-scheduler"]["lr"] == [1e-3]


def test_checkpoint_of_another_shape_is_refused(embedded_cache, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    train(1, tiny_argv(embedded_cache, "--save", ckpt, iters=3))
    wider = [a if a != "64" else "128" for a in tiny_argv(embedded_cache, "--load", ckpt, iters=4)]
    with pytest.raises(Exception, match=r"hidden_size: checkpoint 64, this run 128"):
        train(1, wider)


def test_focus_gate_is_recorded_and_older_checkpoints_read_as_log_gate(embedded_cache, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    focus = ["--attention", "focus", "--focus-window", "8", "--focus-groups", "4"]
    train(1, tiny_argv(embedded_cache, *focus, "--save", ckpt, iters=3))
    args_file = os.path.join(ckpt, "iter_0000003", "model_args.json")
    recorded = json.load(open(args_file))
    assert recorded["focus_gate"] == "log"
    assert recorded["seq_length"] == int(TINY[TINY.index("--seq-length") + 1])  # for the tools
    del recorded["focus_gate"]  # as saved before the gate (and checksums) were recorded
    json.dump(recorded, open(args_file, "w"))
    os.remove(os.path.join(ckpt, "iter_0000003", "checksums.json"))
    sigmoid = tiny_argv(embedded_cache, *focus, "--focus-gate", "sigmoid", "--load", ckpt, iters=4)
    with pytest.raises(Exception, match=r"focus_gate: checkpoint 'log', this run 'sigmoid'"):
        train(1, sigmoid)
    resumed = train(
        1,
        tiny_argv(
            embedded_cache, *focus, "--load", ckpt, "--override-opt_param-scheduler", iters=4
        ),
    )  # one more iteration
    assert len(resumed["losses"]) == 1


def _routers(ckpt, tag):
    saved = torch.load(
        os.path.join(ckpt, tag, "mp_rank_00_model_states.pt"),
        map_location="cpu",
        weights_only=False,
    )["module"]
    return {name: value for name, value in saved.items() if ".router." in name}


def test_a_soft_run_continued_in_sparse_mode_is_refused_or_starts_its_optimizer_afresh(
    embedded_cache, tmp_path
):
    """Sparse mode freezes the routers, so a soft run's optimizer state does not fit: resuming
    it is refused before the engine is built, naming --finetune and --no-load-optim, which both
    continue (the routers kept as they were); at ZeRO 3 --no-load-optim is refused too."""
    ckpt = str(tmp_path / "ckpt")
    focus = ["--attention", "focus", "--focus-window", "4", "--focus-groups", "4"]
    sparse = [*focus, "--focus-attention-mode", "sparse", "--save", ckpt, "--load", ckpt]
    train(1, tiny_argv(embedded_cache, *focus, "--save", ckpt, "--exit-interval", "2"))
    refused = (
        r"iter_0000002: its optimizer state covers other weights than this run trains \(this "
        r"run freezes 4: decoder.layers.0.self_attention.core_attention.router.centroids, .*\): "
        r"this run's flags freeze them \(--focus-attention-mode sparse freezes the routers, .*"
        r"To continue it as it was, drop that flag; .*--finetune .*--no-load-optim"
    )
    with pytest.raises(Exception, match=refused):
        train(1, tiny_argv(embedded_cache, *sparse))
    layout_file = os.path.join(ckpt, "iter_0000002", "layout.json")
    layout = json.load(open(layout_file))
    del layout["trained"]  # as saved before it was recorded: DeepSpeed's ZeRO record tells
    json.dump(layout, open(layout_file, "w"))
    os.remove(os.path.join(ckpt, "iter_0000002", "checksums.json"))
    with pytest.raises(Exception, match=refused):
        train(1, tiny_argv(embedded_cache, *sparse))
    assert open(os.path.join(ckpt, "latest")).read() == "iter_0000002"

    continued = train(1, tiny_argv(embedded_cache, *sparse, "--no-load-optim"))
    assert len(continued["losses"]) == 2  # from iteration 2
    assert not [
        n
        for n in json.load(open(os.path.join(ckpt, "iter_0000004", "layout.json")))["trained"]
        if ".router." in n
    ]
    before, after = _routers(ckpt, "iter_0000002"), _routers(ckpt, "iter_0000004")
    assert len(before) == 4 and all(torch.equal(before[n], after[n]) for n in before)
    # the other way: a sparse run's checkpoint continued in soft mode, whose routers would train
    with pytest.raises(
        Exception,
        match=r"iter_0000004: .*\(this run trains 4: .*\): the run that saved it froze them "
        r"\(--focus-attention-mode sparse freezes the routers, .*\)\. To continue it as it was, "
        r"resume with that run's flag; else start from its weights with --finetune",
    ):
        train(1, tiny_argv(embedded_cache, *focus, "--load", ckpt))
    finetuned = train(
        1,
        tiny_argv(
            embedded_cache, *focus, "--focus-attention-mode", "sparse", "--load", ckpt, "--finetune"
        ),
    )
    assert len(finetuned["losses"]) == 4  # from the weights, at iteration 0

    zero3 = str(tmp_path / "zero3")
    train(1, tiny_argv(embedded_cache, *focus, "--zero-stage", "3", "--save", zero3, iters=3))
    with pytest.raises(Exception, match=r"which ZeRO stage 3 cannot load without their optimizer"):
        train(
            1,
            tiny_argv(
                embedded_cache,
                *focus,
                "--focus-attention-mode",
                "sparse",
                "--zero-stage",
                "3",
                "--load",
                zero3,
                "--no-load-optim",
            ),
        )


def _as_saved_before_the_router_moved(ckpt, legacy):
    """A copy of `ckpt` as earlier versions wrote it: each router beside its core attention."""
    from megatron_focus.checkpoint import integrity

    shutil.copytree(ckpt, legacy)
    tag_dir = os.path.join(legacy, open(os.path.join(legacy, "latest")).read())
    shard = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    saved = torch.load(shard, map_location="cpu", weights_only=False)
    old = lambda name: name.replace("core_attention.router", "router")  # noqa: E731
    saved["module"] = {old(k): v for k, v in saved["module"].items()}
    saved["param_shapes"] = [{old(k): v for k, v in g.items()} for g in saved["param_shapes"]]
    info = saved["universal_checkpoint_info"]  # names as regular expressions
    info["tp_replicated_parameter_patterns"] = [
        p.replace(r"core_attention\.router", "router")
        for p in info["tp_replicated_parameter_patterns"]
    ]
    assert sum(".self_attention.router." in k for k in saved["module"]) == 4
    torch.save(saved, shard)
    for path in glob.glob(os.path.join(tag_dir, "*optim_states.pt")):
        optim = torch.load(path, map_location="cpu", weights_only=False)
        slices = optim["optimizer_state_dict"]["param_slice_mappings"]
        slices[:] = [{old(k): v for k, v in group.items()} for group in slices]
        torch.save(optim, path)
    integrity.write(tag_dir, integrity.digests(tag_dir))


def test_checkpoints_with_the_router_beside_core_attention_resume_and_export(
    embedded_cache, tmp_path
):
    """The router moved into the core attention: checkpoints written before resume as they
    did (same layout, and through a layout change) and export the same weights."""
    focus = ["--attention", "focus", "--focus-window", "8", "--focus-groups", "4"]
    ckpt, legacy = str(tmp_path / "ckpt"), str(tmp_path / "legacy")
    stop = ["--save", ckpt, "--exit-interval", "3"]
    train(1, tiny_argv(embedded_cache, *focus, *stop, iters=5))
    _as_saved_before_the_router_moved(ckpt, legacy)
    for layout in ([], ["--zero-stage", "0"]):
        now, before = (
            train(1, tiny_argv(embedded_cache, *focus, *layout, "--load", c, iters=5))
            for c in (ckpt, legacy)
        )
        assert len(now["losses"]) == 2 and now["losses"] == before["losses"]
    now, before = full_weights(ckpt), full_weights(legacy)
    assert now.keys() == before.keys()
    assert all(torch.equal(now[k], before[k]) for k in now)


def _ramp_argv(cache, *extra):
    """A run of 40 samples whose batch grows 2, 2, 4, 6, then 8 (micro-batches of 2): a
    ramp over its first 12 samples, its schedule in samples."""
    tiny, warmup = list(TINY), TINY.index("--lr-warmup-iters")
    del tiny[warmup : warmup + 2]
    tiny[tiny.index("--micro-batch-size") + 1] = "2"
    ramp = ["--rampup-batch-size", "2", "2", "12", "--train-samples", "40"]
    return tiny + ramp + ["--lr-warmup-samples", "6", "--data-cache-path", cache, *extra]


def _megatron_lrs(args, batches):
    """The LR after each step as Megatron-LM sets it: its scheduler built from the sample
    counts (training.py's get_optimizer_param_scheduler), stepped by each step's batch."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.lr)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_samples,
        lr_decay_steps=args.train_samples,  # --lr-decay-samples' default
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_samples,
        wd_incr_style="constant",
    )
    lrs = []
    for batch in batches:
        scheduler.step(batch)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", ["1", "3"])
def test_a_run_stopped_mid_ramp_resumes_exactly(zero_stage, embedded_cache, tmp_path):
    """--rampup-batch-size: a run stopped at iteration 3 (batch 4, the next 6) and resumed ends
    with the losses and weights of the uninterrupted run; the logged batch sizes, consumed
    samples and LRs are Megatron-LM's (its own scheduler as reference)."""
    from megatron_focus.training.arguments import parse_args

    straight_ckpt, ckpt, tb = (str(tmp_path / name) for name in ("straight", "ckpt", "tb"))
    argv = _ramp_argv(embedded_cache, "--zero-stage", zero_stage)
    straight = train(1, argv + ["--save", straight_ckpt, "--tensorboard-dir", tb])
    first = train(1, argv + ["--save", ckpt, "--exit-interval", "3"])
    second = train(1, argv + ["--save", ckpt, "--load", ckpt])
    assert first["losses"] + second["losses"] == straight["losses"]
    assert first["lr"] + second["lr"] == straight["lr"]
    ours, resumed = full_weights(straight_ckpt), full_weights(ckpt)
    assert ours.keys() == resumed.keys()
    assert all(torch.equal(ours[k], resumed[k]) for k in ours)

    # 3 increments over 12 samples, one per 4 consumed: 2 at 0 and 2, 4 at 4, 6 at 8, then 8
    # from 14 (past the ramp) on; 40 samples: the ramp's 14, then 3 whole batches of 8
    batches = [2, 2, 4, 6, 8, 8, 8]
    args = parse_args(argv)
    assert len(straight["losses"]) == args.train_iters == len(batches)
    assert straight["lr"] == pytest.approx(_megatron_lrs(args, batches), rel=1e-12)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    logged = events.Scalars("batch-size vs samples")
    assert [(e.step, e.value) for e in logged] == [
        (sum(batches[: i + 1]), b) for i, b in enumerate(batches)
    ]


@pytest.mark.slow
def test_a_ramp_over_two_data_parallel_ranks_trains_as_one_process(embedded_cache):
    """Each rank takes its share of every grown batch: ZeRO-2 over 2 ranks follows one
    process accumulating the same batches."""
    argv = _ramp_argv(embedded_cache, "--micro-batch-size", "1")  # the ramp's 2: one per rank
    one = train(1, argv + ["--zero-stage", "0"])
    sharded = train(2, argv + ["--zero-stage", "2"])
    torch.testing.assert_close(sharded["losses"], one["losses"], rtol=1e-5, atol=1e-5)
    assert sharded["lr"] == one["lr"]
