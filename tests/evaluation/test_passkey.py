"""Passkey retrieval: the prompt is what the task says, and tools/eval_passkey.py answers alike on
a native checkpoint and its HF export, in each Focus mode."""

import json

import pytest

from megatron_focus.evaluation.passkey import (
    FILLER,
    NEEDLE,
    QUESTION,
    TASK,
    passkey_prompt,
    retrieved,
)


def words(text):  # a tokenizer of whole words, to read prompts back
    return text.split()


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_prompt_places_the_needle_at_its_depth(depth):
    prompt = passkey_prompt(words, 200, depth, 12345)
    needle, task, question = words(NEEDLE.format(key=12345)), words(TASK), words(QUESTION)
    assert len(prompt) == 200
    assert prompt[: len(task)] == task and prompt[-len(question) :] == question
    start = next(i for i in range(len(prompt)) if prompt[i : i + len(needle)] == needle)
    room = 200 - len(task) - len(needle) - len(question)
    assert start - len(task) == round(depth * room)
    filler = [w for w in prompt[len(task) : -len(question)] if w not in needle]
    assert set(filler) <= set(words(FILLER))


def test_prompts_too_short_and_answers_are_checked():
    with pytest.raises(ValueError, match="cannot hold"):
        passkey_prompt(words, 20, 0.5, 12345)
    assert retrieved(" 12345. Remember", 12345) and retrieved("12345", 12345)
    assert not retrieved(" 1234 5", 12345) and not retrieved(" the key", 12345)


@pytest.mark.slow
def test_native_checkpoint_and_export_answer_alike(embedded_cache, tmp_path, run_tool):
    from megatron_focus.hf import export_to_hf

    from tiny_runs import tiny_argv, train

    ckpt, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    train(
        1,
        tiny_argv(
            embedded_cache,
            "--attention",
            "focus",
            "--focus-window",
            "8",
            "--focus-groups",
            "3",
            "--position-embedding-type",
            "rope",
            "--save",
            ckpt,
            iters=3,
        ),
    )
    export_to_hf(ckpt, hf, progress=False)
    results = {}
    for source, path in (("--load", ckpt), ("--hf", hf)):
        report = str(tmp_path / f"{source[2:]}.json")
        trust = ["--trust-remote-code"] if source == "--hf" else []
        out = run_tool(
            "tools/eval_passkey.py",
            source,
            path,
            *trust,
            "--lengths",
            "100",
            "160",
            "--depths",
            "0",
            "1",
            "--trials",
            "2",
            "--top-k",
            "1",
            "--json",
            report,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        results[source] = json.load(open(report))["rows"]
    native, exported = results["--load"], results["--hf"]
    assert [(r["mode"], r["top_k"], r["length"], r["depth"]) for r in native] == [
        (mode, k, n, d)
        for mode, k in (("soft", None), ("sparse", 1))
        for n in (100, 160)
        for d in (0.0, 1.0)
    ]
    assert all(0 <= r["accuracy"] <= 1 for r in native)
    assert [r["answers"] for r in native] == [r["answers"] for r in exported]
