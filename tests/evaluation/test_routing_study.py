"""examples/routing_study.py, the language-modelling study, as its --tiny smoke run: the full
model, the random-router control and the distilled router trained and scored in every mode, the
table's figures well formed (the window and the learned router take the same loop in
tests/data/test_mqar.py's run of mqar_study.py)."""

import json
import math
import os

import pytest


@pytest.mark.slow
def test_routing_study_tiny_scores_every_variant_and_mode(tmp_path, run_tool):
    out = run_tool(
        "examples/routing_study.py",
        "--tiny",
        "--variants",
        "standard",
        "focus-random",
        "focus-distilled",
        "--out",
        tmp_path / "runs",
        "--json",
        tmp_path / "s.json",
        "--plot",
        tmp_path / "s.png",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.load(open(tmp_path / "s.json"))["summary"]
    rows = {(r["variant"], r["mode"]): r for r in summary}
    focus_modes = ["soft"] + [f"sparse top-{k}" for k in range(1, 5)]  # K = 4
    assert list(rows) == [("standard", "full")] + [
        (variant, m) for variant in ("focus-random", "focus-distilled") for m in focus_modes
    ]
    assert rows[("focus-random", "soft")]["router"] == "random"
    assert rows[("focus-distilled", "soft")]["router"] == "distilled"
    for (variant, mode), r in rows.items():
        assert r["seeds"] == 1 and math.isfinite(r["loss"][0]) and r["loss"][0] > 0
        assert r["ppl"][0] == pytest.approx(math.exp(r["loss"][0]), rel=1e-6)
        if mode.startswith("sparse"):
            assert 0 <= r["kept_mass"][0] <= 1 and 0 < r["pairs_kept"][0] <= 1
        else:
            assert r["kept_mass"] is None
    control = (tmp_path / "runs" / "focus-random-seed1" / "log.txt").read_text()
    assert "--focus-router random" in control and "--seq-length 64" in control
    distilled = (tmp_path / "runs" / "focus-distilled-seed1" / "log.txt").read_text()
    assert "--focus-distill-coeff 1" in distilled and "focus router loss:" in distilled
    assert os.path.getsize(tmp_path / "s.png") > 5_000
