"""The benchmark scripts of the GPU benchmark's CPU smoke run still run end to end and write every figure they promise
(bench_scripts.py says how; one file per theme so the test workers share them out)."""

from __future__ import annotations

import json
import subprocess
import sys

from bench_scripts import REPO


def test_gpu_benchmark_smoke_runs_on_the_trainer_numerics_without_grpc_protobuf_or_pydantic():
    # as on a GPU box without temper installed: the shim + torch/transformers only
    code = ("import runpy, sys\n"
            "sys.argv = ['gpu_multitenant.py', '--smoke']\n"
            "try:\n    runpy.run_path(sys.argv_path, run_name='__main__')\n"
            "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
            "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'pydantic', 'pydantic_settings')"
            " or m.startswith(('google.protobuf', 'temper.v1', 'temper.common'))))\n")
    code = code.replace("sys.argv_path", repr(str(REPO / "benchmarks" / "gpu_multitenant.py")))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "LOADED []"
    result = json.loads(lines[-2])
    assert result["ratios"]["cobatch_gain"] > 0 and result["config"]["numerics_module"].endswith("services/trainer/numerics.py")
