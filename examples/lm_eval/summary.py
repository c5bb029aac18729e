"""One table of an lm-evaluation-harness run per rule: each task's metrics (lm-eval's own
results file) and the time per token of the model (`timed.py`'s timing.json), one row per rule,
so that the price of each rule sits next to what it scores.

    python examples/lm_eval/summary.py RESULTS_DIR RULE [RULE ...]

RESULTS_DIR/<rule>/ is a rule's `--output_path` (its newest results_*.json, wherever lm-eval put
it underneath) and holds its timing.json. Prints a Markdown table: a column per task metric
(standard errors left out), then the forward's microseconds per token (the tokens its forwards
computed, padding included) and, where a task generated, the microseconds per generated token.
"""

import glob
import json
import os
import sys


def rule_row(folder: str) -> tuple[dict, dict]:
    """({(task, metric): value}, timing) of one rule's output folder."""
    found = glob.glob(os.path.join(folder, "**", "results_*.json"), recursive=True)
    if not found:
        raise FileNotFoundError(f"{folder}: no lm-eval results_*.json under it")
    with open(max(found, key=os.path.getmtime)) as f:
        results = json.load(f)["results"]
    metrics = {
        (task, name.split(",")[0]): value
        for task, values in results.items()
        for name, value in values.items()
        if "," in name and "_stderr" not in name and isinstance(value, (int, float))
    }
    with open(os.path.join(folder, "timing.json")) as f:
        return metrics, json.load(f)


def _number(value) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}" if abs(value) < 1 else f"{value:.2f}"


def summary(results_dir: str, rules: list[str]) -> str:
    rows = {rule: rule_row(os.path.join(results_dir, rule)) for rule in rules}
    columns = sorted({key for metrics, _ in rows.values() for key in metrics})
    generated = any(t["generate"]["tokens"] for _, t in rows.values())
    header = ["rule"] + [f"{task} {metric}" for task, metric in columns]
    header += ["forward us/token", "forward tokens"]
    header += ["generate us/token"] if generated else []
    lines = [
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    for rule, (metrics, timing) in rows.items():
        cells = [rule] + [_number(metrics.get(key)) for key in columns]
        cells += [_number(timing["forward"]["us_per_token"]), f"{timing['forward']['tokens']:,}"]
        cells += [_number(timing["generate"]["us_per_token"])] if generated else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: summary.py RESULTS_DIR RULE [RULE ...]")
    print(summary(sys.argv[1], sys.argv[2:]))
