"""The scheduler's folders are its architecture: every import (type-only and in-function ones too)
points to the module's own layer or one below, and no modules import each other in a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "scheduler"
PACKAGE = "temper.scheduler"
# Top to bottom. A module may import its own layer and the layers below it.
LAYERS = [
    ("entry", {"app", "__main__", "admin"}),
    ("api", {"api"}),
    ("planning", {"planning"}),
    ("cluster", {"cluster"}),  # lane leases and fencing (issue 32): lanes in planning ask it whether they may write
    ("workers", {"workers"}),
    ("tenancy", {"tenancy"}),
    ("db", {"db"}),
    ("base", {"settings", "metrics", "__init__"}),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def layer_of(module: str) -> int:
    first = module[len(PACKAGE) + 1:].split(".")[0] if module != PACKAGE else "__init__"
    for index, (_, heads) in enumerate(LAYERS):
        if first in heads:
            return index
    raise AssertionError(f"{module} is in no layer: add its folder to LAYERS (and say why in the package docstring)")


def scheduler_imports(path: Path, modules: set[str]) -> set[str]:
    """Every temper.scheduler module ``path`` imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from temper.scheduler import metrics` names a module; `from x.y import Name` names x.y
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        found.update(n for n in names if n == PACKAGE or n.startswith(PACKAGE + "."))
    return found - {PACKAGE}


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: scheduler_imports(path, set(paths)) for name, path in paths.items()}


def test_every_module_has_a_layer_and_imports_only_downward():
    upward = [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
              for module, targets in graph().items() for target in sorted(targets)
              if layer_of(target) < layer_of(module)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [module, target]) if target in path
                              else f"{module} -> {target}")
            elif target in edges and not state.get(target):
                visit(target, path + [module])
        state[module] = 2

    for module in sorted(edges):
        if not state.get(module):
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("source, expected", [
    ("from temper.scheduler.planning.loop import SchedulerLoop\n", {"temper.scheduler.planning.loop"}),
    ("if TYPE_CHECKING:\n    from temper.scheduler.api import servicer\n", {"temper.scheduler.api.servicer"}),
    ("def f():\n    import temper.scheduler.workers.backends\n", {"temper.scheduler.workers.backends"}),
])
def test_the_walk_sees_type_only_and_late_imports(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\n" + source)
    assert scheduler_imports(path, {"temper.scheduler.api.servicer"}) == expected
