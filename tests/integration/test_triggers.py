"""Change-stream triggers on real servers: each inserted order runs its job exactly once while
the watcher's worker is SIGKILLed, one watcher at a time, a full tier makes the watcher wait,
and a stream that cannot go on (its collection dropped, its place gone from the oplog) is
reported.

Each test has its own ledger database, queue namespace and watched collection, on the session's
servers (the lost-token test starts servers of its own, with a tiny oplog).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import uuid
from argparse import Namespace
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from bson import Decimal128, ObjectId
from click.testing import CliRunner
from pymongo import MongoClient

from celery_ledger import LedgerCelery, State
from celery_ledger.cli.triggers import triggers as triggers_cli
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess
from celery_ledger.health import run_checks
from celery_ledger.identity import derive_task_id
from celery_ledger.ledger.trigger_store import TriggerStore
from celery_ledger.triggers import change_key, watchers_for
from tests.integration.apps import dying_trigger as hooked
from tests.integration.apps import triggers as trigger_app

from .conftest import producer_app
from .helpers import wait_for

MODULE = "tests.integration.apps.triggers"
HOOKED_MODULE = "tests.integration.apps.dying_trigger"  # the same app, dying once at a publish
LEASE_KEY = f"{trigger_app.NAME}:ledger:trigger:{trigger_app.TASK}"


class TriggerWorld:
    """One test's trigger: its collection, ledger database, queues and workers."""

    def __init__(self, stack: EmbeddedStack, data_dir: Path, **env: str) -> None:
        assert stack.ledger is not None and stack.broker is not None
        suffix = uuid.uuid4().hex[:8]
        self.collection_name = f"orders_{suffix}"
        self.namespace = f"trig_{suffix}"
        self.database = f"triggers_{suffix}"
        self.client: MongoClient[dict[str, Any]] = MongoClient(stack.ledger.url, tz_aware=True)
        self.world = self.client.get_database("reference_world")
        self.orders = self.world.get_collection(self.collection_name)
        self.redis = redis.Redis.from_url(stack.broker.url)
        self.env = {
            "TRIGGER_TEST_COLLECTION": self.collection_name,
            "LEDGER_MONGO_DB": self.database,
            "LEDGER_QUEUE_NAMESPACE": self.namespace,
            "LEDGER_DEFER_POLL_SECONDS": "0.2",
            "LEDGER_RECONCILE_IN_WORKERS": "false",
            **env,
        }
        self.stack = EmbeddedStack(
            MODULE,
            data_dir,
            broker=stack.broker,
            ledger=stack.ledger,
            queue_namespace=self.namespace,
        )
        self.workers: dict[str, WorkerProcess] = {}
        # A probe: the same app's trigger on its own ledger database, to read records and checks
        self.probe: LedgerCelery = producer_app(
            stack, trigger_app.NAME, mongo_db=self.database, queue_namespace=self.namespace
        )
        trigger_app.register(self.probe, self.collection_name)
        self.store = TriggerStore(self.probe.ledger)
        self.redis.delete(LEASE_KEY)  # a lease a killed worker of an earlier test left

    def start(
        self, name: str, *tiers: str, concurrency: int = 2, app: str = MODULE, **env: str
    ) -> WorkerProcess:
        """A worker of ``app`` (the trigger app, or a variant of it) with ``env`` of its own."""
        stack = self.stack if app == MODULE else replace(self.stack, app_module=app, workers=[])
        worker = stack.start_worker(
            self.stack.queues_of(*tiers),
            concurrency=concurrency,
            name=f"{name}@127.0.0.1",
            env={**self.env, **env},
        )
        self.workers[name] = worker
        return worker

    def watching(self) -> bool:
        """A watcher has opened the stream and kept its starting place (a new trigger sees the
        changes made after that)."""
        state = self.store.load(trigger_app.TASK)
        return state is not None and state.token is not None

    def holder(self) -> str | None:
        value = self.redis.get(LEASE_KEY)
        return value.decode().split("|", 1)[0] if value else None

    def runs(self) -> dict[str, int]:
        """Runs of the job of each order that has its effect, by order id."""
        effects = self.world.get_collection(trigger_app.EFFECTS)
        found = effects.find({"_id": {"$regex": f"^{self.collection_name}-"}}, {"runs": 1})
        return {doc["_id"]: doc["runs"] for doc in found}

    def in_broker(self, task_id: str) -> list[str]:
        """The keys of this test's queues (ready, or delivered and unacknowledged) that hold a
        message of ``task_id``."""
        found = []
        for key in self.redis.scan_iter(match=f"{self.namespace}*"):
            kind = self.redis.type(key)
            if kind == b"list":
                values = self.redis.lrange(key, 0, -1)
            elif kind == b"hash":
                values = self.redis.hvals(key)
            else:
                continue
            if any(task_id.encode() in value for value in values):
                found.append(key.decode())
        return found

    def describe(self) -> str:
        """What a failing wait shows: runs, records by state, the trigger's place."""
        states = {
            row["_id"]: row["n"]
            for row in self.probe.ledger.collection.aggregate(
                [{"$group": {"_id": "$state", "n": {"$sum": 1}}}]
            )
        }
        runs = self.runs()
        return (
            f"{len(runs)} orders ran ({sum(runs.values())} runs); records {states};"
            f" trigger {self.store.load(trigger_app.TASK)}; holder {self.holder()}"
        )

    def close(self) -> None:
        for worker in self.workers.values():
            worker.kill()  # each test has its own queues, database and collection
        self.probe.close()
        self.client.close()
        self.redis.close()


@pytest.fixture
def world(stack: EmbeddedStack, tmp_path: Path) -> Iterator[Callable[..., TriggerWorld]]:
    made: list[TriggerWorld] = []

    def make(**env: str) -> TriggerWorld:
        made.append(TriggerWorld(stack, tmp_path, **env))
        return made[-1]

    yield make
    for each in made:
        each.close()


def order(world: TriggerWorld, number: int) -> dict[str, Any]:
    return {
        "_id": f"{world.collection_name}-{number}",
        "amount": Decimal128(f"{number}.50"),
        "placed_at": datetime.now(UTC),
        "ref": ObjectId(),
    }


def test_each_inserted_order_runs_once_while_the_watcher_is_killed_twice(
    world: Callable[..., TriggerWorld],
) -> None:
    # Given two workers, both competing for the trigger's lease, whose own housekeeping brings
    # back the jobs a killed worker held (a short job lease, the reconciler every second)
    w = world(
        LEDGER_LEASE_SECONDS="3",
        LEDGER_RECONCILE_EVERY_SECONDS="1",
        LEDGER_RECONCILE_LEASE_GRACE_SECONDS="1",
        LEDGER_RECONCILE_IN_WORKERS="true",
    )
    for name in ("tw1", "tw2"):
        w.start(name)
    wait_for(w.watching, timeout=30, what="a watcher")
    first = w.holder()
    holders = [first]

    # When 1,000 orders are inserted in bursts while the watcher's worker is SIGKILLed twice
    total = 1000
    done = threading.Event()

    def insert() -> None:
        for start in range(0, total, 50):
            w.orders.insert_many([order(w, n) for n in range(start, start + 50)])
            time.sleep(random.uniform(0.05, 0.3))
        done.set()

    inserter = threading.Thread(target=insert, daemon=True)
    inserter.start()
    for kill in range(2):
        # the watcher has turned some changes into jobs and saved its place
        wait_for(
            lambda k=kill: (
                (s := w.store.load(trigger_app.TASK)) is not None and s.changes >= (k + 1) * 150
            ),
            timeout=90,
            what=f"the watcher's progress before kill {kill + 1}",
        )
        holder = w.holder()
        assert holder is not None
        victim = next(n for n, wk in w.workers.items() if holder.endswith(f":{wk.pid}"))
        w.workers[victim].kill()
        # Then the other worker takes the watch over once the lease ends
        taken = wait_for(
            lambda h=holder: (x := w.holder()) is not None and x != h and x,
            timeout=30,
            what=f"another watcher after kill {kill + 1}",
        )
        holders.append(taken)
        w.start(victim)  # the host comes back
    inserter.join(60)
    assert done.is_set()

    # Then every order's job ran and has its one effect, and each job's record succeeded
    try:
        runs = wait_for(lambda: len(r := w.runs()) == total and r, timeout=120, what="1000 runs")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {w.describe()}") from None
    # (a body runs again only when its worker was killed while it ran, before its completion
    # was recorded: the claim is taken over after the job's lease, its attempts say so; at most
    # the jobs in flight at the two kills)
    repeated = {key: n for key, n in runs.items() if n != 1}
    taken_over = w.probe.ledger.collection.count_documents(
        {"task": trigger_app.TASK, "attempts": {"$gte": 2}}
    )
    assert len(repeated) <= taken_over <= 2 * 2, (repeated, taken_over)
    records = w.probe.ledger.collection.count_documents(
        {"task": trigger_app.TASK, "state": State.SUCCEEDED.value}
    )
    assert records == total
    assert w.probe.ledger.collection.count_documents({"task": trigger_app.TASK}) == total
    # And the arguments arrived as relaxed Extended JSON, restored to their BSON types
    sample = w.world.get_collection(trigger_app.EFFECTS).find_one({"_id": f"{w.collection_name}-7"})
    assert sample is not None
    assert (sample["amount"], sample["amount_type"], sample["placed_type"]) == (
        "7.50",
        "Decimal128",
        "datetime",
    )
    # And each kill moved the watch to another process (checked as it happened, above)
    assert holders[1] != holders[0] and holders[2] != holders[1]
    state = w.store.load(trigger_app.TASK)
    assert state is not None and state.problem is None and state.changes >= total


def test_a_watcher_killed_between_a_changes_record_and_its_message_is_recovered(
    world: Callable[..., TriggerWorld], tmp_path: Path
) -> None:
    # Given a trigger watched by one worker of two (the watcher consumes no bulk: it runs no
    # job), which dies as it publishes order 12's job: its record written, its message not
    # (the crash: the before_task_publish hook of apps/dying_trigger.py); the other worker
    # runs the jobs and waits for the lease. No reconciler runs anywhere.
    w = world(TRIGGER_TEST_LEASE_SECONDS="10")  # time to look at the broker before a takeover
    total, doomed = 30, 12
    doomed_order = f"{w.collection_name}-{doomed}"
    marker = tmp_path / "watcher-died"
    watcher = w.start(
        "td1",
        "default",
        concurrency=1,
        app=HOOKED_MODULE,
        **{hooked.DIE_AT_ORDER: doomed_order, hooked.DIE_MARKER: str(marker)},
    )
    wait_for(w.watching, timeout=30, what="a watcher")
    first = w.holder()
    assert first is not None and first.endswith(f":{watcher.pid}")
    w.start("td2")

    # When 30 orders come in (their changes' record ids read from a stream of our own)
    with w.orders.watch() as stream:
        w.orders.insert_many([order(w, n) for n in range(total)])
        changes = [wait_for(stream.try_next, timeout=10, what="a change") for _ in range(total)]
    ids = [derive_task_id(trigger_app.TASK, change_key(c)) for c in changes]
    assert [c["fullDocument"]["_id"] for c in changes][doomed] == doomed_order
    # Then the watcher's worker is SIGKILLed at order 12's publish, and at that moment (before
    # any takeover) its job is recorded queued, unclaimed, with no message in the broker;
    # the orders after it have no record
    assert watcher.process.wait(30) == -signal.SIGKILL
    assert marker.read_text() == f"{watcher.pid} {doomed_order}"
    record = w.probe.ledger.find_raw(ids[doomed])
    assert record is not None, "the record is written before the message"
    assert (record["state"], record["attempts"]) == (State.QUEUED.value, 0)
    assert w.in_broker(ids[doomed]) == []
    known = w.probe.ledger.collection.count_documents({"_id": {"$in": ids}})
    assert known == doomed + 1
    assert w.holder() == first, "the lease was taken over before the look: nothing is shown"

    # Then the other worker takes the watch over from the stored token
    wait_for(
        lambda: (x := w.holder()) is not None and x != first,
        timeout=30,
        what="another watcher",
    )
    # And every order's job ran exactly once, the one whose message was lost included
    try:
        runs = wait_for(lambda: len(r := w.runs()) == total and r, timeout=60, what="30 runs")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {w.describe()}") from None
    assert runs == {f"{w.collection_name}-{n}": 1 for n in range(total)}
    # (the effect is written by the body, its record's completion just after)

    def records() -> dict[str, tuple[str, int]]:
        found = w.probe.ledger.collection.find({"task": trigger_app.TASK})
        return {doc["_id"]: (doc["state"], doc["attempts"]) for doc in found}

    succeeded = dict.fromkeys(ids, (State.SUCCEEDED.value, 1))
    try:
        wait_for(lambda: records() == succeeded, timeout=10, what="30 succeeded records")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {records()}") from None
    state = w.store.load(trigger_app.TASK)
    assert state is not None and state.problem is None


def test_a_watcher_stopped_warmly_saves_its_place_and_gives_its_watch_up_at_once(
    world: Callable[..., TriggerWorld],
) -> None:
    # Given two workers, one watching with a 30 s lease, and orders it turned into jobs
    w = world(TRIGGER_TEST_LEASE_SECONDS="30")
    w.start("tw1")
    wait_for(w.watching, timeout=30, what="a watcher")
    w.start("tw2")
    holder = w.holder()
    assert holder is not None
    victim = next(n for n, wk in w.workers.items() if holder.endswith(f":{wk.pid}"))
    w.orders.insert_many([order(w, n) for n in range(20)])
    wait_for(lambda: len(w.runs()) == 20, timeout=60, what="20 runs")
    # When its worker is stopped warmly (SIGTERM: a deploy, a scale-down)
    stopped_at = time.monotonic()
    w.workers[victim].process.send_signal(signal.SIGTERM)
    assert w.workers[victim].process.wait(30) == 0
    # Then the other worker watches well before the lease would have ended (it was given up),
    # from the place the stopped one saved: the next orders run once, the earlier ones not again
    taken = wait_for(
        lambda: (x := w.holder()) is not None and x != holder and x, timeout=20, what="takeover"
    )
    assert time.monotonic() - stopped_at < 20, "the lease ran out: it was not given up"
    assert not taken.endswith(f":{w.workers[victim].pid}")
    w.orders.insert_many([order(w, n) for n in range(20, 30)])
    runs = wait_for(lambda: len(r := w.runs()) == 30 and r, timeout=60, what="30 runs")
    assert runs == {f"{w.collection_name}-{n}": 1 for n in range(30)}


def test_two_watchers_never_read_at_once(world: Callable[..., TriggerWorld]) -> None:
    # Given three live workers competing for one trigger (a lease no stall of a loaded
    # machine outlasts: the test is of who reads, not of a takeover)
    w = world(TRIGGER_TEST_LEASE_SECONDS="10")
    for name in ("tx1", "tx2", "tx3"):
        w.start(name, "default", concurrency=1)
    wait_for(w.watching, timeout=30, what="a watcher")
    # When orders keep coming for a while (no job runs: no worker consumes bulk)
    savers: set[str] = set()
    holders: set[str] = set()
    for batch in range(15):
        w.orders.insert_many([order(w, batch * 10 + n) for n in range(10)])
        time.sleep(0.3)
        holders.add(w.holder() or "")
        doc = w.store.collection.find_one({"_id": trigger_app.TASK})
        if doc:
            savers.add(doc["holder"])
    # Then one process held the lease the whole time, and only it saved the trigger's place
    assert len(holders) == 1 and "" not in holders
    assert savers == holders
    # And each change was published once: one queued record and one message per order
    wait_for(
        lambda: (s := w.store.load(trigger_app.TASK)) is not None and s.changes >= 150,
        timeout=30,
        what="all 150 changes recorded",
    )
    assert w.probe.ledger.collection.count_documents({"task": trigger_app.TASK}) == 150
    assert w.redis.llen(f"{w.namespace}.bulk") == 150


def test_a_full_tier_makes_the_watcher_wait(world: Callable[..., TriggerWorld]) -> None:
    # Given a bulk tier with a high-water mark of 40 and, at first, no worker consuming it
    w = world(LEDGER_TIER_LIMITS='{"bulk": {"high_water": 40, "low_water": 10}}')
    w.start("tp1", "default", concurrency=1)
    wait_for(w.watching, timeout=30, what="a watcher")
    # When a burst of 200 orders comes in
    w.orders.insert_many([order(w, n) for n in range(200)])
    # Then the watcher publishes up to the mark and waits there
    wait_for(lambda: w.redis.llen(f"{w.namespace}.bulk") >= 40, timeout=30, what="the tier filling")
    depths = []
    for _ in range(10):
        depths.append(w.redis.llen(f"{w.namespace}.bulk"))
        time.sleep(0.2)
    assert max(depths) <= 40
    # And once a worker drains the tier, every order runs exactly once
    w.start("tp2", "bulk", concurrency=2)
    runs = wait_for(lambda: len(r := w.runs()) == 200 and r, timeout=90, what="200 runs")
    assert set(runs.values()) == {1}


def test_a_dropped_collection_stops_the_trigger_and_is_reported(
    world: Callable[..., TriggerWorld],
) -> None:
    # Given a trigger whose watcher has run the first orders
    w = world()
    worker = w.start("ti1", concurrency=1)
    wait_for(w.watching, timeout=30, what="a watcher")
    w.orders.insert_many([order(w, n) for n in range(5)])
    wait_for(lambda: len(w.runs()) == 5, timeout=30, what="5 runs")
    # When the watched collection is dropped (the stream is invalidated)
    w.orders.drop()
    # Then the trigger stops with the problem stored, logged and failing the health check
    state = wait_for(
        lambda: (s := w.store.load(trigger_app.TASK)) is not None and s.problem and s,
        timeout=30,
        what="the problem stored",
    )
    assert state.problem == "invalidated"
    wait_for(
        lambda: "stopped (invalidated)" in worker.log_path.read_text(errors="replace"),
        timeout=10,
        what="the error logged",
    )
    check = next(c for c in run_checks(w.probe, required=(), timeout=2.0) if c.name == "triggers")
    assert check.status == "down" and "invalidated" in check.detail
    # And orders inserted later run nothing until an operator resets the trigger
    w.orders.insert_many([order(w, n) for n in range(5, 8)])
    time.sleep(2)
    assert len(w.runs()) == 5
    # When an operator sees it and resets it (the documented recovery, before a backfill)
    listed = CliRunner().invoke(triggers_cli, ["list", "--json"], obj=Namespace(app=w.probe))
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.output)[0]["status"] == "invalidated"
    reset = CliRunner().invoke(
        triggers_cli, ["reset", trigger_app.TASK, "--actor", "olive"], obj=Namespace(app=w.probe)
    )
    assert reset.exit_code == 0 and "Backfill" in reset.output, reset.output
    # Then the trigger watches again from now
    wait_for(
        lambda: (s := w.store.load(trigger_app.TASK)) is not None and s.token is not None,
        timeout=30,
        what="the watcher starting again",
    )
    w.orders.insert_one(order(w, 100))
    wait_for(lambda: f"{w.collection_name}-100" in w.runs(), timeout=30, what="a new run")
    assert len(w.runs()) == 6  # the three inserted while stopped are the backfill's to do


def test_a_token_gone_from_the_oplog_is_reported(tmp_path: Path, stack: EmbeddedStack) -> None:
    # Given servers of its own whose oplog keeps only 30 entries
    own = EmbeddedStack(MODULE, tmp_path / "own", auth=True, queue_namespace="trig_lost")
    try:
        own.start_servers()
        assert own.ledger is not None
        own.ledger.stop(timeout=30.0)
        own.ledger.argv = [*own.ledger.argv, "--oplog-max-entries", "30"]
        own.ledger.restart()
        w = TriggerWorld(own, tmp_path)
        try:
            worker = w.start("tl1", concurrency=1)
            wait_for(w.watching, timeout=30, what="the trigger's first place")
            w.orders.insert_many([order(w, n) for n in range(3)])
            wait_for(lambda: len(w.runs()) == 3, timeout=30, what="3 runs")
            # When the watcher is down while 100 changes push its place out of the oplog
            worker.stop()
            w.orders.insert_many([order(w, n) for n in range(3, 103)])
            w.client.admin.command("secantusAdmin.pruneOplog")
            worker = w.start("tl1", concurrency=1)
            # Then the next watcher reports the lost history instead of skipping silently
            state = wait_for(
                lambda: (s := w.store.load(trigger_app.TASK)) is not None and s.problem and s,
                timeout=30,
                what="the problem stored",
            )
            assert state.problem == "history_lost"
            check = next(
                c for c in run_checks(w.probe, required=(), timeout=2.0) if c.name == "triggers"
            )
            assert check.status == "down" and "history_lost" in check.detail
            assert len(w.runs()) == 3
        finally:
            w.close()
    finally:
        own.stop()


def test_the_job_is_keyed_on_the_change_and_an_oversized_one_is_kept_dead(
    world: Callable[..., TriggerWorld],
) -> None:
    # Given a trigger whose arguments may be at most 2 KiB of JSON
    w = world(LEDGER_MAX_PAYLOAD_BYTES="2048")
    w.start("tk1", concurrency=1)
    wait_for(w.watching, timeout=30, what="a watcher")
    # When an order too large to publish comes in, then a normal one
    with w.orders.watch() as stream:
        w.orders.insert_one({**order(w, 0), "notes": "x" * 4096})
        w.orders.insert_one(order(w, 1))
        big = wait_for(stream.try_next, timeout=10, what="the first change")
        normal = wait_for(stream.try_next, timeout=10, what="the second change")

    # Then each job's record is the one keyed on its change's resume token
    def record(change: dict[str, Any], state: State) -> Any:
        record_id = derive_task_id(trigger_app.TASK, change_key(change))
        return wait_for(
            lambda: (
                (r := w.probe.ledger.find_raw(record_id)) is not None
                and r.get("state") == state.value
                and r
            ),
            timeout=30,
            what=f"a {state.value} record",
        )

    assert record(normal, State.SUCCEEDED)["key"] == normal["_id"]["_data"]
    # And the oversized one is a dead letter with its reason, not a trigger stuck on it
    dead = record(big, State.DEAD)
    assert (
        dead["dead_reason"].startswith("payload:")
        and f"{w.collection_name}-0" in dead["dead_reason"]
    )
    assert list(w.runs()) == [f"{w.collection_name}-1"]


def test_a_watchers_stop_during_a_ledger_outage_keeps_to_its_time(
    tmp_path: Path, stack: EmbeddedStack
) -> None:
    # Given a watcher holding its lease with changes read and not saved, on servers of its own
    own = EmbeddedStack(MODULE, tmp_path / "own", auth=True, queue_namespace="trig_stop")
    try:
        own.start_servers()
        assert own.ledger is not None
        w = TriggerWorld(own, tmp_path)
        try:
            [watcher] = watchers_for(w.probe)
            wait_for(lambda: watcher.tick() and w.watching(), timeout=30, what="the stream open")
            w.orders.insert_many([order(w, n) for n in range(3)])
            jobs = w.probe.ledger.collection
            wait_for(
                lambda: watcher.tick() is not None and jobs.count_documents({}) >= 3,
                timeout=30,
                what="3 jobs published",
            )
            # When the worker stops with 0.5 s for it while the ledger does not answer
            os.kill(own.ledger.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                watcher.stop(timeout=0.5)
                took = time.monotonic() - started
            finally:
                os.kill(own.ledger.pid, signal.SIGCONT)
            # Then the stop keeps to its time (the place not saved is read again, keyed)
            # (it took 10 s before: the stream's close waited for the driver's timeouts)
            assert took < 0.5 + 3, f"the stop took {took:.1f}s"
        finally:
            w.close()
    finally:
        own.stop()


def test_workers_with_triggers_off_never_watch_and_the_watch_resumes_where_they_are_on(
    world: Callable[..., TriggerWorld],
) -> None:
    """A fleet mix: two workers with triggers off (``LEDGER_TRIGGERS_IN_WORKERS=false``) and
    one with them on. Only that one watches; the others run the jobs. When it dies, no worker
    watches (the changes wait in the collection, none lost) until one with triggers on comes
    up, which reads on from the saved place: every change runs once."""
    w = world(TRIGGER_TEST_LEASE_SECONDS="3")
    for name in ("off1", "off2"):
        w.start(name, LEDGER_TRIGGERS_IN_WORKERS="false")
    watcher = w.start("on1")
    wait_for(w.watching, timeout=30, what="a watcher")
    assert (w.holder() or "").endswith(f":{watcher.pid}")
    w.orders.insert_many([order(w, n) for n in range(100)])
    wait_for(lambda: len(w.runs()) == 100, timeout=60, what="100 runs")
    # When the only worker with triggers on dies, and orders keep coming
    watcher.kill()
    w.orders.insert_many([order(w, n) for n in range(100, 200)])
    time.sleep(3 + 4)  # its lease ends: a worker with triggers off never takes it
    assert w.holder() is None, w.holder()
    assert len(w.runs()) == 100
    # Then a worker with triggers on reads on from the saved place: each change once
    w.start("on2")
    try:
        runs = wait_for(lambda: len(r := w.runs()) == 200 and r, timeout=60, what="200 runs")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {w.describe()}") from None
    assert set(runs.values()) == {1}, {k: n for k, n in runs.items() if n != 1}
