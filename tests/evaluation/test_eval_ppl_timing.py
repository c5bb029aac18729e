"""tools/eval_ppl.py reports the time per token of each mode next to its perplexity: the whole
forward's and its attention's, positive, the attention's a part of the forward's, for every row
of the table and of its JSON, at one length and at several."""

import json

import pytest

from megatron_focus.evaluation.perplexity import TIMING_NOTE, table

EVAL = ["--eval-iters", "2", "--micro-batch-size", "2"]


def _row(mode, top_k, n, us, attn_us):
    return {
        "mode": mode,
        "top_k": top_k,
        "seq_length": n,
        "loss": 3.0,
        "ppl": 20.09,
        "accuracy": 0.25,
        "pairs_kept": 0.5,
        "kept_mass": None if mode == "soft" else 0.75,
        "us_per_token": us,
        "attention_us_per_token": attn_us,
    }


def test_table_prints_time_per_token_in_every_row():
    rows = [_row("soft", None, 64, 123.45, 67.89), _row("sparse", 1, 64, 98.76, 43.21)]
    lines = table(rows, [64]).splitlines()
    assert "us/token" in lines[0] and "attn us/token" in lines[0]
    assert lines[1].split()[-2:] == ["123.45", "67.89"]
    assert lines[2].split()[-2:] == ["98.76", "43.21"]
    assert "\n".join(lines[-2:]).startswith(TIMING_NOTE) and "attn" in lines[-1]
    rows = [_row("sparse", 2, n, float(n), 1.0) for n in (16, 32)]
    lines = table(rows, [16, 32]).splitlines()
    assert lines[0].split()[-2:] == ["us/tok@16", "us/tok@32"]
    assert lines[1].split()[-2:] == ["16.00", "32.00"]
    assert "\n".join(lines[-2:]) == TIMING_NOTE


def _timed(row, n):
    assert row["tokens"] == 2 * 2 * n  # eval-iters x micro-batch x length
    assert row["us_per_token"] > 0 and row["attention_us_per_token"] > 0
    assert row["attention_us_per_token"] < row["us_per_token"]  # a part of the forward
    assert row["forward_ms"] <= row["total_ms"]
    assert row["us_per_token"] == pytest.approx(row["forward_ms"] * 1e3 / row["tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["focus", "standard"])
def test_eval_ppl_times_every_mode(attention, embedded_cache, tmp_path, run_tool):
    from tiny_runs import tiny_argv, train

    ckpt, report = str(tmp_path / "ckpt"), str(tmp_path / "ppl.json")
    focus = ["--focus-window", "4", "--focus-groups", "2"] if attention == "focus" else []
    train(
        1,
        tiny_argv(
            embedded_cache,
            "--attention",
            attention,
            *focus,
            "--position-embedding-type",
            "rope",
            "--save",
            ckpt,
            iters=3,
        ),
    )
    # no length: the checkpoint's own (it trained at 32)
    for lengths in ([], ["32"], ["16", "32"]):
        out = run_tool(
            "tools/eval_ppl.py",
            "--load",
            ckpt,
            "--data-cache-path",
            embedded_cache,
            *EVAL,
            *(["--seq-lengths", *lengths] if lengths else []),
            "--json",
            report,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        rows = json.load(open(report))["rows"]
        assert {row["seq_length"] for row in rows} == {int(n) for n in lengths or ["32"]}
        modes = [(r["mode"], r["top_k"]) for r in rows[:: max(len(lengths), 1)]]
        expected = [("soft", None), ("sparse", 1), ("sparse", 2)]
        assert modes == (expected if attention == "focus" else [(attention, None)])
        for row in rows:
            _timed(row, row["seq_length"])
        lines = out.stdout.splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("mode"))
        printed = lines[header + 1 : header + 1 + len(modes)]
        if len(lengths) <= 1:
            assert "us/token" in lines[header]
            for line, row in zip(printed, rows):
                assert float(line.split()[-2]) == pytest.approx(row["us_per_token"], abs=0.006)
        else:
            assert "us/tok@16" in lines[header] and "us/tok@32" in lines[header]
            for line, group in zip(printed, zip(rows[::2], rows[1::2])):
                us = [float(v) for v in line.split()[-2:]]
                assert us == pytest.approx([r["us_per_token"] for r in group], abs=0.006)
        assert TIMING_NOTE in out.stdout
