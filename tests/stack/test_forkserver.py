"""temper/forkserver.py + temper/forked_process.py: a service forked from the warm process runs as
``python -m`` would run it — its own environment, working folder, output, exit code and signals — and
nothing it started outlives the process that asked for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from temper.forked_process import ForkServer, can_fork_into

PROBE = textwrap.dedent("""
    import os, sys, time
    print("env", os.environ.get("PROBE_VALUE"), "cwd", os.getcwd(), "main", __name__, flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    mode = os.environ.get("PROBE_MODE")
    if mode == "sleep":
        time.sleep(600)
    if mode == "message":
        sys.exit("refused: a message")
    if mode == "raise":
        raise ValueError("boom")
    sys.exit(int(os.environ.get("PROBE_CODE", "0")))
""")


@pytest.fixture(scope="module")
def probe_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("modules")
    (folder / "temper_probe.py").write_text(PROBE)
    return folder


def start_server(folder, probe_path):
    """A fork server of its own (not the worker's shared one) that can import the probe module."""
    patch = pytest.MonkeyPatch()
    patch.setenv("PYTHONPATH", f"{probe_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    try:
        forks = ForkServer(folder)
        forks.spawn("temper_probe", {"PATH": os.environ["PATH"]}, folder / "warm.log").wait(timeout=120)  # started now
    finally:
        patch.undo()
    return forks


@pytest.fixture(scope="module")
def server(tmp_path_factory, probe_path):
    """One fork server for the module's probes (each start imports torch once more)."""
    forks = start_server(tmp_path_factory.mktemp("server"), probe_path)
    yield forks
    forks.stop()


def spawn(server, tmp_path, name: str, **env):
    log = tmp_path / f"{name}.log"
    log.touch()  # the child appends to it once it runs
    return server.spawn("temper_probe", {"PATH": os.environ["PATH"], **env}, log), log


def test_a_forked_module_runs_as_main_with_its_own_env_cwd_output_and_exit_code(server, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    process, log = spawn(server, tmp_path, "code", PROBE_VALUE="seven", PROBE_CODE="3")
    assert process.wait(timeout=60) == 3 and process.poll() == 3
    text = log.read_text()
    assert f"env seven cwd {work} main __main__" in text and "to stderr" in text
    assert "PROBE_VALUE" not in os.environ  # the child's environment is its own


@pytest.mark.parametrize(("mode", "code", "printed"), [("message", 1, "refused: a message"), ("raise", 1, "ValueError: boom"),
                                                       (None, 0, "env None")])
def test_exits_read_as_the_interpreter_reports_them(server, tmp_path, mode, code, printed):
    process, log = spawn(server, tmp_path, f"mode-{mode}", **({"PROBE_MODE": mode} if mode else {}))
    assert process.wait(timeout=60) == code
    assert printed in log.read_text()


def test_signals_reach_the_child_and_its_exit_reads_negative_as_popen_does(server, tmp_path):
    process, _ = spawn(server, tmp_path, "sleeper", PROBE_MODE="sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.3)
    process.send_signal(signal.SIGSTOP)
    process.send_signal(signal.SIGCONT)
    process.kill()
    assert process.wait(timeout=30) == -signal.SIGKILL
    process.kill()  # a second signal to an ended process changes nothing


def test_children_end_with_the_server(probe_path, tmp_path):
    server = start_server(tmp_path / "own-server", probe_path)
    process, log = spawn(server, tmp_path, "orphan", PROBE_MODE="sleep")
    deadline = time.monotonic() + 60
    while "env" not in log.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.stop()
    deadline = time.monotonic() + 30
    while True:
        try:
            os.kill(process.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the forked child outlived its fork server"
        time.sleep(0.05)


def test_settings_the_warm_process_cannot_honour_are_started_with_python_m():
    assert can_fork_into({"TEMPER_TRAINER_BASE_MODEL": "x"})
    assert not can_fork_into({"TEMPER_TRAINER_TUNE_HOST_ALLOCATOR": "false"})
    assert not can_fork_into({"MALLOC_TOP_PAD_": "0"})


def test_localstack_forks_its_services_when_asked(stack):
    """The session stack of this worker (tests/conftest.py turns the fork server on): services are
    children of the fork server, not of the test process."""
    from temper.forked_process import ForkedProcess

    assert all(isinstance(s.process, ForkedProcess) for s in stack.services)
    assert os.getppid() != stack.service("trainer").process.pid
    assert int(open(f"/proc/{stack.service('trainer').process.pid}/stat").read().split()[3]) != os.getpid()
    assert sys.executable  # the fork server runs this interpreter
