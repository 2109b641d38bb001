"""benchmarks/report.py (the one ratio/spread printer the co-batching benchmarks share) and the
benchmarks' import graph (no module imports one that imports it back, TYPE_CHECKING imports included)."""

import ast
import io
import statistics
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import report  # noqa: E402  (benchmarks/ is a script folder, not a package)


def test_cobatch_ratios_are_ratios_of_medians_and_paired_per_rep():
    co, single, sliced = [2.0, 4.0, 3.0], [1.0, 2.0, 3.0], [6.0, 8.0, 9.0]
    ratios, per_rep = report.cobatch_ratios(co, single, sliced)
    assert ratios == {"cobatch_overhead": statistics.median(co) / statistics.median(single),
                      "cobatch_gain": statistics.median(sliced) / statistics.median(co)}
    assert per_rep == {"cobatch_overhead": [2.0, 2.0, 1.0], "cobatch_gain": [3.0, 2.0, 3.0]}


def test_spread_quartiles_and_a_single_repetition():
    s = report.spread([1.0, 2.0, 3.0, 4.0, 5.0])
    q = statistics.quantiles([1.0, 2.0, 3.0, 4.0, 5.0], n=4)
    assert (s["min"], s["q1"], s["median"], s["q3"], s["max"]) == (1.0, q[0], 3.0, q[2], 5.0)
    assert report.spread([1.5]) == {"min": 1.5, "q1": 1.5, "median": 1.5, "q3": 1.5, "max": 1.5, "per_rep": [1.5]}


def test_goal_met_both_directions_and_no_value():
    assert report.goal_met(("<=", 1.1), 1.1) is True
    assert report.goal_met(("<=", 1.1), 1.2) is False
    assert report.goal_met((">=", 1.2), 1.3) is True
    assert report.goal_met((">=", 1.2), 1.1) is False
    assert report.goal_met((">=", 1.2), None) is None


def test_print_ratios_lines():
    out = io.StringIO()
    report.print_ratios(
        {"cobatch_overhead": 1.0834, "scheduler_overhead": None, "memory_ratio": 0.86},
        {"cobatch_overhead": ("<=", 1.15), "memory_ratio": "0.75-1.25"},
        {"cobatch_overhead": {"wall": True, "CPU time": False}, "memory_ratio": True},
        width=17, details={"cobatch_overhead": "per rep 1.0-1.2"}, file=out)
    assert out.getvalue().splitlines() == [
        "cobatch_overhead   1.083 (per rep 1.0-1.2)  (goal <= 1.15: wall met, CPU time MISSED)",
        "memory_ratio       0.860  (goal 0.75-1.25: met)",
    ]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_import_cycle_among_benchmarks():
    modules = {p.stem: p for p in BENCHMARKS.glob("*.py")}
    graph = {m: (_imports(p) & modules.keys()) - {m} for m, p in modules.items()}
    assert "scaleout_runs" in graph["scaleout_procs"] and "scaleout_load" not in graph["scaleout_procs"]
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph[module]):
            assert dep not in path, "import cycle: " + " -> ".join(path + [dep])
            if dep not in done:
                visit(dep, path + [dep])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])
