"""Megatron-LM's `--profile`: a trace of chosen iterations on chosen ranks.

With `--use-pytorch-profiler`, or on a machine without a GPU, the iterations
[`--profile-step-start`, `--profile-step-end`) are recorded by the PyTorch profiler into the
TensorBoard folder (TensorBoard's profiler plugin, or Perfetto, reads the `.pt.trace.json`).
Otherwise, as in Megatron-LM, they are bracketed by `cudaProfilerStart/Stop` for an enclosing
`nsys profile --capture-range=cudaProfilerApi`.
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron_focus import platform
from megatron_focus.config.run_config import RunConfig


class StepProfiler:
    def __init__(self, args: RunConfig):
        self.args = args
        self.on = args.profile and dist.get_rank() in args.profile_ranks
        self.torch_profiler: Optional[torch.profiler.profile] = None
        if self.on and (args.use_pytorch_profiler or not platform.has_cuda()):
            start, end = args.profile_step_start, args.profile_step_end
            self.torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(
                    wait=max(start - 1, 0),
                    warmup=1 if start > 0 else 0,
                    active=end - start,
                    repeat=1,
                ),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(args.tensorboard_dir),
                record_shapes=True,
                with_stack=True,
            )
            self.torch_profiler.start()

    def after_step(self, iteration: int) -> None:
        """Called once each iteration is done (`iteration` counts from the run's first)."""
        if not self.on:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif iteration == self.args.profile_step_start:
            torch.cuda.profiler.start()
        elif iteration == self.args.profile_step_end:
            torch.cuda.profiler.stop()

    def close(self) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
