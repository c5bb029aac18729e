"""The held-out data of the lm-evaluation-harness example: docstrings of the standard library's
idlelib, which the embedded training corpus leaves out (megatron_focus/data/corpus.py).

    python examples/lm_eval/make_tasks.py    # writes examples/lm_eval/data/*.jsonl

docstrings.jsonl: {"text"}, for a rolling perplexity task (as wikitext). cloze.jsonl: {"context",
"choices", "label"}: a docstring's first words, its next four words and three four-word spans
of other docstrings, for a multiple-choice task scored by log-likelihood. Deterministic for a
given Python version.
"""

import json
import os
import random
import sysconfig

from megatron_focus.data.corpus import file_docstrings

DOCS, MIN_CHARS, CONTEXT_WORDS, CHOICE_WORDS, DISTRACTORS = 200, 200, 24, 4, 3
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def held_out_docstrings() -> list[str]:
    root = os.path.join(sysconfig.get_paths()["stdlib"], "idlelib")
    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                for doc in file_docstrings(os.path.join(dirpath, name)):
                    if len(doc) >= MIN_CHARS:
                        seen.setdefault(" ".join(doc.split()), None)
    return list(seen)[:DOCS]


def cloze(docs: list[str], rng: random.Random) -> list[dict]:
    words = [doc.split() for doc in docs]
    long_enough = [w for w in words if len(w) >= CONTEXT_WORDS + CHOICE_WORDS]
    items = []
    for i, w in enumerate(long_enough):
        span = slice(CONTEXT_WORDS, CONTEXT_WORDS + CHOICE_WORDS)
        others = rng.sample([o for j, o in enumerate(long_enough) if j != i], DISTRACTORS)
        choices = [" ".join(w[span])] + [" ".join(o[span]) for o in others]
        order = list(range(len(choices)))
        rng.shuffle(order)
        items.append(
            {
                "context": " ".join(w[:CONTEXT_WORDS]),
                "choices": [choices[k] for k in order],
                "label": order.index(0),
            }
        )
    return items


def main() -> None:
    docs = held_out_docstrings()
    os.makedirs(HERE, exist_ok=True)
    for name, rows in (
        ("docstrings", [{"text": d} for d in docs]),
        ("cloze", cloze(docs, random.Random(0))),
    ):
        with open(os.path.join(HERE, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
