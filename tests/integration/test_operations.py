"""Operations against the real stack: authentication, Flower, health, metrics and JSON logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from argparse import Namespace
from base64 import b64encode
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from pymongo import MongoClient
from pymongo.errors import OperationFailure
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_ledger.cli.health import health
from celery_ledger.embedded.flower import start_flower
from celery_ledger.embedded.servers import LOOPBACK, free_port
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess

from .conftest import APP_MODULE, TEST_ENV
from .helpers import wait_for

OPS_QUEUE = "ops"


def test_clients_without_credentials_are_refused(stack: EmbeddedStack) -> None:
    assert stack.broker is not None and stack.ledger is not None
    # Given clients that connect without the stack's passwords
    anonymous_redis = redis.Redis(
        host=LOOPBACK, port=stack.broker.port, protocol=2, retry=Retry(NoBackoff(), 0)
    )
    anonymous_mongo: MongoClient[dict[str, Any]] = MongoClient(
        LOOPBACK, stack.ledger.port, directConnection=True, serverSelectionTimeoutMS=2000
    )
    try:
        # Then the broker answers NOAUTH and the ledger refuses a read
        with pytest.raises(redis.AuthenticationError, match="Authentication required"):
            anonymous_redis.ping()
        with pytest.raises(OperationFailure) as refused:
            anonymous_mongo.ledger_tests.ledger.find_one()
        assert refused.value.code == 13  # Unauthorized
    finally:
        anonymous_redis.close()
        anonymous_mongo.close()
    # While the URLs the stack hands out carry working credentials
    assert redis.Redis.from_url(stack.broker.url).ping()
    with MongoClient(stack.ledger.url) as client:
        client.ledger_tests.ledger.find_one()


def _get(url: str, auth: tuple[str, str] | None = None) -> int:
    request = urllib.request.Request(url)
    if auth is not None:
        token = b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_the_stacks_secrets_stay_with_its_owner(stack: EmbeddedStack) -> None:
    import shlex
    import stat
    from urllib.parse import urlsplit

    assert stack.broker is not None and stack.ledger is not None
    # Data (the AOF holds messages), auth files and logs: owner-only directories
    for directory in (stack.data_dir, stack.broker.data_dir, stack.ledger.data_dir):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory

    # The credentials go to an owner-only file that a shell can source...
    path = stack.write_env_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    sourced = subprocess.run(
        ["bash", "-c", f"source {shlex.quote(str(path))} && env"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": os.environ["PATH"]},
    ).stdout.splitlines()
    for name, value in stack.env.items():
        assert f"{name}={value}" in sourced

    # ...and never to what the stack prints
    passwords = [urlsplit(server.url).password for server in (stack.broker, stack.ledger)]
    assert all(passwords)
    described = stack.describe()
    assert str(stack.ledger.port) in described
    assert not any(password in described for password in passwords if password)


def test_the_ledgers_unauthenticated_first_start_admits_only_the_stack(tmp_path: Path) -> None:
    from pymongo.errors import PyMongoError

    from celery_ledger.embedded.servers import (
        ServerProcess,
        _one_time_tls,
        _spawn,
        _wait_ready,
        secantus_command,
        start_secantus,
    )

    # Given the ledger server as the stack's first start runs it (no --auth yet)
    port = free_port()
    tls_args, tls_query = _one_time_tls(tmp_path)
    argv = [
        *secantus_command(),
        *("--host", LOOPBACK, "--port", str(port), "--storage-path", str(tmp_path / "db")),
        *tls_args,
    ]
    plain = f"mongodb://{LOOPBACK}:{port}/?directConnection=true"
    server = ServerProcess(
        "secantus",
        port,
        f"{plain}&{tls_query}",
        tmp_path,
        argv,
        tmp_path / "log",
        _spawn(argv, tmp_path / "log"),
    )
    try:
        _wait_ready(server, 30)
        # Then a local process without the one-time client certificate cannot use it
        ca_only = f"{plain}&tls=true&tlsCAFile={tmp_path / 'ca.pem'}"
        for url in (plain, ca_only):
            with pytest.raises(PyMongoError), MongoClient(url, serverSelectionTimeoutMS=1500) as c:
                c.admin.command("createUser", "intruder", pwd="x", roles=["root"])
        # while the stack (holding it) can create its user
        with MongoClient(server.url, serverSelectionTimeoutMS=5000) as client:
            client.admin.command("createUser", "admin", pwd="p", roles=["root"])
    finally:
        server.stop(timeout=30.0)

    # And the whole start leaves no certificate or key behind
    ledger = start_secantus(tmp_path / "full", password="s3cret")
    try:
        assert not (tmp_path / "full" / "provisioning-tls").exists()
        with MongoClient(ledger.url, serverSelectionTimeoutMS=5000) as client:
            client.admin.command("ping")
    finally:
        ledger.stop(timeout=30.0)


def test_flower_requires_basic_auth(stack: EmbeddedStack, tmp_path: Path) -> None:
    # Given Flower on the real broker, with generated credentials
    flower = start_flower(APP_MODULE, tmp_path, env=stack.env)
    try:
        assert flower.url.startswith(f"http://{LOOPBACK}:")
        assert len(flower.password) >= 16
        # Then its API answers with the credentials only
        assert _get(f"{flower.url}/api/workers", (flower.user, flower.password)) == 200
        assert _get(f"{flower.url}/api/workers") == 401
        assert _get(f"{flower.url}/api/workers", (flower.user, "wrong")) == 401
    finally:
        flower.stop()
    assert not flower.alive()


def _celery(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP_MODULE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_health_of_the_running_stack(app: Any) -> None:
    result = _celery("ledger", "health", "--json", "--timeout", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    status = {check["name"]: check["status"] for check in report["checks"]}
    assert report["ok"] is True
    assert status["broker"] == "ok"
    assert status["ledger"] in ("ok", "warn")  # warn: other tests left dead letters
    for tier in ("critical", "default", "bulk"):
        assert status[f"tier {tier}"] == "ok"
    # And the table for people
    runner = CliRunner()
    table = runner.invoke(health, ["--timeout", "1", "--tiers", "critical"], obj=Namespace(app=app))
    assert table.exit_code == 0 and "healthy" in table.output, table.output


@pytest.fixture(scope="module")
def observed_worker(
    stack: EmbeddedStack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, int, Path]]:
    """A worker of its own queue with metrics on and JSON logs."""
    port = free_port()
    metrics_base = tmp_path_factory.mktemp("metrics")
    env = {
        "LEDGER_METRICS_PORT": str(port),
        "LEDGER_METRICS_ADDRESS": LOOPBACK,
        "LEDGER_METRICS_AUTH": METRICS_AUTH,
        "LEDGER_METRICS_CACHE_SECONDS": "0",  # each scrape reads anew: the test waits on them
        "LEDGER_LOG_FORMAT": "json",
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_base),
    }
    worker = stack.start_worker(OPS_QUEUE, concurrency=2, name=f"ops@{LOOPBACK}", env=env)
    try:
        yield worker, port, metrics_base
    finally:
        worker.stop()
        stack.workers.remove(worker)


METRICS_AUTH = "prometheus:scrape-secret"


def _scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    request = urllib.request.Request(
        f"http://{LOOPBACK}:{port}/metrics",
        headers={"Authorization": "Basic " + b64encode(METRICS_AUTH.encode()).decode()},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_worker_metrics_and_json_logs(
    app: Any, token: str, observed_worker: tuple[WorkerProcess, int, Path]
) -> None:
    from tests.integration import ledger_app

    worker, port, metrics_base = observed_worker
    # Given jobs on the observed worker: one succeeds (then a duplicate), one dies
    ledger_app.record.apply_async((token,), queue=OPS_QUEUE).get(timeout=30)
    # (sent with dedupe on publish off: a default producer skips a known key)
    ledger_app.record.dedupe_on_publish = False
    try:
        ledger_app.record.apply_async((token,), queue=OPS_QUEUE)
    finally:
        ledger_app.record.dedupe_on_publish = None
    dead = ledger_app.boom.apply_async((f"{token}-dead",), queue=OPS_QUEUE)
    dead.get(timeout=30, propagate=False)

    # Then the pool processes' metrics are served by the main process
    record, boom = ledger_app.record.name, ledger_app.boom.name

    def scraped() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
        samples = _scrape(port)
        key = ("celery_ledger_duplicates_suppressed_total", _labels(task=record, tier="default"))
        return samples if samples.get(key) else None

    samples = wait_for(scraped, timeout=20, what="the duplicate in the metrics")
    # (without the credentials, nothing is served)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=10)
    assert refused.value.code == 401

    def at(name: str, **labels: str) -> float:
        return samples.get((name, _labels(**labels)), 0.0)

    assert at("celery_ledger_tasks_started_total", task=record, tier="default") >= 1
    assert at("celery_ledger_tasks_succeeded_total", task=record, tier="default") >= 1
    assert at("celery_ledger_tasks_dead_total", task=boom, tier="default") >= 1
    assert at("celery_ledger_queue_wait_seconds_count", task=record, tier="default") >= 2
    assert at("celery_ledger_ledger_command_seconds_count", command="update") >= 2
    assert at("celery_ledger_worker_consuming", queue=OPS_QUEUE) == 1
    assert at("celery_ledger_dependency_up", dependency="broker") == 1
    assert at("celery_ledger_dependency_up", dependency="ledger") == 1
    assert at("celery_ledger_dead_letters") >= 1
    assert ("celery_ledger_queue_depth", _labels(queue="critical")) in samples
    directories = list(metrics_base.glob("celery-ledger-metrics-*"))
    assert [d.name for d in directories] == [f"celery-ledger-metrics-{worker.pid}"]

    # And the worker's log lines are JSON, with the task's fields while a task runs
    entries = [
        json.loads(line)
        for line in worker.log_path.read_text().splitlines()
        if line.startswith("{")
    ]
    dead_line = next(e for e in entries if e["logger"] == "celery_ledger.deadletter")
    assert dead_line["task_id"] == dead.id and dead_line["key"] == f"{token}-dead"
    assert dead_line["tier"] == "default" and dead_line["attempt"] == 1
    assert isinstance(dead_line["fence"], int)


def _labels(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


def test_the_worker_removes_its_metrics_directory_when_it_stops(
    observed_worker: tuple[WorkerProcess, int, Path],
) -> None:
    worker, _, metrics_base = observed_worker  # runs after the test above: same module worker
    worker.stop()
    assert list(metrics_base.iterdir()) == []


def test_ledger_show_finds_a_keyless_job_by_its_id_and_by_a_short_task_name(app: Any) -> None:
    from celery_ledger.cli import ledger
    from tests.integration import ledger_app

    # Given a keyless job (its key is a hash of its arguments: nobody can guess it), done
    x = int.from_bytes(os.urandom(3), "big")
    result = ledger_app.add.delay(x, 1)
    assert result.get(timeout=60) == x + 1

    def show(*args: str) -> dict[str, Any]:
        shown = CliRunner().invoke(ledger, ["show", *args, "--json"], obj=Namespace(app=app))
        assert shown.exit_code == 0, shown.output
        found: dict[str, Any] = json.loads(shown.output)
        return found

    # When it is shown by the id the publish returned (AsyncResult.id, the Celery task id)
    by_id = show(result.id)
    # Then that is its record; and its short task name with its key finds the same one
    assert by_id["task"] == ledger_app.add.name and by_id["result_json"] == str(x + 1)
    assert show("add", by_id["key"])["id"] == by_id["id"]


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_stops_the_embedded_stack_whatever_it_inherited(
    tmp_path: Path, inherited: str
) -> None:
    """``ledger stack`` says "Ctrl-C stops every process": also when it was started where
    SIGINT is ignored (a script's background job, a test runner's process), where Python
    installs no KeyboardInterrupt."""

    def start() -> None:
        if inherited == "ignored":
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    output = tmp_path / "stack.out"
    command = [sys.executable, "-m", "celery", "-A", APP_MODULE, "ledger"]
    command += ["stack", "--data-dir", str(tmp_path / "dev"), "--no-workers", "--no-flower"]
    command += ["--no-console"]
    with output.open("wb") as out:
        stack = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=start,
            cwd=Path(__file__).parents[2],
            env={**os.environ, **TEST_ENV},
        )
    try:
        wait_for(
            lambda: "Ctrl-C stops" in output.read_text() or stack.poll() is not None,
            timeout=60,
            what="the stack up",
        )
        assert stack.poll() is None, output.read_text()
        stack.send_signal(signal.SIGINT)
        assert stack.wait(30) == 0, output.read_text()
        assert "stopping..." in output.read_text()
    finally:
        if stack.poll() is None:
            stack.kill()
            stack.wait()
