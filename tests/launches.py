"""Count the kernels a piece of code launches, as a GPU would, on the CPU.

Every aten op that computes is one launch on a GPU; views, allocations and metadata are none.
Triton kernels do not pass through aten: each launch of the kernels named is counted as one
(under Triton's interpreter, what it does to run a kernel on the CPU is not counted).
The count does not depend on the device, so budgets stated for a GPU are tested here.
"""

import contextlib

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

NO_LAUNCH = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "detach",
    "alias",
    "lift_fresh",
    "_unsafe_view",
}


class _AtenLaunches(TorchDispatchMode):
    def __init__(self, launches: list):
        super().__init__()
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_LAUNCH:
            self.launches.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_launches(triton_kernels=()):
    """Yields a list that holds the name of each launch made in the block, in order."""
    launches = []

    def counted(kernel):
        run = kernel.run

        def run_once(*args, **kwargs):
            launches.append(kernel.__name__)
            with _disable_current_modes():
                return run(*args, **kwargs)

        return run_once

    for kernel in triton_kernels:
        kernel.run = counted(kernel)
    try:
        with _AtenLaunches(launches):
            yield launches
    finally:
        for kernel in triton_kernels:
            del kernel.run  # the class's own again
