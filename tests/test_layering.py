"""The package's layers (docs/design.md, "Layers") hold: no module imports from a layer above its
own or beside it."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megatron_focus"


def documented_layers():
    """[{unit, ...}, ...] lowest first, as the fenced block of docs/design.md's "Layers" lists
    them highest first."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layers", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    return [
        {unit.strip() for unit in line.split(":", 1)[0].split(",")}
        for line in reversed(block.strip().splitlines())
    ]


def unit_of(parts):
    """A module's unit: its folder under the package (model/focus and model/kernels apart from
    model), or the top-level module itself."""
    if parts[0] == "model" and len(parts) > 2 and (PACKAGE / "model" / parts[1]).is_dir():
        return f"model/{parts[1]}"
    return parts[0]


def under_type_checking(tree):
    """Import nodes inside `if TYPE_CHECKING:` blocks (annotations only, never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def imported_units(path):
    """(unit, line) of each package import the module makes, lazy ones included."""
    module = path.relative_to(ROOT).with_suffix("").parts
    package = module[:-1]  # a relative import's level 1 (an __init__'s own package too)
    tree = ast.parse(path.read_text())
    skipped = under_type_checking(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names = [".".join(base + ((node.module,) if node.module else ()))]
            else:
                names = [node.module or ""]
            names = [f"{n}.{a.name}" for n in names for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "megatron_focus" and len(parts) > 1:
                yield unit_of(parts[1:]), node.lineno


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts != ("__init__",):
            yield path, unit_of(parts)


def test_every_unit_has_a_layer():
    placed = set().union(*documented_layers())
    units = {unit for _, unit in modules()}
    assert units - placed == set(), "give these a line in docs/design.md's Layers"
    assert placed - units == set(), "docs/design.md's Layers names units that do not exist"


def test_imports_point_down():
    level = {unit: i for i, layer in enumerate(documented_layers()) for unit in layer}
    upward = [
        f"{path.relative_to(ROOT)}:{line} ({unit}) imports {target}"
        for path, unit in modules()
        for target, line in imported_units(path)
        if target != unit and target in level and level[target] >= level[unit]
    ]
    assert upward == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check is not vacuous: an upward import, even a lazy one, is found; one for
    annotations only is not."""
    module = tmp_path / "megatron_focus" / "data" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from megatron_focus.training import trainer\n"
        "def f():\n"
        "    from megatron_focus.config import flags\n"
    )
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert list(imported_units(module)) == [("config", 5)]
