"""docker-compose.yml: it validates, and it keeps the production topology's invariants.

Needs Debian's ``docker-compose`` (skipped without it, except under ``CI=true`` where it fails).
The resolved configuration is read as JSON: with PyYAML if this interpreter has it, else with
``docker-compose config --format json`` (Compose v2), else with the system Python that runs
Debian's docker-compose (python3-yaml is one of its dependencies). No Docker daemon is needed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
TIERS = ("critical", "default", "bulk")
WORKERS = tuple(f"worker-{tier}" for tier in TIERS)

# Dummy values for every ${VAR:?...} the compose file requires.
DUMMY_ENV = {
    "REDIS_PASSWORD": "dummy-redis-password",
    "MONGO_USER": "dummy-mongo-user",
    "MONGO_PASSWORD": "dummy-mongo-password",
    "FLOWER_USER": "dummy-flower-user",
    "FLOWER_PASSWORD": "dummy-flower-password",
    "GRAFANA_ADMIN_PASSWORD": "dummy-grafana-password",
}

SUBPROCESS_TIMEOUT = 120


def _docker_compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        reason = "docker-compose is not installed (apt-get install docker-compose)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason}; CI=true requires it")
        pytest.skip(reason)
    return path


def _compose(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run docker-compose on our file with every profile and dummy secrets.

    An empty --env-file keeps a developer's real .env out of the run (and out of any output).
    """
    empty_env_file = tmp_path / "empty.env"
    empty_env_file.write_text("")
    env = {**os.environ, **DUMMY_ENV}
    argv = [
        _docker_compose(),
        "-f",
        str(COMPOSE_FILE),
        "--project-directory",
        str(ROOT),
        "--env-file",
        str(empty_env_file),
        "--profile",
        "monitoring",
        *args,
    ]
    return subprocess.run(
        argv,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )


def _yaml_python(compose_path: str) -> str | None:
    """A Python with PyYAML: the interpreter of Debian's docker-compose script, or the system's."""
    candidates = []
    with open(compose_path, "rb") as script:
        first = script.readline().decode(errors="replace").strip()
    if first.startswith("#!") and "python" in first:
        candidates.append(first[2:].split()[0])
    candidates.append("/usr/bin/python3")
    for python in candidates:
        if (
            Path(python).is_file()
            and subprocess.run(
                [python, "-c", "import yaml"],
                capture_output=True,
                timeout=SUBPROCESS_TIMEOUT,
                check=False,
            ).returncode
            == 0
        ):
            return python
    return None


def _resolved_config(tmp_path: Path) -> dict[str, Any]:
    """The configuration as docker-compose resolves it (anchors merged, variables set)."""
    result = _compose("config", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    try:
        import yaml
    except ImportError:
        pass
    else:
        loaded: dict[str, Any] = yaml.safe_load(result.stdout)
        return loaded

    # Compose v2 only; v1 prints its usage instead (and may still exit 0).
    as_json = _compose("config", "--format", "json", tmp_path=tmp_path)
    if as_json.returncode == 0:
        try:
            loaded = json.loads(as_json.stdout)
        except ValueError:
            pass
        else:
            return loaded

    python = _yaml_python(_docker_compose())
    if python is None:
        pytest.skip(
            "no way to parse YAML: no PyYAML here, no `config --format json`, "
            "no system python3 with yaml"
        )
    converted = subprocess.run(
        [python, "-c", "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"],
        input=result.stdout,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )
    assert converted.returncode == 0, converted.stderr
    loaded = json.loads(converted.stdout)
    return loaded


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    config = _resolved_config(tmp_path_factory.mktemp("compose"))
    found: dict[str, Any] = config["services"]
    return found


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    if isinstance(command, str):
        return shlex.split(command)
    return list(command or [])


def _host_ips(service: dict[str, Any]) -> list[str]:
    """The host address of each published port ("" means every interface)."""
    ips = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):  # long syntax (what Compose v2 prints)
            if port.get("published") in (None, ""):
                continue  # container port only, nothing published
            ips.append(str(port.get("host_ip") or ""))
            continue
        spec = str(port).split("/", 1)[0]
        if spec.startswith("["):  # [ipv6]:host:container
            ips.append(spec[1 : spec.index("]")])
            continue
        parts = spec.split(":")
        ips.append(parts[0] if len(parts) == 3 else "")
    return ips


def test_compose_config_is_valid(tmp_path: Path) -> None:
    result = _compose("config", "-q", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr


def test_missing_secret_fails_loudly(tmp_path: Path) -> None:
    compose = _docker_compose()
    empty_env_file = tmp_path / "empty.env"
    empty_env_file.write_text("")
    env = {k: v for k, v in {**os.environ, **DUMMY_ENV}.items() if k != "REDIS_PASSWORD"}
    result = subprocess.run(
        [
            compose,
            "-f",
            str(COMPOSE_FILE),
            "--project-directory",
            str(ROOT),
            "--env-file",
            str(empty_env_file),
            "config",
            "-q",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )
    assert result.returncode != 0
    assert "REDIS_PASSWORD" in result.stdout + result.stderr


def test_env_example_lists_every_variable() -> None:
    used = set(re.findall(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)", COMPOSE_FILE.read_text()))
    listed = set(re.findall(r"^#?\s*([A-Z_][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), re.M))
    assert used - listed == set()
    assert set(DUMMY_ENV) <= used


@pytest.mark.parametrize("tier", TIERS)
def test_worker_runs_its_tier(services: dict[str, Any], tier: str) -> None:
    worker = services[f"worker-{tier}"]
    assert _command(worker) == ["celery", "-A", "tasks", "ledger", "worker", "--tier", tier]
    probe = " ".join(_command({"command": worker["healthcheck"]["test"]}))
    assert "inspect ping" in probe
    assert re.search(rf"-d {tier}@\$+\{{?HOSTNAME", probe), probe
    # --scale worker-<tier>=N needs neither a fixed name nor a fixed host port.
    assert "container_name" not in worker
    assert not worker.get("ports")


def test_every_service_has_healthcheck_and_restart_policy(services: dict[str, Any]) -> None:
    assert {"redis", "mongo", "flower", "prometheus", "grafana", *WORKERS} <= set(services)
    for name, service in services.items():
        check = service.get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), f"{name}: no healthcheck"
        assert check["test"] != ["NONE"], f"{name}: healthcheck disabled"
        restart = service.get("restart") or service.get("deploy", {}).get("restart_policy")
        assert restart and restart != "no", f"{name}: no restart policy"


def test_ports_are_loopback_only(services: dict[str, Any]) -> None:
    for name, service in services.items():
        for ip in _host_ips(service):
            assert ip == "127.0.0.1", f"{name} publishes a port on {ip or 'every interface'}"
    assert not services["redis"].get("ports")
    assert not services["mongo"].get("ports")


def test_ledger_worker_cli_exists() -> None:
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tasks", "ledger", "worker", "--help"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "--tier" in result.stdout


PASSWORDS = ("REDIS_PASSWORD", "MONGO_PASSWORD", "FLOWER_PASSWORD", "GRAFANA_ADMIN_PASSWORD")


def _unescaped(parts: list[str]) -> list[str]:
    """A resolved argv as the container runs it (``config`` prints ``$`` as ``$$``)."""
    return [part.replace("$$", "$") for part in parts]


def test_no_secret_is_on_a_command_line(services: dict[str, Any]) -> None:
    # A command line is readable by every process of the host (ps, /proc/*/cmdline)
    secrets = [DUMMY_ENV[name] for name in PASSWORDS]
    for name, service in services.items():
        lines = [
            *_command({"command": service.get("entrypoint")}),
            *_command(service),
            *_command({"command": (service.get("healthcheck") or {}).get("test")}),
        ]
        for secret in secrets:
            assert not any(secret in line for line in lines), f"{name}: a secret in its argv"


@pytest.mark.parametrize(
    ("service_name", "variable"),
    [
        ("redis", "REDIS_PASSWORD"),
        ("mongo", "MONGO_PASSWORD"),
        ("flower", "FLOWER_PASSWORD"),
        ("grafana", "GRAFANA_ADMIN_PASSWORD"),
    ],
)
def test_a_placeholder_secret_stops_its_service_at_start(
    services: dict[str, Any], service_name: str, variable: str
) -> None:
    # Given the service's start-up argv and environment with the .env.example placeholder
    service = services[service_name]
    argv = _unescaped([*_command({"command": service.get("entrypoint")}), *_command(service)])
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    placeholder = f"change-me-{variable.lower()}"
    env = {
        key: str(value).replace(DUMMY_ENV[variable], placeholder)
        for key, value in environment.items()
    }
    assert placeholder in "".join(env.values()), f"{service_name} does not get {variable}"

    # When it starts, it stops before its server, saying which secret to set
    result = subprocess.run(
        argv,
        env={**env, "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )
    assert result.returncode == 78, result.stderr
    assert f"{variable} is the .env.example placeholder" in result.stderr


def test_the_broker_never_evicts_a_message(services: dict[str, Any]) -> None:
    script = " ".join(_unescaped(_command(services["redis"])))
    assert "--maxmemory-policy noeviction" in script
    assert '--maxmemory "$REDIS_MAXMEMORY"' in script
    assert services["redis"]["environment"]["REDIS_MAXMEMORY"]
