"""The failover matrix of a broker behind Sentinel (issue 39), each on a failover group of its
own (a primary, two replicas, three sentinels: real valkey-server processes on loopback) and a
real worker: the primary paused past the sentinels' down-after time and continued (it comes back
as a replica, and what it took meanwhile is lost with it); a failover while a job's retry waits
in the delayed set; while a durable workflow waits on a timer; while the reconciler's sweep lock
and a change-stream trigger's lease are held; when the replica promoted stalls at once (twice
in a row); when jobs are published while the ledger is away and the primary's last writes are
lost (their publish refused unless a replica holds them).

Each asserts that every job's body ran once (its effects counted), nothing was lost, no worker
ended, and reports the time to recover (``-s`` prints it). Where the promoted replica may or may
not have the primary's last writes, both are made to happen: ``replicated`` (every replica in
sync at the kill) and ``lost`` (the replicas stopped while the writes were made, so the replica
promoted never had them: :func:`.failover.replicas_paused`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from pymongo import MongoClient

from celery_ledger import NotReplicated, State
from celery_ledger.broker import data_lost
from celery_ledger.embedded.sentinel import SentinelGroup
from celery_ledger.embedded.servers import free_port
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess
from celery_ledger.sentinel import primary_moved
from tasks.effects import effects
from tests.integration.apps import triggers as trigger_app

from .conftest import APP_MODULE, producer_app
from .failover import (
    NAMESPACE,
    RECORD,
    SETTLE_SECONDS,
    assert_worker_stayed,
    first_run_after,
    group_producer,
    group_worker,
    loaded,
    node_client,
    paused,
    ran,
    replicas_paused,
    replicated,
    replicates,
    runs_not_once,
    sentinel_group,
    wait_all_ran,
    worker_log_counts,
)
from .helpers import shared_task, wait_for

pytestmark = pytest.mark.integration

RETRY = "tests.integration.ledger_app.slow_retry"  # fails once, retried 3 s later
JOBS = 8
WRITES = ["replicated", "lost"]


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    with sentinel_group(tmp_path / "sentinel") as running:
        yield running


@pytest.fixture
def worker(tmp_path: Path, stack: EmbeddedStack, group: SentinelGroup) -> Iterator[WorkerProcess]:
    """A worker of the test app on every tier of the group, healing fast."""
    started = group_worker(tmp_path / "stack", stack, group, tiers=())
    try:
        yield started
    finally:
        started.stop()


def kill_primary(group: SentinelGroup, writes: str, write: Any) -> tuple[Any, float, float]:
    """``write()`` (until what it made waits in the broker), then SIGKILL the primary: with
    ``lost``, the replicas were stopped meanwhile and never had it. Returns the old primary
    and the kill's monotonic and wall times."""
    held = replicas_paused(group) if writes == "lost" else contextlib.nullcontext(group.primary())
    with held as old:
        write()
        if writes == "replicated":
            replicated(group)
        killed_at, killed_wall = time.monotonic(), time.time()
        old.kill()
    return old, killed_at, killed_wall


# -- 1. the primary paused past the down-after time --------------------------------------------


def test_a_paused_primary_comes_back_as_a_replica_and_its_late_writes_are_dropped(
    stack: EmbeddedStack, group: SentinelGroup, worker: WorkerProcess
) -> None:
    producer = group_producer(stack, group, "paused-producer")
    worker_pid = worker.pid
    report: list[str] = []
    late_reply: list[object] = []
    with loaded(shared_task(producer, RECORD)) as load:
        # Given jobs published and run through the sentinels
        wait_for(lambda: len(load.published) > 10, timeout=60, what="the load")
        old = group.primary()
        late = node_client(group, old)  # a client of the old primary's, connected before
        late.ping()
        # When the primary stops (SIGSTOP) past the sentinels' down-after time...
        paused_at, paused_wall = time.monotonic(), time.time()
        with paused(old):
            # (a write sent to it while it is stopped: it lands when it is continued, before
            # the sentinels tell it that it is a replica now)
            writer = threading.Thread(
                target=lambda: late_reply.append(_late_write(late)), daemon=True
            )
            writer.start()
            # ...so that the sentinels promote a replica
            new = group.wait_for_new_primary(old.port)
            promoted = time.monotonic() - paused_at
        # ...and is continued then
        continued = time.monotonic()
        writer.join(30)
        late.close()
        # Then it comes back as a replica of the new primary, in sync with it
        wait_for(lambda: role(group, old) == "slave", timeout=60, what="the old primary demoted")
        demoted = time.monotonic() - continued
        # (of the primary now: on a loaded machine the sentinels may fail over again)
        wait_for(
            lambda: (now := group.primary_port()) is not None and replicates(group, old, now),
            timeout=60,
            what="the old primary to follow",
        )
        synced = time.monotonic() - continued
        recovered = first_run_after(load, paused_at, paused_wall)
        report.append(
            f"paused primary {old.port}: {new.port} promoted after {promoted:.1f} s; continued,"
            f" a replica of it {demoted:.1f} s later, in sync {synced:.1f} s later; first job"
            f" published after the pause ran {recovered:.1f} s after it; publishes refused"
            f" meanwhile: {load.refusals}"
        )
        time.sleep(3)  # (jobs published and run on the new primary, the old one a replica)
    # And what the old primary took while it was stopped is nowhere: its late write did not win
    assert late_reply, "the late write never returned"
    for node in (new, old):
        with node_client(group, node) as client:
            assert client.get("failover-test:late") is None, f"the late write is on {node.port}"
    # And every job ran, once (a publish the old primary took late comes back from its record)
    tokens = load.tokens()
    report.append(f"{len(tokens)} jobs; all ran {wait_all_ran(tokens):.1f} s after the load")
    time.sleep(SETTLE_SECONDS)
    assert runs_not_once(tokens) == {}
    # And the worker never ended, and its reconciler noticed the new primary
    assert_worker_stayed(worker, worker_pid)
    counts = worker_log_counts(worker)
    assert counts["noticed"] >= 1
    report.append(f"late write answered {late_reply[0]!r}; reconciler: {counts}")
    print("\n".join(["", *report]))
    producer.close()


def role(group: SentinelGroup, node: Any) -> str | None:
    try:
        with node_client(group, node, socket_timeout=1) as client:
            return str(client.info("replication").get("role"))
    except redis.RedisError:
        return None


def _late_write(client: redis.Redis) -> object:
    try:
        return client.set("failover-test:late", "written to the old primary while it was stopped")
    except redis.RedisError as exc:
        return exc


# -- 2. a retry waiting in the delayed set -----------------------------------------------------


@pytest.mark.parametrize("writes", WRITES)
def test_a_retry_waiting_in_the_delayed_set_runs_once_after_a_failover(
    stack: EmbeddedStack, group: SentinelGroup, worker: WorkerProcess, writes: str
) -> None:
    producer = group_producer(stack, group, f"retry-{writes}")
    task = shared_task(producer, RETRY)
    delayed = producer.runtime.delayed.key
    run = uuid.uuid4().hex[:8]
    tokens = [f"r-{run}-{n}" for n in range(JOBS)]
    worker_pid = worker.pid

    def attempts() -> dict[str, int]:
        found = Counter(
            doc["key"] for doc in effects().find({"kind": "attempt", "key": {"$in": tokens}})
        )
        return {token: found[token] for token in tokens}

    def retries_waiting() -> bool:
        with node_client(group, group.primary()) as client:
            waiting = int(client.zcard(delayed))
        return set(attempts().values()) == {1} and waiting >= JOBS

    # Given jobs whose first attempt failed, each retry waiting in the delayed set (3 s)
    def publish() -> None:
        for token in tokens:
            task.delay(token=token)
        wait_for(retries_waiting, timeout=20, interval=0.05, what="every retry in the delayed set")

    # When the primary is killed then
    old, killed_at, _ = kill_primary(group, writes, publish)
    new = group.wait_for_new_primary(old.port)
    promoted = time.monotonic() - killed_at

    # Then every job succeeds, its body run twice (the failed attempt and its one retry)
    def succeeded() -> bool:
        return all(
            (r := producer.ledger.get(task.name, t)) is not None and r.state is State.SUCCEEDED
            for t in tokens
        )

    wait_for(succeeded, timeout=90, interval=0.5, what="every retried job to succeed")
    recovered = time.monotonic() - killed_at
    time.sleep(SETTLE_SECONDS)
    assert attempts() == dict.fromkeys(tokens, 2)
    # And the worker never ended
    assert_worker_stayed(worker, worker_pid)
    counts = worker_log_counts(worker)
    if writes == "lost":  # the reconciler found them nowhere in the broker, and brought them back
        assert counts["missing"] >= JOBS
    print(
        f"\nretries {writes}: primary {old.port} -> {new.port} after {promoted:.1f} s; {JOBS}"
        f" retried jobs succeeded {recovered:.1f} s after the kill; reconciler: {counts}"
    )
    producer.close()


# -- 3. a durable workflow waiting on a timer --------------------------------------------------

TIMER_SECONDS = 4.0
WORKFLOWS = 3


def step_runs(token: str) -> Counter[str]:
    found = effects().find({"kind": "wf_step", "key": {"$regex": f"^{token}:"}})
    return Counter(str(doc["key"]).split(":", 1)[1] for doc in found)


@pytest.mark.parametrize("writes", WRITES)
def test_a_workflow_waiting_on_a_timer_completes_each_step_once_after_a_failover(
    stack: EmbeddedStack, group: SentinelGroup, worker: WorkerProcess, writes: str
) -> None:
    from tests.integration.ledger_app import declare_workflows

    producer = group_producer(stack, group, f"wf-{writes}")
    flows = declare_workflows(producer)
    run = uuid.uuid4().hex[:8]
    worker_pid = worker.pid
    handles: list[Any] = []

    def waiting_on_timers() -> bool:
        return all((waits := h.status().waiting)[:1] and "timer" in waits[0] for h in handles)

    # Given workflows that ran their first step and wait on a timer (its wake in the delayed set)
    def start() -> None:
        for n in range(WORKFLOWS):
            handles.append(flows["order"].start(f"wt-{run}-{n}", steps=1, sleep=TIMER_SECONDS))
        wait_for(waiting_on_timers, timeout=20, interval=0.05, what="every workflow's timer")

    # When the primary is killed then
    old, killed_at, _ = kill_primary(group, writes, start)
    new = group.wait_for_new_primary(old.port)
    promoted = time.monotonic() - killed_at
    # Then every workflow completes, each step run once
    for handle in handles:
        result = handle.result(timeout=90)
        assert result["done"] == ["s0-done"] and result["parts"] == ["g0-done", "g1-done"]
    recovered = time.monotonic() - killed_at
    time.sleep(SETTLE_SECONDS)
    for n in range(WORKFLOWS):
        assert step_runs(f"wt-{run}-{n}") == Counter({"s0": 1, "g0": 1, "g1": 1})
    fired = [sum(e.kind == "fired" for e in h.history()) for h in handles]
    assert fired == [1] * WORKFLOWS
    # And the worker never ended, and its reconciler woke the workflows again (at their timer)
    assert_worker_stayed(worker, worker_pid)
    assert worker_log_counts(worker)["rewoken"] >= WORKFLOWS
    print(
        f"\nworkflow timers {writes}: primary {old.port} -> {new.port} after {promoted:.1f} s;"
        f" {WORKFLOWS} workflows (timers of {TIMER_SECONDS:.0f} s) completed {recovered:.1f} s"
        f" after the kill; reconciler: {worker_log_counts(worker)}"
    )
    producer.close()


# -- 4. the reconciler's sweep lock and a trigger's lease held ---------------------------------

TRIGGER_MODULE = "tests.integration.apps.triggers"
TRIGGER_LEASE = f"{trigger_app.NAME}:ledger:trigger:{trigger_app.TASK}"
TRIGGER_SWEEP_LOCK = f"{trigger_app.NAME}:ledger:reconciler"
TRIGGER_MARKER = f"{trigger_app.NAME}:ledger:broker-marker"


def holder(group: SentinelGroup, key: str) -> tuple[str, int] | None:
    """Who holds a lease (``host:pid``) and its fencing token, as the primary says now."""
    try:
        with node_client(group, group.primary(), socket_timeout=1) as client:
            value = client.get(key)
    except Exception:  # (a Redis error, or no primary named yet: during the failover)
        return None
    if not value:
        return None
    owner, token = value.decode().rsplit("|", 1)
    return owner, int(token)


def pid_of(owner: str) -> int:
    return int(owner.rsplit(":", 1)[1])


def test_the_sweep_lock_and_a_trigger_lease_held_at_a_failover_are_taken_again(
    stack: EmbeddedStack, group: SentinelGroup, tmp_path: Path
) -> None:
    assert stack.ledger is not None
    suffix = uuid.uuid4().hex[:8]
    collection = f"orders_{suffix}"
    env = {"TRIGGER_TEST_COLLECTION": collection, "LEDGER_MONGO_DB": f"triggers_{suffix}"}

    # Given two workers of a trigger app on the group, both sweeping (one at a time: the sweep
    # lock) and both competing for the trigger's lease
    def start(name: str) -> WorkerProcess:
        return group_worker(
            tmp_path / name,
            stack,
            group,
            name=name,
            app_module=TRIGGER_MODULE,
            tiers=("bulk",),
            namespace=f"trig_{suffix}",
            env=env,
        )

    workers = {name: start(name) for name in ("tw1", "tw2")}
    client: MongoClient[dict[str, Any]] = MongoClient(stack.ledger.url, tz_aware=True)
    world = client.get_database("reference_world")
    orders, runs_of = world.get_collection(collection), world.get_collection(trigger_app.EFFECTS)
    inserted: list[str] = []
    stop = threading.Event()

    def insert(count: int) -> None:
        start = len(inserted)
        ids = [f"{collection}-{n}" for n in range(start, start + count)]
        orders.insert_many([{"_id": i, "amount": n} for n, i in enumerate(ids, start)])
        inserted.extend(ids)

    def runs() -> dict[str, int]:
        found = runs_of.find({"_id": {"$regex": f"^{collection}-"}}, {"runs": 1})
        return {doc["_id"]: doc["runs"] for doc in found}

    def all_ran() -> bool:
        return set(runs()) == set(inserted)

    try:
        lease = wait_for(lambda: holder(group, TRIGGER_LEASE), timeout=60, what="a watcher")
        lock = wait_for(lambda: holder(group, TRIGGER_SWEEP_LOCK), timeout=30, what="a sweeper")
        time.sleep(1.0)  # (the watcher has opened its stream)
        insert(20)
        wait_for(all_ran, timeout=60, what="the first orders' jobs")
        # When the primary is killed while orders are inserted, the leases held

        def keep_inserting() -> None:
            while not stop.is_set():
                insert(5)
                time.sleep(0.2)

        inserter = threading.Thread(target=keep_inserting, daemon=True)
        inserter.start()
        time.sleep(1.0)
        old = group.primary()
        killed_at = time.monotonic()
        old.kill()
        new = group.wait_for_new_primary(old.port)
        promoted = time.monotonic() - killed_at
        # Then the leases are held on the new primary by the workers, sweeps go on (the sweeper
        # notices the new primary) and the trigger's jobs run
        lease_after = wait_for(
            lambda: holder(group, TRIGGER_LEASE), timeout=30, what="the lease on the new primary"
        )
        lock_after = wait_for(
            lambda: holder(group, TRIGGER_SWEEP_LOCK), timeout=30, what="the lock on it"
        )
        assert any(w.pid == pid_of(lock_after[0]) for w in workers.values())
        # (the lock may move between the workers meanwhile: whichever sweeps next notices)
        wait_for(
            lambda: any(worker_log_counts(w)["noticed"] >= 1 for w in workers.values()),
            timeout=30,
            what="the sweeper to notice the new primary",
        )
        time.sleep(2.0)
        stop.set()
        inserter.join(30)
        wait_for(all_ran, timeout=60, interval=0.5, what="every order's job after the failover")
        recovered = time.monotonic() - killed_at
        assert all(w.alive() for w in workers.values()), "a worker ended at the failover"
        # And when a holder dies (SIGKILL: nothing given up; a new worker comes up in its
        # place), another worker takes its lease once its time ends, with a higher token
        for key in (TRIGGER_SWEEP_LOCK, TRIGGER_LEASE):
            # (held, or between a holder's lapse and the next take: a slow sweep's)
            held_by = wait_for(lambda k=key: holder(group, k), timeout=30, what=f"{key} held")
            victim = next(n for n, w in workers.items() if w.pid == pid_of(held_by[0]))
            workers.pop(victim).kill()
            workers[f"{victim}b"] = start(f"{victim}b")
            taken = wait_for(
                lambda k=key, h=held_by: (x := holder(group, k)) is not None and x[0] != h[0] and x,
                timeout=30,
                what=f"another holder of {key}",
            )
            assert taken[1] > held_by[1]
            insert(5)  # (jobs run meanwhile)
            wait_for(all_ran, timeout=60, interval=0.5, what="the orders inserted meanwhile")
        # (held, or between one sweep's lapse and the next take: the loop's own wait)
        sweeping = wait_for(
            lambda: holder(group, TRIGGER_SWEEP_LOCK), timeout=30, what="a sweeper now"
        )
        survivor = next(w for w in workers.values() if w.pid == pid_of(sweeping[0]))
        # (its sweeps run: a marker gone is noticed at its next sweep; on the primary now, the
        # sentinels may have failed over again since, on a loaded machine)
        with node_client(group, group.primary()) as primary:
            primary.delete(TRIGGER_MARKER)
        wait_for(
            lambda: "its marker was missing" in survivor.log_path.read_text(errors="replace"),
            timeout=30,
            what="a sweep by the new holder",
        )
        insert(10)
        wait_for(all_ran, timeout=60, interval=0.5, what="the orders inserted after it")
        time.sleep(SETTLE_SECONDS)
        counted = runs()
        assert {i: n for i, n in counted.items() if n != 1} == {}
        assert set(counted) == set(inserted)
        assert worker_log_counts(survivor)["unrecoverable"] == 0
        print(
            f"\nleases: primary {old.port} -> {new.port} after {promoted:.1f} s; lock"
            f" {lock} -> {lock_after}, lease {lease} -> {lease_after}; {len(inserted)} orders,"
            f" each run once, all ran {recovered:.1f} s after the kill"
        )
    finally:
        stop.set()
        for running in workers.values():
            running.kill()
        client.close()


def test_a_sweeper_that_first_looks_after_a_failover_notices_it(
    stack: EmbeddedStack, group: SentinelGroup
) -> None:
    """The sweep lock may move to another worker during a failover (its holder cannot renew it
    meanwhile): that worker's first look has no look of its own to compare with, and compares
    with the primary the fleet's last look recorded in the broker."""
    # Given the fleet's sweeper that looked at the broker before the failover (its first look
    # wrote the app's marker), the sweepers of one app (one name) in three processes
    before = group_producer(stack, group, "sweepers")
    assert before.reconciler._broker.continuity() is not None
    assert data_lost(None, before.reconciler._broker.continuity()) is None
    replicated(group)
    # When the primary dies, and another process looks for the first time after it
    old = group.primary()
    old.kill()
    group.wait_for_new_primary(old.port)
    after = group_producer(stack, group, "sweepers")
    # (the primary the sentinels name at the look: on a loaded machine they may fail over
    # again within seconds)
    now = wait_for(
        lambda: (
            (c := after.reconciler._broker.continuity()) is not None
            and c.primary == f"127.0.0.1:{group.primary_port()}"
            and c
        ),
        timeout=30,
        what="a look at the new primary",
    )
    # Then it says the broker may have lost data: its primary moved (from the killed one)
    why = data_lost(None, now)
    assert why is not None and f"from 127.0.0.1:{old.port} to {now.primary}" in why, why
    # and a later first look by yet another process says nothing (the fleet saw it)
    again = group_producer(stack, group, "sweepers")
    assert data_lost(None, again.reconciler._broker.continuity()) is None
    for app in (before, after, again):
        app.close()


# -- 5. twice in a row: the promoted replica stalls at once --------------------------------------

STALE_JOBS = 20


def test_a_promoted_replica_that_stalls_at_once_is_failed_over_too_and_nothing_is_lost(
    stack: EmbeddedStack, group: SentinelGroup, worker: WorkerProcess
) -> None:
    """On a loaded machine the replica just promoted may miss the sentinels' pings for their
    down-after time (a busy core, a fork for its first sync): they fail over again, to the last
    replica, while clients may hold connections to the stalled one, which runs again believing
    itself the primary, taking their writes, until the sentinels make it a replica and it drops
    them. Every job must still run, once, and those it dropped come back at the reconciler's
    next sweeps (it watches for missing messages for a while after a failover), not after its
    ordinary wait for a quiet job (30 s)."""
    producer = group_producer(stack, group, "stalled-producer")
    worker_pid = worker.pid
    with loaded(shared_task(producer, RECORD)) as load:
        # Given jobs published and run through the sentinels
        wait_for(lambda: len(load.published) > 10, timeout=60, what="the load")
        # When the primary is killed, and the replica promoted stalls (SIGSTOP) at once, past
        # the down-after time, then runs again
        first = group.primary()
        killed_at = time.monotonic()
        first.kill()
        second = group.wait_for_new_primary(first.port)
        with paused(second):
            third = group.wait_for_new_primary(second.port)
            promoted = time.monotonic() - killed_at
        continued = time.monotonic()
        # ...and a client still connected to it publishes there meanwhile
        stale = producer_app(
            EmbeddedStack(APP_MODULE, Path("."), broker=second, ledger=stack.ledger),
            "stale-producer",
            queue_namespace=NAMESPACE,
        )
        assert role(group, second) == "master"
        stale_tokens = [f"stale-{uuid.uuid4().hex[:12]}" for _ in range(STALE_JOBS)]
        for token in stale_tokens:
            shared_task(stale, RECORD).delay(token=token)
        stale_published = time.monotonic()
        # Then those jobs run soon, their messages missing from the primary (brought back by
        # the sweeps of the watch, before or after it drops them)
        stale_ran = wait_all_ran(stale_tokens, timeout=90)
        # And it becomes a replica of the last one (what it took meanwhile dropped)
        wait_for(
            lambda: replicates(group, second, third), timeout=60, what="the stalled one demoted"
        )
        demoted_at = time.monotonic()
        time.sleep(3)  # (jobs published and run on the last primary)
    # And every job ran, once
    tokens = load.tokens() + stale_tokens
    wait_all_ran(tokens)
    drained = time.monotonic() - demoted_at
    time.sleep(SETTLE_SECONDS)
    assert runs_not_once(tokens) == {}
    # (the ordinary look finds a job missing only once it was quiet for 30 s)
    assert stale_ran < 20, f"the stale primary's jobs ran {stale_ran:.1f} s after their publish"
    # and the worker never ended
    assert_worker_stayed(worker, worker_pid)
    counts = worker_log_counts(worker)
    print(
        f"\nprimary {first.port} killed, {second.port} promoted and stalled, {third.port}"
        f" promoted {promoted:.1f} s after the kill; {STALE_JOBS} jobs published to the stalled"
        f" one {stale_published - continued:.1f} s after it ran again ran {stale_ran:.1f} s"
        f" later; it was a replica {demoted_at - continued:.1f} s after it ran again;"
        f" {len(tokens)} jobs, all ran"
        f" {drained:.1f} s after that; refusals {load.refusals}; reconciler: {counts}"
    )
    producer.close()
    stale.close()


# -- 6. published while the ledger is away, the primary's last writes lost ------------------------

AWAY_JOBS = 6
AWAY_BULK = 4


@pytest.mark.parametrize("confirmed", [True, False], ids=["confirmed", "unconfirmed"])
def test_jobs_published_while_the_ledger_is_away_survive_a_failover_that_loses_their_writes(
    tmp_path: Path, stack: EmbeddedStack, group: SentinelGroup, confirmed: bool
) -> None:
    """A job published while the ledger is away has no record: only the broker keeps it (its
    message, and its record kept beside it until the ledger is back). If the primary took
    those writes and a failover promoted a replica that never received them, nothing would
    know the job existed. So such a publish returns only once a replica holds its record, and
    is refused otherwise; the caller publishes again (the key runs it once). ``unconfirmed``
    is the same without the wait (``LEDGER_BROKER_CONFIRM_REPLICAS=0``): the jobs are lost,
    which is what this test exists to catch."""
    unreachable = f"mongodb://127.0.0.1:{free_port()}/"  # (the producers' ledger: away)

    def away_producer(name: str) -> Any:  # (each finds the ledger away at its first publish)
        return group_producer(
            stack,
            group,
            name,
            mongo_uri=unreachable,
            mongo_timeout_ms=300,
            broker_timeout_seconds=2.0,  # (the replicas' confirmation waited for: 1 s)
            broker_confirm_replicas=None if confirmed else 0,
        )

    producer, bulk_producer = away_producer("away-one"), away_producer("away-bulk")
    task = shared_task(producer, RECORD)
    run = uuid.uuid4().hex[:8]
    singles = [f"away-{run}-one{n}" for n in range(AWAY_JOBS)]
    bulk = [f"away-{run}-bulk{n}" for n in range(AWAY_BULK)]
    refused: list[str] = []
    reasons: list[str] = []
    replicated(group)
    # Given the ledger away, when jobs are published (in a bulk publish whose records' write
    # fails; one by one, the first write failing, then the ledger seen away) while the
    # replicas receive none of the primary's writes, and the primary is killed
    with replicas_paused(group) as old:
        try:
            bulk_task = shared_task(bulk_producer, RECORD)
            bulk_producer.publish_many([bulk_task.s(token=token) for token in bulk])
        except NotReplicated as exc:
            refused.extend(bulk)
            reasons.append(str(exc))
        for token in singles:
            try:
                task.delay(token=token)
            except NotReplicated as exc:
                refused.append(token)
                reasons.append(str(exc))
        old.kill()
        killed_at = time.monotonic()
    group.wait_for_new_primary(old.port)
    promoted = time.monotonic() - killed_at
    # Then, confirmed, every publish was refused, saying why (and none was, unconfirmed): the
    # bulk publish once, for its whole batch
    tokens = bulk + singles
    assert refused == (tokens if confirmed else [])
    assert len(reasons) == (1 + AWAY_JOBS if confirmed else 0)
    assert all("not published: the ledger is away" in reason for reason in reasons)
    # And when the caller publishes the refused ones again (the ledger still away)...
    for token in refused:
        wait_for(lambda token=token: _published(task, token), timeout=60, what="a publish again")
    again = time.monotonic() - killed_at
    # ...and a worker runs (its ledger reachable)
    starting = time.monotonic()
    worker = group_worker(tmp_path / "stack", stack, group, tiers=())
    try:
        # Then every job runs, once: its record kept on a replica that became the primary
        if not confirmed:
            with pytest.raises(AssertionError, match="published jobs to run"):
                wait_all_ran(tokens, timeout=15)
            assert ran(tokens) == set(), "a job published to the lost primary ran"
            return
        wait_all_ran(tokens, timeout=90)
        took = time.monotonic() - starting
        time.sleep(SETTLE_SECONDS)
        assert runs_not_once(tokens) == {}
        print(
            f"\npromoted {promoted:.1f} s after the kill; {len(tokens)} jobs refused"
            f" ({len(reasons)} refusals), all published again {again:.1f} s after the kill,"
            f" all ran {took:.1f} s after a worker was started"
        )
    finally:
        worker.stop()
        producer.close()
        bulk_producer.close()


def _published(task: Any, token: str) -> bool:
    try:
        task.delay(token=token)
    except Exception:  # (the new primary's replica not in sync yet; a demoted one's refusal)
        return False
    return True


def test_jobs_published_while_the_ledger_is_away_to_a_stalled_old_primary_are_not_lost(
    tmp_path: Path, stack: EmbeddedStack, group: SentinelGroup
) -> None:
    """The failover soak's case: the primary stops past the sentinels' down-after time, a
    replica is promoted, and the old one runs again believing itself the primary until the
    sentinels demote it, a producer's pooled connections still on it. What it takes meanwhile
    is dropped at its demotion; with the ledger away a publish there has nothing else to keep
    it, so it must be refused (no replica of its confirms it), never lost."""
    producer = group_producer(
        stack,
        group,
        "stalled-away-producer",
        mongo_uri=f"mongodb://127.0.0.1:{free_port()}/",  # (the producer's ledger: away)
        mongo_timeout_ms=300,
        broker_timeout_seconds=2.0,  # (the replicas' confirmation waited for: 1 s)
    )
    task = shared_task(producer, RECORD)
    run = uuid.uuid4().hex[:8]
    # Given a producer's connections to the primary of now (a publish, the ledger away)
    tokens = [f"stale-{run}-warm"]
    replicated(group)  # (the replicas' first sync done: one of them confirms it)
    task.delay(token=tokens[0])
    old = group.primary()
    watcher = producer.runtime.broker_target.client()  # (a client of its own, as the producer's)
    watcher.ping()
    moved = primary_moved(watcher)
    assert moved is not None and not moved()
    # When the primary stops until a replica is promoted, then runs again
    with paused(old):
        new = group.wait_for_new_primary(old.port)
    # (a client's check after a confirmed WAIT: the sentinels name another primary than its
    # connections', and once asked its next connection is made to the new one)
    assert moved()
    assert watcher.ping() and not moved()
    watcher.close()
    # ...and jobs are published while it is still a primary (the sentinels demote it later)
    refused: list[str] = []
    refusals: Counter[str] = Counter()
    deadline = time.monotonic() + 8.0
    while time.monotonic() < deadline and role(group, old) == "master":
        token = f"stale-{run}-{len(tokens)}"
        tokens.append(token)
        try:
            task.delay(token=token)
        except Exception as exc:  # (or what a demoted primary's connection answers)
            refused.append(token)
            refusals[type(exc).__name__] += 1
    # Then the publishes that reached it were refused for want of a replica's confirmation
    assert refusals["NotReplicated"] >= 1, f"refusals {dict(refusals)} of {len(tokens) - 1}"
    # And when it is a replica, and the caller has published the refused ones again...
    wait_for(lambda: role(group, old) == "slave", timeout=60, what="the old primary demoted")
    for token in refused:
        wait_for(lambda token=token: _published(task, token), timeout=60, what="a publish again")
    # ...and a worker runs: every job ran, once
    worker = group_worker(tmp_path / "stack", stack, group, tiers=())
    try:
        took = wait_all_ran(tokens, timeout=90)
        time.sleep(SETTLE_SECONDS)
        assert runs_not_once(tokens) == {}
        print(
            f"\nold primary {old.port} stopped, {new.port} promoted; {len(tokens) - 1} publishes"
            f" while it ran again as a primary: refused {dict(refusals)}; published again, all"
            f" {len(tokens)} jobs ran {took:.1f} s after a worker was started"
        )
    finally:
        worker.stop()
        producer.close()
