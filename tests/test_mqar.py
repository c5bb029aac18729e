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
        keys, values = tokens[0:16:2], tokens[1:16:2]
        assert len(set(keys)) == 8 and all(1 <= k < 32 for k in keys)
        assert all(32 <= v < 64 for v in values)
        counted = sample["loss_mask"].nonzero().flatten().tolist()
        assert len(counted) == 8
        for q in counted:  # each counted position is a key asked again; its label its value
            key = tokens[q]
            assert key in keys and q - 2 * keys.index(key) > 40
            assert sample["labels"][q] == values[keys.index(key)]
        asked = [tokens[q] for q in counted]
        assert sorted(asked) == sorted(keys)
        rest = set(range(16, 129)) - set(counted) - {q + 1 for q in counted}
        assert all(tokens[i] == FILLER for i in rest)
        assert torch.equal(sample["position_ids"], torch.arange(128))


def test_samples_are_a_pure_function_of_seed_split_and_index():
    a, b = (MQARDataset(5, 96, 4, 32, 30, seed=1) for _ in range(2))
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(5))
    other_split = MQARDataset(5, 96, 4, 32, 30, seed=1, split="valid")
    assert not torch.equal(a[0]["tokens"], other_split[0]["tokens"])
    assert not torch.equal(a[0]["tokens"], a[1]["tokens"])


@pytest.mark.parametrize("settings, error", [
    ((96, 4, 8, 30), "needs --mqar-vocab-size >= 10"),
    ((40, 8, 64, 20), "needs --seq-length >= 52"),
    ((96, 4, 64, 0), "needs --seq-length"),
])
def test_impossible_settings_are_refused(settings, error):
    with pytest.raises(ValueError, match=error):
        check_mqar(*settings)


def test_pretrain_and_eval_ppl_on_mqar(tmp_path, run_tool):
    """A few iterations on MQAR, a checkpoint without a tokenizer, and eval_ppl's recall accuracy
    in each Focus mode."""
    from test_training import TINY, train

    mqar = ["--mqar", "--mqar-pairs", "4", "--mqar-vocab-size", "64", "--mqar-min-distance", "16"]
    ckpt = str(tmp_path / "ckpt")
    history = train(1, TINY + mqar + ["--attention", "focus", "--focus-window", "8",
                                      "--focus-groups", "2", "--train-iters", "3", "--save", ckpt,
                                      "--eval-interval", "3"])
    assert len(history["losses"]) == 3 and history["validation"]
    tokenizer = json.load(open(os.path.join(ckpt, "iter_0000003", "tokenizer_args.json")))
    assert tokenizer == {"tokenizer_type": None, "tokenizer_model": None, "vocab_size": 64}
    report = str(tmp_path / "eval.json")
    out = run_tool("tools/eval_ppl.py", "--load", ckpt, *mqar, "--seq-length", "32",
                   "--eval-iters", "2", "--micro-batch-size", "2", "--json", report)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.load(open(report))["rows"]
    assert [(r["mode"], r["top_k"]) for r in rows] == [("soft", None), ("sparse", 1),
                                                        ("sparse", 2)]
    assert all(0 <= r["accuracy"] <= 1 for r in rows)
    assert rows[-1]["pairs_kept"] == pytest.approx(1.0)  # top-k = K keeps every pair
