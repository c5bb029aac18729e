"""examples/lm_eval: the task files name data that exists, and every cloze item's answer is the
text that really follows its context in a held-out docstring (and no distractor is); every rule's
run is timed (timed.py) and its time per token printed next to its metrics (summary.py)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from tiny_runs import ROOT, tiny_argv, train

EXAMPLE = os.path.join(ROOT, "examples", "lm_eval")
TASKS = os.path.join(EXAMPLE, "tasks")


def _example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_task_files_name_existing_data():
    for name in os.listdir(TASKS):
        with open(os.path.join(TASKS, name)) as f:
            task = yaml.safe_load(f)
        assert task["task"] == name.removesuffix(".yaml")
        for path in task["dataset_kwargs"]["data_files"].values():
            assert _rows(path), path


def test_cloze_answers_follow_their_context():
    texts = [row["text"] for row in _rows("examples/lm_eval/data/docstrings.jsonl")]
    items = _rows("examples/lm_eval/data/cloze.jsonl")
    assert len(items) > 100
    for item in items:
        assert len(item["choices"]) == 4
        follows = [
            any(f"{item['context']} {choice}" in text for text in texts)
            for choice in item["choices"]
        ]
        assert follows == [i == item["label"] for i in range(4)], item["context"]
    # the answer's position is not a giveaway
    assert len({item["label"] for item in items}) == 4


class _FakeHFLM:
    """lm-eval's HFLM's two model calls, as they are called: a forward of [batch, length] tokens,
    and a generate returning the context with the new tokens after it."""

    def __init__(self):
        self.ran = []

    def _model_call(self, inps, attn_mask=None, labels=None):
        self.ran.append("forward")
        return torch.randn(*inps.shape, 8).softmax(-1).cumsum(-1)

    def _model_generate(self, context, max_length, stop, **kwargs):
        self.ran.append("generate")
        new = torch.zeros(context.shape[0], max_length - context.shape[1], dtype=context.dtype)
        return torch.cat([context, new], 1)


def test_timing_counts_the_tokens_of_every_timed_call():
    timed = _example("timed")
    timing = timed.Timing()
    timed.time_calls(_FakeHFLM, timing)
    model = _FakeHFLM()
    for length in (5, 7, 3):
        model._model_call(torch.zeros(4, length, dtype=torch.long))
    model._model_generate(torch.zeros(2, 6, dtype=torch.long), 10, [])
    model._model_generate(torch.zeros(2, 3, dtype=torch.long), 4, [])
    # the first call of each kind also ran once untimed (the warm-up)
    assert model.ran == ["forward"] * 4 + ["generate"] * 3
    report = timing.report()
    assert report["forward"]["calls"] == 3 and report["forward"]["tokens"] == 4 * (5 + 7 + 3)
    assert report["generate"]["calls"] == 2 and report["generate"]["tokens"] == 2 * 4 + 2 * 1
    for kind in ("forward", "generate"):
        assert report[kind]["seconds"] > 0
        assert report[kind]["us_per_token"] == pytest.approx(
            report[kind]["seconds"] * 1e6 / report[kind]["tokens"]
        )
    assert timed.Timing().report()["forward"]["us_per_token"] is None  # never called: no figure


def _write_rule(folder, bpb, us_per_token, generate_tokens=0):
    nested = folder / "model-name"
    nested.mkdir(parents=True)
    results = {
        "docstrings_ppl": {"alias": "docstrings_ppl", "bits_per_byte,none": bpb},
        "docstrings_cloze": {"acc,none": 0.25, "acc_stderr,none": 0.03},
    }
    (nested / "results_2026-01-01T00-00-00.json").write_text(json.dumps({"results": results}))
    timing = {
        "forward": {"calls": 2, "tokens": 1234, "seconds": 1.0, "us_per_token": us_per_token},
        "generate": {
            "calls": 1 if generate_tokens else 0,
            "tokens": generate_tokens,
            "seconds": 0.5 if generate_tokens else 0.0,
            "us_per_token": 0.5e6 / generate_tokens if generate_tokens else None,
        },
    }
    (folder / "timing.json").write_text(json.dumps(timing))


def test_summary_puts_each_rules_time_per_token_beside_its_metrics(tmp_path):
    summary = _example("summary")
    _write_rule(tmp_path / "soft", 2.331, 812.5)
    _write_rule(tmp_path / "sparse-top1", 2.332, 301.25)
    lines = summary.summary(str(tmp_path), ["soft", "sparse-top1"]).splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == [
        "rule",
        "docstrings_cloze acc",
        "docstrings_ppl bits_per_byte",
        "forward us/token",
        "forward tokens",
    ]  # no standard errors, no alias
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert rows == [
        ["soft", "0.25", "2.33", "812.50", "1,234"],
        ["sparse-top1", "0.25", "2.33", "301.25", "1,234"],
    ]
    _write_rule(tmp_path / "gen", 2.0, 100.0, generate_tokens=50)
    lines = summary.summary(str(tmp_path), ["soft", "gen"]).splitlines()
    assert lines[0].rstrip(" |").endswith("generate us/token")
    assert lines[-2].split("|")[-2].strip() == "-" and lines[-1].split("|")[-2].strip() == "10,000"
    with pytest.raises(FileNotFoundError, match="no lm-eval results"):
        summary.summary(str(tmp_path), ["missing"])


def test_run_sh_times_every_rule_and_prints_one_table():
    with open(os.path.join(EXAMPLE, "run.sh")) as f:
        script = f.read()
    assert "lm_eval run" not in script  # every rule runs under timed.py
    assert 'timed.py --timing "$OUT/results/$rule/timing.json"' in script
    assert 'summary.py "$OUT/results" "${RULES[@]}"' in script


def test_timed_lm_eval_run_on_an_export(embedded_cache, tmp_path):
    """lm-eval itself (where installed) under timed.py on a Focus export in sparse mode: its
    model calls are the ones timed, and summary.py reads what it wrote."""
    pytest.importorskip("lm_eval")
    from megatron_focus.hf import export_to_hf

    ckpt, hf, out = str(tmp_path / "ckpt"), str(tmp_path / "hf"), tmp_path / "results"
    flags = ["--attention", "focus", "--focus-window", "4", "--focus-groups", "2"]
    train(1, tiny_argv(embedded_cache, *flags, "--position-embedding-type", "rope", "--save", ckpt))
    export_to_hf(ckpt, hf, progress=False)
    model_args = f"pretrained={hf},trust_remote_code=True,dtype=float32"
    model_args += ",focus_attention_mode=sparse,focus_top_k=1"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    # the tasks name their data relative to the repository's root
    run = subprocess.run(
        [
            sys.executable,
            "examples/lm_eval/timed.py",
            "--timing",
            str(out / "sparse-top1" / "timing.json"),
            "run",
            "--model",
            "hf",
            "--model_args",
            model_args,
            "--tasks",
            "docstrings_cloze",
            "--include_path",
            "examples/lm_eval/tasks",
            "--device",
            "cpu",
            "--batch_size",
            "4",
            "--limit",
            "4",
            "--output_path",
            str(out / "sparse-top1"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    timing = json.loads((out / "sparse-top1" / "timing.json").read_text())
    assert timing["forward"]["calls"] > 0 and timing["forward"]["tokens"] > 0
    assert timing["forward"]["us_per_token"] > 0
    assert timing["generate"]["calls"] == 0  # a log-likelihood task generates nothing
    table = _example("summary").summary(str(out), ["sparse-top1"])
    assert "docstrings_cloze acc" in table and "forward us/token" in table
