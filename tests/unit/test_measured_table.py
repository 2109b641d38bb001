"""docs/measured.md stays a table a reader can scan (issue 34): one row per figure with six short
cells, history kept in docs/measured-history.md, and the README's pointer landing on the table."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ROOT / "docs" / "measured.md"
COLUMNS = ["figure", "value today", "goal", "command", "date", "machine"]
MAX_CELL = 300


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _rows() -> list[list[str]]:
    lines = [l for l in MEASURED.read_text().splitlines() if l.startswith("|")]
    assert _cells(lines[0]) == COLUMNS, lines[0]
    assert set("".join(_cells(lines[1]))) <= {"-", ":"}, lines[1]
    return [_cells(l) for l in lines[2:]]


def test_every_row_has_six_short_cells():
    rows = _rows()
    assert len(rows) >= 20
    for row in rows:
        assert len(row) == len(COLUMNS), row[0]
        for cell in row:
            assert cell, f"empty cell in row {row[0]!r}"
            assert len(cell) <= MAX_CELL, f"{len(cell)} characters in row {row[0]!r}: {cell[:80]}…"


def test_every_row_is_dated():
    for row in _rows():
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row[COLUMNS.index("date")]), row[0]


def test_relative_links_resolve():
    # History moved out of the table; a link that no longer lands is history lost.
    text = MEASURED.read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (MEASURED.parent / target).exists(), target


def test_history_anchor_exists():
    anchors = re.findall(r"measured-history\.md#([\w-]+)", MEASURED.read_text())
    headings = (ROOT / "docs" / "measured-history.md").read_text().splitlines()
    slugs = {
        re.sub(r"[^\w\- ]", "", h.lstrip("#").strip().lower()).replace(" ", "-")
        for h in headings
        if h.startswith("#")
    }
    assert anchors
    for anchor in anchors:
        assert anchor in slugs, anchor


def test_readme_points_at_the_table():
    readme = (ROOT / "README.md").read_text()
    assert "docs/measured.md#figures" in readme
