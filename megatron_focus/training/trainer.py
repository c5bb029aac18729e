"""The pretraining loop: data, model, DeepSpeed engine, then iterate, evaluate, save.

Read `pretrain` top to bottom; the helpers below it are the steps it names. One code path serves a
laptop (one process, CPU, gloo), `torchrun` and the DeepSpeed launcher across nodes.
"""

import argparse
import math
import os
import signal
import time
from typing import Optional

import deepspeed
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_focus import platform
from megatron_focus.data.datasets import build_datasets
from megatron_focus.data.embedded import TOKENIZER_TYPE as EMBEDDED_TOKENIZER_TYPE
from megatron_focus.data.embedded import ensure_embedded_data
from megatron_focus.data.tokenizer import build_tokenizer
from megatron_focus.model.focus import focus_statistics, set_focus_mode, train_routers_only
from megatron_focus.model.focus_gate import lse_kernel, soft_kernel
from megatron_focus.model.gpt import build_model, padded_vocab_size
from megatron_focus.parallel import install_sequence_parallel_grad_allreduce
from megatron_focus.training import checkpointing
from megatron_focus.training.deepspeed_config import deepspeed_config
from megatron_focus.training.metrics import Reporter, flops_per_token

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "megatron-focus")


def pretrain(args: argparse.Namespace) -> dict:
    """Train as the flags say; returns {"losses": [...], "validation": [(iteration, loss)...]}
    for this rank (a Focus run adds its other mode's, e.g. "validation sparse")."""
    platform.init_distributed(args.tensor_model_parallel_size, args.distributed_timeout_minutes)
    platform.manual_seed(args.seed)
    rank0 = dist.get_rank() == 0

    # Data first: a wrong path or a tokenizer that does not fit the data fails before any compute.
    tokenizer = tokenizer_for(args, rank0)
    args.padded_vocab_size = padded_vocab_size(
        tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
    train_data, valid_data = datasets_for(args, tokenizer)

    model = build_model(args, tokenizer.vocab_size)
    if args.retrofit:  # frozen weights stay out of the optimizer
        train_routers_only(model)
    install_sequence_parallel_grad_allreduce(model)
    engine = _deepspeed_engine(args, model)

    iteration, consumed = checkpointing.load(engine, args) if args.load else (0, 0)
    reporter = Reporter(args, flops_per_token(args, args.padded_vocab_size), dist.get_world_size(),
                        is_last_rank=dist.get_rank() == dist.get_world_size() - 1)
    if rank0:
        _print_banner(args, model, iteration)
    stop = _SignalFlag(signal.SIGTERM) if args.exit_signal_handler else None

    history = {"losses": [], "validation": []}
    if args.retrofit and iteration == 0 and valid_data is not None:
        # A retrofit's starting point (the base model with fresh routers) is what it must beat.
        _validate(engine, valid_data, args, iteration, reporter, history)
    nan_iterations = 0
    window_start, window_losses = time.time(), []  # the log line averages since the last one
    while iteration < args.train_iters:
        loss, finite = train_step(engine, train_data, consumed, args)
        iteration += 1
        consumed += args.global_batch_size
        window_losses.append(loss)
        if not finite:
            nan_iterations += 1
            if rank0:
                print(f" iteration {iteration}: lm loss is {loss}; the step was skipped", flush=True)
        history["losses"].append(loss)

        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            seconds = (time.time() - window_start) / len(window_losses)
            reporter.train(iteration, consumed, sum(window_losses) / len(window_losses),
                           engine.get_lr()[0], engine.get_global_grad_norm(), seconds,
                           engine.skipped_steps, nan_iterations, focus_statistics(engine.module))
            window_start, window_losses = time.time(), []
        if valid_data is not None and (
            iteration % args.eval_interval == 0 or iteration == args.train_iters
        ):
            _validate(engine, valid_data, args, iteration, reporter, history)
        saved = args.save and (
            (args.save_interval and iteration % args.save_interval == 0)
            or iteration == args.train_iters
        )
        if saved:
            _save(engine, args, iteration, consumed, rank0)
        exit_now = (args.exit_interval and iteration % args.exit_interval == 0) or (
            stop is not None and stop.any_rank()
        )
        if exit_now:
            if args.save and not saved:
                _save(engine, args, iteration, consumed, rank0)
            if rank0:
                print(f" exiting at iteration {iteration}", flush=True)
            break

    reporter.close()
    if rank0:
        _print_where(args)
    return history


def _validate(engine, dataset, args, iteration: int, reporter, history: dict) -> None:
    """Validation loss in the run's mode and, for Focus, in the other mode too."""
    history["validation"].append((iteration, evaluate(engine, dataset, args)))
    reporter.validation(*history["validation"][-1])
    if args.attention.startswith("focus"):
        other = "sparse" if args.focus_attention_mode == "soft" else "soft"
        loss = evaluate(engine, dataset, args, other)
        history.setdefault(f"validation {other}", []).append((iteration, loss))
        reporter.validation(iteration, loss, other)


def _save(engine, args, iteration: int, consumed: int, rank0: bool) -> None:
    path = checkpointing.save(engine, args, iteration, consumed)
    if rank0:
        print(f" saved checkpoint {path}", flush=True)


def train_step(engine, dataset, consumed: int, args: argparse.Namespace) -> tuple[float, bool]:
    """One global batch: forward/backward per micro-batch, then DeepSpeed's optimizer step.

    Returns the loss averaged over micro-batches and data-parallel ranks, and whether it was
    finite. A non-finite loss is never trained on: DeepSpeed's overflow check (fp16 loss scaling,
    bf16 `check_grad_overflow`, or the non-finite gradient norm under ZeRO with clipping) skips the
    step, and with ZeRO stage 0 in fp32, where DeepSpeed has no such check, training stops.
    """
    engine.train()
    total = torch.zeros((), dtype=torch.float64)
    micro_batches = engine.gradient_accumulation_steps()
    for micro in range(micro_batches):
        batch = micro_batch(dataset, consumed, micro, args)
        loss = lm_loss(engine, batch)
        engine.backward(loss)
        total += loss.detach().double().cpu()
        skipped_before = engine.skipped_steps
        engine.step()
    mean = _average_over_data_parallel(total / micro_batches)
    finite = math.isfinite(mean)
    if not finite and engine.skipped_steps == skipped_before:
        raise FloatingPointError(
            f"lm loss is {mean} and DeepSpeed applied the step (ZeRO stage 0 without fp16 does not "
            "check for overflow): use --zero-stage 1 or higher, or --fp16"
        )
    return mean, finite


@torch.no_grad()
def evaluate(engine, dataset, args: argparse.Namespace, focus_mode: Optional[str] = None) -> float:
    """Mean loss over the first `--eval-iters` global batches of the validation split.

    Always the same samples, so validation curves of different runs and variants compare.
    `focus_mode` evaluates a Focus model in that mode (soft / sparse) instead of its own.
    """
    engine.eval()
    if focus_mode is not None:
        set_focus_mode(engine.module, focus_mode)
    total = torch.zeros((), dtype=torch.float64)
    micro_batches = engine.gradient_accumulation_steps()
    for it in range(args.eval_iters):
        for micro in range(micro_batches):
            batch = micro_batch(dataset, it * args.global_batch_size, micro, args)
            total += lm_loss(engine, batch).double().cpu()
    if focus_mode is not None:
        set_focus_mode(engine.module, args.focus_attention_mode)
    engine.train()
    return _average_over_data_parallel(total / (args.eval_iters * micro_batches))


def lm_loss(engine, batch: dict) -> torch.Tensor:
    device = platform.setup().device
    tokens = batch["tokens"].to(device)
    per_token = engine(tokens, batch["position_ids"].to(device), None,
                       labels=batch["labels"].to(device))
    mask = batch["loss_mask"].to(device=device, dtype=torch.float32)
    return (per_token.float() * mask).sum() / mask.sum().clamp(min=1)


def micro_batch(dataset, consumed: int, micro: int, args: argparse.Namespace) -> dict:
    """The samples of this rank's micro-batch, by position in the sample stream.

    A global batch is samples [consumed, consumed + global batch); micro-batch m of data-parallel
    rank r takes its slice [m * mbs * dp + r * mbs, ... + mbs). Tensor-parallel ranks of one
    replica read the same samples. Being a pure function of `consumed`, it resumes exactly.
    """
    dp, rank = (parallel_state.get_data_parallel_world_size(),
                parallel_state.get_data_parallel_rank())
    start = consumed + (micro * dp + rank) * args.micro_batch_size
    samples = [dataset[(start + i) % len(dataset)] for i in range(args.micro_batch_size)]
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}


def _average_over_data_parallel(value: torch.Tensor) -> float:
    value = value.to(platform.setup().device, torch.float64)
    dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
    return value.item() / parallel_state.get_data_parallel_world_size()


def tokenizer_for(args: argparse.Namespace, rank0: bool):
    if args.data_path is None:
        # The zero-download default: rank 0 builds the cache, the others wait and reuse it.
        cache = args.data_cache_path or DEFAULT_CACHE
        if rank0:
            ensure_embedded_data(cache)
        dist.barrier()
        prefix, model_file = ensure_embedded_data(cache)
        args.data_path, args.tokenizer_type, args.tokenizer_model = (
            [prefix], EMBEDDED_TOKENIZER_TYPE, model_file
        )
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model)


def datasets_for(args: argparse.Namespace, tokenizer):
    valid_samples = args.eval_iters * args.global_batch_size if args.eval_iters else 0
    cache = os.path.join(args.data_cache_path or DEFAULT_CACHE, "indices")
    train, valid, _ = build_datasets(
        args.data_path, args.split, args.seq_length, args.seed, tokenizer,
        (args.train_iters * args.global_batch_size, valid_samples, 0), cache,
    )
    return train, valid if valid_samples else None


def _deepspeed_engine(args: argparse.Namespace, model: torch.nn.Module):
    """AdamW without weight decay on biases and norms, Megatron's LR schedule, in DeepSpeed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
        lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
        weight_decay=args.weight_decay,
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style="constant",
    )
    config = deepspeed_config(args, parallel_state.get_data_parallel_world_size())
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=_StepByOne(scheduler),
        mpu=platform.deepspeed_mpu(), config=config, dist_init_required=False,
    )
    return engine


class _StepByOne:
    """Megatron's scheduler counts in steps passed to `step(increment)`; DeepSpeed calls `step()`."""

    def __init__(self, scheduler: OptimizerParamScheduler):
        self.scheduler = scheduler

    def step(self, increment: int = 1) -> None:
        self.scheduler.step(increment)

    def get_lr(self):
        return [g["lr"] for g in self.scheduler.optimizer.param_groups]

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)


class _SignalFlag:
    """Remembers a signal; `any_rank()` tells every rank if one of them received it."""

    def __init__(self, signum: int):
        self.received = False
        signal.signal(signum, self._handler)

    def _handler(self, *_):
        self.received = True

    def any_rank(self) -> bool:
        flag = torch.tensor([int(self.received)], device=platform.setup().device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _print_banner(args: argparse.Namespace, model: torch.nn.Module, iteration: int) -> None:
    params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"training {trained:,} of {params:,} parameters (TP rank 0)", flush=True)
    print(
        f"megatron-focus | attention {args.attention} | {args.num_layers} layers, hidden "
        f"{args.hidden_size}, {args.num_attention_heads} heads | {params / 1e6:.2f}M parameters on "
        f"TP rank 0 | TP {args.tensor_model_parallel_size}, DP "
        f"{parallel_state.get_data_parallel_world_size()}, ZeRO {args.zero_stage} | data "
        f"{' '.join(args.data_path)} | starting at iteration {iteration}",
        flush=True,
    )
    if args.attention.startswith("focus"):
        device = platform.setup().device
        soft = soft_kernel(args.focus_kernel, device, args.attention_dropout)
        print(f"Focus {args.focus_gate} gate | kernels: soft gate {soft}, sparse "
              f"{lse_kernel(device)}", flush=True)


def _print_where(args: argparse.Namespace) -> None:
    if args.tensorboard_dir:
        print(f"TensorBoard logs: {args.tensorboard_dir}  (tensorboard --logdir "
              f"{args.tensorboard_dir})", flush=True)
    if args.save:
        print(f"Checkpoints: {args.save}", flush=True)
