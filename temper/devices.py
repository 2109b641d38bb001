"""Device specs for the memory planner (``python -m temper.plan --devices 8x141GiB``): how many
devices of how much memory, parsed from one string."""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 1 << 30
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
DEVICE_KINDS = ("cuda", "gpu", "cpu")
_DEVICE_RE = re.compile(r"^(?:(?P<kind>[a-z]+):)?(?:(?P<count>\d+)\s*[x\*]\s*)?(?P<size>\d+(?:\.\d+)?)\s*(?P<unit>[a-z]+)$")


@dataclass(frozen=True)
class Devices:
    count: int
    bytes_each: int
    kind: str = "cuda"      # "cuda" or "cpu"

    def __str__(self) -> str:
        return f"{self.kind}:{self.count}x{self.bytes_each / GIB:g}GiB"


def parse_devices(spec: str) -> Devices:
    """``8x141GiB``, ``2x80GB``, ``cpu:2x24GiB``, ``141GiB`` (one device). Units: B, KB/MB/GB/TB
    (powers of 10) and KiB/MiB/GiB/TiB (powers of 2). ValueError saying what is wrong."""
    text = spec.strip().lower()
    match = _DEVICE_RE.match(text)
    example = "expected [kind:]COUNTxSIZEUNIT, e.g. 8x141GiB, 2x80GB, cpu:2x24GiB"
    if not match:
        raise ValueError(f"device spec {spec!r}: {example}")
    kind = match["kind"] or "cuda"
    if kind not in DEVICE_KINDS:
        raise ValueError(f"device spec {spec!r}: kind {kind!r} is not one of {list(DEVICE_KINDS)}")
    unit = match["unit"]
    if unit not in UNITS:
        raise ValueError(f"device spec {spec!r}: unit {unit!r} is not one of GiB, GB, MiB, MB, TiB, TB, KiB, KB, B")
    count = int(match["count"]) if match["count"] is not None else 1
    if count < 1:
        raise ValueError(f"device spec {spec!r}: device count {count} must be at least 1")
    size = int(float(match["size"]) * UNITS[unit])
    if size <= 0:
        raise ValueError(f"device spec {spec!r}: device memory {match['size']}{unit} must be above 0")
    return Devices(count, size, "cuda" if kind == "gpu" else kind)
