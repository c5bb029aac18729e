"""A small English corpus that needs no download: the Python standard library's docstrings.

It is prose about programming, a few MB, and identical on every machine with the same Python,
which makes it a reproducible smoke-test corpus for tokenizer training and pretraining.
"""

import ast
import json
import os
import sysconfig

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__"}
MIN_CHARS = 40


def file_docstrings(path: str) -> list[str]:
    with open(path, "rb") as f:
        source = f.read()
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError):  # a few stdlib data files are deliberately not valid Python
        return []
    nodes = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    docs = [ast.get_docstring(n) for n in nodes]
    return [d for d in docs if d and len(d) > MIN_CHARS]


def stdlib_docstrings() -> list[str]:
    """Module, class and function docstrings, in sorted file order, first occurrence kept."""
    root = sysconfig.get_paths()["stdlib"]
    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                for doc in file_docstrings(os.path.join(dirpath, name)):
                    seen.setdefault(doc, None)
    return list(seen)


def write_stdlib_corpus(out_path: str) -> int:
    """Write the docstrings as jsonl `{"text": ...}`; returns the number of documents."""
    docs = stdlib_docstrings()
    with open(out_path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return len(docs)
