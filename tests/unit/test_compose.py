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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
TLS_FILE = ROOT / "docker-compose.tls.yml"  # the TLS override
ENV_EXAMPLE = ROOT / ".env.example"
TIERS = ("critical", "default", "bulk")
WORKERS = tuple(f"worker-{tier}" for tier in TIERS)

# Dummy values for every ${VAR:?...} the compose file requires.
DUMMY_ENV = {
    "REDIS_WORKER_PASSWORD": "dummy-redis-worker-password",
    "REDIS_FLOWER_PASSWORD": "dummy-redis-flower-password",
    "REDIS_HEALTH_PASSWORD": "dummy-redis-health-password",
    "MONGO_ROOT_USER": "dummy-mongo-root-user",
    "MONGO_ROOT_PASSWORD": "dummy-mongo-root-password",
    "MONGO_APP_PASSWORD": "dummy-mongo-app-password",
    "FLOWER_USER": "dummy-flower-user",
    "FLOWER_PASSWORD": "dummy-flower-password",
    "GRAFANA_ADMIN_PASSWORD": "dummy-grafana-password",
    "LEDGER_SIGNING_KEYS": '["dummy-ledger-signing-key-0123456789abcdef"]',
    "LEDGER_ENCRYPTION_KEYS": '["AcKyJ2oLnrAAy_LZcIqJcLFxu0NMYeTJnp7JIrpzIs4="]',
    "LEDGER_KEY_SECRET": "dummy-ledger-key-secret-0123456789abcdef",
    "LEDGER_CONSOLE_USERS": '{"dummy": {"password": "dummy-console-password", "role": "viewer"}}',
    "LEDGER_CONSOLE_SECRET": "dummy-console-session-secret-0123456789abcdef",
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


def _compose(
    *args: str, tmp_path: Path, files: tuple[Path, ...] = (COMPOSE_FILE,)
) -> subprocess.CompletedProcess[str]:
    """Run docker-compose on our file with every profile and dummy secrets.

    An empty --env-file keeps a developer's real .env out of the run (and out of any output).
    """
    empty_env_file = tmp_path / "empty.env"
    empty_env_file.write_text("")
    env = {**os.environ, **DUMMY_ENV}
    argv = [
        _docker_compose(),
        *(arg for file in files for arg in ("-f", str(file))),
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


def _resolved_config(tmp_path: Path, files: tuple[Path, ...] = (COMPOSE_FILE,)) -> dict[str, Any]:
    """The configuration as docker-compose resolves it (anchors merged, variables set, later
    ``files`` overriding earlier ones)."""
    result = _compose("config", tmp_path=tmp_path, files=files)
    assert result.returncode == 0, result.stderr
    try:
        import yaml
    except ImportError:
        pass
    else:
        loaded: dict[str, Any] = yaml.safe_load(result.stdout)
        return loaded

    # Compose v2 only; v1 prints its usage instead (and may still exit 0).
    as_json = _compose("config", "--format", "json", tmp_path=tmp_path, files=files)
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
    env = {k: v for k, v in {**os.environ, **DUMMY_ENV}.items() if k != "REDIS_WORKER_PASSWORD"}
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
    assert "REDIS_WORKER_PASSWORD" in result.stdout + result.stderr


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


ONE_SHOT = ("mongo-init",)  # deploy steps: run once per `up`, exit, and are waited for


def test_every_service_has_healthcheck_and_restart_policy(services: dict[str, Any]) -> None:
    assert {"redis", "mongo", "flower", "prometheus", "grafana", *WORKERS} <= set(services)
    for name, service in services.items():
        if name in ONE_SHOT:
            assert service.get("restart") == "no", f"{name}: a one-shot step restarts"
            continue
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


PASSWORDS = (
    "REDIS_WORKER_PASSWORD",
    "REDIS_FLOWER_PASSWORD",
    "REDIS_HEALTH_PASSWORD",
    "MONGO_ROOT_PASSWORD",
    "MONGO_APP_PASSWORD",
    "FLOWER_PASSWORD",
    "GRAFANA_ADMIN_PASSWORD",
)


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
        ("redis", "REDIS_WORKER_PASSWORD"),
        ("redis", "REDIS_FLOWER_PASSWORD"),
        ("redis", "REDIS_HEALTH_PASSWORD"),
        ("mongo", "MONGO_ROOT_PASSWORD"),
        ("flower", "FLOWER_PASSWORD"),
        ("grafana", "GRAFANA_ADMIN_PASSWORD"),
    ],
)
def test_a_placeholder_secret_stops_its_service_at_start(
    services: dict[str, Any], service_name: str, variable: str
) -> None:
    # Given the service's start-up argv and environment with the .env.example placeholder
    # (the files it mounts from this repository at their paths here)
    service = services[service_name]
    argv = _unescaped([*_command({"command": service.get("entrypoint")}), *_command(service)])
    for source, target in _bind_mounts(service):
        argv = [part.replace(target, source) for part in argv]
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


def _bind_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host path, container path) of each file or directory the service mounts from here."""
    mounts = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                mounts.append((str(volume["source"]), str(volume["target"])))
        else:
            source, _, rest = str(volume).partition(":")
            if source.startswith((".", "/")):
                mounts.append((str((ROOT / source).resolve()), rest.split(":")[0]))
    return mounts


def _environment(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {key: str(value) for key, value in environment.items()}


def test_only_the_ledgers_server_and_its_deploy_step_know_its_root_password(
    services: dict[str, Any],
) -> None:
    root = DUMMY_ENV["MONGO_ROOT_PASSWORD"]
    knows = {name for name, s in services.items() if root in json.dumps(_environment(s))}
    assert knows == {"mongo", "mongo-init"}


def test_workers_connect_as_the_apps_least_privilege_users(services: dict[str, Any]) -> None:
    for name in WORKERS:
        env = _environment(services[name])
        assert env["LEDGER_BROKER_URL"].startswith("redis://ledger:")
        assert env["LEDGER_MONGO_URI"].startswith("mongodb://ledger:")
        # the ledger's user exists before the worker starts
        assert services[name]["depends_on"]["mongo-init"]["condition"] == (
            "service_completed_successfully"
        )
    init = " ".join(_command(services["mongo-init"]))
    assert "ledger provision-users" in init


def test_flower_has_its_own_broker_user_and_no_ledger_credentials(
    services: dict[str, Any],
) -> None:
    env = _environment(services["flower"])
    assert env["LEDGER_BROKER_URL"].startswith("redis://flower:")
    assert not any(key.startswith("LEDGER_MONGO") for key in env)
    assert not any(
        DUMMY_ENV[name] in value
        for value in env.values()
        for name in ("MONGO_ROOT_PASSWORD", "MONGO_APP_PASSWORD", "REDIS_WORKER_PASSWORD")
    )


def test_the_broker_has_no_default_user_and_checks_health_as_its_own(
    services: dict[str, Any], tmp_path: Path
) -> None:
    redis_service = services["redis"]
    script = " ".join(_unescaped(_command(redis_service)))
    assert "--aclfile /tmp/users.acl" in script and "--requirepass" not in script
    assert "--user health" in " ".join(_command({"command": redis_service["healthcheck"]["test"]}))
    # The mounted script, run with the service's environment, writes the users
    mounts = dict((target, source) for source, target in _bind_mounts(redis_service))
    env = {**_environment(redis_service), "PATH": os.environ["PATH"]}
    acl = tmp_path / "users.acl"
    result = subprocess.run(
        ["sh", mounts["/etc/redis/write-acl.sh"], str(acl)],
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    users = {line.split()[1]: line for line in acl.read_text().splitlines()}
    assert users["default"].startswith("user default off")
    assert set(users) == {"default", "ledger", "flower", "health"}


@pytest.fixture(scope="module")
def tls_services(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The configuration with the TLS override applied (as the deployment page runs it)."""
    config = _resolved_config(
        tmp_path_factory.mktemp("compose-tls"), files=(COMPOSE_FILE, TLS_FILE)
    )
    found: dict[str, Any] = config["services"]
    return found


def test_with_the_tls_override_every_connection_is_verified_tls(
    tls_services: dict[str, Any],
) -> None:
    redis_script = " ".join(_unescaped(_command(tls_services["redis"])))
    assert "--port 0 --tls-port 6379" in redis_script  # no plain port at all
    assert "--aclfile /tmp/users.acl" in redis_script  # still the ACL users
    mongo = " ".join(_command(tls_services["mongo"]))
    assert "--tlsMode requireTLS" in mongo
    for name in (*WORKERS, "mongo-init", "flower"):
        env = _environment(tls_services[name])
        assert env["LEDGER_BROKER_URL"].startswith("rediss://"), name
        assert "ssl_cert_reqs=required&ssl_ca_certs=/certs/ca.pem" in env["LEDGER_BROKER_URL"]
        if name != "flower":
            assert "tls=true&tlsCAFile=/certs/ca.pem" in env["LEDGER_MONGO_URI"], name
        assert any(t == "/certs" for _, t in _bind_mounts(tls_services[name])), name
    assert "tls=true" in _environment(tls_services["mongo-init"])["LEDGER_MONGO_ADMIN_URI"]
    assert not any(k.startswith("LEDGER_MONGO") for k in _environment(tls_services["flower"]))
    for server in ("redis", "mongo"):
        probe = " ".join(_command({"command": tls_services[server]["healthcheck"]["test"]}))
        assert "/certs/ca.pem" in probe, server


def test_the_image_installs_every_extra_the_compose_file_turns_on(
    services: dict[str, Any],
) -> None:
    # A worker whose setting needs an extra the image lacks refuses to start ("pip install
    # 'celery-ledger[metrics]'"): the image must carry what the compose environment enables.
    env = services["worker-default"]["environment"]
    needed = {"metrics"} if env.get("LEDGER_METRICS_PORT") else set()
    needed |= {"sentry"} if "LEDGER_SENTRY_DSN" in env else set()
    needed |= {"tracing"} if "LEDGER_TRACING" in env else set()
    needed |= {"console"} if "console" in services else set()
    installed = re.search(r'pip install "\.\[([a-z,]+)\]"', (ROOT / "Dockerfile").read_text())
    assert installed is not None, "the Dockerfile installs the library without extras"
    assert needed <= set(installed.group(1).split(",")), needed


def test_the_trace_collector_forwards_to_the_trace_viewer(services: dict[str, Any]) -> None:
    import yaml

    collector = yaml.safe_load((ROOT / "ops" / "otel" / "collector.yaml").read_text())
    pipeline = collector["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    [exporter] = pipeline["exporters"]
    assert collector["exporters"][exporter]["endpoint"].startswith("jaeger:")
    assert services["otel-collector"]["profiles"] == ["monitoring"]
    assert services["jaeger"]["profiles"] == ["monitoring"]
    endpoint = services["worker-default"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert endpoint.startswith("http://otel-collector:4318")


SENTINEL_FILE = ROOT / "docker-compose.sentinel.yml"  # the failover override
SENTINEL_ENV = {
    "REDIS_REPLICA_PASSWORD": "dummy-redis-replica-password",
    "REDIS_SENTINEL_PASSWORD": "dummy-redis-sentinel-password",
    "SENTINEL_PEER_PASSWORD": "dummy-sentinel-peer-password",
    "SENTINEL_CLIENT_PASSWORD": "dummy-sentinel-client-password",
}


@pytest.fixture(scope="module")
def sentinel_services(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch
) -> dict[str, Any]:
    """The configuration with the Sentinel override applied (as its runbook runs it)."""
    for name, value in SENTINEL_ENV.items():
        monkeypatch_module.setenv(name, value)
    config = _resolved_config(
        tmp_path_factory.mktemp("compose-sentinel"), files=(COMPOSE_FILE, SENTINEL_FILE)
    )
    found: dict[str, Any] = config["services"]
    return found


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_with_the_sentinel_override_every_client_finds_the_primary_through_three_sentinels(
    sentinel_services: dict[str, Any],
) -> None:
    # A primary, two replicas of it, three sentinels watching it with a majority quorum
    for replica in ("redis-replica-1", "redis-replica-2"):
        assert _environment(sentinel_services[replica])["REPLICA_OF"] == "redis"
    for index in (1, 2, 3):
        env = _environment(sentinel_services[f"sentinel-{index}"])
        assert (env["MASTER_NAME"], env["PRIMARY_HOST"], env["QUORUM"]) == ("ledger", "redis", "2")
    # Every client lists the three sentinels, as its own least-privilege broker user
    for name in (*WORKERS, "console", "flower", "mongo-init"):
        env = _environment(sentinel_services[name])
        url = env["LEDGER_BROKER_URL"]
        assert url.count("sentinel://") == 3, name
        user = "flower" if name == "flower" else "ledger"
        assert url.startswith(f"sentinel://{user}:"), name
        assert (env["LEDGER_SENTINEL_MASTER"], env["LEDGER_SENTINEL_USERNAME"]) == (
            "ledger",
            "ledger",
        )
    # And no password of the group is on a command line
    secrets = [*(DUMMY_ENV[name] for name in PASSWORDS), *SENTINEL_ENV.values()]
    for name, service in sentinel_services.items():
        probe = (service.get("healthcheck") or {}).get("test")
        lines = [*_command(service), *_command({"command": probe})]
        for secret in secrets:
            assert not any(secret in line for line in lines), f"{name}: a secret in its argv"


def test_env_example_lists_every_variable_of_the_sentinel_override() -> None:
    used = set(re.findall(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)", SENTINEL_FILE.read_text()))
    listed = set(re.findall(r"^#?\s*([A-Z_][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), re.M))
    assert used - listed == set()


def test_the_sentinel_scripts_refuse_placeholders_and_give_least_privilege(
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "REDIS_SENTINEL_PASSWORD": "s" * 20,
        "SENTINEL_PEER_PASSWORD": "p" * 20,
        "SENTINEL_CLIENT_PASSWORD": "change-me-sentinel-client-password",
    }
    script = ROOT / "ops" / "redis" / "write-sentinel-conf.sh"
    refused = subprocess.run(
        ["sh", str(script), str(tmp_path / "refused.conf")], env=env, capture_output=True
    )
    assert refused.returncode == 78
    env["SENTINEL_CLIENT_PASSWORD"] = "c" * 20
    written = subprocess.run(["sh", str(script), str(tmp_path / "s.conf")], env=env, check=True)
    assert written.returncode == 0
    conf = (tmp_path / "s.conf").read_text()
    assert "user default off" in conf
    client = next(line for line in conf.splitlines() if line.startswith("user ledger "))
    assert "-@all" in client and "+sentinel|get-master-addr-by-name" in client
    assert "c" * 20 not in conf  # (kept as its SHA-256)
