"""Least privilege on real servers: the broker's ACL users of ``ops/redis/write-acl.sh`` and
the ledger's role and user of ``celery ledger provision-users``.

The compose file runs that script in the Redis container and that command before the workers;
here the same script writes the ACL of a real valkey server, the same command provisions a
real SecantusDB (which enforces roles per collection), and the platform's whole traffic (a
worker, producers, retries and the delayed set, breakers' scripts, rate limits, a workflow,
atomic steps, inspect and control, Flower's events and inspect) runs as those users.
Nothing may be refused (the broker's ``ACL LOG`` stays empty of them), and each user is
refused what its role does not need: the app may not rewrite the audit trail.
"""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import time
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from pymongo import MongoClient
from pymongo.errors import DuplicateKeyError, OperationFailure

from celery_ledger.embedded.flower import start_flower
from celery_ledger.embedded.servers import ServerProcess, start_secantus, start_valkey
from celery_ledger.ledger.access import ROLE, privileges
from celery_ledger.routing import unacked_keys

from .conftest import APP_MODULE, NAMESPACE, producer_app
from .helpers import shared_task
from .watchdog import WATCH, WatchedStack

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "redis" / "write-acl.sh"
ROLES = ("worker", "flower", "health", "admin")
USERS = {"worker": "ledger", "flower": "flower", "health": "health", "admin": "admin"}


def write_acl(path: Path, **passwords: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS_")}
    env.update({f"REDIS_{role.upper()}_PASSWORD": pw for role, pw in passwords.items()})
    return subprocess.run(
        ["sh", str(SCRIPT), str(path)], env=env, capture_output=True, text=True, check=False
    )


@dataclass
class AclBroker:
    server: ServerProcess
    passwords: dict[str, str]
    ledger_url: str = ""  # the ledger as the app's least-privilege user

    def url(self, role: str) -> str:
        return f"redis://{USERS[role]}:{self.passwords[role]}@127.0.0.1:{self.server.port}/0"

    def client(self, role: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(role))

    def refusals(self) -> list[dict[str, Any]]:
        with self.client("admin") as admin:
            entries: list[dict[str, Any]] = admin.acl_log(count=1000)
        return entries


@pytest.fixture
def acl_stack(tmp_path: Path, stack: Any) -> Iterator[tuple[WatchedStack, AclBroker]]:
    passwords = {role: secrets.token_hex(16) for role in ROLES}
    acl = tmp_path / "users.acl"
    written = write_acl(acl, **passwords)
    assert written.returncode == 0, written.stderr
    (tmp_path / "stack").mkdir(mode=0o700)
    running = WatchedStack(APP_MODULE, tmp_path / "stack", auth=False, queue_namespace=NAMESPACE)
    running.broker = start_valkey(tmp_path / "valkey", acl_file=acl)
    broker = AclBroker(running.broker, passwords)
    try:
        running.ledger = start_secantus(tmp_path / "secantus", password=secrets.token_hex(16))
        broker.ledger_url = provision_app_user(running.ledger)
        running.extra_env["LEDGER_BROKER_URL"] = broker.url("worker")
        running.extra_env["LEDGER_MONGO_URI"] = broker.ledger_url
        WATCH.watch(running)
        yield running, broker
    finally:
        WATCH.unwatch(running)
        running.stop()


def provision_app_user(ledger: ServerProcess) -> str:
    """Run ``celery ledger provision-users`` as the deploy step does; the app user's URL."""
    from celery_ledger.cli.commands import ledger as ledger_cli

    password = secrets.token_hex(16)
    app = producer_app_for(ledger.url)
    result = CliRunner().invoke(
        ledger_cli,
        ["provision-users", "--app-database", "reference_world"],
        obj=type("Ctx", (), {"app": app})(),
        env={"LEDGER_MONGO_ADMIN_URI": ledger.url, "LEDGER_MONGO_APP_PASSWORD": password},
    )
    assert result.exit_code == 0, result.output
    assert password not in result.output
    return (
        f"mongodb://ledger:{password}@127.0.0.1:{ledger.port}/"
        "?retryWrites=false&directConnection=true&authSource=admin"
    )


def producer_app_for(mongo_uri: str) -> Any:
    from celery_ledger import Settings, create_app

    return create_app(
        "provisioner",
        settings=Settings(mongo_uri=mongo_uri, mongo_db="ledger_tests"),
        set_as_current=False,
    )


def test_the_acl_file_holds_hashes_and_no_default_user(tmp_path: Path) -> None:
    passwords = {role: secrets.token_hex(16) for role in ROLES}
    acl = tmp_path / "users.acl"
    assert write_acl(acl, **passwords).returncode == 0

    text = acl.read_text()
    assert stat.S_IMODE(acl.stat().st_mode) == 0o600
    assert not any(pw in text for pw in passwords.values())
    assert "user default off" in text
    assert {line.split()[1] for line in text.splitlines()} == set(USERS.values()) | {"default"}


@pytest.mark.parametrize("missing", ["worker", "flower", "health"])
def test_a_missing_or_placeholder_password_stops_the_script(tmp_path: Path, missing: str) -> None:
    passwords = {role: secrets.token_hex(16) for role in ("worker", "flower", "health")}
    for bad in ("", "change-me-redis-password"):
        passwords[missing] = bad
        result = write_acl(tmp_path / "users.acl", **passwords)
        assert result.returncode == 78
        assert f"REDIS_{missing.upper()}_PASSWORD" in result.stderr
        assert not (tmp_path / "users.acl").exists()


def test_the_platforms_broker_traffic_runs_as_the_app_user_without_one_refusal(
    acl_stack: tuple[WatchedStack, AclBroker],
) -> None:
    running, broker = acl_stack
    running.start_worker(running.queues_of(), concurrency=2, name="acl@127.0.0.1")
    producer = producer_app(
        running, "acl_producer", broker_url=broker.url("worker"), mongo_uri=broker.ledger_url
    )
    token = f"acl-{time.time_ns()}"

    # Plain jobs, a retry through the delayed set, a countdown, a breaker, a rate limit
    results = [
        shared_task(producer, "tests.integration.ledger_app.record").delay(token),
        shared_task(producer, "tests.integration.ledger_app.flaky").delay(f"{token}-f", 1),
        shared_task(producer, "tests.integration.ledger_app.record").apply_async(
            (f"{token}-later",), countdown=1
        ),
        shared_task(producer, "tests.integration.ledger_app.call_payments").delay(f"{token}-p"),
        shared_task(producer, "tests.integration.ledger_app.rate_limited").delay(f"{token}-r"),
    ]
    for result in results:
        result.get(timeout=60)
    # A workflow: its wakes, steps, a compensation's registration, a fan-out
    from tests.integration.ledger_app import declare_workflows

    handle = declare_workflows(producer)["order"].start(f"{token}-wf", steps=2)
    assert handle.result(timeout=90)["parts"]
    # Atomic steps (a transaction over the ledger and the app's own database)
    atomic = shared_task(producer, "tests.integration.ledger_app.atomic_effect")
    assert atomic.delay(f"{token}-a", "ok").get(timeout=60)["receipt"]
    # Inspect and control (the pidbox: a fanout and a reply queue)
    assert producer.control.inspect(timeout=5).ping()
    # An audited operator action, as the app's user: its entry and its outcome
    from celery_ledger import audit

    audit.record(producer.ledger, "probe", token, actor="test [--actor]")
    assert any(
        e["target"] == token and e["outcome"] == "done" for e in audit.entries(producer.ledger)
    )

    assert [e for e in broker.refusals() if e["username"] == "ledger"] == []
    # Every collection the workload made in the ledger's database is one the role names
    with MongoClient(broker.ledger_url) as client:
        made = set(client["ledger_tests"].list_collection_names())
    named = {p["resource"]["collection"] for p in privileges("ledger_tests", "ledger")}
    assert made and made <= named, made - named
    with broker.client("worker") as client:
        for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("MONITOR",)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
    producer.close()


def test_the_app_user_may_not_rewrite_the_audit_trail_or_reach_beyond_the_ledger(
    acl_stack: tuple[WatchedStack, AclBroker],
) -> None:
    """What the embedded server enforces, refused for real; the per-collection part (the
    audit trail append-only) read back from the role the server holds. SecantusDB matches a
    custom role's privileges by database only (measured: an update of the audit collection
    passes there), while MongoDB matches the collection too."""
    running, broker = acl_stack
    with MongoClient(broker.ledger_url) as client:
        db = client["ledger_tests"]
        db["ledger_audit"].insert_one({"action": "probe", "target": "t", "actor": "a"})
        refused = [
            lambda: db["ledger_audit"].drop(),
            lambda: db["ledger"].drop(),
            lambda: client["admin"].command("createUser", "x", pwd="y", roles=["root"]),
            lambda: client["admin"].command("grantRolesToUser", "ledger", roles=["root"]),
            lambda: client["elsewhere"]["c"].find_one(),
            lambda: client["elsewhere"]["c"].insert_one({"x": 1}),
        ]
        for call in refused:
            with pytest.raises(OperationFailure) as denied:
                call()
            assert denied.value.code == 13  # Unauthorized
        db["ledger"].insert_one({"_id": "probe"})  # the records: read and written
        assert db["ledger"].find_one({"_id": "probe"}) is not None
        # An action has one outcome: a second, written before or after, is refused
        action = db["ledger_audit"].insert_one({"action": "purge", "actor": "a"}).inserted_id
        db["ledger_audit"].insert_one({"of": action, "outcome": "done"})
        with pytest.raises(DuplicateKeyError):
            db["ledger_audit"].insert_one({"of": action, "outcome": "failed"})

    assert running.ledger is not None
    with MongoClient(running.ledger.url) as admin:
        info = admin["admin"].command("rolesInfo", ROLE, showPrivileges=True)["roles"][0]
    grants = {
        (p["resource"]["db"], p["resource"]["collection"]): set(p["actions"])
        for p in info["privileges"]
    }
    audit = grants[("ledger_tests", "ledger_audit")]
    assert "insert" in audit and "find" in audit
    # append-only, and no index (a TTL index would have the server delete the trail): the
    # provisioning step made its indexes with the administrator's connection
    assert not audit & {"update", "remove", "dropCollection", "collMod", "createIndex"}
    with MongoClient(running.ledger.url) as admin:
        indexes = admin["ledger_tests"]["ledger_audit"].index_information()
    assert indexes["one_outcome"]["unique"] is True
    # No grant on a whole database reads or writes (MongoDB adds grants up: it would reach
    # the audit trail), and no grant outside the ledger's database
    assert grants[("ledger_tests", "")] == {"listCollections"}
    assert {db for db, _ in grants} == {"ledger_tests"}


def test_flower_works_as_its_own_user_with_no_ledger_credentials(
    acl_stack: tuple[WatchedStack, AclBroker], tmp_path: Path
) -> None:
    running, broker = acl_stack
    running.start_worker(
        running.queues_of(), concurrency=1, name="flowered@127.0.0.1", extra_args=("-E",)
    )
    env = {
        "LEDGER_BROKER_URL": broker.url("flower"),
        "LEDGER_MONGO_URI": "mongodb://127.0.0.1:9/",  # nothing listens: Flower never needs it
        "LEDGER_TTL_INDEX": "false",
    }
    flower = start_flower(APP_MODULE, tmp_path / "flower", env=env)
    producer = producer_app(
        running, "flowered_producer", broker_url=broker.url("worker"), mongo_uri=broker.ledger_url
    )
    try:
        auth = "Basic " + b64encode(f"{flower.user}:{flower.password}".encode()).decode()

        def get(path: str) -> bytes:
            request = urllib.request.Request(flower.url + path, headers={"Authorization": auth})
            with urllib.request.urlopen(request, timeout=30) as response:
                body: bytes = response.read()
                return body

        assert b"flowered@127.0.0.1" in get("/api/workers?refresh=1")  # inspect, as flower
        # Events: Flower receives a job's, over pub/sub, as its own user
        record = shared_task(producer, "tests.integration.ledger_app.record")
        deadline, seen = time.monotonic() + 30, False
        while not seen and time.monotonic() < deadline:
            result = record.delay(f"flower-{time.time_ns()}")
            result.get(timeout=60)
            time.sleep(0.5)
            seen = result.id.encode() in get("/api/tasks")
        assert seen
        # A sensitive job: Flower's task list and the task's page show none of its arguments
        # or result, while a plain job's are there (the reading sees text)
        secret = f"pan-{time.time_ns()}"
        sealed = shared_task(producer, "tests.integration.ledger_app.store_card")
        stored = sealed.delay(f"flower-card-{time.time_ns()}", secret)
        assert stored.get(timeout=60)["echo"] == secret
        plain = shared_task(producer, "tests.integration.ledger_app.echo").delay(secret[::-1])
        plain.get(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            listed = get("/api/tasks")
            if stored.id.encode() in listed and plain.id.encode() in listed:
                break
            time.sleep(0.5)
        pages = listed + get(f"/api/task/info/{stored.id}") + get(f"/api/task/info/{plain.id}")
        assert stored.id.encode() in listed and secret[::-1].encode() in pages
        assert secret.encode() not in pages
    finally:
        producer.close()
        flower.stop()
    assert [e for e in broker.refusals() if e["username"] == "flower"] == []
    # Flower cannot put a job on a queue, take one off kombu's unacknowledged bookkeeping
    # (restoring one there would drop it: it may not push it back), touch the delayed set, or
    # anything dangerous; and it never tried (no refusal above)
    with broker.client("flower") as client:
        assert client.llen(running.queues_of("default")) == 0  # it reads every key
        for command in (
            ("LPUSH", running.queues_of("default"), "{}"),
            ("ZADD", f"{NAMESPACE}:ledger:delayed", "0", "x"),
            ("HDEL", unacked_keys(NAMESPACE)["unacked_key"], "a-delivery-tag"),
            ("FLUSHALL",),
            ("CONFIG", "GET", "*"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)


def test_the_health_user_may_ping_and_nothing_else_and_nobody_is_anonymous(
    acl_stack: tuple[WatchedStack, AclBroker],
) -> None:
    _, broker = acl_stack
    with broker.client("health") as health:
        assert health.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            health.get("ledger_tests.default")
    anonymous = redis.Redis(host="127.0.0.1", port=broker.server.port)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    anonymous.close()
