"""docker-compose.yml read as compose reads it, then mapped onto one host (tests/stack/compose_processes.py).

Compose gives each service its own container: its own address, ports, file system and volumes. Here
every service is a local process, so the mapping is derived from the file alone:

- `${VAR}`, `${VAR:?msg}`, `${VAR:-default}` ... are interpolated from the environment the test gives
  (a required variable that is missing fails, as `docker compose` does);
- a service name or network alias followed by `:port`, and a service's own `0.0.0.0:port` or
  `127.0.0.1:port`, become `127.0.0.1:<a free local port>`, one per (service, container port); an alias
  of several services (`dns:///schedulers:50051`) becomes the list of their local addresses;
- a URL naming a service the test provides (postgres) becomes the test's URL for it;
- an absolute path under a volume's mount becomes that volume's folder; any other absolute path a
  folder of the service's own (its container's file system);
- `python` and the console scripts run from this virtual environment; the image's ENV (Dockerfile)
  comes first, then the service's `environment`.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from free_ports import free_port

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
LOOPBACK = "127.0.0.1"
OWN_HOSTS = ("0.0.0.0", "127.0.0.1", "localhost")
_INTERPOLATION = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_ABSOLUTE_PATH = re.compile(r"^/[^\s:,]*$")


class ComposeError(RuntimeError):
    """The compose file cannot be read or run as written."""


def interpolate(value, environ: dict[str, str]):
    """Compose's variable substitution over every string of ``value`` (lists and maps too)."""
    if isinstance(value, dict):
        return {key: interpolate(item, environ) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, environ) for item in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, argument = match.group(1) or match.group(4), match.group(2), match.group(3) or ""
        current = environ.get(name)
        unset = current is None or (operator is not None and operator.startswith(":") and current == "")
        if operator in ("?", ":?") and unset:
            raise ComposeError(f"required variable {name} is missing a value: {argument}")
        if operator in ("-", ":-") and unset:
            return argument
        if operator in ("+", ":+"):
            return "" if unset else argument
        return current or ""

    return _INTERPOLATION.sub(one, value)


def as_list(command) -> list[str]:
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def as_env(environment) -> dict[str, str]:
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) if "=" in item else (item, "") for item in environment)
    return {str(k): "" if v is None else str(v) for k, v in (environment or {}).items()}


def image_env(dockerfile: Path) -> dict[str, str]:
    """The ENV of the image (``ENV KEY=VALUE ...`` instructions, continuation lines joined)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    env: dict[str, str] = {}
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if len(words) == 2 and words[0].upper() == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(words[1]) if "=" in pair)
    return env


def duration(text, default: float) -> float:
    """Compose's durations: ``10s``, ``1m30s``, ``500ms``."""
    if text is None:
        return default
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(text))
    if not parts:
        raise ComposeError(f"not a compose duration: {text!r}")
    return sum(float(number) * units[unit] for number, unit in parts)


@dataclass
class HostMapping:
    """Where each service's names, ports, volumes and folders land on this host."""

    services: dict                        # the compose file's services, interpolated
    root: Path                            # tmp folder: volumes/<name>, rootfs/<service>
    provided: dict[str, str]              # service -> the URL the test provides instead (postgres)
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    provided_as: dict[str, str] = field(default_factory=dict)  # provided service -> the URL compose gives it

    def __post_init__(self):
        names = {*self.services, *OWN_HOSTS}
        for name in self.services:
            names.update(alias for aliases in self.networks_of(name).values() for alias in aliases)
        hosts = sorted(names, key=len, reverse=True)
        self._address = re.compile(r"(dns:///)?(?<![\w.-])(" + "|".join(map(re.escape, hosts)) + r"):(\d+)(?![\d])")
        self._url = re.compile(r"^[a-z][\w+.-]*://(?:[^@/]*@)?(" + "|".join(map(re.escape, self.provided or ["-"])) + r")[:/]")

    def networks_of(self, service: str) -> dict[str, list[str]]:
        """network -> the service's aliases on it (compose's `default` network where it names none)."""
        networks = self.services[service].get("networks") or ["default"]
        if isinstance(networks, list):
            return {net: [] for net in networks}
        return {net: list((spec or {}).get("aliases") or ()) for net, spec in networks.items()}

    def resolve(self, service: str, host: str) -> list[str]:
        """The services ``host`` names from ``service``: compose's DNS answers a service name or an alias
        only on a network both are on."""
        if host in OWN_HOSTS:
            return [service]
        mine = self.networks_of(service)
        found = [other for other in self.services
                 if any(net in mine and (host == other or host in aliases) for net, aliases in self.networks_of(other).items())]
        if not found:
            raise ComposeError(f"{service} names {host}, which no service on its networks ({', '.join(mine)}) answers to")
        return found

    def port(self, service: str, container_port: int) -> int:
        """The local port standing for ``service``'s ``container_port`` (allocated on first use)."""
        key = (service, int(container_port))
        while key not in self.ports:
            port = free_port()
            if port not in self.ports.values():  # none bound yet: the same number could come twice
                self.ports[key] = port
        return self.ports[key]

    def address(self, service: str, container_port: int) -> str:
        return f"{LOOPBACK}:{self.port(service, container_port)}"

    def text(self, service: str, value: str) -> str:
        """``value`` (an env value, a command word) as seen from ``service``: addresses and URLs mapped."""
        provided = self._url.match(value)
        if provided:  # one test server stands for the service: every service must name the same database on it
            self.resolve(service, provided.group(1))  # reachable from here, as any name
            first = self.provided_as.setdefault(provided.group(1), value)
            if value != first:
                raise ComposeError(f"{service} reaches {provided.group(1)} as {value}, another service as {first}")
            return self.provided[provided.group(1)]

        def one(match: re.Match) -> str:
            host, port = match.group(2), int(match.group(3))
            targets = self.resolve(service, host)
            if len(targets) == 1:
                return (match.group(1) or "") + self.address(targets[0], port)
            # a name of several services (DNS answers each one's address): the list of their addresses
            return ",".join(self.address(target, port) for target in targets)

        return self._address.sub(one, value)

    def volume_dir(self, name: str) -> Path:
        path = self.root / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def mounts(self, service: str) -> list[tuple[str, Path]]:
        """(container path, host folder) of each of ``service``'s volumes, longest path first."""
        found = []
        for volume in self.services[service].get("volumes") or ():
            source, target = (volume["source"], volume["target"]) if isinstance(volume, dict) else str(volume).split(":")[:2]
            host = (REPO / source).resolve() if source.startswith((".", "/")) else self.volume_dir(source)
            found.append((target.rstrip("/") or "/", host))
        return sorted(found, key=lambda mount: len(mount[0]), reverse=True)

    def path(self, service: str, value: str) -> str:
        """An absolute container path of ``service`` on this host (other values unchanged)."""
        if not _ABSOLUTE_PATH.match(value):
            return value
        for target, host in self.mounts(service):
            if value == target or value.startswith(target + "/"):
                return str(host / value[len(target):].lstrip("/"))
        private = self.root / "rootfs" / service / value.lstrip("/")
        private.parent.mkdir(parents=True, exist_ok=True)
        return str(private)

    def env(self, service: str, base: dict[str, str]) -> dict[str, str]:
        """``base`` (the image's ENV) then the service's environment, each value mapped."""
        merged = {**base, **as_env(self.services[service].get("environment"))}
        return {key: self.path(service, self.text(service, value)) for key, value in merged.items()}

    def argv(self, service: str, words: list[str]) -> list[str]:
        """A command of ``service``: python and console scripts from this venv, addresses mapped."""
        if not words:
            raise ComposeError(f"{service}: no command (the image's CMD is not run here)")
        first = words[0]
        program = sys.executable if first == "python" or re.fullmatch(r"python3(\.\d+)?", first) else (
            str(VENV_BIN / first) if (VENV_BIN / first).is_file() else first)
        return [program, *(self.text(service, word) for word in words[1:])]


def load_compose(path: Path, environ: dict[str, str]) -> dict:
    with open(path) as handle:
        return interpolate(yaml.safe_load(handle), environ)


def selected(services: dict, profiles: set[str], scale_zero: set[str] = frozenset()) -> list[str]:
    """The services `docker compose --profile ... up --scale X=0` starts, in file order."""
    return [name for name, service in services.items()
            if (not service.get("profiles") or set(service["profiles"]) & profiles) and name not in scale_zero]


def documented_up(text: str, profile: str) -> set[str]:
    """Services the compose file's own `docker compose --profile <profile> up ... --scale X=0` line scales to 0."""
    for line in text.splitlines():
        if re.search(rf"docker compose .*--profile {re.escape(profile)}\b.* up\b", line):
            return set(re.findall(r"--scale ([\w.-]+)=0\b", line))
    return set()
