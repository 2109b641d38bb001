"""glibc malloc settings for a process that trains with torch on the CPU.

PyTorch's CPU tensors come straight from malloc. With glibc's defaults, blocks above the dynamic
mmap threshold (at most 32 MiB) are fresh mmaps and freed heap tops are trimmed back to the
kernel, so every training pass page-faults, and the kernel zeroes, much of its activation set
again; the bigger the pass, the larger the share (measured in benchmarks/multitenant.py: a
co-batched 8-tenant pass ran 20-30% slower and far noisier than with these settings). The settings
below make the heap behave like a caching allocator: a fixed 32 MiB mmap threshold, no trimming,
and a 512 MiB top pad. The cost is that RSS stays at its high-water mark, as a CUDA caching
allocator's reserved memory does.

glibc reads these variables once, at start-up, so a process applies them by re-executing itself
(before it imports torch). Variables that are already set are left as they are.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Mapping

log = logging.getLogger("temper.allocator")

TUNED_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
    "MALLOC_TOP_PAD_": str(512 << 20),
}
# Set after the re-exec, so a process that cannot apply the settings never loops.
_MARKER = "TEMPER_HOST_ALLOCATOR_TUNED"


def tuned_environ(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with, or None when there is nothing to change."""
    if environ.get(_MARKER) or all(name in environ for name in TUNED_MALLOC_ENV):
        return None
    return {**TUNED_MALLOC_ENV, **environ, _MARKER: "1"}


def is_glibc_linux() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def reexec_with_tuned_allocator(enabled: bool = True) -> None:
    """Replace this process with itself under TUNED_MALLOC_ENV (glibc Linux only; returns otherwise)."""
    if not enabled or not is_glibc_linux():
        return
    env = tuned_environ(os.environ)
    if env is None:
        return
    argv = [sys.executable, *sys.orig_argv[1:]]
    log.debug("re-executing with %s", {k: env[k] for k in TUNED_MALLOC_ENV})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
