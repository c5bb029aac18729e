"""Count the kernels a piece of code launches, as a GPU would, on the CPU.

Every aten op that computes is one launch on a GPU; views, allocations and metadata are none.
Triton kernels do not pass through aten: each launch of the kernels named is counted as one
(under Triton's interpreter, what it does to run a kernel on the CPU is not counted).
The count does not depend on the device, so budgets stated for a GPU are tested here.
"""

import contextlib
import warnings

import torch
from torch._ops import HigherOrderOperator
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
    "promote_types",
}


class _AtenLaunches(TorchDispatchMode):
    supports_higher_order_operators = True  # FlexAttention's, each one kernel on a GPU

    def __init__(self, launches: list):
        super().__init__()
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, HigherOrderOperator):
            self.launches.append(func.name())
            with _disable_current_modes():  # its eager evaluation: not what a GPU launches
                return func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_LAUNCH:
            self.launches.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_launches(triton_kernels=(), regions=()):
    """Yields a list that holds the name of each launch made in the block, in order.

    `regions`: (module, function name) pairs whose calls are each counted as one launch under
    that name, run without the counter: what a GPU compiles into one kernel or region
    (FlexAttention, whose eager CPU evaluation a dispatch mode would send to torch.compile).
    """
    launches = []

    def region(owner, name):
        function = getattr(owner, name)

        def run_once(*args, **kwargs):
            launches.append(name)
            with _disable_current_modes():
                return function(*args, **kwargs)

        return function, run_once

    originals = []
    for owner, name in regions:
        function, counted_call = region(owner, name)
        originals.append((owner, name, function))
        setattr(owner, name, counted_call)

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
        for owner, name, function in originals:
            setattr(owner, name, function)


def gpu_sparse_attention_launches(top_k: int, compiled_routing: bool, n: int = 256) -> list:
    """The launches of one sparse Focus attention call (focus_sparse), forward and backward, as
    a GPU makes them: slot 0 through torch's varlen ops (tests/varlen.py runs them here), the
    other parts through FlexAttention (each call, and each backward, one launch), the routing
    eager or one compiled region (`_route`, one launch)."""
    import pytest
    import torch.nn.attention.flex_attention as flex_attention
    from varlen import varlen_on_the_cpu

    from megatron_focus.model.focus import focus_sparse
    from megatron_focus.model.focus.groups import Routing
    from megatron_focus.model.kernels import flex, kernels

    from reference import assignments

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 64, generator=gen, requires_grad=True) for _ in range(3))
    routing = Routing.of(assignments(1, n, 8, gen))
    regions = [(flex, "_attend_with_lse")] + [(focus_sparse, "_route")] * compiled_routing
    with pytest.MonkeyPatch.context() as patch, varlen_on_the_cpu(patch), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        patch.setattr(flex_attention, "_validate_device", lambda *tensors: None)
        patch.setattr(kernels, "compiled", lambda device: compiled_routing)
        patch.setattr(focus_sparse, "_compiled_route", lambda: focus_sparse._route)
        # A first call builds what a process builds once (the band's cached block mask).
        out = focus_sparse.sparse_focus_attention(
            q, k, v, routing, window=32, top_k=top_k, scale=0.125, kernel=kernels.FLEX_VARLEN_LSE
        )
        cotangent = torch.randn(out.shape, generator=gen)
        with count_launches(regions=regions) as launches:
            out = focus_sparse.sparse_focus_attention(
                q,
                k,
                v,
                routing,
                window=32,
                top_k=top_k,
                scale=0.125,
                kernel=kernels.FLEX_VARLEN_LSE,
            )
            out.backward(cotangent)
    return launches
