"""What an attention variant adds to a run beyond its layers: the trainer asks these, never the
variant's kind.

The defaults add nothing, so a variant that only changes what a layer computes writes none.
Focus's (`model/focus/focus.py: FocusHooks`) keeps its routers out of the optimizer where they must
not learn, validates in its other mode as well, and reports its routing at log steps. A
variant names its hooks class in its registration (`AttentionVariant.hooks`); each run makes
one from the run's settings of the variant.
"""

import contextlib
from typing import Iterator, Optional, Tuple

import torch


class VariantHooks:
    def __init__(self, settings: Optional[object]):
        self.settings = settings  # the variant's settings for this run (None: it has none)

    def banner(self) -> str:
        """What the run's first lines say of the variant beside its kernels ("" for nothing)."""
        return ""

    def freeze(self, model: torch.nn.Module, retrofit: bool) -> None:
        """Before the optimizer sees the parameters: `requires_grad` off for those that must not
        learn in this run (`retrofit`: only what the variant adds to a pretrained model learns)."""

    @contextlib.contextmanager
    def training(self, model: torch.nn.Module, iteration: int, start: int) -> Iterator[None]:
        """The training step after `iteration` runs inside the block: a variant with a schedule
        counted from iteration `start` (resume.variant_schedule) sets its phase for it."""
        yield

    def other_modes(self) -> Tuple[str, ...]:
        """Modes validated beside the run's own, each logged as "validation MODE"."""
        return ()

    @contextlib.contextmanager
    def in_mode(self, model: torch.nn.Module, mode: str) -> Iterator[None]:
        """The model computes in `mode` (one of `other_modes()`) inside the block, in the run's
        own mode again after it, even when the block fails; a variant with modes overrides it."""
        if mode not in self.other_modes():
            raise ValueError(f"this attention variant has no mode {mode!r}")
        yield

    @contextlib.contextmanager
    def recording(self, model: torch.nn.Module) -> Iterator[None]:
        """Forwards inside the block compute what `statistics` reports (at log steps only)."""
        yield

    def statistics(self, model: torch.nn.Module) -> dict:
        """{"name/layerNN/what": 0-dim tensor}: the last recorded forward's, on the device; each
        goes to TensorBoard under its name."""
        return {}

    def summary(self, values: dict) -> str:
        """The log line's part (" | what: value ...") of `statistics`' values, read as floats."""
        return ""
