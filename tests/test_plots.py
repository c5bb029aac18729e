"""The benchmark plots are drawn from the benchmarks' own JSON (benchmarks/plot_speed.py)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(n, groups, top_k, speedup):
    return dict(heads=4, head_dim=64, n=n, groups=groups, top_k=top_k, speedup=speedup,
                ideal_speedup=2 * speedup)  # fmt: skip


def test_speed_plot_draws_one_line_per_shape_k_and_top_k(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import plot_speed

    rows = [_row(4096, 8, 1, 2.0), _row(1024, 8, 1, 0.8), _row(1024, 4, 2, 0.4)]
    assert plot_speed.series(rows) == {
        (4, 64, 4, 2): [(1024, 0.4, 0.8)],
        (4, 64, 8, 1): [(1024, 0.8, 1.6), (4096, 2.0, 4.0)],  # by length
    }
    run = tmp_path / "sparse.json"
    run.write_text(json.dumps({"config": {"device": "cpu", "dtype": "fp32"}, "results": rows}))
    out = tmp_path / "speed.png"
    command = [sys.executable, "benchmarks/plot_speed.py", str(run), str(run), "--out", str(out)]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
