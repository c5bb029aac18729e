"""How the Triton kernels are launched: one table of block sizes, warps and stages per GPU
architecture, head dim, dtype and pass, read by the launchers and by the compile test of fit
(tests/model/test_kernel_fit.py), which compiles every entry for its architecture and holds it to
zero spills and the architecture's shared memory.

Why a table: one launch shape for every GPU spills registers on A100 at head dim 128 and needs
more shared memory than an A10/L4/L40S block has. Where the table has no entry (a GPU before
Ampere, fp32, a head dim past 256), the kernel choice falls back by name (kernels.soft_gate).

`Launch` is one kernel launch as data: the GPU runs it, the fit test compiles it from the same
launcher on meta tensors, so what is tested is what runs.
"""

import dataclasses

import torch
import triton

# Architectures, by the per-block shared memory (opt-in) that decides which tiles fit.
SHARED_MEMORY = {"sm80": 166_912, "sm86": 101_376, "sm90": 232_448}
TARGETS = {"sm80": 80, "sm86": 86, "sm90": 90}  # the compute capability each is compiled for


def arch(capability: tuple) -> str | None:
    """The table's architecture for a CUDA compute capability: A100/A30 (8.0), the 100 KB
    parts (8.6 and 8.9: A10, A40, L4, L40S, RTX 30/40; 12.x: RTX 50), H100/H200 and the data
    centre Blackwells (9.0, 10.x). None before Ampere (no bf16 tensor cores)."""
    major, minor = capability
    if major < 8:
        return None
    if major == 8:
        return "sm80" if minor == 0 else "sm86"
    return "sm86" if major >= 12 else "sm90"


@dataclasses.dataclass(frozen=True)
class Tile:
    """A pass's launch shape: `rows` stacked query rows (query heads sharing a key/value head
    x queries) or tokens, `keys` keys per step, and the compiler's warps and pipeline stages."""

    rows: int
    keys: int
    warps: int
    stages: int


# The soft gate's tiles, for bf16 and fp16: (arch, gate) -> {head dim: (forward, keys,
# queries)}, each "rows x keys x warps x stages" (the keys pass: queries a step x keys a
# program). Found by `benchmarks/kernel_fit.py --search`: candidates in order, FlashAttention-2's
# shapes first (forward 128 x 64, keys pass 32 x 128, queries pass 128 x 32, 8 warps), keeping
# the first that fits (triton_fit.Fit: no spill inside a loop, shared memory within the
# architecture's limit) at GQA 1 and 8, with and without documents, for the whole sequence and a
# context-parallel chunk, by Triton 3.9 (tests/model/test_kernel_fit.py holds them). fp32 has
# none (FlexAttention or the chunked path serve it).
_GATE_TABLE = {
    ("sm80", "log"): {
        64: ("128x32x8x2", "32x128x8x2", "128x32x8x2"),
        128: ("128x32x8x2", "16x128x8x2", "128x32x8x2"),
        256: ("64x32x8x2", "16x32x8x2", "64x16x4x2"),
    },
    ("sm86", "log"): {
        64: ("128x32x8x2", "16x128x8x2", "128x32x8x2"),
        128: ("128x32x8x2", "16x128x8x2", "128x32x8x2"),
        256: ("32x32x4x2", "16x32x8x2", "64x16x4x2"),
    },
    ("sm90", "log"): {
        64: ("128x64x8x2", "32x128x8x2", "128x32x8x2"),
        128: ("128x64x8x2", "16x128x8x2", "128x32x8x2"),
        256: ("64x32x8x2", "16x32x8x2", "64x16x8x2"),
    },
}
# The paper's sigmoid gate keeps one more tile in its backward (the factor beside the scores):
# it takes the log gate's tiles where they fit it too; at d64 its keys' 32-row tile spills
# inside the loop on sm80 and sm90, so 16 rows there.
_SIGMOID_KEYS = {("sm80", 64): "16x128x8x2", ("sm90", 64): "16x128x8x2"}
_GATE_TABLE.update(
    {
        (arch, "sigmoid"): {
            size: (fwd, _SIGMOID_KEYS.get((arch, size), keys), queries)
            for size, (fwd, keys, queries) in tiles.items()
        }
        for (arch, _), tiles in list(_GATE_TABLE.items())
    }
)

# A context-parallel chunk's kernels (triton_gate's CHUNK) keep the chunk's positions live beside
# its rows: where the table's tile does not fit a chunk, (arch, gate, head dim, pass) -> the
# chunk's tile (None: none fits, and a chunk falls back by name). None needed today.
_CHUNK_TILES: dict = {}


def _tile(text: str) -> "Tile":
    return Tile(*map(int, text.split("x")))


GATE_PASSES = ("forward", "keys", "queries")
HEAD_DIMS = (64, 128, 256)  # the table's head dims; a smaller one takes the next's tiles
_INTERPRETED = Tile(16, 16, 4, 1)  # small blocks, so small test inputs cross block edges


def gate_tile(
    pass_: str,
    capability,
    head_dim: int,
    dtype: torch.dtype,
    gate: str = "log",
    chunk: bool = False,
) -> Tile | None:
    """The soft gate's tile for a pass ("forward", "keys", "queries") and gate ("log", or the
    paper's "sigmoid") on a GPU of `capability` (None: Triton's interpreter), for the whole
    sequence or a context-parallel `chunk`; None where no tile fits that GPU."""
    if capability is None:
        return _INTERPRETED
    if dtype == torch.float32:
        return None
    by_head_dim = _GATE_TABLE.get((arch(capability), gate), {})
    size = next((d for d in sorted(by_head_dim) if head_dim <= d), None)
    if size is None:
        return None
    key = (arch(capability), gate, size, pass_)
    if chunk and key in _CHUNK_TILES:
        return None if _CHUNK_TILES[key] is None else _tile(_CHUNK_TILES[key])
    return _tile(by_head_dim[size][GATE_PASSES.index(pass_)])


# Sparse Focus's fused kernel (triton_sparse.py), bf16 and fp16: arch -> {head dim: (forward,
# keys, queries)} as the gate's table ("rows x keys x warps x stages"; the keys pass: queries a
# step x keys a program), FlashAttention-2's shapes where they fit (triton_fit.Fit, held by
# tests/model/test_kernel_fit.py). Its tiles gather rows through the routing's orders, so
# they keep the row indices and the ranges' bounds live beside FlashAttention's.
_SPARSE_TABLE = {
    "sm80": {
        64: ("128x64x4x2", "128x32x8x2", "16x128x8x2"),
        128: ("128x64x8x2", "128x32x8x2", "16x128x8x2"),
        256: ("64x32x8x2", "64x32x8x2", "16x32x8x2"),
    },
    "sm86": {
        64: ("128x64x4x2", "128x32x8x2", "16x128x8x2"),
        128: ("128x32x8x2", "64x32x4x2", "16x64x8x2"),
        256: ("64x32x8x2", "32x32x4x2", "16x32x8x2"),
    },
    "sm90": {
        64: ("128x64x4x2", "128x32x8x2", "32x128x8x2"),
        128: ("128x64x8x2", "128x32x8x2", "16x128x8x2"),
        256: ("64x32x8x2", "64x32x8x2", "16x32x8x2"),
    },
}
SPARSE_PASSES = ("forward", "queries", "keys")  # in the table's order


def sparse_tile(pass_: str, capability, head_dim: int, dtype: torch.dtype) -> Tile | None:
    """The fused sparse kernel's tile for a pass on a GPU of `capability` (None: the
    interpreter); None where it has none (fp32, before Ampere, past head dim 256)."""
    if capability is None:
        return _INTERPRETED
    by_head_dim = _SPARSE_TABLE.get(arch(capability), {})
    size = next((d for d in sorted(by_head_dim) if head_dim <= d), None)
    if dtype == torch.float32 or size is None:
        return None
    return _tile(by_head_dim[size][SPARSE_PASSES.index(pass_)])


def decode_tile(capability, head_dim: int) -> Tile | None:
    """Sparse Focus's decoding step over a static cache (triton_decode.py): `keys` slots a
    step, `rows` the fewest stacked query heads (a tensor-core dot's 16); None before Ampere
    or past head dim 256."""
    if capability is None:
        return _INTERPRETED
    if arch(capability) is None or head_dim > 256:
        return None
    return Tile(16, 64 if head_dim <= 128 else 32, 4, 2)


_XSA = {64: Tile(64, 0, 4, 1), 128: Tile(32, 0, 4, 1), 256: Tile(16, 0, 4, 1)}  # rows: tokens


def xsa_tile(capability, head_dim: int) -> Tile:
    """XSA's projection: tokens per program by head dim (the same on every architecture: it
    keeps no tile in shared memory); any head dim up to 256 and any dtype fit."""
    if capability is None:
        return _INTERPRETED
    return _XSA[next((d for d in HEAD_DIMS if head_dim <= d), 256)]  # past 256: the fewest


def sinkhorn_tile(capability) -> Tile:
    """The causal Sinkhorn's tokens per block (a program walks the blocks of its span)."""
    return _INTERPRETED if capability is None else Tile(64, 0, 4, 1)


_SINKHORN_PROGRAMS = 1024  # enough to fill an H100's 132 SMs several times over


def sinkhorn_span(capability, batch: int, tokens: int) -> int:
    """Tokens per program of the causal Sinkhorn (whole blocks): sequences cut into as many
    spans as fill the GPU, at least a block each; fewer spans keep the sums of the spans before
    each one (a loop over them per program) small at long sequences. Under the interpreter two
    blocks, so that tests cross both spans and blocks."""
    block = sinkhorn_tile(capability).rows
    if capability is None:
        return 2 * block
    blocks = triton.cdiv(tokens, block)
    spans = max(1, min(blocks, triton.cdiv(_SINKHORN_PROGRAMS, batch)))
    return triton.cdiv(blocks, spans) * block


def padded(size: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(size))


def capability_of(t: torch.Tensor):
    """The CUDA compute capability of a tensor's device; None for CPU tensors (the interpreter)."""
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: `kernel[grid](*args, **constants, **options)`."""

    kernel: object  # a triton.JITFunction
    grid: tuple
    args: tuple
    constants: dict
    options: dict

    def __call__(self):
        self.kernel[self.grid](*self.args, **self.constants, **self.options)


INT32_MAX = 2**31 - 1


def check_tile_offsets(name: str, strides: tuple, extents: tuple):
    """The kernels address a tile from a 64-bit base by 32-bit offsets inside it: refuse by name
    a layout whose offsets inside one tile would pass 2^31."""
    span = sum(abs(s) * (e - 1) for s, e in zip(strides, extents))
    if span > INT32_MAX:
        raise ValueError(
            f"{name}: one tile spans {span} elements of its tensor (strides {strides}), past "
            "the kernels' 32-bit offsets inside a tile; make it contiguous"
        )


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy where its rows are not contiguous: the kernels step over the other dims by
    their strides."""
    return t if t.stride(-1) == 1 else t.contiguous()
