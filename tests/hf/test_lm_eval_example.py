"""examples/lm_eval: the task files name data that exists, and every cloze item's answer is the
text that really follows its context in a held-out docstring (and no distractor is)."""

import json
import os

import yaml

from tiny_runs import ROOT

TASKS = os.path.join(ROOT, "examples", "lm_eval", "tasks")


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
