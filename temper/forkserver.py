"""A warm parent for LocalStack's services: imports torch, transformers and the services' modules once,
then forks each service on request (`python -m temper.forkserver`).

Why: a trainer or sampler spends ~4 CPU-seconds importing torch and transformers before it does anything,
and the test suite starts a few hundred of them on two cores. A child forked from this process runs the
service's own ``__main__`` under the service's own environment, exactly as ``python -m`` would, minus
the imports. LocalStack uses it only where asked (``TEMPER_LOCALSTACK_FORKSERVER=1``; the tests set it);
`make serve`, the demo, compose and every deployment start services with ``python -m``.

Protocol, one JSON object per line: stdin ``{"module", "env", "cwd", "log", "exit"}`` -> stdout ``{"pid"}``.
The child appends its stdout and stderr to ``log``; when it ends, its exit code (negative: the signal,
as subprocess reports it) is written to ``exit``. EOF on stdin stops the children still running, then
this process.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import signal
import sys
import traceback

# What every service imports at start (the services import lazily, after their settings are read).
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen3.modeling_qwen3",
           "temper.services.models.loading",
           "temper.services.trainer.engine", "temper.services.trainer.servicer", "temper.services.sampler.torch_backend",
           "temper.services.sampler.servicer", "temper.common.server", "temper.common.metrics", "temper.scheduler.app",
           "temper.services.gateway.app")

_exit_paths: dict[int, str] = {}


def preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)


def _write_exit(pid: int, code: int) -> None:
    path = _exit_paths.pop(pid, None)
    if path:
        with open(f"{path}.tmp", "w") as out:
            out.write(str(code))
        os.replace(f"{path}.tmp", path)  # the reader never sees half a number


def _reap(signum=None, frame=None) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _write_exit(pid, os.waitstatus_to_exitcode(status))


def _run_child(request: dict) -> None:
    """In the forked child: become the service. Never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the service's own subprocesses are its business
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})  # blocked by serve() around the fork
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(0, closefd=False)
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True, line_buffering=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True, line_buffering=True,
                                      errors="backslashreplace")
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:  # as the interpreter reports it: a number, or a message and 1
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as an uncaught exception would be
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(stdin=sys.stdin, stdout=sys.stdout) -> None:
    signal.signal(signal.SIGCHLD, _reap)
    for line in stdin:
        request = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # the pid is recorded before it can be reaped
        try:
            pid = os.fork()
            if pid == 0:
                _run_child(request)
            _exit_paths[pid] = request["exit"]
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        stdout.write(json.dumps({"pid": pid}) + "\n")
        stdout.flush()
    for pid in list(_exit_paths):  # our parent went away: so do the services it started
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> None:
    preload()
    print(json.dumps({"ready": True}), flush=True)
    serve()


if __name__ == "__main__":
    main()
