"""The pretraining loop: data, model, DeepSpeed engine, then iterate, evaluate, save.

Read `pretrain` top to bottom; the helpers below it are the steps it names. One code path serves a
laptop (one process, CPU, gloo), `torchrun` and the DeepSpeed launcher across nodes.
"""

import contextlib
import datetime
import functools
import gc
import math
import os
import re
import signal
import time
from typing import Iterator, Optional

import deepspeed
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_focus import cli, platform
from megatron_focus.checkpoint.format import LATEST, latest_tag
from megatron_focus.config.deepspeed_config import deepspeed_config
from megatron_focus.config.global_batch import GlobalBatch
from megatron_focus.config.run_config import RunConfig
from megatron_focus.data.loader import micro_batches, to_device
from megatron_focus.data.sources import data_prefixes, datasets_for, tokenizer_for
from megatron_focus.deepspeed_builds import skip_unused_builds
from megatron_focus.model.auxiliary import AuxiliaryLoss
from megatron_focus.model.flops import flops_per_token
from megatron_focus.model.gpt import build_model
from megatron_focus.model.kernels import kernels
from megatron_focus.parallel import context_parallel
from megatron_focus.parallel.tensor_parallel import (
    install_sequence_parallel_grad_allreduce,
    num_zeros_in_grad,
    params_norm,
)
from megatron_focus.training.checkpointing import CheckpointManager, CheckpointStart
from megatron_focus.training.metrics import LogStep, Reporter
from megatron_focus.training.optimizer import in_unit, param_groups, schedule, steps_in
from megatron_focus.training.profiling import StepProfiler
from megatron_focus.variants import variant


def pretrain(args: RunConfig) -> dict:
    """Train as the flags say; returns {"losses": [...], "validation": [(iteration, loss)...],
    "lr": [the LR at each log step]} for this rank (a Focus run adds its other mode's
    validation, e.g. "validation sparse")."""
    started = time.time()  # --exit-duration-in-mins counts from here, as Megatron-LM's does
    platform.init_distributed(
        args.tensor_model_parallel_size,
        args.distributed_timeout_minutes,
        args.distributed_backend,
        args.context_parallel_size,
    )
    platform.manual_seed(args.seed)
    rank0 = dist.get_rank() == 0
    # the --save folder, held for this job, and what the run starts from, decided once before
    # the data is built
    with CheckpointStart.held(args) as start:  # the folder free again however the run ends
        return _train(args, start, rank0, started)


def _train(args: RunConfig, start: CheckpointStart, rank0: bool, started: float):
    """`pretrain` once what the run starts from is decided."""
    # Data first: a wrong path or a tokenizer that does not fit the data fails before any compute.
    tokenizer = tokenizer_for(args, rank0)
    start.check(tokenizer.vocab_size)  # a checkpoint the plan cannot use
    train_data, valid_data = datasets_for(args, tokenizer)

    model = build_model(args, tokenizer.vocab_size)
    hooks = variant(args.attention).hooks_for(args)  # what the variant adds to the run
    hooks.freeze(model, args.retrofit)  # frozen weights stay out of the optimizer
    install_sequence_parallel_grad_allreduce(model)
    engine = _deepspeed_engine(args, model, start)
    progress = _Progress(args.max_skipped_steps, rank0)
    checkpoints = CheckpointManager(start, engine, ready=progress.saving)
    iteration, consumed = checkpoints.load()

    global_batch = GlobalBatch.of(args, parallel_state.get_data_parallel_world_size())
    total = global_batch.consumed_after(args.train_iters)  # the samples the whole run trains on
    reporter = Reporter(args, flops_per_token(args, start.padded_vocab_size), total)
    if rank0:
        _print_banner(args, model, hooks, iteration)
    stop = _StopRequest(args, started, start.lost)
    if args.manual_gc:  # collections at chosen steps, the same on every rank
        gc.disable()
        gc.collect()
    valid_batches = _validation_batches(valid_data, args)
    progress.begin(iteration, consumed, engine.skipped_steps)
    validate = functools.partial(_validate, engine, valid_batches, args, hooks, reporter, progress)
    if args.retrofit and iteration == 0 and valid_batches is not None:
        # A retrofit's starting point (the base model with fresh routers) is what it must beat.
        validate(iteration, consumed)
    batches = iter(data_loader(train_data, consumed, total, args))
    profiler = StepProfiler(args)
    schedule_start = start.plan.schedule_start  # where a variant's schedule counts from
    try:
        while iteration < args.train_iters:
            # the batch follows the samples consumed (--rampup-batch-size), as in Megatron-LM
            batch_size = global_batch.running(consumed)
            _set_global_batch(engine, batch_size, args)
            log_now = args.at_interval(args.log_interval, iteration + 1)
            recording = hooks.recording(engine.module) if log_now else contextlib.nullcontext()
            with recording, hooks.training(engine.module, iteration, schedule_start):
                loss, zeros = train_step(
                    engine, batches, args, log_now and args.log_num_zeros_in_grad
                )
            iteration += 1
            consumed += batch_size
            progress.add(iteration, loss, engine)
            profiler.after_step(iteration)
            if (
                args.manual_gc
                and args.manual_gc_interval
                and iteration % args.manual_gc_interval == 0
            ):
                gc.collect()
            if log_now:
                reporter.train(
                    progress.log_step(engine, args, iteration, consumed, zeros, batch_size, hooks)
                )
            if valid_batches is not None and args.at_interval(args.eval_interval, iteration):
                with progress.paused():
                    validate(iteration, consumed)
            checkpoints.save(iteration, consumed)
            if (args.exit_interval and iteration % args.exit_interval == 0) or stop.any_rank():
                progress.read()
                checkpoints.save(iteration, consumed, exiting=True)
                if rank0:
                    print(f" exiting at iteration {iteration}", flush=True)
                break
    except RuntimeError as e:  # gloo's: NCCL's watchdog aborts the process itself
        if not _lost_a_rank(e):
            raise
        raise _StalledRank(_stalled(args, iteration, str(e))) from e
    profiler.close()
    reporter.close()
    if rank0:
        _print_where(args)
    return progress.history


class _StalledRank(cli.Stopped):
    """A collective that another rank never joined (stalled, or died): this rank stops, so that
    the launcher ends the job rather than it waiting out the allocation."""


# What gloo says when a collective's peer never answers within the process group's timeout
# (--distributed-timeout-minutes), or is gone.
_PEER_LOST = ("Timed out waiting", "Connection reset by peer", "Connection closed by peer")


def _lost_a_rank(error: RuntimeError) -> bool:
    return any(words in str(error) for words in _PEER_LOST)


def _stalled(args: RunConfig, iteration: int, error: str) -> str:
    """The line a rank stops with when a collective lost a rank: itself, the iterations it
    completed, what gloo said, and the checkpoint a rerun resumes from."""
    latest = os.path.join(args.save, LATEST) if args.save else None
    kept = (
        f"the last complete checkpoint, {latest_tag(args.save)}, is intact"
        if latest and os.path.isfile(latest)
        else "no checkpoint was saved"
    )
    said = re.sub(r"^\[[^\]]*\] ", "", error.splitlines()[0])  # less gloo's source line
    return (
        f"rank {dist.get_rank()} waited for the other ranks after iteration {iteration} longer "
        f"than --distributed-timeout-minutes {args.distributed_timeout_minutes:g}, or lost "
        f"one ({said[:120]}): a rank stalled or died; stopping the job, {kept}"
    )


def _set_global_batch(engine, batch_size: int, args: RunConfig) -> None:
    """DeepSpeed's gradient accumulation for a global batch of `batch_size` samples (the micro
    batch stays), and what the LR schedule advances by after it."""
    # DeepSpeed's data-parallel ranks include the context-parallel ones (platform.py)
    if batch_size * args.context_parallel_size != engine.train_batch_size():
        engine.set_train_batch_size(batch_size * args.context_parallel_size)
    engine.lr_scheduler.trains(batch_size)


def _validation_batches(valid_data, args: RunConfig):
    """The same batches at every evaluation, read by workers that stay."""
    if valid_data is None:
        return None
    return data_loader(
        valid_data, 0, args.eval_iters * args.global_batch_size, args, persistent=True
    )


def _validate(
    engine, batches, args, hooks, reporter, progress, iteration: int, consumed: int
) -> None:
    """Validation loss in the run's mode and in the variant's other modes (Focus's)."""
    if args.manual_gc and args.manual_gc_eval:
        gc.collect()
    history = progress.history
    history["validation"].append((iteration, evaluate(engine, batches, args)))
    reporter.validation(iteration, consumed, history["validation"][-1][1])
    for mode in hooks.other_modes():
        with hooks.in_mode(engine.module, mode):
            loss = evaluate(engine, batches, args)
        history.setdefault(f"validation {mode}", []).append((iteration, loss))
        reporter.validation(iteration, consumed, loss, mode)


def train_step(
    engine, batches: Iterator[dict], args: RunConfig, count_zeros: bool = False
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One global batch: forward/backward per micro-batch, then DeepSpeed's optimizer step.

    Returns the loss averaged over micro-batches and data-parallel ranks as a device tensor: the
    step itself never waits for the device (no host read); `_UnreadLosses` reads the losses at
    log and save steps. With `count_zeros`, also the zeros in the gradients the step applies
    (read after the last backward, before DeepSpeed's step consumes them); None otherwise.

    A non-finite loss is never trained on: DeepSpeed's overflow check (fp16 loss scaling, bf16
    `check_grad_overflow`, or the non-finite gradient norm under ZeRO with clipping) skips the
    step; ZeRO stage 0 in fp32 has no such check, and the run stops at the next read (before any
    checkpoint is written).
    """
    engine.train()
    micro = engine.gradient_accumulation_steps()
    AuxiliaryLoss.scale = _auxiliary_scale(engine)
    step = [next(batches) for _ in range(micro)]
    per_token = None
    if args.calculate_per_token_loss:  # DeepSpeed divides by the micro-batches and DP x CP ranks
        tokens = sum(batch["loss_mask"].sum() for batch in step).float()
        per_token = _mean_over_data_parallel(tokens.to(platform.setup().device)) / micro
    total = torch.zeros((), dtype=torch.float32, device=platform.setup().device)
    zeros = None
    for index, batch in enumerate(step):
        # the step's last micro-batch is the boundary, however many came before the batch grew
        engine.set_gradient_accumulation_boundary(index == micro - 1)
        loss = lm_loss(engine, batch, per_token)
        engine.backward(loss)
        total += loss.detach()
        if count_zeros and index == micro - 1:
            zeros = num_zeros_in_grad(engine.module)
        engine.step()
    return _mean_over_data_parallel(total / micro), zeros


class _Progress:
    """The run's history, and the losses not yet read from the device.

    Per-iteration losses stay on the device until a log or save step reads them, with whatever
    else that step reports, in one host read: one synchronisation per log. The log interval's
    time leaves evaluation and checkpoint saves out, as Megatron-LM's interval timer does: the
    per-iteration time, tokens/s and ETA measure training alone.

    As Megatron-LM's `training_log`, the logged loss is the mean over the interval's advanced
    iterations (those whose step was applied): a skipped step's loss (non-finite, or fp16's
    overflow) is left out and counted apart, with the non-finite ones, for the interval alone.
    """

    def __init__(self, max_skipped: int, rank0: bool):
        self.history = {"losses": [], "validation": [], "lr": []}
        self.pending = []  # (iteration, loss tensor, whether DeepSpeed skipped the step)
        # the log interval's: summed loss and count of advanced iterations; skipped; non-finite
        self.interval = {"loss": 0.0, "advanced": 0, "skipped": 0, "nan": 0}
        self.max_skipped, self.in_a_row = max_skipped, 0
        self.rank0 = rank0

    def begin(self, iteration: int, consumed: int, skipped: int) -> None:
        """The first log interval starts where the run does (`skipped`: DeepSpeed's count of
        skipped steps, a resumed checkpoint's)."""
        self.skipped = skipped  # DeepSpeed's count before the next step
        self.first, self.started = iteration, time.time()
        self.first_consumed = consumed

    def add(self, iteration: int, loss: torch.Tensor, engine) -> None:
        before, self.skipped = self.skipped, engine.skipped_steps
        self.pending.append((iteration, loss, self.skipped > before))

    @contextlib.contextmanager
    def saving(self):
        """Around a checkpoint save: never one after a step trained on a non-finite loss, and
        its time is not the step's."""
        self.read()
        with self.paused():
            yield

    @contextlib.contextmanager
    def paused(self):
        paused = time.time()
        try:
            yield
        finally:
            self.started += time.time() - paused

    def log_step(
        self, engine, args, iteration: int, consumed: int, zeros, batch_size: int, hooks
    ) -> LogStep:
        """The log line's values, the variant's statistics with them (one host read); starts
        the next log interval."""
        grad_norm = engine.get_global_grad_norm()
        values = self.read(
            {
                "grad norm": grad_norm
                if torch.is_tensor(grad_norm)
                else torch.tensor(float("nan") if grad_norm is None else float(grad_norm)),
                # fp16's dynamic loss scale; nothing is scaled in bf16 and fp32
                "loss scale": torch.as_tensor(getattr(engine.optimizer, "loss_scale", 1.0)),
                **({"params norm": params_norm(engine.module)} if args.log_params_norm else {}),
                **({"num zeros": zeros} if zeros is not None else {}),
                **hooks.statistics(engine.module),
            }
        )
        # the whole interval's: a checkpoint save in it has read some of its losses
        interval = self.interval
        grad_norm, loss_scale = values.pop("grad norm"), values.pop("loss scale")
        norm, num_zeros = values.pop("params norm", None), values.pop("num zeros", None)
        if num_zeros is not None:
            self.history.setdefault("num zeros", []).append(num_zeros)
        self.history["lr"].append(engine.get_lr()[0])
        step = LogStep(
            iteration,
            consumed,
            batch_size,
            interval["loss"] / interval["advanced"] if interval["advanced"] else None,
            self.history["lr"][-1],
            (time.time() - self.started) / (iteration - self.first),
            (consumed - self.first_consumed) / (iteration - self.first),
            interval["skipped"],
            interval["nan"],
            None if math.isnan(grad_norm) else grad_norm,
            loss_scale,
            norm,
            num_zeros,
            values,
            hooks.summary(values),
        )
        self.first, self.started, self.first_consumed = iteration, time.time(), consumed
        self.interval = {"loss": 0.0, "advanced": 0, "skipped": 0, "nan": 0}
        return step

    def read(self, extra: Optional[dict] = None) -> dict:
        """`extra`'s tensors as floats; appends the pending losses to history["losses"].
        Raises if a non-finite loss was trained on."""
        extra = extra or {}
        tensors = [loss for _, loss, _ in self.pending] + list(extra.values())
        values = (
            torch.stack(
                [t.detach().double().reshape(()).to(tensors[0].device) for t in tensors]
            ).tolist()
            if tensors
            else []
        )
        losses = values[: len(self.pending)]
        for (iteration, _, skipped), loss in zip(self.pending, losses):
            if not skipped:
                self.interval["loss"] += loss
                self.interval["advanced"] += 1
            else:
                self.interval["skipped"] += 1
            if math.isfinite(loss):
                self.in_a_row = 0
                continue
            if not skipped:
                raise FloatingPointError(
                    f"lm loss is {loss} at iteration {iteration} and DeepSpeed applied the step "
                    "(ZeRO stage 0 in fp32 does not check gradients for overflow): use "
                    "--zero-stage 1 or higher, or --bf16 / --fp16"
                )
            self.interval["nan"] += 1
            self.in_a_row += 1
            if self.rank0:
                print(
                    f" iteration {iteration}: lm loss is {loss}; the step was skipped", flush=True
                )
            if self.in_a_row == self.max_skipped:
                raise FloatingPointError(
                    f"lm loss non-finite for {self.in_a_row} steps in a row (iterations "
                    f"{iteration - self.in_a_row + 1}-{iteration}), each skipped: stopping "
                    "without a further checkpoint (--max-skipped-steps); lower --lr or check the "
                    "data"
                )
        self.history["losses"] += losses
        self.pending = []
        return dict(zip(extra, values[len(losses) :]))


@torch.no_grad()
def evaluate(engine, batches, args: RunConfig) -> float:
    """Mean loss over `batches`, the first `--eval-iters` global batches of the validation split.

    Always the same samples, so validation curves of different runs and variants compare.
    """
    device = platform.setup().device
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    engine.eval()
    try:
        for batch in batches:
            if args.calculate_per_token_loss:  # the mean over every loss token of every batch
                total += lm_loss(engine, batch, torch.ones((), device=device)).double()
                count += batch["loss_mask"].sum().to(device)
            else:  # the mean of the micro-batches' means
                total += lm_loss(engine, batch).double()
                count += 1
    finally:
        engine.train()
    return (_mean_over_data_parallel(total) / _mean_over_data_parallel(count)).item()


def _auxiliary_scale(engine) -> float:
    """The gradient an auxiliary loss receives in a micro-batch's backward (model/auxiliary.py):
    what the main loss is scaled by, by `lm_loss` (the context-parallel size) and by DeepSpeed's
    backward (1 / gradient accumulation steps, and fp16's loss scale)."""
    scale = parallel_state.get_context_parallel_world_size() / engine.gradient_accumulation_steps()
    if engine.fp16_enabled():
        optimizer = engine.optimizer
        scale *= float(getattr(optimizer, "cur_scale", getattr(optimizer, "loss_scale", 1.0)))
    return scale


def lm_loss(engine, batch: dict, tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The micro-batch's summed token losses over `tokens`, by default its own loss tokens (the
    mean); `--calculate-per-token-loss` passes the global batch's count per micro-batch and rank,
    so that every token weighs the same however the batch is cut.

    Under context parallelism each rank holds two chunks of every sequence (Megatron-Core's
    `get_batch_on_this_cp_rank`): its share of the mean is its tokens' losses over the sequence's
    loss tokens, times the CP size, as Megatron-LM scales it, since gradients and reported losses
    are averaged over data-parallel x context-parallel ranks."""
    batch = context_parallel.batch_on_this_rank(to_device(batch, platform.setup().device))
    per_token = engine(
        batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"]
    )
    mask = batch["loss_mask"].float()
    cp = parallel_state.get_context_parallel_world_size()
    summed = (per_token.float() * mask).sum() * cp
    if tokens is not None:
        return summed / tokens
    count = mask.sum()
    if cp > 1:  # the sequences' loss tokens, on every rank of the sequences
        dist.all_reduce(count, group=parallel_state.get_context_parallel_group())
    return summed / count.clamp(min=1)


def data_loader(dataset, consumed: int, total: int, args: RunConfig, persistent: bool = False):
    """This rank's micro-batches of samples [consumed, total) (data/loader.py): tensor-parallel
    ranks of one replica read the same samples."""
    return micro_batches(
        dataset,
        consumed,
        total,
        args.micro_batch_size,
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_data_parallel_rank(),
        args.num_workers,
        pin_memory=platform.setup().is_cuda,
        persistent=persistent,
    )


def _mean_over_data_parallel(value: torch.Tensor) -> torch.Tensor:
    """The mean over every rank holding the same weights (data-parallel x context-parallel):
    with context parallelism, each rank's value is its share times the CP size (`lm_loss`)."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dist.all_reduce(value, group=group)
    return value / dist.get_world_size(group)


def _deepspeed_engine(args: RunConfig, model: torch.nn.Module, start: CheckpointStart):
    """AdamW without weight decay on biases and norms, Megatron's LR schedule, in DeepSpeed."""
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for _, p in group], **options}
            for options, group in param_groups(model, args)
        ],
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        **schedule(args),
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
    )
    config = deepspeed_config(args, parallel_state.get_data_parallel_world_size())
    start.engine_config(model, config)
    skip_unused_builds()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=_StepBySchedule(scheduler, args),
        mpu=platform.deepspeed_mpu(),
        config=config,
        dist_init_required=False,
    )
    return engine


class _StepBySchedule:
    """Megatron's scheduler counts in steps passed to `step(increment)`: a step's iterations (1)
    or, in a run of --train-samples, its samples, as Megatron-LM counts; DeepSpeed calls
    `step()` after each optimizer step it applies. The state records the unit (`steps_in`)."""

    def __init__(self, scheduler: OptimizerParamScheduler, args: RunConfig):
        self.scheduler = scheduler
        self.unit, self.global_batch = steps_in(args), args.global_batch_size
        self.increment = 1

    def trains(self, batch_size: int) -> None:
        """The next step's global batch."""
        self.increment = batch_size if self.unit == "samples" else 1

    def step(self, increment: Optional[int] = None) -> None:
        self.scheduler.step(self.increment if increment is None else increment)

    def get_lr(self):
        return [g["lr"] for g in self.scheduler.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {**self.scheduler.state_dict(), "steps_in": self.unit}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(in_unit(state, self.unit, self.global_batch))


class _StopRequest:
    """A SIGTERM or SIGINT (`--exit-signal-handler`) or the end of `--exit-duration-in-mins`;
    `any_rank()` tells every rank if one of them has one, so all save at the same iteration and
    stop together. A scheduler (SLURM's preemption, torchrun passing on its own signal) may signal
    the whole process group or a single rank; the DataLoader workers leave the signal to this
    handler (data/loader.py). Asked every step anyway, it also stops a job whose `--save` folder
    was taken over (`lost`): its save then refuses to write."""

    def __init__(self, args: RunConfig, started: float, lost):
        self.lost = lost
        self.asked = bool(args.exit_signal_handler or args.exit_duration_in_mins)
        self.received = False
        self.deadline = (
            started + 60 * args.exit_duration_in_mins if args.exit_duration_in_mins else None
        )
        # Asked every iteration: a CPU flag reduced over gloo never waits for the GPU's queue.
        if self.asked and dist.get_backend() != "gloo":
            timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        else:
            self.group = None
        if args.exit_signal_handler:
            for stop in (signal.SIGTERM, signal.SIGINT):
                signal.signal(stop, self._handler)

    def _handler(self, *_):
        self.received = True

    def any_rank(self) -> bool:
        if not self.asked:  # neither flag given: nothing to reduce
            return False
        late = self.deadline is not None and time.time() >= self.deadline
        flag = torch.tensor([int(self.received or late or self.lost())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag[0])


def _print_banner(args: RunConfig, model: torch.nn.Module, hooks, iteration: int) -> None:
    params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"training {trained:,} of {params:,} parameters (TP rank 0)", flush=True)
    print(
        f"megatron-focus | attention {args.attention} | {args.num_layers} layers, hidden "
        f"{args.hidden_size}, {args.num_attention_heads} heads | {params / 1e6:.2f}M parameters on "
        f"TP rank 0 | TP {args.tensor_model_parallel_size}, DP "
        f"{parallel_state.get_data_parallel_world_size()}, ZeRO {args.zero_stage} | data "
        f"{_data_name(args)} | starting at iteration {iteration}",
        flush=True,
    )
    if args.rampup_batch_size:
        start, increment, samples = args.rampup_batch_size
        print(
            f"global batch {start} -> {args.global_batch_size} by {increment} over the first "
            f"{samples:,} samples: {args.train_iters:,} iterations for {args.train_samples:,} "
            "samples",
            flush=True,
        )
    chosen = ", ".join(f"{operation} {name}" for operation, name in kernels.chosen(model).items())
    line = [hooks.banner()] + ([f"kernels: {chosen}"] if chosen else [])
    if any(line):
        print(" | ".join(filter(None, line)), flush=True)
    for warning in kernels.warnings(model):
        print(f"warning: {warning}", flush=True)
    _print_where(args)  # before the first step too: where to look while it trains


def _data_name(args: RunConfig) -> str:
    if args.mqar:
        return (
            f"MQAR ({args.mqar_pairs} {'packed ' if args.mqar_packed else ''}pairs, "
            f"vocabulary {args.mqar_vocab_size}, queries >= {args.mqar_min_distance} tokens "
            "after them)"
        )
    if args.mock_data:
        return "mock (synthetic sequences)"
    if args.train_data_path:
        return " | ".join(
            f"{name} {' '.join(paths)}"
            for name, paths in (
                ("train", args.train_data_path),
                ("valid", args.valid_data_path),
                ("test", args.test_data_path),
            )
            if paths
        )
    return " ".join(data_prefixes(args))


def _print_where(args: RunConfig) -> None:
    """Where the run's logs and checkpoints go (at its start, and again at its end)."""
    if args.tensorboard_dir:
        print(
            f"TensorBoard logs: {args.tensorboard_dir}  (tensorboard --logdir "
            f"{args.tensorboard_dir})",
            flush=True,
        )
    if args.save:
        print(f"Checkpoints: {args.save}", flush=True)
