"""The Triton kernels fit real GPUs: every launch the launchers make for the recipes' shapes
(head dims 64, 128, 256; GQA 1-8; bf16 and fp16; both gates; packed documents; a
context-parallel chunk's queries) compiled on this CPU for A100 (sm_80), A10/L4/L40S (sm_86) and
H100/H200 (sm_90) by Triton's own toolchain, with zero spill bytes and shared memory within the
architecture's per-block limit, every tensor addressed in 64 bits (benchmarks/kernel_fit.py,
model/kernels/triton_fit.py); where no tile fits, the kernel choice falls back by name.

The interpreter tests prove the kernels' logic; these prove their fit. The compiles run in a
process without TRITON_INTERPRET (the interpreter compiles nothing), and need a Triton whose
NVIDIA backend compiles without a GPU and reports ptxas (3.9, CI's); elsewhere they skip.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_focus.model.kernels import kernels

triton = pytest.importorskip("triton")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kernel_fit(tmp_path, *args) -> list:
    """benchmarks/kernel_fit.py's rows for `args`."""
    knobs = getattr(triton, "knobs", None)
    if not hasattr(getattr(knobs, "nvidia", None), "dump_ptxas_log"):
        pytest.skip(f"Triton {triton.__version__} does not report ptxas")
    out = tmp_path / "fit.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "benchmarks/kernel_fit.py", *map(str, args), "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def assert_all_fit(rows):
    misfits = [f"{r['arch']} {r['shape']} {r['kernel']}: {r['registers']} registers, "
               f"{r['spill_stores']} B spilled, {r['shared']} B shared" for r in rows
               if not r["fits"]]  # fmt: skip
    assert rows and not misfits, "\n".join(misfits)


@pytest.mark.slow
def test_the_recipes_launches_fit(tmp_path):
    """The recipes' GQA 4 shapes on an H100 and an A100 (head dims 128 and 256, the log gate),
    which the matrix below (GQA 1 and 8, every architecture; CI runs it in a step of its own)
    does not compile."""
    rows = kernel_fit(tmp_path, "--archs", "sm90", "--head-dims", 128, 256, "--gqa", 4,
                      "--gates", "log")  # fmt: skip
    rows += kernel_fit(tmp_path, "--archs", "sm80", "--head-dims", 128, "--gqa", 4,
                       "--gates", "log")  # fmt: skip
    assert {r["arch"] for r in rows} == {"sm80", "sm90"}
    assert_all_fit(rows)


@pytest.mark.fit_matrix
@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm90"])
def test_every_launch_fits_each_architecture(tmp_path, arch):
    """bf16 at head dims 64, 128, 256, GQA 1 and 8 (Triton compiles an argument equal to 1
    apart), both gates: some 90 compiles an architecture, minutes each (`pytest -m
    fit_matrix`, CI's step after the suite)."""
    rows = kernel_fit(tmp_path, "--archs", arch, "--gqa", 1, 8)
    kinds = {r["kernel"] for r in rows}
    assert kinds == {
        "gate forward", "gate delta", "gate keys", "gate queries",
        "gate forward (chunk)", "gate keys (chunk)", "gate queries (chunk)",
        "xsa forward", "xsa backward", "sinkhorn forward", "sinkhorn backward",
        "sinkhorn forward (chunk)", "sinkhorn backward (chunk)",
        *(f"sparse {part} {pass_}" for part in ("band", "buckets", "rule")
          for pass_ in ("forward", "queries", "keys")), "decode step",
    }  # fmt: skip
    assert len({r["shape"] for r in rows if r["kernel"] == "gate keys"}) == 12
    assert_all_fit(rows)


@pytest.mark.fit_matrix
def test_documents_and_other_gqa_ratios_in_fp16_fit_the_a100(tmp_path):
    """sm_80 has the fewest registers to spare (ptxas gives up at 255): packed documents (a
    load and a mask more), GQA 2 and 4 in fp16."""
    documents = kernel_fit(tmp_path, "--archs", "sm80", "--gqa", 8, "--gates", "log",
                           "--documents")  # fmt: skip
    assert any("+docs" in r["shape"] for r in documents)
    fp16 = kernel_fit(tmp_path, "--archs", "sm80", "--head-dims", 128, 256, "--gqa", 2, 4,
                      "--dtypes", "fp16", "--gates", "log")  # fmt: skip
    assert_all_fit(documents + fp16)


@pytest.mark.slow
def test_addresses_are_64_bit_where_a_tensor_passes_2_31_elements(tmp_path):
    """At the 0.7B recipe's heads (6 of 256), micro-batch 8 and 64K tokens, V's row stride
    ((rep + 2) b H_kv d) times the tokens passes 2^31 elements: every tensor argument of the
    gate's, XSA's and sparse Focus's kernels is offset from its base in 64 bits (Triton types a
    Python int below 2^31 as i32, so 32-bit products of sizes and strides would wrap)."""
    tokens, batch, kv_heads, head_dim = 65536, 8, 6, 256
    assert tokens * batch * kv_heads * 3 * head_dim > 2**31
    rows = kernel_fit(tmp_path, "--archs", "sm90", "--head-dims", head_dim, "--gqa", 1,
                      "--gates", "log", "--documents", "--tokens", tokens, "--batch", batch,
                      "--kv-heads", kv_heads)  # fmt: skip
    wide = {r["kernel"]: r["wide_addresses"] for r in rows if not r["kernel"].startswith("sink")}
    assert len(wide) == 19 and all(wide.values()), wide  # gate, chunk, XSA, sparse, decode


def test_no_tile_is_a_named_fallback_not_an_error_at_the_first_step(monkeypatch):
    """fp32 inputs, GPUs before Ampere and head dims past 256 have no tile: "auto" takes
    FlexAttention, and the fused kernel asked by name is refused before any compute."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "has_triton", lambda: True)
    monkeypatch.setattr(kernels, "device_capability", lambda device: (8, 0))
    assert kernels.soft_gate("auto", cuda, head_dim=128, dtype=torch.bfloat16).name == "triton"
    assert kernels.soft_gate("auto", cuda, head_dim=128, dtype=torch.float32).name == "flex"
    assert kernels.soft_gate("auto", cuda, head_dim=512, dtype=torch.bfloat16).name == "flex"
    with pytest.raises(ValueError, match="--focus-kernel triton: .*no tile.*head dim 128"):
        kernels.soft_gate("triton", cuda, head_dim=128, dtype=torch.float32)
    monkeypatch.setattr(kernels, "device_capability", lambda device: (7, 5))  # T4
    assert kernels.soft_gate("auto", cuda, head_dim=64, dtype=torch.float16).name == "flex"


def test_a_layout_whose_tile_offsets_would_wrap_is_refused_by_name():
    from megatron_focus.model.kernels.triton_fit import Shape, megatron_qkv
    from megatron_focus.model.kernels.triton_gate import Plan

    q, k, v = megatron_qkv(Shape(128, 1))
    far = torch.empty(0, device="meta", dtype=v.dtype).as_strided(v.shape, (1, 128, 2**26, 1))
    g = torch.empty(2, 4096, 8, device="meta")
    plan = Plan(q, k, far, g, None, window=4, gate_scale=1.0, scale=0.1, sink=0, gate="log",
                capability=(9, 0))  # fmt: skip
    with pytest.raises(ValueError, match="^v: one tile spans"):
        plan.launches(q, k, far, g, g)
