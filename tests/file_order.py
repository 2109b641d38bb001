"""Longest file first: `make test` hands whole files to the workers (--dist loadfile, with
--no-loadscope-reorder so xdist keeps our order instead of putting files with many tests first).
A long file that starts last runs alone while the other workers idle; handing out files longest first
(the LPT rule) keeps the end of the run short.

Durations come from tests/file_durations.json (seconds per file, from a whole run with
``--record-file-durations tests/file_durations.json``). A file missing from it (a new one) counts as
NEW_FILE_SECONDS. Stale numbers only cost time, never correctness.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).with_name("file_durations.json")
NEW_FILE_SECONDS = 20.0


def file_key(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def longest_first(items: list, durations: dict[str, float]) -> None:
    """Sort pytest items in place by their file's duration, longest first; stable within a file."""
    items.sort(key=lambda item: -durations.get(file_key(item.nodeid), NEW_FILE_SECONDS))


class DurationRecorder:
    """Sums each file's setup + call + teardown seconds from the test reports (on the xdist
    controller too: it receives every worker's reports) and writes them at the end of the run."""

    def __init__(self, path: Path):
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[file_key(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session) -> None:
        if hasattr(session.config, "workerinput"):  # a worker: the controller writes the file
            return
        rounded = {name: round(value, 1) for name, value in sorted(self.seconds.items())}
        self.path.write_text(json.dumps(rounded, indent=1) + "\n")
