"""What an attention variant adds to a run beyond its layers: the trainer asks these, never the
variant's kind.

The defaults add nothing, so a variant that only changes what a layer computes writes none.
Focus's (`model/focus/focus.py: FocusHooks`) keeps its routers out of the optimizer where they must
not learn, validates in its other mode as well, and reports its routing at log steps. A
variant names its hooks class in its registration (`AttentionVariant.hooks`); each run makes
one from the run's settings of the variant.
"""

import contextlib
import dataclasses
from typing import Iterator, Optional, Sequence, Tuple, Union

import torch


@dataclasses.dataclass(frozen=True)
class EvalMode:
    """One way the model computes that the evaluation tools compare (a row of their tables):
    `mode` by name, `top_k` the hard rule's groups per query (where the variant has one), `sparse`
    whether it computes only the pairs it keeps (their share is then measured)."""

    mode: str
    top_k: Optional[int] = None
    sparse: bool = False


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

    def evaluated_modes(self, top_k: Optional[Sequence[int]] = None) -> Tuple[EvalMode, ...]:
        """The modes tools/eval_ppl.py and tools/eval_passkey.py compare, one row each (`top_k`:
        the tool's --top-k, None: every one); none (the default): the model as it is."""
        return ()

    def set_mode(self, model: torch.nn.Module, mode: EvalMode) -> None:
        """The model computes in `mode`, one of `evaluated_modes()`, from now on."""
        raise ValueError(f"this attention variant has no mode {mode.mode!r}")

    @contextlib.contextmanager
    def recording(self, model: torch.nn.Module, sample: Union[int, str] = "log") -> Iterator[None]:
        """Forwards inside the block compute what `statistics` reports (at log steps only);
        `sample`: the queries that statistics costing dense work sample ("log": as at log steps,
        "all": every one, 0: none)."""
        yield

    def statistics(self, model: torch.nn.Module) -> dict:
        """{"name/layerNN/what": 0-dim tensor}: the last recorded forward's, on the device; each
        goes to TensorBoard under its name."""
        return {}

    def summary(self, values: dict) -> str:
        """The log line's part (" | what: value ...") of `statistics`' values, read as floats."""
        return ""
