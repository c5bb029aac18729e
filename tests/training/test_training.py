"""pretrain_gpt.py end to end on the CPU: DeepSpeed parity, bad flags, logs, schedules."""

import glob
import json
import math
import os
import re

import pytest
import torch

from distributed import run_distributed
from tiny_runs import TINY, launch, run_pretrain, tiny_argv, train


class _Payload:
    """Pickled, it creates `path` as it is unpickled: code that a checkpoint runs at load."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _crafted(folder, name, content):
    """Replace a checkpoint file as someone crafting it would: checksums to match."""
    from megatron_focus.checkpoint import integrity

    torch.save(content, folder / name)
    integrity.write(str(folder), integrity.digests(str(folder)))


def test_checkpoints_with_pickled_code_are_refused(embedded_cache, tmp_path):
    """Resume (our read and DeepSpeed's) and export read tensors and DeepSpeed's records only."""
    from megatron_focus.hf import export_to_hf

    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    train(1, tiny_argv(embedded_cache, "--save", str(ckpt), "--exit-interval", "3", iters=4))
    tag = ckpt / "iter_0000003"
    files = sorted(f for f in os.listdir(tag) if f.endswith(".pt"))
    assert files == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    for name in files:  # each file DeepSpeed reads: the model's and the optimizer's
        original = torch.load(tag / name, weights_only=False)
        _crafted(tag, name, {**original, "extra": _Payload(str(marker))})
        with pytest.raises(Exception, match=f"{name} holds pickled objects that could run code"):
            train(1, tiny_argv(embedded_cache, "--save", str(ckpt), "--load", str(ckpt), iters=4))
        _crafted(tag, name, original)
    _crafted(
        tag,
        files[0],
        {**torch.load(tag / files[0], weights_only=False), "extra": _Payload(str(marker))},
    )
    with pytest.raises(ValueError, match="--allow-unsafe-checkpoints"):
        export_to_hf(str(ckpt), str(tmp_path / "hf"), progress=False)
    assert not marker.exists()


# Untied, the input embedding's rows of tokens absent from a batch get exactly zero gradient:
# at least (4096 - 8 x 32) x 64 zeros per step for --log-num-zeros-in-grad to count.
ZEROS = ["--log-num-zeros-in-grad", "--untie-embeddings-and-output-weights"]
STRUCTURAL_ZEROS = (4096 - 8 * 32) * 64


@pytest.mark.slow
def test_zero_data_parallel_matches_one_process(embedded_cache):
    """ZeRO-2 and ZeRO-3 over 2 data-parallel ranks == one process accumulating 2 micro-batches,
    also in the zeros of the gradients each step applies (ZeRO's partitions gathered; a few
    elements may round to zero in one reduction order only)."""
    one = train(1, tiny_argv(embedded_cache, "--zero-stage", "0", *ZEROS))
    assert len(one["losses"]) == 4 and one["losses"][-1] < one["losses"][0]
    assert len(one["num zeros"]) == 4 and min(one["num zeros"]) >= STRUCTURAL_ZEROS
    for stage in ("2", "3"):
        sharded = train(2, tiny_argv(embedded_cache, "--zero-stage", stage, *ZEROS))
        torch.testing.assert_close(sharded["losses"], one["losses"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sharded["num zeros"], one["num zeros"], rtol=0, atol=8)


@pytest.mark.slow
def test_zero1_tensor_parallel_matches_tp1(embedded_cache):
    """Also the gradients' zeros: TP shards summed over the ranks, replicated weights counted
    once."""
    tp1 = train(1, tiny_argv(embedded_cache, "--zero-stage", "1", *ZEROS))
    tp2 = train(
        2,
        tiny_argv(
            embedded_cache,
            "--zero-stage",
            "1",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            *ZEROS,
        ),
    )
    torch.testing.assert_close(tp2["losses"], tp1["losses"], rtol=1e-5, atol=1e-5)
    assert min(tp1["num zeros"]) >= STRUCTURAL_ZEROS
    torch.testing.assert_close(tp2["num zeros"], tp1["num zeros"], rtol=0, atol=8)


def test_default_run_loss_falls_and_logs_to_tensorboard(embedded_cache, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    history = train(
        1,
        [
            "--data-cache-path",
            embedded_cache,
            "--train-iters",
            "12",
            "--num-layers",
            "2",
            "--seq-length",
            "64",
            "--eval-interval",
            "6",
            "--eval-iters",
            "1",
            "--log-interval",
            "3",
            "--tensorboard-dir",
            tb,
            "--log-throughput",
            "--log-timers-to-tensorboard",
            "--log-validation-ppl-to-tensorboard",
            "--log-memory-to-tensorboard",
            "--log-params-norm",
        ],
    )
    losses = history["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5
    events = EventAccumulator(tb)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    megatron = {
        "lm loss",
        "lm loss validation",
        "lm loss validation ppl",
        "learning-rate",
        "grad-norm",
        "params-norm",
        "batch-size",
        "loss-scale",
    }  # also vs samples
    assert (
        megatron
        | {f"{tag} vs samples" for tag in megatron}
        | {
            "iteration-time",
            "throughput",
            "tokens-per-sec",
            "tflops-per-device",
            "mem-peak-rss-bytes",
            "mem-rss-bytes",
        }
        <= tags
    )
    assert [e.step for e in events.Scalars("lm loss")] == [3, 6, 9, 12]
    # 8 sequences per iteration (the demo's micro-batch, one rank)
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [24, 48, 72, 96]
    assert [e.value for e in events.Scalars("loss-scale")] == [1.0] * 4
    arguments = {f"{name}/text_summary" for name in ("seq_length", "attention", "lr")}
    assert arguments <= set(events.Tags()["tensors"])
    # each point averages the iterations since the previous one, as Megatron's log line does
    assert math.isclose(events.Scalars("lm loss")[-1].value, sum(losses[-3:]) / 3, rel_tol=1e-6)


def _slow_saves(argv):
    """pretrain(argv) with every checkpoint save taking 1000 seconds longer on the trainer's
    clock (a clock that jumps, not a sleep: the test then does not depend on how fast the
    machine runs the steps around it)."""
    import time
    import types

    from megatron_focus.training import checkpointing, trainer

    save, skipped = checkpointing._save, [0.0]
    trainer.time = types.SimpleNamespace(time=lambda: time.time() + skipped[0])

    def slow(*args, **kwargs):
        skipped[0] += 1000.0
        return save(*args, **kwargs)

    checkpointing._save = slow
    return run_pretrain(argv)


def test_log_line_covers_its_whole_interval_and_leaves_out_saves(embedded_cache, tmp_path):
    """Saves that fall between log lines (every 3 iterations, logs every 4) neither cut the
    logged loss's average short nor count in the time per iteration, as in Megatron-LM."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    argv = tiny_argv(
        embedded_cache,
        "--log-interval",
        "4",
        "--save",
        str(tmp_path / "ckpt"),
        "--save-interval",
        "3",
        "--tensorboard-dir",
        tb,
        "--log-timers-to-tensorboard",
        iters=8,
    )
    losses = run_distributed(_slow_saves, 1, argv)["losses"]
    events = EventAccumulator(tb)
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("lm loss")]
    assert [step for step, _ in logged] == [4, 8]
    for (step, value), window in zip(logged, (losses[:4], losses[4:])):
        assert math.isclose(value, sum(window) / 4, rel_tol=1e-6), step
    # both intervals hold a 1000-second save (at 3 and 6): counted, it adds 250 s per iteration
    times = [e.value for e in events.Scalars("iteration-time")]
    assert max(times) < 100, times


def _non_finite_at(argv, iterations):
    """pretrain(argv) with the loss of each of `iterations` NaN: DeepSpeed skips those steps
    (under ZeRO, a non-finite gradient norm)."""
    from megatron_focus.training import trainer

    lm_loss, steps = trainer.lm_loss, {"micro-batches": 0}

    def poisoned(engine, batch, tokens=None):
        loss = lm_loss(engine, batch, tokens)
        if not engine.training:
            return loss
        steps["micro-batches"] += 1
        iteration = (steps["micro-batches"] - 1) // engine.gradient_accumulation_steps() + 1
        return loss * float("nan") if iteration in iterations else loss

    trainer.lm_loss = poisoned
    return run_pretrain(argv)


def test_a_skipped_step_is_left_out_of_the_logged_loss(embedded_cache, tmp_path, capfd):
    """As Megatron-LM's `training_log`: the logged loss (console and TensorBoard) averages the
    interval's advanced iterations only; its skipped and non-finite ones are counted for the
    interval alone, and an interval of skipped steps logs no loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    flags = ["--log-interval", "2", "--zero-stage", "1", "--tensorboard-dir", tb]
    losses = run_distributed(
        _non_finite_at, 1, tiny_argv(embedded_cache, *flags, iters=6), {2, 3, 4}
    )["losses"]
    assert [math.isfinite(loss) for loss in losses] == [True, False, False, False, True, True]
    logged = [
        (
            int(re.search(r"iteration +(\d+)/", line)[1]),
            float(re.search(r"lm loss: (\S+)", line)[1]) if "lm loss: " in line else None,
            re.search(
                r"skipped iterations: +(\d+) \| number of nan iterations: +(\d+)", line
            ).groups(),
        )
        for line in capfd.readouterr().out.splitlines()
        if re.search(r"iteration +\d+/", line)
    ]
    mean = sum(losses[4:]) / 2
    assert logged == [
        (2, pytest.approx(losses[0], rel=1e-5), ("1", "1")),
        (4, None, ("2", "2")),
        (6, pytest.approx(mean, rel=1e-5), ("0", "0")),
    ], logged
    events = EventAccumulator(tb)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("lm loss")] == [
        (2, pytest.approx(losses[0], rel=1e-6)),
        (6, pytest.approx(mean, rel=1e-6)),
    ]


def _host_reads(argv):
    """pretrain(argv), counting the host reads of tensors that this package's own code makes
    (.item(), float() / bool() of a tensor, .tolist(), .cpu(), .numpy()): on a GPU each one
    waits for the device's queue of work. A read is this package's when the innermost frame
    outside torch that asks for it is in megatron_focus/ (DeepSpeed's own are not counted)."""
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_focus.training.arguments import parse_args
    from megatron_focus.training.trainer import pretrain

    counts = {"reads": 0}

    def ours():
        frame = sys._getframe(2)
        while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
            frame = frame.f_back
        return frame is not None and f"{os.sep}megatron_focus{os.sep}" in frame.f_code.co_filename

    class ScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and ours():
                counts["reads"] += 1
            return func(*args, **(kwargs or {}))

    def counted(method):
        def read(self, *args, **kwargs):
            counts["reads"] += ours()
            return method(self, *args, **kwargs)

        return read

    for name in ("tolist", "cpu", "numpy"):
        setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    with ScalarReads():
        history = pretrain(parse_args(argv))
    return counts["reads"], len(history["losses"])


def test_training_reads_the_device_once_per_logged_iteration(embedded_cache):
    """Twice the iterations with the same number of log lines: not one host read more; one
    more log line: exactly one more. Focus+XSA, whose statistics are logged too."""

    def reads(iters, log_interval):
        argv = tiny_argv(
            embedded_cache,
            "--attention",
            "focus+xsa",
            "--focus-window",
            "8",
            "--focus-groups",
            "4",
            "--eval-iters",
            "0",
            "--log-interval",
            str(log_interval),
            iters=iters,
        )
        count, steps = run_distributed(_host_reads, 1, argv)
        assert steps == iters
        return count

    one_log = reads(8, 8)
    assert one_log == reads(4, 4)
    assert reads(8, 4) == one_log + 1


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--micro-batch-size", "3", "--global-batch-size", "8"], "not divisible by --micro-batch"),
        (
            [
                "--data-path",
                "nowhere/text_document",
                "--tokenizer-type",
                "SentencePieceTokenizer",
                "--tokenizer-model",
                "nowhere.model",
            ],
            "nowhere",
        ),
        (["--data-path", "x_text_document"], "go together"),
    ],
)
def test_bad_flags_are_refused_before_any_model(argv, error):
    with pytest.raises(Exception, match=error) as failure:
        train(1, argv)
    assert "build_model" not in str(failure.value)  # refused before the model was built


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--seq-length", "0"),
        ("--num-layers", "0"),
        ("--hidden-size", "0"),
        ("--num-attention-heads", "0"),
        ("--kv-channels", "0"),
        ("--micro-batch-size", "0"),
        ("--tensor-model-parallel-size", "0"),
        ("--make-vocab-size-divisible-by", "0"),
        ("--log-interval", "0"),
        ("--eval-interval", "0"),
        ("--exit-interval", "-1"),
        ("--clip-grad", "-1.0"),
        ("--rotary-percent", "0.0"),
        ("--rotary-percent", "1.5"),
        ("--hidden-dropout", "1.0"),
        ("--max-skipped-steps", "-1"),
        ("--lr", "-0.001"),
        ("--focus-groups", "0"),
        ("--focus-tau", "0.0"),
    ],
)
def test_values_no_run_can_use_are_refused_by_name(flag, value):
    """Checked as the flags are parsed: before data, model or engine."""
    from megatron_focus.training.arguments import parse_args

    with pytest.raises(ValueError, match=f"^{flag} {value}: must be"):
        parse_args([flag, value])


def test_range_checks_name_real_flags():
    from megatron_focus.config.flags import build_parser
    from megatron_focus.config.validation import AT_LEAST, WITHIN

    dests = {action.dest for action in build_parser()._actions}
    assert set(AT_LEAST) | set(WITHIN) <= dests


def test_skipped_steps_in_a_row_stop_the_run(embedded_cache, tmp_path):
    """A loss that is NaN at every step (weights of std 1e30): each step is skipped, and the
    third in a row stops the run before another checkpoint."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(Exception, match=r"non-finite for 3 steps in a row \(iterations 1-3\)"):
        train(
            1,
            tiny_argv(
                embedded_cache,
                "--init-method-std",
                "1e30",
                "--max-skipped-steps",
                "3",
                "--save",
                str(ckpt),
                "--save-interval",
                "1",
                iters=30,
            ),
        )
    assert (ckpt / "latest").read_text() == "iter_0000002"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001", "iter_0000002"]


def test_checkpoint_folders_are_checked_before_any_model(embedded_cache, tmp_path):
    """A --save that cannot be written, and complete checkpoints without `latest` (resuming
    would start from scratch and overwrite them), are refused before the model is built."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(Exception, match="--save .*a-file/ckpt: cannot write there") as failure:
        train(1, tiny_argv(embedded_cache, "--save", str(blocker / "ckpt")))
    assert "build_model" not in str(failure.value)
    ckpt = tmp_path / "ckpt"
    train(1, tiny_argv(embedded_cache, "--save", str(ckpt), "--exit-interval", "2"))
    (ckpt / "latest").unlink()
    before = sorted(str(p) for p in ckpt.rglob("*"))
    with pytest.raises(Exception, match="holds checkpoints iter_0000002 but no 'latest' file"):
        train(1, tiny_argv(embedded_cache, "--save", str(ckpt), "--load", str(ckpt)))
    assert sorted(str(p) for p in ckpt.rglob("*")) == before


def test_unknown_tokenizer_type_is_refused(capsys):
    from megatron_focus.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--tokenizer-type", "WordPiece"])
    assert "invalid choice: 'WordPiece'" in capsys.readouterr().err


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(embedded_cache, tmp_path):
    import signal

    ckpt = str(tmp_path / "ckpt")
    argv = tiny_argv(embedded_cache, "--save", ckpt, "--exit-signal-handler", iters=10_000)
    proc = launch(argv, start_new_session=True)
    try:
        for line in proc.stdout:
            if "iteration        2/" in line:  # to the DataLoader workers too, as a job's signal
                os.killpg(proc.pid, signal.SIGTERM)
                break
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    tag = open(os.path.join(ckpt, "latest")).read()
    assert tag.startswith("iter_") and int(tag[5:]) >= 2
    assert "exiting at iteration" in output


def test_focus_training_logs_groups_and_both_validation_modes(embedded_cache, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    history = train(
        1,
        tiny_argv(
            embedded_cache,
            "--attention",
            "focus+xsa",
            "--focus-window",
            "8",
            "--focus-groups",
            "4",
            "--lr",
            "3e-3",
            "--eval-interval",
            "6",
            "--tensorboard-dir",
            tb,
            iters=12,
        ),
    )
    losses = history["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    events = EventAccumulator(tb)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss validation", "lm loss validation sparse"} <= tags
    for layer in ("01", "02"):
        assert {
            f"focus/layer{layer}/{s}"
            for s in ("largest-group", "group-entropy", "pairs-kept", "kept-mass")
        } <= tags
        largest = [e.value for e in events.Scalars(f"focus/layer{layer}/largest-group")]
        assert len(largest) == 12 and max(largest) < 2 / 4  # never twice the balanced share
        # the dense attention's mass the top-2 rule keeps (a window of 8 in 32 tokens)
        mass = [e.value for e in events.Scalars(f"focus/layer{layer}/kept-mass")]
        assert len(mass) == 12 and all(0 < m < 1 for m in mass)


def _saved_bytes_loss_and_grad(argvs):
    """For each argv: (bytes autograd keeps for the backward pass, loss, squared gradient norm)
    of one training forward and backward of a fresh model."""
    from megatron_focus import platform
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args

    platform.init_distributed(1)
    results = []
    for argv in argvs:
        args = parse_args(argv)
        platform.manual_seed(args.seed)
        model = build_model(args, 100)
        tokens = torch.randint(
            0, 100, (2, args.seq_length), generator=torch.Generator().manual_seed(0)
        )
        kept = []

        def pack(t):
            kept.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens, torch.arange(args.seq_length)[None], None, labels=tokens).mean()
        loss.backward()
        grad = sum(p.grad.double().square().sum() for p in model.parameters()).item()
        results.append((sum(kept), loss.item(), grad))
    return results


RECOMPUTE = (
    ["--recompute-activations"],
    ["--recompute-granularity", "full", "--recompute-method", "uniform"],
    [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "2",
    ],
)


def test_recompute_keeps_less_for_backward_and_computes_the_same():
    """Megatron-Core's recompute, selective and full, for every variant (Focus's routing is an
    input of the selective checkpoint): fewer bytes kept, the same loss and gradients."""
    argvs = []
    for attention in ("standard", "xsa", "focus+xsa"):
        focus = (
            ["--focus-window", "8", "--focus-groups", "4"] if attention.startswith("focus") else []
        )
        base = TINY + ["--attention", attention, "--num-layers", "4", *focus]
        argvs += [base] + [base + flags for flags in RECOMPUTE]
    results = run_distributed(_saved_bytes_loss_and_grad, 1, argvs)
    for i in range(0, len(results), 1 + len(RECOMPUTE)):
        (saved, loss, grad), *recomputed = results[i : i + 1 + len(RECOMPUTE)]
        for flags, (less, same_loss, same_grad) in zip(RECOMPUTE, recomputed):
            assert less < saved, (argvs[i], flags)
            assert same_loss == pytest.approx(loss, rel=1e-6), (argvs[i], flags)
            assert same_grad == pytest.approx(grad, rel=1e-5), (argvs[i], flags)


def test_decoupled_lr_gives_the_embedding_and_output_their_own_schedule(embedded_cache):
    """Megatron's --decoupled-lr: the input embedding and output layer follow a schedule with
    their own peak and floor; every other weight follows --lr. Untied, so both layers exist."""
    flags = ["--untie-embeddings-and-output-weights", "--lr-decay-style", "linear"]
    plain = train(1, tiny_argv(embedded_cache, *flags))
    same = train(
        1, tiny_argv(embedded_cache, *flags, "--decoupled-lr", "1e-3", "--decoupled-min-lr", "1e-4")
    )  # = --lr, --min-lr of TINY
    assert same["losses"] == plain["losses"]
    other = train(1, tiny_argv(embedded_cache, *flags, "--decoupled-lr", "1e-2"))
    assert other["losses"][0] == plain["losses"][0] and other["losses"][1:] != plain["losses"][1:]


def test_per_token_loss_weighs_every_token_alike_however_the_batch_is_cut(embedded_cache):
    """--calculate-per-token-loss over 2 data-parallel ranks x 2 micro-batches == one micro-batch
    of the whole global batch (where the token mean is the per-token loss), training and
    validation; the mean of means differs, since end-of-document tokens leave the loss."""
    flags = ["--eod-mask-loss", "--eval-interval", "2", "--eval-iters", "1"]
    whole = train(1, tiny_argv(embedded_cache, *flags, "--micro-batch-size", "8"))
    cut = ["--micro-batch-size", "2", *flags]
    per_token = train(2, tiny_argv(embedded_cache, *cut, "--calculate-per-token-loss"))
    # fp32 sums in another order: a few ulps, well under what the mean of means is off by
    torch.testing.assert_close(per_token["losses"], whole["losses"], rtol=0, atol=4e-6)
    torch.testing.assert_close(per_token["validation"], whole["validation"], rtol=0, atol=4e-6)
    means = train(2, tiny_argv(embedded_cache, *cut))
    assert min(abs(a - b) for a, b in zip(means["losses"], whole["losses"])) > 1e-5


FAKE_WANDB = """
import json, os
calls = {"log": []}
class Run:
    def log(self, data, step):
        calls["log"].append([step, data])
    def finish(self):
        with open(os.environ["FAKE_WANDB_OUT"], "w") as f:
            json.dump(calls, f)
def init(**kwargs):
    calls["init"] = {**kwargs, "config": sorted(kwargs["config"])}
    return Run()
"""


def test_wandb_gets_the_curves_megatron_logs(embedded_cache, tmp_path, monkeypatch):
    """--wandb-project: wandb.init as Megatron-LM calls it and every curve against iterations,
    recorded by a stand-in wandb."""
    fake = tmp_path / "fake"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    monkeypatch.syspath_prepend(str(fake))  # the spawned ranks take the parent's sys.path
    monkeypatch.setenv("FAKE_WANDB_OUT", str(tmp_path / "calls.json"))
    flags = [
        "--wandb-project",
        "proj",
        "--wandb-exp-name",
        "exp",
        "--eval-interval",
        "2",
        "--save",
        str(tmp_path / "run"),
    ]
    history = train(1, tiny_argv(embedded_cache, *flags))
    calls = json.loads((tmp_path / "calls.json").read_text())
    assert calls["init"]["project"] == "proj" and calls["init"]["name"] == "exp"
    assert calls["init"]["dir"] == str(tmp_path / "run" / "wandb")
    assert "lr" in calls["init"]["config"] and "attention" in calls["init"]["config"]
    logged = [(step, data["lm loss"]) for step, data in calls["log"] if "lm loss" in data]
    assert logged == list(enumerate(history["losses"], start=1))
    assert [
        (step, data["lm loss validation"])
        for step, data in calls["log"]
        if "lm loss validation" in data
    ] == history["validation"]


def test_real_wandb_offline_takes_the_same_calls(embedded_cache, tmp_path, monkeypatch):
    """With wandb installed (the wandb extra; not the test extra, as Megatron-Core imports wandb
    in every process when it is there): offline, it writes the run without a network."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    real = train(
        1,
        tiny_argv(
            embedded_cache,
            "--wandb-project",
            "proj",
            "--wandb-exp-name",
            "exp",
            "--wandb-save-dir",
            str(tmp_path / "wb"),
            iters=3,
        ),
    )
    assert len(real["losses"]) == 3
    runs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1 and os.path.getsize(runs[0]) > 0


@pytest.mark.parametrize("attention", ["standard", "focus+xsa"])
def test_mock_data_trains_with_megatron_data_flags(tmp_path, attention):
    """Megatron-Core's mock documents, packed with their mask (Focus restarts at each one)."""
    history = train(
        1,
        TINY
        + [
            "--attention",
            attention,
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "500",
            "--train-iters",
            "3",
            "--eod-mask-loss",
            "--reset-position-ids",
            "--reset-attention-mask",
            "--data-cache-path",
            str(tmp_path),
        ],
    )
    assert len(history["losses"]) == 3 and all(math.isfinite(x) for x in history["losses"])


def test_profile_writes_a_pytorch_trace_of_the_chosen_steps(embedded_cache, tmp_path):
    tb = tmp_path / "tb"
    train(
        1,
        tiny_argv(
            embedded_cache,
            "--profile",
            "--profile-step-start",
            "1",
            "--profile-step-end",
            "2",
            "--tensorboard-dir",
            str(tb),
            iters=3,
        ),
    )
    traces = list(tb.glob("*.pt.trace.json"))
    assert len(traces) == 1 and '"ProfilerStep#' in traces[0].read_text()


def test_an_evaluation_that_fails_leaves_the_runs_focus_mode_and_training_on(
    embedded_cache, single_process
):
    from megatron_focus.model.focus.focus import FocusAttention
    from megatron_focus.model.gpt import build_model
    from megatron_focus.training.arguments import parse_args
    from megatron_focus.training.trainer import evaluate
    from megatron_focus.variants import variant

    args = parse_args(tiny_argv(embedded_cache, "--attention", "focus", "--focus-window", "4"))
    model = build_model(args, 200).train()

    class FailingEngine:  # the forward fails as an out-of-memory would
        module = model

        def eval(self):
            model.eval()

        def train(self):
            model.train()

        def __call__(self, *inputs, **kwargs):
            assert {
                m.focus.attention_mode for m in model.modules() if isinstance(m, FocusAttention)
            } == {"sparse"}
            raise RuntimeError("out of memory")

    batch = {k: torch.zeros(1, 8, dtype=torch.long) for k in ("tokens", "position_ids", "labels")}
    hooks = variant("focus").hooks_for(args)
    with pytest.raises(RuntimeError, match="out of memory"), hooks.in_mode(model, "sparse"):
        evaluate(FailingEngine(), [{**batch, "loss_mask": torch.ones(1, 8)}], args)
    modes = {m.focus.attention_mode for m in model.modules() if isinstance(m, FocusAttention)}
    assert modes == {"soft"} and model.training
