"""megatron-focus's `torchrun.handlers` entry point (setup.py).

torchelastic loads that entry point group in every process that imports its rendezvous (an
exported model's process under transformers too, where nothing of megatron-focus may load), so
this module stands outside the package and imports it only inside torchrun itself, to make
torchrun's agent honour a refusal's final exit (megatron_focus/launchers.py)."""

import os
import sys


def _is_torchrun() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return os.path.basename(sys.argv[0] if sys.argv else "") == "torchrun" or getattr(
        spec, "name", None
    ) in ("torch.distributed.run", "torch.distributed.launch")


def _not_a_rendezvous(params):
    raise ValueError(
        "megatron-focus registers no rendezvous backend: use --rdzv-backend c10d (or static)"
    )


def plugin():
    """The rendezvous handler factory the entry point group asks for (none of ours is
    selectable); inside torchrun, its agent made to honour final failures first."""
    if _is_torchrun():
        from megatron_focus.launchers import honour_final_failures_in_torchrun

        honour_final_failures_in_torchrun()
    return _not_a_rendezvous
