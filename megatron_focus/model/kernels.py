"""Which kernel runs where, and the torch calls that are private or version-specific.

Every kernel choice is a named function here, so what runs on a given machine is decided in one
place: flash-attn or SDPA for standard attention, the fused Triton kernel, FlexAttention or the
chunked path for Focus's soft gate, the CPU flash kernel or FlexAttention for attention with its
log-sum-exp (the sparse path's).

setup.py accepts torch 2.11 to 2.15; the suite runs on 2.11 and 2.13 (and its fast part on 2.15).
What could move between releases lives here too, so a new torch is one file to check:

* the CPU flash kernel's (output, log-sum-exp), a private aten op: the sparse path's CPU kernel;
  where a torch lacks it, the same result from explicit scores (correct, slower).

(Dynamo's recompile limit, a process-wide setting, is `platform.setup()`'s.)
"""

import importlib.util
import os

import torch

from megatron_focus.variants import FOCUS_KERNELS

try:  # optional GPU extra: pip install megatron-focus[gpu]
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def has_cpu_flash_with_lse() -> bool:
    return _CPU_FLASH is not None


def cpu_attention_with_lse(q, k, v, scale: float, causal: bool, mask=None):
    """(output, natural log-sum-exp [b, h, nq]) of softmax attention on the CPU; kv heads may be
    fewer than q heads (GQA); `mask` additive, broadcastable to the scores. A query with no key
    left gets output 0 and log-sum-exp 0, as the fused kernel gives."""
    if _CPU_FLASH is not None:
        return _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
    return explicit_attention_with_lse(q, k, v, scale, causal, mask)


def explicit_attention_with_lse(q, k, v, scale: float, causal: bool, mask=None):
    """`cpu_attention_with_lse` by explicit scores (an nq x nk tensor per head)."""
    rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    if causal:
        nq, nk = scores.shape[-2:]
        future = torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(1)  # as SDPA's
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    out = (probs @ v.float()).to(q.dtype)
    return out, lse.masked_fill(empty, 0.0)


def use_flash_attn(q: torch.Tensor) -> bool:
    """Standard attention runs flash-attn's kernel when it is installed and the inputs are on a
    GPU in half precision; SDPA otherwise."""
    return flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """Triton runs its kernels on CPU tensors only under its interpreter (tests, rehearsals)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def soft_kernel(requested: str, device: torch.device, dropout_p: float = 0.0) -> str:
    """Focus's soft rule's kernel: "auto" is the fused Triton kernel (triton_gate.py) on a GPU
    without dropout, FlexAttention's where Triton is missing, the chunked one otherwise (the
    fused kernels have no dropout; on the CPU, Triton only interprets and FlexAttention has no
    backward)."""
    if requested not in FOCUS_KERNELS:
        raise ValueError(f"unknown Focus kernel {requested!r}; choose from {FOCUS_KERNELS}")
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
    if requested == "auto":
        if device.type != "cuda" or dropout_p > 0:
            return "chunked"
        return "triton" if has_triton() else "flex"
    return requested


def xsa_kernel(device: torch.device) -> str:
    """XSA's projection: one fused Triton kernel each way on a GPU (triton_xsa.py), PyTorch's
    ops elsewhere."""
    return "triton" if device.type == "cuda" and has_triton() else "torch"


def sinkhorn_kernel(device: torch.device) -> str:
    """The causal Sinkhorn: one fused Triton kernel each way on a GPU (triton_sinkhorn.py),
    PyTorch's float64 scans elsewhere."""
    return "triton" if device.type == "cuda" and has_triton() else "torch"


def lse_kernel(device: torch.device) -> str:
    """The kernel of attention with its log-sum-exp (the sparse path's): the CPU's fused flash
    kernel, or FlexAttention (linear memory on a GPU)."""
    return "cpu-flash" if device.type == "cpu" else "flex"


def compiled_flex(device: torch.device) -> bool:
    """FlexAttention compiled on a GPU; eager elsewhere (a dense evaluation, forward only)."""
    return device.type == "cuda"
