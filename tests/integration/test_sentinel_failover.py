"""A broker behind Sentinel fails over under load: a real failover group (a primary, two
replicas, three sentinels: valkey-server processes on loopback), a real worker and a producer,
and the primary SIGKILLed while jobs are published and run; then the new primary too.

Every job's body runs once, none is lost, the worker never ends, and the time from the kill to
the first job published after it having run is reported (``-s`` prints it).

Redis replicates asynchronously: a message the old primary took just before it died may never
reach the replica promoted in its place. The ledger brings such a job back only if a record was
written at its publish (``LEDGER_DEDUPE_ON_PUBLISH=true``, off by default) and once it is
``LEDGER_RECONCILE_STALE_AFTER_SECONDS`` old (900 by default): this test turns the first on and
shortens the second to 3 s, so what it shows is what a deployment with those settings gets.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from pymongo.errors import PyMongoError

from celery_ledger.embedded.sentinel import SentinelGroup, start_sentinel_group
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess
from celery_ledger.health import run_checks
from tasks.effects import effects

from .conftest import APP_MODULE, HEALING, producer_app
from .helpers import shared_task, wait_for

pytestmark = pytest.mark.integration

NAMESPACE = "sentinel_tests"
RECORD = "tests.integration.ledger_app.record"
STALE_AFTER_SECONDS = 5.0
# One thread publishing a job every PUBLISH_PAUSE_SECONDS or slower: about what the worker
# runs on a busy 2-core machine, so that no backlog delays the jobs published after a kill
PUBLISHERS = 1
PUBLISH_PAUSE_SECONDS = 0.05
SETTINGS = {
    **HEALING,
    "LEDGER_QUEUE_NAMESPACE": NAMESPACE,
    "LEDGER_DEDUPE_ON_PUBLISH": "true",
    "LEDGER_RECONCILE_STALE_AFTER_SECONDS": str(STALE_AFTER_SECONDS),
}


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    running = start_sentinel_group(tmp_path / "sentinel")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def worker(tmp_path: Path, stack: EmbeddedStack, group: SentinelGroup) -> Iterator[WorkerProcess]:
    """A worker of the test app on the group (through the sentinels) and the session's ledger."""
    (tmp_path / "stack").mkdir(mode=0o700)
    running = EmbeddedStack(
        APP_MODULE,
        tmp_path / "stack",
        broker=group.nodes[0],
        ledger=stack.ledger,
        queue_namespace=NAMESPACE,
        extra_env={**group.env, **SETTINGS},
    )
    started = running.start_worker(
        running.queues_of("default"), concurrency=2, name="failover@127.0.0.1"
    )
    try:
        yield started
    finally:
        started.stop()  # (the servers are the group's and the session's: not stopped here)


@dataclass
class Load:
    """Jobs published one after another until stopped; a refused publish is tried again with
    the same key (the producer follows the new primary; dedupe makes a second try harmless)."""

    task: Any
    published: list[tuple[str, float]] = field(default_factory=list)  # (token, when)
    refusals: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            token = f"f-{uuid.uuid4().hex[:12]}"
            while True:
                try:
                    self.task.delay(token=token)
                    break
                except Exception:
                    self.refusals += 1
                    time.sleep(0.1)
            self.published.append((token, time.monotonic()))
            time.sleep(PUBLISH_PAUSE_SECONDS)

    def since(self, moment: float) -> list[str]:
        return [token for token, when in self.published if when > moment]


def first_run_after(load: Load, killed_at: float, killed_wall: float) -> float:
    """Seconds from the kill to the first job published after it having run."""
    after = load.since(killed_at)
    found = wait_for(
        lambda: effects().find_one(
            {"kind": "record", "key": {"$in": load.since(killed_at)}}, sort=[("at", 1)]
        ),
        timeout=60,
        what="a job published after the kill to run",
    )
    assert after is not None
    return float(found["at"].timestamp() - killed_wall)


def workers_primary(producer: Any, port: int) -> str | None:
    """The health check's finding once it names ``port`` the primary and the worker on it."""
    check = next(c for c in run_checks(producer, required=(), timeout=2) if c.name == "primary")
    on_it = check.status == "ok" and check.data["primary"] == f"127.0.0.1:{port}"
    return check.detail if on_it else None


def ran(tokens: list[str]) -> set[str]:
    """The tokens whose job ran (an unanswered read, the ledger busy: none yet)."""
    try:
        return set(effects().distinct("key", {"kind": "record", "key": {"$in": tokens}}))
    except PyMongoError:
        return set()


def replica_online(group: SentinelGroup) -> bool:
    primary = group.primary()
    client = redis.Redis(host="127.0.0.1", port=primary.port, password=group.password)
    with client:
        info = client.info("replication")
    return any(
        isinstance(value, dict) and value.get("state") == "online"
        for key, value in info.items()
        if key.startswith("slave")
    )


def test_jobs_run_once_and_the_worker_stays_through_two_failovers(
    stack: EmbeddedStack, group: SentinelGroup, worker: WorkerProcess
) -> None:
    # Given a producer through the same sentinels, publishing under load
    producer = producer_app(
        EmbeddedStack(APP_MODULE, Path("."), broker=group.nodes[0], ledger=stack.ledger),
        "sentinel-producer",
        broker_url=group.url,
        sentinel_master=group.master_name,
        sentinel_password=group.sentinel_password,
        queue_namespace=NAMESPACE,
        dedupe_on_publish=True,
    )
    load = Load(shared_task(producer, RECORD))
    publishers = [threading.Thread(target=load.run, daemon=True) for _ in range(PUBLISHERS)]
    for publisher in publishers:
        publisher.start()
    worker_pid = worker.pid
    report: list[str] = []
    try:
        first = group.primary().port
        report.append(f"health before: {wait_for(lambda: workers_primary(producer, first))}")
        for round_ in (1, 2):
            # When the primary is killed (SIGKILL) while jobs are published and run
            old = group.primary()
            killed_at, killed_wall = time.monotonic(), time.time()
            refused_before = load.refusals
            old.kill()
            # Then the sentinels promote a replica, and jobs published after the kill run
            new = group.wait_for_new_primary(old.port)
            promoted = time.monotonic() - killed_at
            recovered = first_run_after(load, killed_at, killed_wall)
            report.append(
                f"failover {round_}: primary {old.port} -> {new.port}, promoted after"
                f" {promoted:.1f} s, first job published after the kill ran after"
                f" {recovered:.1f} s, publishes refused meanwhile: {load.refusals - refused_before}"
            )
            # And the health check names the new primary, and the worker on it
            on_new = wait_for(
                lambda port=new.port: workers_primary(producer, port),
                timeout=30,
                what="the worker on it",
            )
            report.append(f"  health: {on_new}")
            if round_ == 1:  # the remaining replica follows the new primary before the next kill
                wait_for(lambda: replica_online(group), timeout=60, what="a replica in sync")
            time.sleep(3)
    finally:
        load.stop.set()
        for publisher in publishers:
            publisher.join(30)
    tokens = [token for token, _ in load.published]
    # Then every job ran, once (a message the old primary lost comes back from its record)
    settle_started = time.monotonic()
    wait_for(
        lambda: ran(tokens) == set(tokens),
        timeout=180,
        interval=1.0,
        what="every published job to run",
    )
    report.append(
        f"{len(tokens)} jobs published; all ran {time.monotonic() - settle_started:.1f} s after"
        " the load stopped"
    )
    time.sleep(STALE_AFTER_SECONDS + 2)  # (a late second run would show now)
    runs = effects().aggregate(
        [
            {"$match": {"kind": "record", "key": {"$in": tokens}}},
            {"$group": {"_id": "$key", "n": {"$sum": 1}}},
            {"$match": {"n": {"$ne": 1}}},
        ]
    )
    assert {run["_id"]: run["n"] for run in runs} == {}
    assert ran(tokens) == set(tokens)
    # And the worker never ended
    assert worker.alive() and worker.pid == worker_pid
    log = worker.log_path.read_text(errors="replace")
    assert "Unrecoverable error" not in log
    republished = sum(int(n) for n in re.findall(r"'stale_queued': (\d+)", log))
    restored = sum(int(n) for n in re.findall(r"'restored_from_broker': (\d+)", log))
    report.append(
        f"the reconciler republished {republished} queued job(s) older than the stale window"
        f" (a message a failover lost, or one that waited that long), and put back {restored}"
        " taken message(s)"
    )
    print("\n".join(["", *report]))
    producer.close()
