"""What a run reports: Megatron's console line and TensorBoard scalars under Megatron's tag names.

One rank, the last (as in Megatron-LM), prints the log line and writes TensorBoard, so a
multi-rank run makes one set of curves; the numbers are already averaged over data-parallel ranks.
As Megatron-LM's `training_log`, each of its curves is also written against the samples consumed
(`<tag> vs samples`), and the run's arguments are written as text, one entry per argument.
"""

import dataclasses
import datetime
import math
import os
import resource
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_focus import platform
from megatron_focus.config.run_config import RunConfig
from megatron_focus.model.flops import PEAK_BF16_FLOPS


def peak_memory_bytes() -> tuple[str, int]:
    """(tag, bytes): the CUDA allocator's peak on a GPU, the process's peak RSS on the CPU."""
    if platform.has_cuda():
        return "mem-max-allocated-bytes", torch.cuda.max_memory_allocated()
    return "mem-peak-rss-bytes", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_now() -> dict:
    """Megatron-LM's `--log-memory-to-tensorboard` curves: the CUDA allocator's on a GPU, the
    resident set on the CPU."""
    if platform.has_cuda():
        stats = torch.cuda.memory_stats()
        return {
            "mem-reserved-bytes": stats["reserved_bytes.all.current"],
            "mem-allocated-bytes": stats["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
            "mem-allocated-count": stats["allocation.all.current"],
        }
    try:
        with open("/proc/self/statm") as f:
            return {"mem-rss-bytes": int(f.read().split()[1]) * resource.getpagesize()}
    except OSError:  # no /proc (macOS): the peak is what the system reports
        return dict([peak_memory_bytes()])


@dataclasses.dataclass(frozen=True)
class LogStep:
    """What one log line reports, read from the device in one go. `batch_size`: the last step's
    global batch; `loss`: as Megatron-LM's, the mean over the iterations since the previous line
    whose step was applied (None if every one was skipped), `skipped` and `nan_iters` counting
    the others; `seconds_per_iter`: their training time alone; `samples_per_iter`: their mean
    batch."""

    iteration: int
    consumed_samples: int
    batch_size: int
    loss: Optional[float]
    lr: float
    seconds_per_iter: float
    samples_per_iter: float
    skipped: int
    nan_iters: int
    grad_norm: Optional[float] = None
    loss_scale: float = 1.0
    params_norm: Optional[float] = None
    num_zeros: Optional[float] = None
    statistics: dict = dataclasses.field(default_factory=dict)  # the variant's, to TensorBoard
    summary: str = ""  # the variant's part of the log line


class Reporter:
    def __init__(self, args: RunConfig, flops_token: float, total_samples: int):
        self.args = args
        self.total_samples = total_samples  # the ETA's: batches grow under --rampup-batch-size
        self.flops_token = flops_token
        self.world_size = dist.get_world_size()
        is_last_rank = dist.get_rank() == self.world_size - 1
        self.active = is_last_rank
        self.writer = None
        if is_last_rank and args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=100)
            for name, value in sorted(args.flags().items()):
                self.writer.add_text(name, str(value), global_step=0)
        self.wandb = _wandb_run(args) if is_last_rank and args.wandb_project else None
        self.peak = None
        if platform.has_cuda():
            name = torch.cuda.get_device_name()
            self.peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        self.started = time.time()

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log({tag: value}, step=step)

    def megatron_scalar(self, tag: str, value: float, iteration: int, samples: int) -> None:
        """A curve Megatron-LM writes both ways: against iterations and against samples (the
        latter to TensorBoard only, as Megatron-LM: wandb has one step axis)."""
        self.scalar(tag, value, iteration)
        if self.writer is not None:
            self.writer.add_scalar(f"{tag} vs samples", value, samples)

    def train(self, step: LogStep) -> None:
        if not self.active:
            return
        args = self.args
        samples_per_s = step.samples_per_iter / step.seconds_per_iter
        tokens_per_s = samples_per_s * args.seq_length
        tflops = tokens_per_s * self.flops_token / self.world_size / 1e12  # per GPU
        mem_tag, mem = peak_memory_bytes()
        eta = datetime.timedelta(
            seconds=int((self.total_samples - step.consumed_samples) / samples_per_s)
        )
        throughput = (
            f" | throughput per GPU (TFLOP/s/GPU): {tflops:.1f}" if args.log_throughput else ""
        )
        line = (
            f" [{datetime.datetime.now():%Y-%m-%d %H:%M:%S}] iteration {step.iteration:8d}/"
            f"{args.train_iters:8d} | consumed samples: {step.consumed_samples:12d}"
            f" | elapsed time per iteration (ms): {step.seconds_per_iter * 1000:.1f}{throughput}"
            f" | learning rate: {step.lr:.6E} | global batch size: {step.batch_size:5d}"
            + (f" | lm loss: {step.loss:.6E}" if step.loss is not None else "")
            + f" | grad norm: {step.grad_norm if step.grad_norm is not None else float('nan'):.3f}"
            + (f" | num zeros: {step.num_zeros:.1f}" if step.num_zeros is not None else "")
            + (f" | params norm: {step.params_norm:.3f}" if step.params_norm is not None else "")
            + f" | number of skipped iterations: {step.skipped:3d}"
            + f" | number of nan iterations: {step.nan_iters:3d}"
            f" | tokens/s: {tokens_per_s:.0f} | TFLOP/s/device: {tflops:.3f} | ETA: {eta}"
        )
        print(line + step.summary, flush=True)
        if step.iteration % args.tensorboard_log_interval:
            return
        at, samples = step.iteration, step.consumed_samples
        for tag, value in (
            ("lm loss", step.loss),
            ("learning-rate", step.lr),
            ("grad-norm", step.grad_norm),
            ("num-zeros", step.num_zeros),
            ("params-norm", step.params_norm),
            ("batch-size", step.batch_size),
        ):
            if value is not None:
                self.megatron_scalar(tag, value, at, samples)
        if args.log_loss_scale_to_tensorboard:
            self.megatron_scalar("loss-scale", step.loss_scale, at, samples)
        if args.log_world_size_to_tensorboard:
            self.megatron_scalar("world-size", self.world_size, at, samples)
        if args.log_timers_to_tensorboard:
            self.scalar("iteration-time", step.seconds_per_iter, at)
            if args.log_throughput:
                self.scalar("throughput", tflops, at)
        self.scalar("tokens-per-sec", tokens_per_s, at)
        self.scalar("tflops-per-device", tflops, at)
        if self.peak:
            self.scalar("mfu", tflops * 1e12 / self.peak, at)
        self.scalar(mem_tag, mem, at)
        if args.log_memory_to_tensorboard:
            for tag, value in memory_now().items():
                self.scalar(tag, value, at)
        self.scalar("skipped-iterations", step.skipped, at)
        for tag, value in step.statistics.items():
            self.scalar(tag, value, at)

    def validation(
        self, iteration: int, consumed_samples: int, loss: float, focus_mode: str = ""
    ) -> None:
        """Megatron's tags; a Focus model's other mode gets the mode as a suffix."""
        if not self.active:
            return
        suffix = f" {focus_mode}" if focus_mode else ""
        ppl = math.exp(min(loss, 20.0))
        print(
            f" validation loss{suffix} at iteration {iteration} | lm loss value: {loss:.6E}"
            f" | lm loss PPL: {ppl:.6E}",
            flush=True,
        )
        self.megatron_scalar(f"lm loss validation{suffix}", loss, iteration, consumed_samples)
        if self.args.log_validation_ppl_to_tensorboard:
            self.megatron_scalar(
                f"lm loss validation{suffix} ppl", ppl, iteration, consumed_samples
            )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(args: RunConfig):
    """Megatron-LM's wandb run: the project and name given, the arguments as its config."""
    import wandb

    folder = args.wandb_save_dir or os.path.join(args.save or args.tensorboard_dir or ".", "wandb")
    os.makedirs(folder, exist_ok=True)
    return wandb.init(
        project=args.wandb_project,
        name=args.wandb_exp_name,
        entity=args.wandb_entity or None,
        dir=folder,
        config={k: v for k, v in args.flags().items() if _plain(v)},
    )


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, list, tuple))
