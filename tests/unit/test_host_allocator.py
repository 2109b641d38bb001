"""The trainer's malloc settings: what the re-exec environment holds, and that a process gets it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from temper.common.host_allocator import TUNED_MALLOC_ENV, is_glibc_linux, tuned_environ


def test_tuned_environ_adds_the_settings_and_keeps_the_users_own():
    env = tuned_environ({"PATH": "/bin", "MALLOC_TOP_PAD_": "0"})
    assert env["PATH"] == "/bin"
    assert env["MALLOC_TOP_PAD_"] == "0"  # set by the user: kept
    assert env["MALLOC_MMAP_THRESHOLD_"] == TUNED_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert env["MALLOC_TRIM_THRESHOLD_"] == TUNED_MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"]
    # after the re-exec (marker set) or with everything set there is nothing to do: no loop
    assert tuned_environ(env) is None
    assert tuned_environ(dict(TUNED_MALLOC_ENV)) is None


PROBE = """
import json, os, sys
from temper.common.host_allocator import reexec_with_tuned_allocator
reexec_with_tuned_allocator(sys.argv[1] == "on")
print(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in %r}}))
"""


def run_probe(flag: str) -> dict:
    code = PROBE % (list(TUNED_MALLOC_ENV),)
    env_cmd = [sys.executable, "-c", code, flag, "extra-arg"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "TEMPER_HOST_ALLOCATOR_TUNED"}
    out = subprocess.run(env_cmd, capture_output=True, text=True, env=clean, timeout=60, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_process_reexecutes_itself_with_the_settings_and_its_arguments():
    on, off = run_probe("on"), run_probe("off")
    assert on["argv"] == ["on", "extra-arg"] and off["argv"] == ["off", "extra-arg"]
    assert off["env"] == {k: None for k in TUNED_MALLOC_ENV}
    if is_glibc_linux():
        assert on["env"] == TUNED_MALLOC_ENV
    else:  # other C libraries do not read these variables; nothing to apply
        assert on["env"] == off["env"]
