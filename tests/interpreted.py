"""Whether Triton's kernels can be checked here, on CPU tensors under its interpreter.

The project's kernels take loop bounds computed in the kernel (a query block's first key, a head
count): Triton 3.9's interpreter runs them; older ones (3.6, which torch 2.11 pins) fail on such a
bound under numpy 2. Such a setup skips these tests, naming why; a GPU compiles the kernels.
"""

import functools
import os

import pytest


@functools.lru_cache(maxsize=None)
def _loop_bounds_run() -> bool:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def count(out, n, block: tl.constexpr):
        total = 0
        for _ in range(0, tl.minimum(tl.program_id(0) * block + block, n), block):
            total += 1
        tl.store(out + tl.program_id(0), total)

    out = torch.zeros(2, dtype=torch.int32)
    try:
        count[(2,)](out, 20, 16)
    except Exception:  # noqa: BLE001 -- any failure of the interpreter means it cannot run them
        return False
    return out.tolist() == [1, 2]


def skip_unless_kernels_run():
    """Call at a test module's top: skips it where the interpreter cannot run the kernels."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1" and not _loop_bounds_run():
        pytest.skip(
            f"Triton {triton.__version__}'s interpreter cannot take a loop bound computed in "
            "the kernel (3.9's can)",
            allow_module_level=True,
        )


def gpu_launch_shapes(monkeypatch, module, capability=(9, 0)):
    """The module's kernels launched with the tiles and options a GPU of `capability` gets
    (triton_launch.py's table; float32 inputs take half precision's tiles), here under the
    interpreter."""
    import torch

    from megatron_focus.model.kernels import triton_launch

    gate_tile = triton_launch.gate_tile
    monkeypatch.setattr(triton_launch, "capability_of", lambda t: capability)
    monkeypatch.setattr(
        triton_launch,
        "gate_tile",
        lambda pass_, cap, head_dim, dtype, *gate: gate_tile(
            pass_, cap, head_dim, torch.bfloat16, *gate
        ),
    )
    if hasattr(module, "_launch_shape"):
        shape = getattr(module._launch_shape, "__wrapped__", module._launch_shape)
        monkeypatch.setattr(module, "_launch_shape", lambda *args: shape(*args[:-1], True))
