"""What the Sentinel failover tests share (test_sentinel_failover.py and its matrix,
test_sentinel_failover_matrix.py): a failover group's worker and producer, a load of jobs
published one after another, and the reads that say whether every job ran once.

A failover that loses the primary's last writes is made on purpose with
:func:`replicas_paused`: the replicas stopped (SIGSTOP) and their links to the primary cut,
writes made to the primary meanwhile, the primary killed while they are stopped. The replica
promoted then never received those writes, as after an asynchronous replication's worst moment.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from pymongo.errors import PyMongoError

from celery_ledger.embedded.sentinel import SentinelGroup, start_sentinel_group
from celery_ledger.embedded.servers import ServerProcess
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess
from celery_ledger.health import run_checks
from tasks.effects import effects

from .conftest import APP_MODULE, HEALING, producer_app
from .helpers import wait_for


@contextlib.contextmanager
def sentinel_group(path: Path) -> Iterator[SentinelGroup]:
    """A failover group (a primary, two replicas, three sentinels) in ``path``, stopped after."""
    running = start_sentinel_group(path)
    try:
        yield running
    finally:
        running.stop()


NAMESPACE = "sentinel_tests"
RECORD = "tests.integration.ledger_app.record"
SETTLE_SECONDS = 5.0  # after every job ran: a late second run would show by then
# One thread publishing a job every PUBLISH_PAUSE_SECONDS or slower: about what the worker
# runs on a busy 2-core machine, so that no backlog delays the jobs published after a kill
PUBLISHERS = 1
PUBLISH_PAUSE_SECONDS = 0.05
SETTINGS = {**HEALING, "LEDGER_QUEUE_NAMESPACE": NAMESPACE}
DELAYED = f"{NAMESPACE}:ledger:delayed"
NOTICED = r"the broker may have lost data: its primary moved"


def group_worker(
    base: Path,
    stack: EmbeddedStack,
    group: SentinelGroup,
    *,
    name: str = "failover",
    app_module: str = APP_MODULE,
    tiers: tuple[str, ...] = ("default",),
    namespace: str = NAMESPACE,
    env: dict[str, str] | None = None,
) -> WorkerProcess:
    """A worker of ``app_module`` on the group (through the sentinels) and the session's
    ledger, healing fast (:data:`~.conftest.HEALING`); ``base`` is its own directory."""
    base.mkdir(mode=0o700, exist_ok=True)
    running = EmbeddedStack(
        app_module,
        base,
        broker=group.primary(),  # (the worker itself reaches it through the sentinels)
        ledger=stack.ledger,
        queue_namespace=namespace,
        extra_env={**group.env, **SETTINGS, "LEDGER_QUEUE_NAMESPACE": namespace, **(env or {})},
    )
    worker = running.start_worker(
        running.queues_of(*tiers), concurrency=2, name=f"{name}@127.0.0.1", wait=False
    )
    for attempt in range(3):
        try:
            running.wait_ready(worker)
            break
        except redis.ConnectionError:  # (the probe's own connection, right after a failover)
            if attempt == 2:
                worker.stop()  # (not left running past the test)
                raise
            time.sleep(1.0)
        except BaseException:
            worker.stop()
            raise
    return worker


def group_producer(stack: EmbeddedStack, group: SentinelGroup, name: str, **settings: Any) -> Any:
    """An app publishing through the group's sentinels (the test app's queues by default)."""
    settings.setdefault("queue_namespace", NAMESPACE)
    settings.setdefault("broker_url", group.url)
    return producer_app(
        EmbeddedStack(APP_MODULE, Path("."), broker=group.nodes[0], ledger=stack.ledger),
        name,
        sentinel_master=group.master_name,
        sentinel_password=group.sentinel_password,
        **settings,
    )


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

    def tokens(self) -> list[str]:
        return [token for token, _ in self.published]


@contextlib.contextmanager
def loaded(task: Any) -> Iterator[Load]:
    """A :class:`Load` of ``task`` published by :data:`PUBLISHERS` threads while in the block."""
    load = Load(task)
    publishers = [threading.Thread(target=load.run, daemon=True) for _ in range(PUBLISHERS)]
    for publisher in publishers:
        publisher.start()
    try:
        yield load
    finally:
        load.stop.set()
        for publisher in publishers:
            publisher.join(30)


def first_run_after(load: Load, since: float, since_wall: float) -> float:
    """Seconds from ``since`` (a kill, a pause) to the first job published after it having
    run."""
    found = wait_for(
        lambda: effects().find_one(
            {"kind": "record", "key": {"$in": load.since(since)}}, sort=[("at", 1)]
        ),
        timeout=60,
        what="a job published after the kill to run",
    )
    return float(found["at"].timestamp() - since_wall)


def workers_primary(producer: Any, group: SentinelGroup) -> str | None:
    """The health check's finding once it names the primary that a majority of the sentinels
    name now, and the worker on it. (Not the one a failover promoted: on a loaded machine the
    sentinels may fail over again within seconds, a new primary being slow to answer its first
    pings, and the check must follow them.)"""
    port = group.primary_port()
    if port is None:  # (no majority now: mid-failover)
        return None
    checks = run_checks(producer, required=(), timeout=2)
    check = next((c for c in checks if c.name == "primary"), None)
    if check is None:  # (not reported this time: the broker's check did not answer in time)
        return None
    on_it = check.status == "ok" and check.data.get("primary") == f"127.0.0.1:{port}"
    return check.detail if on_it else None


def ran(tokens: list[str], kind: str = "record") -> set[str]:
    """The tokens whose job ran (an unanswered read, the ledger busy: none yet)."""
    try:
        return set(effects().distinct("key", {"kind": kind, "key": {"$in": tokens}}))
    except PyMongoError:
        return set()


def runs_not_once(tokens: list[str], kind: str = "record", times: int = 1) -> dict[str, int]:
    """The tokens whose ``kind`` effect happened other than ``times`` times, with the count."""
    counted = effects().aggregate(
        [
            {"$match": {"kind": kind, "key": {"$in": tokens}}},
            {"$group": {"_id": "$key", "n": {"$sum": 1}}},
        ]
    )
    found = {run["_id"]: run["n"] for run in counted}
    return {token: found.get(token, 0) for token in tokens if found.get(token, 0) != times}


def wait_all_ran(tokens: list[str], timeout: float = 120.0) -> float:
    """Wait until every token's job ran; the seconds it took."""
    started = time.monotonic()
    wait_for(
        lambda: ran(tokens) == set(tokens),
        timeout=timeout,
        interval=0.5,
        what=f"every one of {len(tokens)} published jobs to run",
    )
    return time.monotonic() - started


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


def node_client(group: SentinelGroup, node: ServerProcess, **options: Any) -> redis.Redis:
    """A client of one data node (not through the sentinels)."""
    return redis.Redis(host="127.0.0.1", port=node.port, password=group.password, **options)


def replicates(group: SentinelGroup, node: ServerProcess, primary: ServerProcess | int) -> bool:
    """Whether ``node`` is a replica of ``primary`` (a node, or the port it is reached at) now,
    its link up and its sync done."""
    port = primary if isinstance(primary, int) else group.reached_at(primary)
    try:
        with node_client(group, node, socket_timeout=1) as client:
            info: Any = client.info("replication")
    except redis.RedisError:
        return False
    return (
        info.get("role") == "slave"
        and int(info.get("master_port") or 0) == port
        and info.get("master_link_status") == "up"
        and int(info.get("master_sync_in_progress") or 0) == 0
    )


def replicated(group: SentinelGroup) -> None:
    """Until every replica has every write the primary took so far (WAIT after a write of
    ours: replication offsets only grow)."""
    with node_client(group, group.primary()) as client:
        client.set("failover-test:sync", uuid.uuid4().hex)
        acked = int(client.execute_command("WAIT", len(group.nodes) - 1, 5000))
    assert acked == len(group.nodes) - 1, f"{acked} replica(s) in sync"


@contextlib.contextmanager
def paused(*servers: ServerProcess) -> Iterator[None]:
    """The servers stopped (SIGSTOP) in the block, and continued (SIGCONT) after it, whatever
    happens in it (a stopped server would hang its own stop at the end of the test)."""
    for server in servers:
        os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for server in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.pid, signal.SIGCONT)


@contextlib.contextmanager
def replicas_paused(group: SentinelGroup) -> Iterator[ServerProcess]:
    """The replicas stopped for the block, their links to the primary (yielded) cut: it takes
    writes they never receive. Kill it in the block: the replica promoted in its place lacks
    them. (Stopping the replicas alone is not enough: the kernel still receives the
    replication stream into their sockets, and they apply it once continued. So the primary
    closes their links, and the stopped replicas cannot connect again until it is dead.)"""
    primary = group.primary()
    with paused(*(node for node in group.nodes if node is not primary)):
        with node_client(group, primary) as client:
            cut = int(client.execute_command("CLIENT", "KILL", "TYPE", "replica"))
        assert cut == len(group.nodes) - 1, f"{cut} replication link(s) cut"
        yield primary


def worker_log_counts(worker: WorkerProcess) -> dict[str, int]:
    """What the worker's reconciler logged: failovers noticed, jobs brought back, workflows
    woken again."""
    log = worker.log_path.read_text(errors="replace")
    return {
        "noticed": len(re.findall(NOTICED, log)),
        "missing": sum(int(n) for n in re.findall(r"'missing': (\d+)", log)),
        "restored": sum(int(n) for n in re.findall(r"'restored_from_broker': (\d+)", log)),
        "republished": sum(int(n) for n in re.findall(r"'republished': (\d+)", log)),
        "rewoken": sum(int(n) for n in re.findall(r"'workflows_rewoken': (\d+)", log)),
        "unrecoverable": log.count("Unrecoverable error"),
    }


def assert_worker_stayed(worker: WorkerProcess, pid: int) -> None:
    """The worker never ended (the same process, alive, never an unrecoverable error)."""
    assert worker.alive() and worker.pid == pid
    assert worker_log_counts(worker)["unrecoverable"] == 0
