"""A broker behind Sentinel fails over under load: a real failover group (a primary, two
replicas, three sentinels: valkey-server processes on loopback), a real worker and a producer,
and the primary SIGKILLed while jobs are published and run; then the new primary too.

Every job's body runs once, none is lost, the worker never ends, and the time from the kill to
the first job published after it having run is reported (``-s`` prints it).

Redis replicates asynchronously: a message the old primary took just before it died may never
reach the replica promoted in its place. Under default settings the job's record was written at
its publish (``LEDGER_DEDUPE_ON_PUBLISH``), and the worker's reconciler notices the new primary
at its next sweep and publishes again, at once, every queued job whose message is nowhere in the
broker: the test runs with the defaults, but for the healing worker's quick sweeps.

And the least-privilege users of the compose override (``ops/redis/write-acl.sh``,
``ops/redis/write-sentinel-conf.sh``) are enough for a producer's every Redis use (queues, the
delayed set, a breaker's scripts) through a failover, and the sentinels' client user cannot
move the primary.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ledger.embedded.sentinel import SentinelGroup
from celery_ledger.embedded.servers import (
    ServerProcess,
    _spawn,
    _wait_ready,
    free_port,
    start_valkey,
    valkey_binary,
)
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess
from tasks.effects import effects

from .conftest import APP_MODULE, producer_app
from .failover import (
    PUBLISHERS,
    RECORD,
    SETTLE_SECONDS,
    Load,
    first_run_after,
    group_producer,
    group_worker,
    ran,
    replica_online,
    sentinel_group,
    workers_primary,
)
from .helpers import shared_task, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    with sentinel_group(tmp_path / "sentinel") as running:
        yield running


@pytest.fixture
def worker(tmp_path: Path, stack: EmbeddedStack, group: SentinelGroup) -> Iterator[WorkerProcess]:
    """A worker of the test app on the group (through the sentinels) and the session's ledger."""
    started = group_worker(tmp_path / "stack", stack, group)
    try:
        yield started
    finally:
        started.stop()  # (the servers are the group's and the session's: not stopped here)


def test_jobs_run_once_and_the_worker_stays_through_two_failovers(
    stack: EmbeddedStack, group: SentinelGroup, worker: WorkerProcess
) -> None:
    # Given a producer through the same sentinels, publishing under load
    producer = group_producer(stack, group, "sentinel-producer")
    load = Load(shared_task(producer, RECORD))
    publishers = [threading.Thread(target=load.run, daemon=True) for _ in range(PUBLISHERS)]
    for publisher in publishers:
        publisher.start()
    worker_pid = worker.pid
    report: list[str] = []
    try:
        report.append(f"health before: {wait_for(lambda: workers_primary(producer, group))}")
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
                lambda: workers_primary(producer, group), timeout=30, what="the worker on it"
            )
            report.append(f"  health: {on_new}")
            if (now := group.primary().port) != new.port:
                report.append(f"  the sentinels failed over again, to {now}")
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
    time.sleep(SETTLE_SECONDS)
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
    # And its reconciler noticed each failover (the broker may have lost the last writes)
    noticed = re.findall(r"the broker may have lost data: its primary moved", log)
    assert len(noticed) >= 2, "the reconciler did not notice both failovers"
    missing = sum(int(n) for n in re.findall(r"'missing': (\d+)", log))
    restored = sum(int(n) for n in re.findall(r"'restored_from_broker': (\d+)", log))
    report.append(
        f"the reconciler noticed {len(noticed)} failover(s), published again {missing} job(s)"
        f" whose message was nowhere in the broker, and put back {restored} taken message(s)"
    )
    print("\n".join(["", *report]))
    producer.close()


ROOT = Path(__file__).resolve().parents[2]
ACL_SECRETS = {
    "REDIS_WORKER_PASSWORD": "ledger-" + uuid.uuid4().hex,
    "REDIS_FLOWER_PASSWORD": "flower-" + uuid.uuid4().hex,
    "REDIS_HEALTH_PASSWORD": "health-" + uuid.uuid4().hex,
    "REDIS_ADMIN_PASSWORD": "admin-" + uuid.uuid4().hex,
    "REDIS_REPLICA_PASSWORD": "replica-" + uuid.uuid4().hex,
    "REDIS_SENTINEL_PASSWORD": "sentinel-" + uuid.uuid4().hex,
    "SENTINEL_PEER_PASSWORD": "peer-" + uuid.uuid4().hex,
    "SENTINEL_CLIENT_PASSWORD": "client-" + uuid.uuid4().hex,
}


@pytest.fixture
def acl_group(tmp_path: Path) -> Iterator[tuple[list[ServerProcess], list[ServerProcess]]]:
    """A failover group whose users are the compose override's: the data nodes' from
    ops/redis/write-acl.sh, the sentinels' from ops/redis/write-sentinel-conf.sh."""
    env = {**os.environ, **ACL_SECRETS}
    acl = tmp_path / "users.acl"
    subprocess.run(["sh", str(ROOT / "ops/redis/write-acl.sh"), str(acl)], env=env, check=True)
    nodes: list[ServerProcess] = []
    sentinels: list[ServerProcess] = []
    try:
        nodes.append(start_valkey(tmp_path / "node-0", acl_file=acl))
        for index in (1, 2):
            node = start_valkey(tmp_path / f"node-{index}", acl_file=acl, replica_of=nodes[0].port)
            nodes.append(node)
        for node in nodes:  # (as the compose file's replication.conf: any node may replicate)
            admin = redis.Redis(
                port=node.port, username="admin", password=ACL_SECRETS["REDIS_ADMIN_PASSWORD"]
            )
            with admin:
                admin.config_set("masteruser", "replica")
                admin.config_set("masterauth", ACL_SECRETS["REDIS_REPLICA_PASSWORD"])
        for index in range(3):
            directory = tmp_path / f"sentinel-{index}"
            directory.mkdir(mode=0o700)
            conf = directory / "sentinel.conf"
            script = str(ROOT / "ops/redis/write-sentinel-conf.sh")
            settings = {"PRIMARY_HOST": "127.0.0.1", "PRIMARY_PORT": str(nodes[0].port)}
            settings |= {"DOWN_AFTER_MS": "1000", "FAILOVER_TIMEOUT_MS": "5000"}
            subprocess.run(["sh", script, str(conf)], env={**env, **settings}, check=True)
            port = free_port()
            argv = [str(valkey_binary()), str(conf), "--sentinel", "--port", str(port)]
            argv += ["--bind", "127.0.0.1"]
            password = ACL_SECRETS["SENTINEL_CLIENT_PASSWORD"]
            url = f"redis://ledger:{password}@127.0.0.1:{port}/0"
            log = directory / "sentinel.log"
            server = ServerProcess("valkey", port, url, directory, argv, log, _spawn(argv, log))
            sentinels.append(server)
            _wait_ready(server, 15)
        yield nodes, sentinels
    finally:
        for server in (*sentinels, *nodes):
            server.stop()


def test_the_compose_files_least_privilege_users_publish_and_fail_over(
    stack: EmbeddedStack, acl_group: tuple[list[ServerProcess], list[ServerProcess]]
) -> None:
    nodes, sentinels = acl_group
    worker_password = ACL_SECRETS["REDIS_WORKER_PASSWORD"]
    url = ";".join(
        f"sentinel://{f'ledger:{worker_password}@' if index == 0 else ''}127.0.0.1:{s.port}/0"
        for index, s in enumerate(sentinels)
    )
    # Given an app that reaches the group as the data nodes' "ledger" user and the sentinels'
    producer = producer_app(
        EmbeddedStack(APP_MODULE, Path("."), broker=nodes[0], ledger=stack.ledger),
        "sentinel-acl",
        broker_url=url,
        sentinel_master="ledger",
        sentinel_username="ledger",
        sentinel_password=ACL_SECRETS["SENTINEL_CLIENT_PASSWORD"],
        queue_namespace="sentinel_acl",
    )
    queue = "sentinel_acl.default"
    record = shared_task(producer, RECORD)
    client = producer.runtime.redis
    wait_for(lambda: sentinels_watch(sentinels), timeout=30, what="the sentinels to find all")
    # When it publishes, and uses a breaker (Lua scripts) and the delayed set
    record.delay(token=f"acl-{uuid.uuid4().hex[:8]}")
    record.apply_async(kwargs={"token": f"acl-{uuid.uuid4().hex[:8]}"}, countdown=3600)
    producer.breakers["acl"].status()
    assert client.llen(queue) == 1
    assert client.zcard("sentinel_acl:ledger:delayed") == 1
    # And the primary dies
    time.sleep(1)  # (replicated)
    nodes[0].kill()
    # Then the same clients go on, on the promoted replica
    wait_for(lambda: promoted(client, nodes[0].port), timeout=30, what="a replica promoted")
    wait_for(lambda: publishes(record), timeout=30, what="a publish on the new primary")
    assert client.llen(queue) == 2
    assert client.zcard("sentinel_acl:ledger:delayed") == 1
    producer.breakers["acl"].status()
    # And the sentinels' client user finds the primary but cannot move it
    watcher = redis.Redis(
        port=sentinels[0].port,
        username="ledger",
        password=ACL_SECRETS["SENTINEL_CLIENT_PASSWORD"],
    )
    with watcher, pytest.raises(redis.exceptions.NoPermissionError):
        watcher.execute_command("SENTINEL", "FAILOVER", "ledger")
    producer.close()


def sentinels_watch(sentinels: list[ServerProcess]) -> bool:
    for sentinel in sentinels:
        client = redis.Redis(
            port=sentinel.port,
            username="ledger",
            password=ACL_SECRETS["SENTINEL_CLIENT_PASSWORD"],
        )
        with client:
            master: Any = client.sentinel_master("ledger")
        if int(master["num-other-sentinels"]) < 2 or int(master["num-slaves"]) < 2:
            return False
    return True


def promoted(client: redis.Redis, old_port: int) -> bool:
    try:
        client.ping()
    except redis.RedisError:
        return False
    pool: Any = client.connection_pool
    return bool(pool.master_address and pool.master_address[1] != old_port)


def publishes(task: Any) -> bool:
    try:
        task.delay(token=f"acl-{uuid.uuid4().hex[:8]}")
    except Exception:
        return False
    return True
