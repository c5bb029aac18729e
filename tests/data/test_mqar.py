"""data/mqar.py: the MQAR sequences are what the task says, and pretrain_gpt.py / eval_ppl.py
train and score on them (recall accuracy)."""

import json
import os

import pytest
import torch

from megatron_focus.data.mqar import FILLER, MQARDataset, check_mqar


def test_sequences_hold_pairs_then_far_queries_and_only_values_count():
    data = MQARDataset(20, seq_length=128, pairs=8, vocab_size=64, min_distance=40, seed=3)
    for index in range(len(data)):
        sample = data[index]
        tokens = torch.cat([sample["tokens"], sample["labels"][-1:]]).tolist()
        assert tokens[0] == FILLER  # the start token
        keys, values = tokens[1:17:2], tokens[2:17:2]
        assert len(set(keys)) == 8 and all(1 <= k < 32 for k in keys)
        assert all(32 <= v < 64 for v in values)
        counted = sample["loss_mask"].nonzero().flatten().tolist()
        assert len(counted) == 8
        for q in counted:  # each counted position is a key asked again; its label its value
            key = tokens[q]
            assert key in keys and q - (1 + 2 * keys.index(key)) > 40
            assert sample["labels"][q] == values[keys.index(key)]
        asked = [tokens[q] for q in counted]
        assert sorted(asked) == sorted(keys)
        rest = set(range(17, 129)) - set(counted) - {q + 1 for q in counted}
        assert all(tokens[i] == FILLER for i in rest)
        assert torch.equal(sample["position_ids"], torch.arange(128))


def test_more_queries_ask_every_key_then_random_ones():
    data = MQARDataset(
        5, seq_length=200, pairs=6, vocab_size=40, min_distance=30, seed=0, queries=20
    )
    for index in range(len(data)):
        sample = data[index]
        tokens = sample["tokens"].tolist()
        keys, values = tokens[1:13:2], tokens[2:13:2]
        counted = sample["loss_mask"].nonzero().flatten().tolist()
        assert len(counted) == 20 and set(tokens[q] for q in counted) == set(keys)
        assert all(sample["labels"][q] == values[keys.index(tokens[q])] for q in counted)
    with pytest.raises(ValueError, match="at least one per pair"):
        MQARDataset(5, 200, 6, 40, 30, seed=0, queries=5)


def test_packed_pairs_are_one_token_each():
    data = MQARDataset(
        4, seq_length=100, pairs=5, vocab_size=49, min_distance=30, seed=2, packed=True
    )
    n = 6  # floor(sqrt(49)) - 1 keys and values
    for index in range(len(data)):
        sample = data[index]
        tokens = sample["tokens"].tolist()
        pairs = tokens[1:6]
        assert all(n + 1 <= t < n + 1 + n * n for t in pairs)
        key_of = {(t - n - 1) // n + 1: (t - n - 1) % n for t in pairs}  # key -> value choice
        counted = sample["loss_mask"].nonzero().flatten().tolist()
        assert sorted(tokens[q] for q in counted) == sorted(key_of)
        for q in counted:
            assert sample["labels"][q] == n + 1 + n * n + key_of[tokens[q]]
            assert q - 5 > 30
    with pytest.raises(ValueError, match="needs --mqar-vocab-size >= 36"):
        check_mqar(100, 5, 35, 30, packed=True)


def test_samples_are_a_pure_function_of_seed_split_and_index():
    a, b = (MQARDataset(5, 96, 4, 32, 30, seed=1) for _ in range(2))
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(5))
    other_split = MQARDataset(5, 96, 4, 32, 30, seed=1, split="valid")
    assert not torch.equal(a[0]["tokens"], other_split[0]["tokens"])
    assert not torch.equal(a[0]["tokens"], a[1]["tokens"])


@pytest.mark.parametrize(
    "settings, error",
    [
        ((96, 4, 8, 30), "needs --mqar-vocab-size >= 10"),
        ((40, 8, 64, 20), "needs --seq-length >= 53"),
        ((96, 4, 64, 0), "needs --seq-length"),
    ],
)
def test_impossible_settings_are_refused(settings, error):
    with pytest.raises(ValueError, match=error):
        check_mqar(*settings)


@pytest.mark.slow
def test_pretrain_and_eval_ppl_on_mqar(tmp_path, run_tool):
    """A few iterations on MQAR, a checkpoint without a tokenizer, and eval_ppl's recall accuracy
    in each Focus mode."""
    from tiny_runs import TINY, train

    mqar = ["--mqar", "--mqar-pairs", "4", "--mqar-vocab-size", "64", "--mqar-min-distance", "15"]
    ckpt = str(tmp_path / "ckpt")
    history = train(
        1,
        TINY
        + mqar
        + [
            "--attention",
            "focus",
            "--focus-window",
            "8",
            "--focus-groups",
            "2",
            "--train-iters",
            "3",
            "--save",
            ckpt,
            "--eval-interval",
            "3",
        ],
    )
    assert len(history["losses"]) == 3 and history["validation"]
    tokenizer = json.load(open(os.path.join(ckpt, "iter_0000003", "tokenizer_args.json")))
    assert tokenizer == {
        "tokenizer_type": None,
        "tokenizer_model": None,
        "vocab_file": None,
        "merge_file": None,
        "vocab_size": 64,
    }
    report = str(tmp_path / "eval.json")
    out = run_tool(
        "tools/eval_ppl.py",
        "--load",
        ckpt,
        *mqar,
        "--seq-length",
        "32",
        "--eval-iters",
        "2",
        "--micro-batch-size",
        "2",
        "--json",
        report,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.load(open(report))["rows"]
    assert [(r["mode"], r["top_k"]) for r in rows] == [("soft", None), ("sparse", 1), ("sparse", 2)]
    assert all(0 <= r["accuracy"] <= 1 for r in rows)
    assert rows[-1]["pairs_kept"] == pytest.approx(1.0)  # top-k = K keeps every pair


@pytest.mark.slow
def test_mqar_study_script_trains_evaluates_and_plots(tmp_path, run_tool):
    """examples/mqar_study.py itself, shrunk: three variants (the random router's control among
    them), one seed, 3 iterations at 32 tokens then 3 at 48 from those weights (the length
    curriculum)."""
    out = run_tool(
        "examples/mqar_study.py",
        "--out",
        tmp_path / "runs",
        "--variants",
        "window",
        "focus-sink1",
        "focus+xsa-random",
        "--seeds",
        "1",
        "--seq-length",
        "48",
        "--iters",
        "3",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--mqar-pairs",
        "3",
        "--mqar-queries",
        "4",
        "--mqar-min-distance",
        "20",
        "--mqar-vocab-size",
        "16",
        "--focus-window",
        "4",
        "--micro-batch-size",
        "2",
        "--short-seq-length",
        "32",
        "--short-iters",
        "3",
        "--short-min-distance",
        "10",
        "--short-micro-batch-size",
        "2",
        "--eval-iters",
        "1",
        "--json",
        tmp_path / "s.json",
        "--plot",
        tmp_path / "s.png",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.load(open(tmp_path / "s.json"))["summary"]
    modes = {(r["variant"], r["mode"]) for r in summary}
    assert ("window", "window") in modes and ("focus-sink1", "soft") in modes
    assert ("focus-sink1", "sparse top-1") in modes
    assert ("focus+xsa-random", "sparse top-1") in modes
    control = (tmp_path / "runs" / "focus-xsa-random-seed1" / "log.txt").read_text()
    assert control.count("--focus-router random") == 2  # both stages
    assert all(0 <= r["accuracy"][0] <= 1 for r in summary)
    run = tmp_path / "runs" / "focus-sink1-seed1"
    assert (run / "ckpt-32" / "latest").read_text() == "iter_0000003"
    assert "--pretrained-checkpoint " + str(run / "ckpt-32") in (run / "log.txt").read_text()
    window = next(r for r in summary if r["variant"] == "window")  # keys i - 3 .. i of 48
    assert window["pairs_kept"][0] == pytest.approx(
        sum(min(i + 1, 4) for i in range(48)) / (48 * 49 / 2)
    )
    assert os.path.getsize(tmp_path / "s.png") > 5_000

    # a further stage from those models, and a clear error where one is missing
    further = (
        "--variants window --seeds 1 --seq-length 64 --iters 2 --layers 1 --hidden 32 "
        "--mqar-pairs 3 --mqar-queries 4 --mqar-min-distance 20 --mqar-vocab-size 16 "
        "--focus-window 4 --micro-batch-size 2 --eval-iters 1"
    ).split()
    missing = run_tool(
        "examples/mqar_study.py", "--out", tmp_path / "x", "--init-from", tmp_path, *further
    )
    assert missing.returncode != 0 and "no checkpoint in" in missing.stderr
    out = run_tool(
        "examples/mqar_study.py",
        "--out",
        tmp_path / "long",
        "--init-from",
        tmp_path / "runs",
        *further,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    log = (tmp_path / "long" / "window-seed1" / "log.txt").read_text()
    assert "--pretrained-checkpoint " + str(tmp_path / "runs" / "window-seed1" / "ckpt") in log
    assert "--seq-length 64" in log
    scored = run_tool(
        "examples/mqar_study.py",
        "--out",
        tmp_path / "scored",
        "--init-from",
        tmp_path / "long",
        *further,
        "--iters",
        "0",
        "--json",
        tmp_path / "scored.json",
    )
    assert scored.returncode == 0, scored.stdout[-2000:] + scored.stderr[-2000:]
    log = (tmp_path / "scored" / "window-seed1" / "log.txt").read_text()
    assert "pretrain_gpt.py" not in log
    assert "--load " + str(tmp_path / "long" / "window-seed1" / "ckpt") in log
    assert json.load(open(tmp_path / "scored.json"))["summary"][0]["variant"] == "window"
