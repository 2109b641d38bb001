"""The benchmarks' memory child reads its own peak RSS, not its parent's: getrusage's ru_maxrss keeps
the peak of the forked copy across exec, so under a big parent it read the parent's peak and no growth."""

import argparse
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PARENT_MIB = 1024


def test_memory_child_measures_its_own_peak_under_a_bigger_parent(family_dirs):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import harness
    finally:
        sys.path.remove(str(BENCHMARKS))
    held = b"\x01" * (PARENT_MIB << 20)  # touched pages: this process's peak is at least this
    args = argparse.Namespace(model=str(family_dirs["llama"]), device="cpu", dtype="float32", threads=1,
                              memory_tokens=64, no_activation_checkpointing=False, checkpoint_min_tokens=None)
    result = harness.run_memory_child(args, "chunked")
    assert len(held) == PARENT_MIB << 20
    # the tiny model's child (torch and all) peaks near 400 MiB; with ru_maxrss it read the parent's >= 1 GiB
    assert result["peak_reset"]
    assert result["load_peak_rss_kb"] < (PARENT_MIB << 10) * 3 // 4
    assert 0 < result["delta_rss_kb"] < result["peak_rss_kb"] < (PARENT_MIB << 10) * 3 // 4
