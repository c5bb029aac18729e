"""Whether the Triton kernels fit real GPUs, found without one: each launch the launchers make
(on meta tensors laid out as the model lays them out) compiled for sm_80, sm_86 and sm_90 by
Triton's own toolchain, its ptxas report read (registers, spill bytes, shared memory against the
architecture's per-block limit) and its SASS (spill instructions inside its loops, and each
loop's instructions by class: the speed proxy of benchmarks/kernel_sass.py).

A launch fits when no loop of it touches spilled registers and its shared memory is within the
limit: a few bytes spilled outside the loops (pointers and sizes kept across a kernel's runs of
blocks) are stored and reloaded once a program, next to the hundreds of tile loads it makes,
while a tile small enough to spill nothing at all costs every iteration (FlashAttention-2's
tiles at head dim 128 sit at the register edge, the reference's own included).

The interpreter proves the kernels' logic; this proves their fit (tests/model/test_kernel_fit.py
holds every launch to it; benchmarks/kernel_fit.py prints the table, and on a GPU the driver's
own counts beside it).
"""

import contextlib
import dataclasses
import io
import re

import torch

from megatron_focus.model.kernels import (
    triton_decode,
    triton_gate,
    triton_launch,
    triton_sinkhorn,
    triton_sparse,
    triton_xsa,
)
from megatron_focus.model.kernels.triton_launch import SHARED_MEMORY, TARGETS, Launch


@dataclasses.dataclass(frozen=True)
class Fit:
    registers: int
    spill_stores: int  # bytes, ptxas's count
    spill_loads: int
    loop_spills: int  # spill loads and stores inside the kernel's loops (SASS instructions)
    shared: int  # bytes of shared memory per block
    limit: int  # the architecture's per-block shared memory
    wide_addresses: bool  # every tensor argument offset from its base in 64 bits

    @property
    def fits(self) -> bool:
        return self.loop_spills == 0 and self.shared <= self.limit


def _specialize(launch: Launch, backend):
    """(signature, constexprs, attributes, options) of a launch, as Triton's launcher derives
    them from its arguments (types, 16-divisibility of sizes, strides and pointers)."""
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    # what Triton's launcher adds to a launch's keywords (fewer in older Tritons)
    extra = dict(debug=False, instrumentation_mode="", fpsan_homomorphic_casts=False)
    known = backend.parse_options({}).__dict__
    keywords = dict(
        **launch.constants, **launch.options, **{k: v for k, v in extra.items() if k in known}
    )
    bound, specialization, options = binder(*launch.args, **keywords)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, keywords, bound, specialization, options
    )
    return signature, constexprs, attrs, options


def _compiled(launch: Launch, arch: str) -> tuple:
    """(Triton's compiled kernel, ptxas's report) of `launch` for `arch`."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", TARGETS[arch], 32)
    backend = make_backend(target)
    signature, constexprs, attrs, options = _specialize(launch, backend)
    log = io.StringIO()
    before = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                ASTSource(launch.kernel, signature, constexprs, attrs),
                target=target,
                options=options.__dict__,
            )
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = before
    return compiled, log.getvalue()


def compile_for(launch: Launch, arch: str) -> Fit:
    """Compile `launch` for `arch` ("sm80", "sm86", "sm90") and read ptxas's report."""
    compiled, report = _compiled(launch, arch)
    loops = sass_loops(_disassembled(compiled))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    registers = re.search(r"Used (\d+) registers", report)
    if spills is None or registers is None:
        raise RuntimeError(f"no ptxas report for {launch.kernel.__name__}: {report[-500:]}")
    return Fit(
        int(registers.group(1)),
        int(spills.group(1)),
        int(spills.group(2)),
        sum(loop.counts.get("local", 0) for loop in loops),
        compiled.metadata.shared,
        SHARED_MEMORY[arch],
        _wide_addresses(launch, compiled.asm["ttir"]),
    )


def _wide_addresses(launch: Launch, ttir: str) -> bool:
    """No tensor argument is offset from its base by a 32-bit integer (Triton types a Python int
    below 2^31, a size or a stride, as i32: a product of them wraps past 2^31)."""
    for name, arg in zip(launch.kernel.arg_names, launch.args):
        if isinstance(arg, torch.Tensor):
            pattern = rf"tt\.addptr %{name}, %\S+ : !tt\.ptr<\w+>, (\w+)"
            if set(re.findall(pattern, ttir)) - {"i64"}:
                return False
    return True


# SASS opcodes by the unit or kind of work they are, for counting a loop's instructions.
SASS_CLASSES = {
    "mma": ("HMMA", "HGMMA", "IMMA", "QGMMA"),
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FSWZADD", "FCHK", "FMNMX3"),
    "mufu": ("MUFU",),
    "convert": ("F2FP", "F2F", "I2F", "F2I", "I2FP", "F2IP", "FRND"),
    "shared": ("LDS", "LDSM", "STS", "STSM", "LDGSTS"),
    "global": ("LDG", "STG", "UBLKCP", "UTMALDG", "UTMASTG"),
    "local": ("LDL", "STL"),  # spilled registers
    "shuffle": ("SHFL",),
    "barrier": ("BAR", "DEPBAR", "LDGDEPBAR", "WARPSYNC", "MEMBAR", "FENCE", "SYNCS",
                "WARPGROUP", "ARRIVES", "ERRBAR", "NOP"),
}  # fmt: skip


def sass_class(opcode: str) -> str:
    """The class of a SASS opcode (its name before the first dot): uniform-datapath (U...) and
    the rest of the integer, predicate and move instructions count as "alu"."""
    for name, opcodes in SASS_CLASSES.items():
        if opcode in opcodes:
            return name
    return "alu"


@dataclasses.dataclass(frozen=True)
class Loop:
    """One loop of a kernel's SASS: its instructions (nested loops' left out) by class, and how
    deep it is nested (0: outermost)."""

    start: int
    end: int
    depth: int
    counts: dict

    @property
    def instructions(self) -> int:
        return sum(self.counts.values())


def sass_of(launch: Launch, arch: str) -> str:
    """The SASS of `launch` compiled for `arch`."""
    return _disassembled(_compiled(launch, arch)[0])


def _disassembled(compiled) -> str:
    """A compiled kernel's SASS, by the Triton wheel's cuobjdump."""
    import os
    import subprocess
    import tempfile

    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run(
            [os.path.join(tools, "cuobjdump"), "-sass", cubin.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)[^;]*;")
_BRANCH_TO = re.compile(r"\bBRA\s+(?:\S+,\s*)?(?:`\()?(?:\.L_x_\d+)?\)?`?\s*0x([0-9a-f]+)")


def sass_loops(sass: str) -> list:
    """The loops of a kernel's SASS (a backward branch closes one), outermost first in address
    order, each counting its own instructions."""
    instructions, back = [], []
    for line in sass.splitlines():
        found = _INSTRUCTION.search(line)
        if not found:
            continue
        address, opcode = int(found.group(1), 16), found.group(2)
        instructions.append((address, opcode))
        target = re.search(r"\bBRA\b[^;]*?0x([0-9a-f]+)\s*;", line)
        if opcode == "BRA" and target and int(target.group(1), 16) < address:
            back.append((int(target.group(1), 16), address))
    spans = sorted(set(back), key=lambda span: (span[0], -span[1]))
    loops = []
    for start, end in spans:
        inner = [(a, b) for a, b in spans if start <= a and b <= end and (a, b) != (start, end)]
        outer = [(a, b) for a, b in spans if a <= start and end <= b and (a, b) != (start, end)]
        counts = {}
        for address, opcode in instructions:
            if start <= address <= end and not any(a <= address <= b for a, b in inner):
                kind = sass_class(opcode)
                counts[kind] = counts.get(kind, 0) + 1
        loops.append(Loop(start, end, len(outer), counts))
    return loops


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention layer's shape: heads of `head_dim`, `rep` query heads a key/value head."""

    head_dim: int
    rep: int
    dtype: torch.dtype = torch.bfloat16
    log_gate: bool = True
    documents: bool = False
    kv_heads: int = 2
    tokens: int = 4096
    batch: int = 2
    groups: int = 8

    def __str__(self):
        dtype = str(self.dtype).removeprefix("torch.")
        gate = "log" if self.log_gate else "sigmoid"
        docs = "+docs" if self.documents else ""
        return f"d{self.head_dim} gqa{self.rep} {dtype} {gate}{docs}"


def megatron_qkv(shape: Shape):
    """q, k, v on the meta device as Megatron's SelfAttention hands them over: views of one
    fused QKV output [s, b, kv, (rep + 2) d] permuted to [b, heads, s, d], k a new tensor
    (RoPE's)."""
    s, b, kv, rep, d = shape.tokens, shape.batch, shape.kv_heads, shape.rep, shape.head_dim
    qkv = torch.empty(s, b, kv, (rep + 2) * d, device="meta", dtype=shape.dtype)
    q, _, v = torch.split(qkv, [rep * d, d, d], dim=-1)
    k = torch.empty(s, b, kv, d, device="meta", dtype=shape.dtype)
    q = q.reshape(s, b, kv * rep, d)
    return (t.permute(1, 2, 0, 3) for t in (q, k, v))


def gate_launches(shape: Shape, capability) -> list:
    """(name, Launch) of the soft gate's forward and backward at `shape`, for the whole
    sequence and for a context-parallel chunk (its last half's queries: compiled apart) where a
    chunk has tiles (else none: a chunk's kernel choice falls back)."""
    q, k, v = megatron_qkv(shape)
    g = torch.empty(shape.batch, shape.tokens, triton_gate.GROUPS_PADDED, device="meta",
                    dtype=shape.dtype)  # fmt: skip
    docs = torch.zeros(shape.batch, shape.tokens, device="meta", dtype=torch.int32)
    gate = "log" if shape.log_gate else "sigmoid"
    chunk_fits = all(
        triton_launch.gate_tile(p, capability, shape.head_dim, shape.dtype, gate, chunk=True)
        for p in triton_launch.GATE_PASSES
    )
    launches = []
    for offset, suffix in ((0, ""), (shape.tokens // 2, " (chunk)"))[: 1 + chunk_fits]:
        rows = q[:, :, offset:]
        plan = triton_gate.Plan(
            rows, k, v, g, docs if shape.documents else None, window=128, gate_scale=1.0,
            scale=0.1, sink=0, gate=gate, capability=capability, offset=offset,
        )  # fmt: skip
        passes = plan.launches(rows, k, v, g, docs if shape.documents else g)
        names = ("gate forward", "gate delta", "gate keys", "gate queries")
        launches += [
            (name + suffix, launch)
            for name, launch in zip(names, passes)
            if not (suffix and name == "gate delta")  # rows alone: one kernel for both
        ]
    return launches


def xsa_launches(shape: Shape, capability) -> list:
    q, _, v = megatron_qkv(shape)
    y = torch.empty(q.shape, device="meta", dtype=shape.dtype)
    dv = torch.empty(v.shape, device="meta", dtype=shape.dtype)
    return [
        ("xsa forward", triton_xsa.launch(triton_xsa._forward, y, v, y, eps=1e-6,
                                          capability=capability)),
        ("xsa backward", triton_xsa.launch(triton_xsa._backward, y, v, y, y, dv, eps=1e-6,
                                           capability=capability)),
    ]  # fmt: skip


def sinkhorn_launches(shape: Shape, capability, iters: int = 10) -> list:
    """The Sinkhorn's launches, and a context-parallel rank's (its two chunks, documents or
    not: it passes them as documents)."""
    b, n, groups = shape.batch, shape.tokens, shape.groups
    scores = torch.empty(b, groups, n, device="meta").transpose(1, 2)  # the router's layout
    states = torch.empty(iters + 1, b, n, groups, device="meta")
    docs = torch.zeros(b, n, device="meta", dtype=torch.int32)
    ends = torch.zeros(b, device="meta", dtype=torch.int32)
    launches = []
    for suffix, chunks in (("", None), (" (chunk)", triton_sinkhorn.Chunks(ends, ends, None))):
        has_docs = shape.documents or chunks is not None
        forward, backward, _ = triton_sinkhorn.launches(
            scores, iters, docs if has_docs else scores, has_docs, states, states, states[0],
            scores, capability, chunks,
        )  # fmt: skip
        # one binary each way: the launches differ only in the iteration, not specialized
        launches += [("sinkhorn forward" + suffix, forward[0])]
        launches += [("sinkhorn backward" + suffix, backward[0])]
    return launches


def sparse_launches(shape: Shape, capability) -> list:
    """Sparse Focus's fused kernel: its band (token order, ranges computed, groups excluded), a
    bucket part (rows through the orders, merged; the last part, in the output's dtype) and
    the whole rule as one part (below the measured crossover), each forward, queries pass and
    keys pass: nine binaries."""
    q, k, v = megatron_qkv(shape)
    rows = shape.batch * shape.tokens
    index = torch.empty(rows, device="meta", dtype=torch.int64)
    bits = torch.empty(2, rows, device="meta", dtype=torch.int64)
    docs = torch.empty(shape.batch, shape.tokens, device="meta", dtype=torch.int64)
    parts = [triton_sparse.Part(), triton_sparse.Part(index, index, index, index)]
    rule = [triton_sparse.Part(rule=True)]
    plan = triton_sparse.Plan(q, k, parts, docs if shape.documents else None, bits, window=128,
                              scale=0.1, capability=capability)  # fmt: skip
    whole = triton_sparse.Plan(q, k, rule, plan.docs, bits, window=128, scale=0.1,
                               capability=capability)  # fmt: skip
    names = [f"sparse {part} {pass_}" for part in ("band", "buckets", "rule")
             for pass_ in ("forward", "queries", "keys")]  # fmt: skip
    return list(zip(names, plan.launches(q, k, v) + whole.launches(q, k, v)))


def decode_launches(shape: Shape, capability) -> list:
    """Sparse Focus's decoding step over a static cache of `shape.tokens` slots, laid out as
    the HF export's holds it: q a view of the projection, the keys, values and buckets in the
    cache's buffers, the query's top-k groups a slice of its ranking."""
    b, kv, rep, d, slots = shape.batch, shape.kv_heads, shape.rep, shape.head_dim, shape.tokens
    q = torch.empty(b, 1, kv * rep, d, device="meta", dtype=shape.dtype).transpose(1, 2)
    k, v = (torch.empty(b, kv, slots, d, device="meta", dtype=shape.dtype) for _ in range(2))
    bucket = torch.empty(b, slots, device="meta", dtype=torch.int64)
    ranking = torch.empty(b, 1, shape.groups, device="meta", dtype=torch.int64)
    position = torch.empty(1, device="meta", dtype=torch.int64)
    chosen = ranking[:, 0, :2]
    launch, _, _ = triton_decode.plan(
        q, k, v, bucket, chosen, position, window=128, sinks=shape.groups, scale=0.1,
        capability=capability,
    )  # fmt: skip
    return [("decode step", launch)]


def all_launches(shape: Shape, arch: str) -> list:
    """Every (name, Launch) the kernels make at `shape` on `arch`: the gate's and sparse
    Focus's (its decoding step's with them) where their tables have a tile (else none: the
    kernel choice falls back), XSA's and the Sinkhorn's always."""
    capability = (TARGETS[arch] // 10, TARGETS[arch] % 10)
    launches = xsa_launches(shape, capability) + sinkhorn_launches(shape, capability)
    if triton_launch.sparse_tile("forward", capability, shape.head_dim, shape.dtype) is not None:
        launches = (
            sparse_launches(shape, capability) + decode_launches(shape, capability) + (launches)
        )
    if triton_launch.gate_tile("forward", capability, shape.head_dim, shape.dtype) is not None:
        launches = gate_launches(shape, capability) + launches
    return launches
