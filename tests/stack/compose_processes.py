"""docker-compose.yml's services as local processes, started as `docker compose up` would start them.

`ComposeProject.up(names)` launches each service once its `depends_on` conditions hold
(service_started, service_healthy: its own healthcheck passes, service_completed_successfully: it
exited 0), and returns when every one is up: healthy by its healthcheck where it has one, exited 0
where it is a one-shot (`restart: "no"`), else running. A service that exits otherwise, or whose
healthcheck does not pass within compose's own allowance (start_period + interval x retries, capped), raises
ComposeError with its stderr tail. Each process leads its own process group; `down` ends the groups.
How names, ports, paths and programs are mapped: compose_model.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from compose_model import REPO, VENV_BIN, ComposeError, HostMapping, as_list, duration, image_env, load_compose

PROBE_EVERY = 1.0  # seconds between health probes: compose's intervals are minutes of idle on a test
MAX_ALLOWANCE = 180.0  # seconds: a wrong healthcheck fails the test in minutes, not compose's six (the trainer's)
STOP_GRACE = 10.0  # seconds a process group gets after SIGTERM before SIGKILL (compose's default)


@dataclass
class Running:
    name: str
    process: subprocess.Popen
    logs: Path
    started: float
    healthy: bool = False
    next_probe: float = 0.0
    last_probe: str = ""
    probe: subprocess.Popen | None = None  # the healthcheck running now
    probe_started: float = 0.0

    def tail(self, stream: str = "err", chars: int = 4000) -> str:
        path = self.logs / f"{self.name}.{stream}"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


@dataclass
class ComposeProject:
    compose_file: Path
    root: Path                          # tmp folder for volumes, containers' file systems and logs
    environ: dict[str, str]             # what `docker compose` interpolates from (the user's shell)
    provided: dict[str, str]            # services the test provides, by the URL that replaces theirs
    running: dict[str, Running] = field(default_factory=dict)
    stopped: list[Running] = field(default_factory=list)

    def __post_init__(self):
        self.text = self.compose_file.read_text()
        self.compose = load_compose(self.compose_file, self.environ)
        self.services = self.compose["services"]
        self.networks = self.compose.get("networks") or {}
        self.mapping = HostMapping(self.services, self.root, self.provided)
        self.logs = self.root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    # ---- what one service runs as -------------------------------------------------------------
    def env(self, name: str) -> dict[str, str]:
        """The process environment of ``name``: a container's (PATH, HOME) with the image's ENV, then
        the service's environment, mapped; no route out (offline hub) where compose gives it none."""
        service = self.services[name]
        home = Path(self.mapping.path(name, "/root"))
        home.mkdir(parents=True, exist_ok=True)
        env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(home),
               "LANG": "C.UTF-8"}
        build = service.get("build")
        base = {}
        if build is not None:
            context = REPO / (build if isinstance(build, str) else build.get("context", "."))
            base = image_env(context / ("Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")))
        networks = service.get("networks") or ["default"]
        if all((self.networks.get(net) or {}).get("internal") for net in networks):
            env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # an `internal: true` network has no route out
        return {**env, **self.mapping.env(name, base)}

    def healthcheck(self, name: str) -> list[str] | None:
        """The argv of ``name``'s healthcheck test, mapped; None where it has none."""
        check = self.services[name].get("healthcheck") or {}
        test = check.get("test")
        if not test or check.get("disable") or test == ["NONE"]:
            return None
        if isinstance(test, str) or test[0] == "CMD-SHELL":
            shell = test if isinstance(test, str) else " ".join(test[1:])
            return ["/bin/sh", "-c", self.mapping.text(name, shell)]
        if test[0] != "CMD":
            raise ComposeError(f"{name}: healthcheck test must start with CMD or CMD-SHELL: {test}")
        return self.mapping.argv(name, test[1:])

    def allowance(self, name: str) -> float:
        """Seconds compose waits for ``name`` to turn healthy before calling it unhealthy, at most
        MAX_ALLOWANCE (compose's are sized for the real model's first start, not the tiny one's)."""
        check = self.services[name].get("healthcheck") or {}
        compose = (duration(check.get("start_period"), 0.0) + duration(check.get("interval"), 30.0) * int(check.get("retries", 3))
                   + duration(check.get("timeout"), 30.0))
        return min(compose, MAX_ALLOWANCE)

    def one_shot(self, name: str) -> bool:
        return str(self.services[name].get("restart", "no")) == "no"

    # ---- up / stop / down ---------------------------------------------------------------------
    def up(self, names: list[str]) -> None:
        """Start every service of ``names`` not running yet, in dependency order; return once all are up."""
        pending = [name for name in names if name not in self.running]
        for name in pending:
            for dep in self._depends(name):
                if dep not in names and dep not in self.running and dep not in self.provided:
                    raise ComposeError(f"{name} depends on {dep}, which is not among the services started")
        began = time.monotonic()
        while True:
            for name in list(pending):
                if all(self._condition_met(dep, condition) for dep, condition in self._depends(name).items()):
                    self._launch(name)
                    pending.remove(name)
            self._probe_and_check()
            if pending and time.monotonic() - began > MAX_ALLOWANCE:  # e.g. waiting on a service that never exits
                raise ComposeError(f"never started, their depends_on unmet after {MAX_ALLOWANCE:.0f} s: "
                                   + "; ".join(f"{name}: {self._depends(name)}" for name in pending))
            if not pending and all(self._is_up(name) for name in names):
                return
            time.sleep(0.2)

    def stop(self, name: str) -> None:
        """`--scale name=0`: end ``name``'s process group."""
        service = self.running.pop(name)
        self.stopped.append(service)
        _end_groups([service])

    def down(self) -> list[str]:
        """End every process group, newest first; returns the names of any group still alive after SIGKILL."""
        services = [*reversed(list(self.running.values())), *self.stopped]
        self.running.clear()
        self.stopped.clear()
        return _end_groups(services)

    # ---- internals ----------------------------------------------------------------------------
    def _depends(self, name: str) -> dict[str, str]:
        depends = self.services[name].get("depends_on") or {}
        if isinstance(depends, list):
            return {dep: "service_started" for dep in depends}
        return {dep: (spec or {}).get("condition", "service_started") for dep, spec in depends.items()}

    def _condition_met(self, dep: str, condition: str) -> bool:
        if dep in self.provided:
            return True  # the test's own server (Postgres) is up before the project starts
        service = self.running.get(dep)
        if service is None:
            return False
        if condition == "service_started":
            return True
        if condition == "service_healthy":
            if self.healthcheck(dep) is None:
                raise ComposeError(f"a service waits for {dep} to be healthy, but {dep} has no healthcheck")
            return service.healthy
        if condition == "service_completed_successfully":
            return service.process.poll() == 0
        raise ComposeError(f"unknown depends_on condition {condition!r} (on {dep})")

    def _launch(self, name: str) -> None:
        argv = self.mapping.argv(name, as_list(self.services[name].get("command")))
        with open(self.logs / f"{name}.out", "wb") as out, open(self.logs / f"{name}.err", "wb") as err:
            process = subprocess.Popen(argv, cwd=REPO, env=self.env(name), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                       start_new_session=True)  # its own process group: ended whole
        self.running[name] = Running(name, process, self.logs, time.monotonic())

    def _is_up(self, name: str) -> bool:
        service = self.running[name]
        if self.one_shot(name):
            return service.process.poll() == 0
        return service.healthy if self.healthcheck(name) is not None else service.process.poll() is None

    def _probe_and_check(self) -> None:
        """Fails on any service that exited (a one-shot: other than 0) or outlived its health allowance;
        probes those not healthy yet."""
        now = time.monotonic()
        for name, service in list(self.running.items()):
            code = service.process.poll()
            if code is not None and not (code == 0 and self.one_shot(name)):
                self._fail(service, f"exited with code {code}")
            if self.healthcheck(name) is None or service.healthy:
                continue
            if now - service.started > self.allowance(name):
                self._fail(service, f"not healthy after {self.allowance(name):.0f} s (compose's start_period + "
                                    f"interval x retries, at most {MAX_ALLOWANCE:.0f} s); last probe: {service.last_probe}")
            self._probe(name, service, now)

    def _probe(self, name: str, service: Running, now: float) -> None:
        """Runs ``name``'s healthcheck in the background (one at a time per service), reads its result when done."""
        check = self.services[name]["healthcheck"]
        if service.probe is not None:
            code = service.probe.poll()
            if code is None and now - service.probe_started < duration(check.get("timeout"), 30.0):
                return
            if code is None:
                service.probe.kill()
                service.last_probe = "timed out"
            else:
                service.healthy = code == 0
                service.last_probe = f"exit {code}: {service.probe.communicate()[0].strip()[-500:]}"
            service.probe.wait()
            service.probe = None
            service.next_probe = now + min(PROBE_EVERY, duration(check.get("interval"), 30.0))
        elif now >= service.next_probe:
            service.probe = subprocess.Popen(self.healthcheck(name), cwd=REPO, env=self.env(name), stdin=subprocess.DEVNULL,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            service.probe_started = now

    def _fail(self, service: Running, reason: str) -> None:
        command = " ".join(as_list(self.services[service.name].get("command")))
        raise ComposeError(f"compose service {service.name} ({command}) did not come up: {reason}\n"
                           f"--- its stderr, last lines ---\n{service.tail('err')}\n"
                           f"--- its stdout, last lines ---\n{service.tail('out', 1000)}")


def _end_groups(services: list[Running]) -> list[str]:
    """SIGTERM each process group, SIGKILL what is left after STOP_GRACE; the names of groups still alive."""
    for service in services:
        if service.probe is not None:  # a healthcheck still running: our child, not in the group
            service.probe.kill()
            service.probe.wait()
        _signal_group(service, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for service in services:
        try:
            service.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for service in services:
        _signal_group(service, signal.SIGKILL)  # the leader and anything it started
        try:
            service.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    alive_until = time.monotonic() + 5.0
    alive = [s for s in services if _group_alive(s)]
    while alive and time.monotonic() < alive_until:
        time.sleep(0.1)
        alive = [s for s in alive if _group_alive(s)]
    return [s.name for s in alive]


def _signal_group(service: Running, sig: int) -> None:
    try:
        os.killpg(service.process.pid, sig)  # start_new_session: the group id is the leader's pid
    except ProcessLookupError:
        pass


def _group_alive(service: Running) -> bool:
    try:
        os.killpg(service.process.pid, 0)
    except ProcessLookupError:
        return False
    return True
