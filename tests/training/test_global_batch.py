"""The global batch and the run's length against Megatron-Core's own calculator, and the flags
that set them: ramp-up, sample counts that do not divide the batch, and what is refused."""

import math
import random

import pytest
from megatron.core import num_microbatches_calculator as calculators

from megatron_focus.config.global_batch import GlobalBatch
from megatron_focus.training.arguments import parse_args
from megatron_focus.training.optimizer import schedule

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
# Megatron-Core 0.16's ramp-up calculator, the reference (0.19 ignores --rampup-batch-size)
RAMPUP = getattr(calculators, "RampupBatchsizeNumMicroBatchesCalculator", None)
needs_reference = pytest.mark.skipif(RAMPUP is None, reason="Megatron-Core without ramp-up")
# Megatron-LM's GPT-3 175B script: ramp from 16 by 16 to 1536 over 5,859,375 samples
GPT3 = (1536, 1, 16, False, (16, 16, 5859375))


def _reference(final, mbs, dp, decrease, rampup):
    """Megatron-Core's calculator (rank 1: it logs on rank 0 only)."""
    if rampup is None:
        return calculators.ConstantNumMicroBatchesCalculator(final, mbs, dp, decrease, 1)
    return RAMPUP(final, mbs, dp, decrease, 1, *rampup)


def _megatron_run(calculator, mbs, dp, train_samples, rampup):
    """(the batch of every step, train_iters) as Megatron-LM's training.py counts them: its
    `update_train_iters`, then its loop adding each step's micro-batches to the consumed
    samples."""
    if rampup is None:
        iterations = train_samples // calculator.get_current_global_batch_size()
    else:
        iterations = consumed = 0
        while consumed <= rampup[2] and consumed <= train_samples:
            calculator.update(consumed, consistency_check=False)
            consumed += calculator.get_current_global_batch_size()
            iterations += 1
        final = calculator.global_batch_size
        iterations += max(0, train_samples - consumed) // final
    batches, consumed = [], 0
    for _ in range(iterations):
        calculator.update(consumed, consistency_check=False)
        batches.append(mbs * dp * calculator.get())
        consumed += batches[-1]
    return batches, iterations


def _cases():
    """The GPT-3 script's ramp, edge cases, then random ones (a fixed seed)."""
    yield (*GPT3, 2_000_000)
    yield 64, 4, 2, False, (8, 8, 100), 100  # the run ends inside the ramp
    yield 64, 4, 2, False, (8, 8, 99), 1000  # samples per increment not a whole number
    yield 128, 1, 4, False, None, 1000  # not a multiple of the batch
    yield 60, 4, 2, True, None, 1000  # decreased to 56
    yield 104, 4, 3, True, (14, 30, 500), 3000  # every batch decreased to a multiple of 12
    rng = random.Random(0)
    for _ in range(40):
        mbs, dp = rng.choice((1, 2, 4)), rng.choice((1, 2, 3))
        step, decrease = mbs * dp, rng.random() < 0.3
        start = step * rng.randint(1, 4) + (rng.randint(1, step) - 1 if decrease else 0)
        increment = step * rng.randint(1, 3) + (rng.randint(0, 2) if decrease else 0)
        final = start + increment * rng.randint(1, 6)
        rampup = (start, increment, rng.randint(1, 400)) if rng.random() < 0.8 else None
        yield final, mbs, dp, decrease, rampup, rng.randint(final, 3000)


@needs_reference
@pytest.mark.parametrize("final, mbs, dp, decrease, rampup, train_samples", list(_cases()))
def test_each_step_batch_and_the_run_length_are_megatron_cores(
    final, mbs, dp, decrease, rampup, train_samples
):
    batch = GlobalBatch(final, mbs * dp, rampup, decrease)
    batch.check()
    reference = _reference(final, mbs, dp, decrease, rampup)
    batches, iterations = _megatron_run(reference, mbs, dp, train_samples, rampup)
    assert batch.train_iters(train_samples) == iterations
    ours, consumed = [], 0
    for _ in range(iterations):
        ours.append(batch.running(consumed))
        consumed += ours[-1]
    assert ours == batches
    for done in sorted({0, 1, iterations // 2, iterations}):
        assert batch.consumed_after(done) == sum(batches[:done])


def test_gpt3_ramp_grows_by_16_every_95th_of_its_samples():
    """The GPT-3 script's ramp: 95 increments of 16, one every 5,859,375 / 95 consumed samples
    (figures from the flags, not from the code under test)."""
    batch = GlobalBatch(*GPT3[:2], GPT3[4], GPT3[3])
    per_increment = 5859375 / ((1536 - 16) // 16)
    assert [batch.nominal(math.ceil(k * per_increment)) for k in (0, 1, 2)] == [16, 32, 48]
    assert batch.nominal(math.ceil(per_increment) - 1) == 16
    assert batch.nominal(5859375) == 1536 and batch.nominal(5859375 - 100) == 1536 - 16


def _args(*flags):
    return parse_args(BASE + ["--lr", "1e-3", *flags])


def test_sample_counts_that_do_not_divide_the_batch_round_as_megatron_lm():
    """Megatron-LM: train_iters = train_samples // global batch; the schedule counts samples,
    so warmup and decay keep their exact sample counts (the last partial batch is dropped)."""
    flags = ["--micro-batch-size", "4", "--global-batch-size", "32", "--train-samples", "3201"]
    args = _args(*flags, "--lr-warmup-samples", "321", "--lr-decay-samples", "2881")
    assert args.train_iters == 3201 // 32
    steps = schedule(args)
    assert (steps["lr_warmup_steps"], steps["lr_decay_steps"], steps["wd_incr_steps"]) == (
        321,
        2881,
        3201,
    )
    by_fraction = schedule(_args(*flags, "--lr-warmup-fraction", "0.1"))
    assert by_fraction["lr_decay_steps"] == 3201  # default: every sample
    assert by_fraction["lr_warmup_steps"] == 0.1 * 3201  # Megatron's, not rounded
    llama3 = _args(
        "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000"
    )
    assert llama3.train_iters == 1953125000 // 128
    by_iters = schedule(_args("--micro-batch-size", "4", "--global-batch-size", "32"))
    assert by_iters["lr_decay_steps"] == 300  # iteration-based runs count iterations


@needs_reference
def test_rampup_sets_the_run_length_as_megatron_lm():
    args = _args(
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "16",
        "--rampup-batch-size",
        "4",
        "4",
        "40",
        "--train-samples",
        "200",
    )
    reference = _reference(16, 2, 1, False, (4, 4, 40))
    assert args.train_iters == _megatron_run(reference, 2, 1, 200, (4, 4, 40))[1]


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--rampup-batch-size", "8", "8", "64"], r"--rampup-batch-size counts samples: it needs"),
        (
            ["--train-samples", "640", "--rampup-batch-size", "8", "5", "64"],
            r"must be START plus a whole number",
        ),
        (
            ["--train-samples", "640", "--rampup-batch-size", "32", "8", "64"],
            r"must be START plus a whole number \(at least one\)",
        ),
        (["--train-samples", "640", "--rampup-batch-size", "8", "8", "0"], r"at least 1"),
        (
            ["--train-samples", "640", "--rampup-batch-size", "2", "6", "64"],
            r"every batch of the ramp must be a multiple of .* 4",
        ),
        (
            ["--train-samples", "640", "--rampup-batch-size", "2", "6", "64"]
            + ["--decrease-batch-size-if-needed"],
            r"START 2 is below one micro-batch",
        ),
        (["--train-samples", "31"], r"--train-samples 31 is less than one global batch \(32\)"),
        (["--train-samples", "640", "--train-iters", "10"], r"--train-samples and --train-iters"),
        (
            ["--train-samples", "640", "--lr-decay-iters", "10"],
            r"--train-samples and --lr-decay-iters: a run in samples gives --lr-decay-samples",
        ),
        (["--lr-warmup-samples", "10"], r"--lr-warmup-samples counts samples"),
        (["--global-batch-size", "30"], r"30 is not divisible by --micro-batch-size"),
    ],
)
def test_a_ramp_or_schedule_that_cannot_run_is_refused_before_compute(flags, error):
    base = ["--micro-batch-size", "4", "--global-batch-size", "32"]
    with pytest.raises(ValueError, match=error):
        _args(*base, *flags)


def test_decreasing_is_what_lets_a_batch_micro_batches_do_not_divide_run():
    args = _args(
        "--micro-batch-size", "4", "--global-batch-size", "30", "--decrease-batch-size-if-needed"
    )
    assert GlobalBatch.of(args, 1).running(0) == 28


def _scheduler(warmup, decay):
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    return OptimizerParamScheduler(
        optimizer, 0.0, 1e-3, 1e-4, warmup, decay, "cosine", 0.1, 0.1, decay, "constant"
    )


def test_a_schedule_saved_in_iterations_resumes_in_samples_at_the_same_point():
    """A run of --train-samples saved by a version that counted its schedule in iterations
    (no "steps_in" in its state) continues at the same LR, in samples."""
    from megatron_focus.training.optimizer import in_unit

    by_iters, by_samples = _scheduler(10, 100), _scheduler(320, 3200)
    by_iters.step(7)
    by_samples.load_state_dict(in_unit(by_iters.state_dict(), "samples", 32))
    assert by_samples.num_steps == 7 * 32
    for scheduler in (by_iters, by_samples):
        scheduler.step(0)  # sets the LR
    assert by_samples.optimizer.param_groups[0]["lr"] == by_iters.optimizer.param_groups[0]["lr"]
    saved = {**by_samples.state_dict(), "steps_in": "samples"}
    assert in_unit(saved, "samples", 32) is saved


def test_a_ramp_under_zero2_offload_is_refused(tmp_path):
    """ZeRO-1/2's CPU offload keeps the accumulation steps it was built with."""
    import json

    from megatron_focus.config.deepspeed_config import deepspeed_config

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}))
    ramp = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-samples", "64"]
    ramp += ["--rampup-batch-size", "2", "2", "12", "--deepspeed_config", str(config)]
    with pytest.raises(ValueError, match="offload_optimizer does not follow"):
        _args(*ramp, "--zero-stage", "2")
    args = _args(*ramp, "--zero-stage", "3")
    assert deepspeed_config(args, 1)["gradient_accumulation_steps"] == 8 // 2
