"""The variant registry: a variant registered from outside the package (tests/toy_variant.py,
loaded through MEGATRON_FOCUS_VARIANTS in every process) trains, resumes from its checkpoint and
exports, with no other file knowing its name."""

import pytest
import torch

from distributed import run_distributed
from tiny_runs import tiny_argv, train

TOKENS = torch.randint(0, 4000, (2, 32), generator=torch.Generator().manual_seed(0))


def _export_and_compare(ckpt, hf):
    """(HF config's layer kinds, max |HF logits - native logits|) of an exported checkpoint."""
    from transformers import AutoModelForCausalLM

    from megatron_focus.hf import export_to_hf, native_logits

    export_to_hf(ckpt, hf, progress=False)
    model = AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True).eval()
    with torch.no_grad():
        diff = (model(TOKENS).logits - native_logits(ckpt, TOKENS)).abs().max().item()
    return getattr(model.config, "layer_attention", None), type(model).__name__, diff


def test_a_registered_variant_trains_checkpoints_and_exports(embedded_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_FOCUS_VARIANTS", "toy_variant")
    ckpt, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    explicit = ["--attention", "explicit"]
    first = train(
        1, tiny_argv(embedded_cache, *explicit, "--save", ckpt, "--exit-interval", "3", iters=4)
    )
    resumed = train(
        1, tiny_argv(embedded_cache, *explicit, "--save", ckpt, "--load", ckpt, iters=4)
    )
    standard = train(1, tiny_argv(embedded_cache, iters=4))  # the same function, SDPA's kernel
    assert first["losses"] + resumed["losses"] == pytest.approx(standard["losses"], rel=1e-5)

    kinds, cls, diff = run_distributed(_export_and_compare, 1, ckpt, hf)
    assert cls == "GPT2LMHeadModel" and kinds is None  # a stock class: its layers are standard
    assert diff < 1e-4


def test_unknown_and_duplicate_variants_are_refused():
    from megatron_focus.variants import VARIANTS, register, variant

    with pytest.raises(ValueError, match="unknown --attention 'sparse'; choose from standard"):
        variant("sparse")
    with pytest.raises(ValueError, match="already registered"):
        register(VARIANTS["xsa"])


def test_a_variant_module_that_cannot_be_imported_is_one_error_line():
    import os
    import subprocess
    import sys

    env = {**os.environ, "MEGATRON_FOCUS_VARIANTS": "no_such_variants_module"}
    out = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--help"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "error: MEGATRON_FOCUS_VARIANTS names 'no_such_variants_module', which cannot be "
        "imported: No module named 'no_such_variants_module'"
    ]
