"""Which kernel runs where, and the torch calls that are private or version-specific.

Every kernel choice is a named function here, so what runs on a given machine is decided in one
place: flash-attn or SDPA for standard attention, the fused Triton kernel, FlexAttention or the
chunked path for Focus's soft gate, the CPU flash kernel or FlexAttention for attention with its
log-sum-exp (the sparse path's).

setup.py accepts torch 2.11 to 2.15; the suite runs on 2.11 and 2.13 (and its fast part on 2.15).
What could move between releases lives here too, so a new torch is one file to check:

* the CPU flash kernel's (output, log-sum-exp) and its backward, private aten ops: the sparse
  path's CPU kernel; where a torch lacks them, the same results from explicit scores (correct,
  slower).
* torch's varlen flash attention (`torch.nn.attention.varlen`, 2.10+), called through its
  registered ops `torch_attn::_varlen_attn` and `_varlen_attn_backward`, whose arguments up to
  `scale` are the same from 2.11 to 2.13: the backward takes a given output and log-sum-exp,
  which the public `varlen_attn` hides.

(Dynamo's recompile limit, a process-wide setting, is `platform.setup()`'s.)
"""

import dataclasses
import importlib
import importlib.util
import os

import torch

from megatron_focus.model.kernels.lse_merge import attention_backward
from megatron_focus.variants import FOCUS_KERNELS

try:  # optional GPU extra: pip install megatron-focus[gpu]
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


def has_cpu_flash_with_lse() -> bool:
    return _CPU_FLASH is not None


def cpu_attention_with_lse(q, k, v, scale: float, causal: bool, mask=None):
    """(output, natural log-sum-exp [b, h, nq]) of softmax attention on the CPU; kv heads may be
    fewer than q heads (GQA); `mask` additive, broadcastable to the scores. A query with no key
    left gets output 0 and log-sum-exp 0, as the fused kernel gives."""
    if _CPU_FLASH is not None:
        return _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
    return explicit_attention_with_lse(q, k, v, scale, causal, mask)


def cpu_attention_backward(d_out, q, k, v, out, lse, scale: float, causal: bool, mask=None):
    """dq, dk, dv of `cpu_attention_with_lse` given the output and log-sum-exp the call is part
    of (lse_merge.attention_backward): the CPU flash kernel's backward, which takes both as
    inputs, or the same by explicit scores where a torch lacks it."""
    if _CPU_FLASH_BACKWARD is None:
        return attention_backward(d_out, q, k, v, out, lse, scale, causal, mask)
    lse = lse.to(torch.promote_types(q.dtype, torch.float32))
    return _CPU_FLASH_BACKWARD(
        d_out.to(q.dtype).contiguous(),
        q,
        k,
        v,
        out.to(q.dtype),
        lse,
        0.0,
        causal,
        attn_mask=mask,
        scale=scale,
    )


def explicit_attention_with_lse(q, k, v, scale: float, causal: bool, mask=None):
    """`cpu_attention_with_lse` by explicit scores (an nq x nk tensor per head)."""
    rep = q.shape[1] // k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)  # float64 stays float64
    k, v = (x.repeat_interleave(rep, dim=1).to(dtype) for x in (k, v))
    scores = (q.to(dtype) @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    if causal:
        nq, nk = scores.shape[-2:]
        future = torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(1)  # as SDPA's
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    out = (probs @ v).to(q.dtype)
    return out, lse.masked_fill(empty, 0.0)


def varlen_fits(q: torch.Tensor) -> bool:
    """Inputs that torch's varlen flash kernel takes: CUDA (not ROCm, whose log-sum-exp layout
    differs), half precision, a head dim that is a multiple of 8 up to 256."""
    return (
        q.is_cuda
        and torch.version.hip is None
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
    )


def _varlen_ops():
    import torch.nn.attention.varlen  # noqa: F401  (registers the torch_attn ops)

    return torch.ops.torch_attn


def varlen_causal_attention(q, k, v, cu_seqlens, max_len: int, scale: float):
    """(output [T, h, d], log-sum-exp [T, h] float32) of causal attention inside each packed
    sequence, rows cu_seqlens[i] to cu_seqlens[i + 1] of q [T, h, d] and k/v [T, g, d] (g
    dividing h); `max_len` at least the longest sequence (a bound needs no host sync)."""
    out, lse, _ = _varlen_ops()._varlen_attn(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, True, scale
    )
    return out, lse.transpose(0, 1)


def varlen_causal_backward(d_out, q, k, v, out, lse, cu_seqlens, max_len: int, scale: float):
    """dq, dk, dv of `varlen_causal_attention` given the output and log-sum-exp the call is part
    of (lse_merge.attention_backward)."""
    no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device)
    return _varlen_ops()._varlen_attn_backward(
        d_out.to(q.dtype).contiguous(),
        q,
        k,
        v,
        out.to(q.dtype),
        lse.to(torch.promote_types(q.dtype, torch.float32)).transpose(0, 1).contiguous(),
        cu_seqlens,
        cu_seqlens,
        max_len,
        max_len,
        True,
        no_dropout,
        scale,
    )


def use_flash_attn(q: torch.Tensor) -> bool:
    """Standard attention runs flash-attn's kernel when it is installed and the inputs are on a
    GPU in half precision; SDPA otherwise."""
    return flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """Triton runs its kernels on CPU tensors only under its interpreter (tests, rehearsals)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One implementation of an operation, chosen once when a layer is built (as OLMo-core's
    attention backends are): its name for logs and banners, what it supports, and the function
    it calls ("module:function", imported at the first call, as the implementations import this
    module). Callers ask it what it supports instead of comparing names."""

    name: str
    function: str
    dropout: bool = False  # attention dropout inside the kernel
    backward: bool = True  # gradients
    recompute: bool = False  # its backward keeps much: run it under activation checkpointing
    ranges: bool = False  # attention with log-sum-exp: per-query key ranges in one call
    varlen: bool = False  # ... and causal attention over packed sequences (cu_seqlens), one call
    fused: bool = False  # sparse Focus's parts in one kernel (triton_sparse)
    options: tuple = ()  # (keyword, value) pairs every call gets
    warning: str = ""  # why a faster kernel was passed over, for the run's banner

    def __call__(self, *args, **kwargs):
        module, function = self.function.split(":")
        return getattr(importlib.import_module(module), function)(
            *args, **kwargs, **dict(self.options)
        )


def soft_gate(
    requested: str,
    device: torch.device,
    dropout_p: float = 0.0,
    chunk_size: int = 128,
    context_parallel: bool = False,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
) -> Kernel:
    """Focus's soft rule: "auto" is the fused Triton kernel (triton_gate.py) on a GPU without
    dropout where its table has tiles for the GPU, head dim and dtype (`head_dim`, `dtype`:
    the layer's), FlexAttention's where Triton is missing or no tile fits, the chunked one
    otherwise (the fused kernels have no dropout; on the CPU, Triton only interprets and
    FlexAttention has no backward). Under context parallelism, whose query chunks start inside
    the sequence, FlexAttention's path (which takes no query offset) gives way to the chunked
    one. Each is called as flex.flex_soft_focus, plus `dropout_p` where it has dropout and
    `offset` where the queries start inside the sequence."""
    if requested not in FOCUS_KERNELS:
        raise ValueError(f"unknown Focus kernel {requested!r}; choose from {FOCUS_KERNELS}")
    if requested == "flex" and context_parallel:
        raise ValueError(
            "--focus-kernel flex with --context-parallel-size: FlexAttention's soft gate takes "
            "no query offset; use --focus-kernel auto, triton or chunked"
        )
    if requested in ("flex", "triton") and dropout_p > 0:
        raise ValueError(
            f"the {requested} kernel has no attention dropout: --focus-kernel {requested} needs "
            "--attention-dropout 0"
        )
    if requested == "triton" and not has_triton():
        raise ValueError("--focus-kernel triton needs Triton (pip install triton)")
    if requested == "triton" and device.type == "cpu" and not triton_interpreted():
        raise ValueError(
            "--focus-kernel triton on the CPU runs Triton's interpreter (slow; for tests): set "
            "TRITON_INTERPRET=1, or use auto or chunked"
        )
    fits = (
        device.type != "cuda"
        or head_dim is None
        or gate_fits(device, head_dim, dtype, context_parallel)
    )
    if requested == "triton" and not fits:
        raise ValueError(
            f"--focus-kernel triton: the fused soft gate has no tile that fits this GPU "
            f"(compute capability {device_capability(device)}) at head dim {head_dim} in "
            f"{dtype} (model/kernels/triton_launch.py); use auto, flex or chunked"
        )
    warning = ""
    if requested == "auto":
        if device.type == "cuda" and dropout_p > 0:
            warning = (
                f"--attention-dropout {dropout_p:g}: the fused Focus kernel has no attention "
                "dropout, so Focus's layers run the chunked soft gate, several times slower on "
                "a GPU (docs/benchmarks.md); --attention-dropout 0, as recent LLM recipes train, "
                "runs the fused kernel"
            )
        if device.type != "cuda" or dropout_p > 0:
            requested = "chunked"
        elif has_triton() and fits:
            requested = "triton"
        else:
            requested = "chunked" if context_parallel else "flex"
    if requested == "triton":
        return Kernel("triton", "megatron_focus.model.kernels.triton_gate:triton_soft_focus")
    if requested == "flex":
        return Kernel(
            "flex",
            "megatron_focus.model.kernels.flex:flex_soft_focus",
            backward=device.type == "cuda",
        )
    return Kernel(
        "chunked",
        "megatron_focus.model.focus.focus_gate:chunked_soft_focus",
        dropout=True,
        options=(("chunk_size", chunk_size),),
        warning=warning,
    )


def device_capability(device: torch.device) -> tuple:
    return torch.cuda.get_device_capability(device)


def gate_fits(device: torch.device, head_dim: int, dtype, chunk: bool = False) -> bool:
    """Whether the fused soft gate has tiles for every pass on this GPU, for the whole sequence
    or a context-parallel `chunk` (its table is checked against each architecture's registers
    and shared memory: tests/model/test_kernel_fit.py)."""
    from megatron_focus.model.kernels import triton_launch

    capability = device_capability(device)
    return all(
        triton_launch.gate_tile(p, capability, head_dim, dtype or torch.float32, chunk=chunk)
        is not None
        for p in triton_launch.GATE_PASSES
    )


def xsa(device: torch.device) -> Kernel:
    """XSA's projection: one fused Triton kernel each way on a GPU (triton_xsa.py), PyTorch's
    ops elsewhere; called as xsa.exclusive_projection."""
    if device.type == "cuda" and has_triton():
        return Kernel(
            "triton", "megatron_focus.model.kernels.triton_xsa:triton_exclusive_projection"
        )
    return Kernel("torch", "megatron_focus.model.xsa:exclusive_projection")


def sinkhorn(device: torch.device) -> Kernel:
    """The causal Sinkhorn: Triton kernels on a GPU, a launch per iteration each way, parallel
    along the sequence, under context parallelism too (triton_sinkhorn.py, which keeps its
    iterations' states), PyTorch's float64 scans elsewhere (recomputed in backward: its
    iterations would otherwise keep ~6 [b, s, K] tensors each); called as
    sinkhorn.causal_sinkhorn."""
    if device.type == "cuda" and has_triton():
        return Kernel(
            "triton", "megatron_focus.model.kernels.triton_sinkhorn:triton_causal_sinkhorn"
        )
    return Kernel("torch", "megatron_focus.model.focus.sinkhorn:causal_sinkhorn", recompute=True)


def _kernels(model: torch.nn.Module):
    for module in model.modules():
        for operation, kernel in vars(module).items():
            if isinstance(kernel, Kernel):
                yield operation.replace("_", " "), kernel


def chosen(model: torch.nn.Module) -> dict:
    """The kernels a model's layers chose, by operation (the first layer's): for banners."""
    names = {}
    for operation, kernel in _kernels(model):
        names.setdefault(operation, kernel.name)
    return names


def warnings(model: torch.nn.Module) -> list:
    """Why the model's layers passed over a faster kernel, each reason once."""
    return list(dict.fromkeys(kernel.warning for _, kernel in _kernels(model) if kernel.warning))


# Attention with its log-sum-exp, the sparse path's parts, called as cpu_attention_with_lse:
# the CPU's fused flash kernel, or FlexAttention (linear memory on a GPU; it also attends
# per-query key ranges and the local band in one call each), on CUDA with torch's varlen flash
# kernel for causal attention inside each bucket where its inputs fit (varlen_fits). All train
# (focus_sparse).
CPU_FLASH_LSE = Kernel("cpu-flash", "megatron_focus.model.kernels.kernels:cpu_attention_with_lse")
FLEX_LSE = Kernel("flex", "megatron_focus.model.kernels.flex:flex_attention_with_lse", ranges=True)
FLEX_VARLEN_LSE = dataclasses.replace(FLEX_LSE, name="flex+varlen", varlen=True)


def lse_attention(device: torch.device) -> Kernel:
    if device.type == "cpu":
        return CPU_FLASH_LSE
    return FLEX_VARLEN_LSE if device.type == "cuda" else FLEX_LSE


TRITON_SPARSE = Kernel(
    "triton", "megatron_focus.model.kernels.triton_sparse:triton_sparse_attention", fused=True
)


def sparse(device: torch.device, head_dim: int, dtype) -> Kernel:
    """Sparse Focus's attention: the fused Triton kernel (triton_sparse.py) on a GPU where it
    has a tile (bf16 or fp16, Ampere on, head dim up to 256; per shape the sparse parts or, where
    that measures faster, the whole rule in one masked part); else its parts by
    `lse_attention`."""
    from megatron_focus.model.kernels import triton_launch

    if device.type == "cuda" and has_triton() and dtype in (torch.bfloat16, torch.float16):
        capability = device_capability(device)
        if all(triton_launch.sparse_tile(p, capability, head_dim, dtype)
               for p in triton_launch.SPARSE_PASSES):  # fmt: skip
            return TRITON_SPARSE
    return lse_attention(device)


def slot_decode(device: torch.device, head_dim: int, dtype):
    """Sparse Focus's decoding step over a static cache's slots: the Triton kernel
    (triton_decode.py, a torch op) on a GPU where it has a tile (bf16 or fp16, Ampere on, head
    dim up to 256); else None (the caller's one mask over the slots)."""
    from megatron_focus.model.kernels import triton_launch

    if device.type == "cuda" and has_triton() and dtype in (torch.bfloat16, torch.float16):
        if triton_launch.decode_tile(device_capability(device), head_dim) is not None:
            from megatron_focus.model.kernels import triton_decode

            return triton_decode.slot_decode
    return None


def compiled(device: torch.device) -> bool:
    """FlexAttention and the sparse path's routing compiled on a GPU; eager elsewhere (there
    FlexAttention is a dense evaluation, forward only)."""
    return device.type == "cuda"
