"""The evaluation tools build a checkpoint's native model from its record
(`checkpoint/native.py`), not through the HF bridge, which knows only the variants the HF model
computes: `evaluation/` imports nothing of `hf/`."""

import subprocess
import sys


def test_evaluation_imports_nothing_of_the_hf_bridge():
    modules = [
        "megatron_focus.evaluation.perplexity",
        "megatron_focus.evaluation.passkey_runner",
        "megatron_focus.checkpoint.native",  # what passkey_runner imports when it runs
    ]
    code = (
        f"import sys, {', '.join(modules)}; "
        "print(sorted(m for m in sys.modules if m.startswith('megatron_focus.hf')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
