"""The global batch at each point of a run, and the run's length, as Megatron-LM counts them.

`--rampup-batch-size START INCREMENT SAMPLES` grows the batch from START to `--global-batch-size`
by INCREMENT, one increment every SAMPLES / ((global - START) / INCREMENT) consumed samples
(Megatron-Core 0.16's `RampupBatchsizeNumMicroBatchesCalculator`). A step's batch follows from the
samples consumed before it, so a resumed run, which restores that count, continues with the
batch the uninterrupted run had. `--decrease-batch-size-if-needed` trains each batch rounded
down to a multiple of micro batch x data-parallel size instead of refusing it.

With `--train-samples`, the run's iterations are Megatron-LM's `update_train_iters`: whole
global batches, a last partial batch dropped, the ramp counted batch by batch.
"""

import argparse
import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class GlobalBatch:
    """`final`: --global-batch-size; `per_micro_step`: micro batch x data-parallel size, the
    samples one micro-batch on every replica takes; `rampup`: (START, INCREMENT, SAMPLES)."""

    final: int
    per_micro_step: int
    rampup: Optional[Tuple[int, int, int]] = None
    decrease_if_needed: bool = False

    @classmethod
    def of(cls, args: argparse.Namespace, data_parallel: int) -> "GlobalBatch":
        return cls(
            args.global_batch_size,
            args.micro_batch_size * data_parallel,
            tuple(args.rampup_batch_size) if args.rampup_batch_size else None,
            args.decrease_batch_size_if_needed,
        )

    def nominal(self, consumed: int) -> int:
        """Megatron's current global batch after `consumed` samples."""
        if self.rampup is None:
            return self.final
        start, increment, samples = self.rampup
        if consumed > samples:
            return self.final
        per_increment = samples / ((self.final - start) // increment)  # a float, as Megatron's
        return start + int(consumed / per_increment) * increment

    def running(self, consumed: int) -> int:
        """The batch the next step trains on: the nominal one, rounded down to whole micro-steps
        with `decrease_if_needed`."""
        return self._trained(self.nominal(consumed))

    @property
    def running_final(self) -> int:
        """The batch trained once the ramp is over."""
        return self._trained(self.final)

    def _trained(self, batch: int) -> int:
        return batch - batch % self.per_micro_step if self.decrease_if_needed else batch

    def train_iters(self, train_samples: int) -> int:
        """The iterations `--train-samples` means (Megatron-LM's `update_train_iters`)."""
        if self.rampup is None:
            return train_samples // self.final
        iterations = consumed = 0
        while consumed <= self.rampup[2] and consumed <= train_samples:
            consumed += self.nominal(consumed)
            iterations += 1
        return iterations + max(0, train_samples - consumed) // self.final

    def consumed_after(self, iterations: int) -> int:
        """The samples the first `iterations` steps train on."""
        consumed = done = 0
        while done < iterations and self.nominal(consumed) != self.final:
            consumed += self.running(consumed)
            done += 1
        return consumed + (iterations - done) * self.running(consumed)

    def check(self) -> None:
        """Refuse a ramp Megatron-LM would stop on mid-run (or divide by zero for)."""
        step = self.per_micro_step
        if self.rampup is None:
            if self.running(0) < step or (self.final % step and not self.decrease_if_needed):
                raise ValueError(
                    f"--global-batch-size {self.final} is not divisible by --micro-batch-size x "
                    f"data-parallel size {step} (or --decrease-batch-size-if-needed)"
                )
            return
        start, increment, samples = self.rampup
        flag = f"--rampup-batch-size {start} {increment} {samples}"
        if min(start, increment, samples) < 1:
            raise ValueError(f"{flag}: START, INCREMENT and SAMPLES must each be at least 1")
        if start >= self.final or (self.final - start) % increment:
            raise ValueError(
                f"{flag}: --global-batch-size {self.final} must be START plus a whole number "
                "(at least one) of INCREMENTs"
            )
        if self.decrease_if_needed:
            if self.running(0) < step:
                raise ValueError(
                    f"{flag}: START {start} is below one micro-batch on every data-parallel rank "
                    f"({step} samples)"
                )
        elif start % step or increment % step or self.final % step:
            raise ValueError(
                f"{flag} with --global-batch-size {self.final}: every batch of the ramp must be "
                f"a multiple of --micro-batch-size x data-parallel size {step} (or "
                "--decrease-batch-size-if-needed)"
            )
