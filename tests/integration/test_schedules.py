"""Celery's ``beat_schedule`` on real servers: every tick runs, once per slot, whoever fires it
(celery beat, two beats, the workers without any beat, a scheduling worker SIGKILLed)."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ledger.embedded.servers import app_env, spawn
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess
from tasks.effects import effects

from .helpers import wait_for
from .skew import FakeClock, needs_faketime

MODULE = "tests.integration.apps.periodic"
NAMESPACE = "periodic_tests"
PERIOD = 2.0  # every entry of the app's schedule
KINDS = ("tick", "tick-keyed")


class Fleet:
    """Workers and beats of the periodic app on the session's servers, tagged with one run."""

    def __init__(self, stack: EmbeddedStack, base: Path) -> None:
        self.stack = EmbeddedStack(
            MODULE, base, broker=stack.broker, ledger=stack.ledger, queue_namespace=NAMESPACE
        )
        self.base = base
        self.run = uuid.uuid4().hex[:10]
        self.workers: list[WorkerProcess] = []
        self.beats: list[Any] = []

    def worker(self, name: str, concurrency: int = 1, **env: str) -> WorkerProcess:
        worker = self.stack.start_worker(
            self.stack.queues_of(),
            concurrency=concurrency,
            name=f"{name}@127.0.0.1",
            env={"PERIODIC_RUN": self.run, **env},
        )
        self.workers.append(worker)
        return worker

    def beat(self, name: str, *args: str) -> Any:
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            MODULE,
            "beat",
            "-s",
            str(self.base / f"beat-{name}.db"),
            "--loglevel",
            "INFO",
            *args,
        ]
        env = app_env(self.stack.env, {"PERIODIC_RUN": self.run})
        process = spawn(argv, self.base / f"beat-{name}.log", env)
        self.beats.append(process)
        return process

    def stop_beats(self) -> None:
        for process in self.beats:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=20)

    def stop(self) -> None:
        self.stop_beats()
        for worker in self.workers:
            worker.stop()

    def runs(self, kind: str) -> list[dict[str, Any]]:
        return list(effects().find({"kind": kind, "key": self.run}))

    def slots(self, kind: str) -> Counter[float]:
        return Counter(run["slot"] for run in self.runs(kind))

    def logs(self) -> str:
        paths = [w.log_path for w in self.workers] + list(self.base.glob("beat-*.log"))
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in paths if p.exists())


@pytest.fixture
def fleet(stack: EmbeddedStack, tmp_path: Path) -> Iterator[Fleet]:
    running = Fleet(stack, tmp_path)
    try:
        yield running
    finally:
        running.stop()


def once_per_slot(fleet: Fleet, kind: str, *, at_least: int) -> Counter[float]:
    """Every slot ran exactly once, and at least ``at_least`` slots ran."""
    slots = fleet.slots(kind)
    assert None not in slots, f"{kind}: a run without its slot\n{fleet.logs()}"
    twice = {slot: n for slot, n in slots.items() if n > 1}
    assert not twice, f"{kind}: slots run more than once: {twice}\n{fleet.logs()}"
    assert len(slots) >= at_least, f"{kind}: {len(slots)} slots ran\n{fleet.logs()}"
    return slots


def until_slots(fleet: Fleet, count: int, *, timeout: float = 60) -> None:
    """Wait until every entry ran ``count`` slots (or more)."""
    wait_for(
        lambda: all(len(fleet.slots(kind)) >= count for kind in KINDS),
        timeout=timeout,
        what=f"{count} slots of each entry",
    )


def settle(fleet: Fleet) -> None:
    time.sleep(PERIOD)  # what was published runs


def test_every_tick_of_a_beat_schedule_runs_once_under_two_beats(fleet: Fleet) -> None:
    # Given a worker that leaves the schedule to beat, and two beats (one too many: a failover
    # pair, or two left running by a deploy)
    fleet.worker("beat-worker", LEDGER_SCHEDULES_IN_WORKERS="false")
    fleet.beat("a")
    fleet.beat("b")

    # When they run the app's schedule for a while
    until_slots(fleet, 5)
    fleet.stop_beats()
    settle(fleet)

    # Then every tick ran (a keyless task, and one whose key names a fixed argument), each
    # slot once: on the code before, each ran once in all, every later tick a duplicate
    for kind in KINDS:
        slots = once_per_slot(fleet, kind, at_least=5)
        assert all(slot % PERIOD == 0 for slot in slots)  # the windows of the interval
        ordered = sorted(slots)
        assert all(b - a == PERIOD for a, b in itertools.pairwise(ordered)), ordered
    # and each run is a job of its own, named by its entry and slot
    jobs = [run["job"] for run in fleet.runs("tick")]
    assert len(set(jobs)) == len(jobs) and all(j.startswith("schedule:tick@") for j in jobs)


@pytest.mark.parametrize(
    "offsets",
    [
        (0, 0),
        pytest.param((3600, -3600), marks=needs_faketime),
        pytest.param((-40, 40), marks=needs_faketime),
    ],
    ids=["same-clocks", "hosts+1h-and-1h", "hosts-40s-and+40s"],
)
def test_the_workers_run_the_schedule_without_beat_and_through_a_sigkill(
    fleet: Fleet, offsets: tuple[int, int]
) -> None:
    assert fleet.stack.broker is not None
    # Given two workers and no beat (on hosts whose clocks agree, or are off: the windows are
    # on the broker's clock, and so is the lease a successor waits out)
    workers = [
        fleet.worker(name, **(FakeClock(fleet.base, name, offset).env() if offset else {}))
        for name, offset in zip(("sched-1", "sched-2"), offsets, strict=True)
    ]
    until_slots(fleet, 3)

    # (the operator sees who fires the schedule, and each entry's last slot)
    listed = json.loads(
        subprocess.run(
            [sys.executable, "-m", "celery", "-A", MODULE, "ledger", "schedules", "list", "--json"],
            env=app_env(fleet.stack.env),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    assert {row["schedule"] for row in listed["schedules"]} == set(KINDS)
    assert all(row["last_slot"] and row["next_due"] for row in listed["schedules"]), listed

    # When the one holding the schedule's lease is SIGKILLed
    client = redis.Redis.from_url(fleet.stack.broker.url)
    holder = client.get(f"{NAMESPACE}:ledger:schedules")
    assert holder is not None, fleet.logs()
    assert listed["fired_by"] == holder.decode().split("|")[0]
    pid = int(holder.decode().split("|")[0].rsplit(":", 1)[1])
    [victim] = [w for w in workers if w.pid == pid]
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.time()
    before = {kind: len(fleet.slots(kind)) for kind in KINDS}

    # Then the other takes over within the lease (10 s) and runs every window after it, once
    wait_for(
        lambda: all(len(fleet.slots(kind)) >= before[kind] + 4 for kind in KINDS),
        timeout=60,
        what="four more slots of each entry after the kill",
    )
    settle(fleet)
    for kind in KINDS:
        slots = once_per_slot(fleet, kind, at_least=before[kind] + 4)
        after = sorted(slot for slot in slots if slot > killed_at)
        assert after[0] - killed_at <= 10 + 2 * PERIOD, (kind, killed_at, after)
        assert all(b - a == PERIOD for a, b in itertools.pairwise(after)), (kind, after)
    client.close()


def test_beat_and_the_workers_together_run_each_slot_once(fleet: Fleet) -> None:
    # Given beat and workers that schedule too (an app moving off beat, or keeping both)
    fleet.worker("both-1")
    fleet.beat("a")
    until_slots(fleet, 5)
    fleet.stop_beats()
    settle(fleet)
    # Then each slot ran once
    for kind in KINDS:
        once_per_slot(fleet, kind, at_least=5)


def test_beat_with_another_scheduler_class_runs_every_tick_and_the_workers_stand_down(
    fleet: Fleet,
) -> None:
    assert fleet.stack.broker is not None
    client = redis.Redis.from_url(fleet.stack.broker.url)
    try:
        # Given a worker with the default settings, and beat with Celery's own scheduler
        # class (an app that chose its scheduler): its messages name no slot
        fleet.worker("plain-worker")
        fleet.beat("plain", "-S", "celery.beat:PersistentScheduler")
        wait_for(
            lambda: all(
                sum(r["job"].startswith("beat:") for r in fleet.runs(kind)) >= 4 for kind in KINDS
            ),
            timeout=60,
            what="four runs of each entry sent by beat",
        )
        fleet.stop_beats()
        settle(fleet)

        for kind in KINDS:
            runs = sorted(fleet.runs(kind), key=lambda run: run["at"])
            # every tick ran, each a job of its own
            assert len({run["job"] for run in runs}) == len(runs)
            # and once beat's runs began, the workers' scheduler stood down (or every tick
            # would run twice): its runs, if any, came before (and up to a pass after)
            first_beat = next(run["at"] for run in runs if run["job"].startswith("beat:"))
            fleets = [run["at"] for run in runs if run["job"].startswith("schedule:")]
            assert all((at - first_beat).total_seconds() < 2.0 for at in fleets), fleet.logs()
    finally:
        client.delete(f"{NAMESPACE}:ledger:schedules:foreign-beat")  # (for later tests)
        client.close()


def ledger_cli(fleet: Fleet, *args: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", MODULE, "ledger", "schedules", *args],
        env=app_env(fleet.stack.env, {"LEDGER_ACTOR": "ops-test", **env}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def iso(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).isoformat()


def test_an_operator_pauses_resumes_triggers_and_backfills_a_schedule(fleet: Fleet) -> None:
    from celery_ledger.schedules import PAUSED_READ_SECONDS

    # Given the workers running the schedule
    fleet.worker("ops-1")
    until_slots(fleet, 2)
    # When an operator pauses one entry for a while
    assert "tick: paused" in ledger_cli(fleet, "pause", "tick", "--reason", "maintenance")
    paused_at = time.time()
    listed = json.loads(ledger_cli(fleet, "list", "--json"))
    [row] = [r for r in listed["schedules"] if r["schedule"] == "tick"]
    assert row["paused"]["reason"] == "maintenance" and "ops-test" in row["paused"]["changed_by"]
    time.sleep(PAUSED_READ_SECONDS + 5 * PERIOD)
    resumed_at = time.time()
    assert "tick: resumed" in ledger_cli(fleet, "resume", "tick")
    # Then no slot of it ran while it was paused (past the pause's reach), the other entry's did
    wait_for(
        lambda: any(s > resumed_at + PAUSED_READ_SECONDS for s in fleet.slots("tick")),
        timeout=30,
        what="a slot of the resumed entry",
    )
    quiet_from, quiet_to = paused_at + PAUSED_READ_SECONDS + PERIOD, resumed_at - PERIOD
    assert not [s for s in fleet.slots("tick") if quiet_from <= s <= quiet_to], fleet.logs()
    assert [s for s in fleet.slots("tick-keyed") if quiet_from <= s <= quiet_to]
    # And a backfill over the pause runs each slot it missed, once; none that ran again
    out = ledger_cli(fleet, "backfill", "tick", "--from", iso(paused_at), "--to", iso(resumed_at))
    assert "slot(s)" in out
    grid = [s for s in range(math.ceil(paused_at), math.floor(resumed_at) + 1) if s % PERIOD == 0]
    wait_for(
        lambda: all(float(s) in fleet.slots("tick") for s in grid),
        timeout=30,
        what="every slot of the pause backfilled",
    )
    # And a trigger runs it once now, outside its grid or on it
    triggered = time.time()
    assert "sent" in ledger_cli(fleet, "trigger", "tick")
    wait_for(
        lambda: any(s >= math.floor(triggered) for s in fleet.slots("tick")),
        timeout=30,
        what="the triggered run",
    )
    settle(fleet)
    once_per_slot(fleet, "tick", at_least=len(grid) + 2)
    once_per_slot(fleet, "tick-keyed", at_least=4)


@pytest.mark.parametrize("overlap", ["skip", "allow_all"])
def test_an_overlap_policy_holds_slots_back_while_the_previous_run_runs(
    fleet: Fleet, overlap: str
) -> None:
    # Given an entry every 2 s whose runs take 5 s, on a worker with room for three at once
    fleet.worker("overlap", concurrency=3, PERIODIC_OVERLAP=overlap)
    wait_for(lambda: len(fleet.runs("slow")) >= 4, timeout=60, what="four runs of the entry")
    time.sleep(PERIOD)
    runs = sorted(fleet.runs("slow"), key=lambda run: run["slot"])
    slots = [run["slot"] for run in runs]
    starts = [run["at"].timestamp() for run in runs]
    assert len(set(slots)) == len(slots), f"a slot ran twice: {slots}"
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    if overlap == "skip":
        # Then no run starts while the one before runs: the slots meanwhile are skipped
        assert all(gap >= 4.5 for gap in gaps), (gaps, fleet.logs())
        assert all(b - a >= 3 * PERIOD for a, b in itertools.pairwise(slots)), slots
    else:  # (allow_all, Celery's way: a run every slot, three at a time here)
        assert any(gap < 4.5 for gap in gaps), gaps
        assert all(b - a == PERIOD for a, b in itertools.pairwise(slots)), slots


def test_an_entry_created_at_run_time_runs_each_slot_once_until_deleted(fleet: Fleet) -> None:
    from celery_ledger.schedules import PAUSED_READ_SECONDS

    first = fleet.worker("runtime-1")
    until_slots(fleet, 1)
    name = f"added-{fleet.run}"  # (the ledger is the session's: a name of this test's own)

    def added() -> list[float]:
        prefix = f"schedule:{name}@"
        return sorted(r["slot"] for r in fleet.runs("tick") if r["job"].startswith(prefix))

    # When an operator declares an entry at run time (every 2 s, overlap skip)
    out = ledger_cli(
        fleet, "create", name, "--task", "periodic.tick", "--every", "2", "--policy",
        '{"overlap": "skip"}',
    )  # fmt: skip
    assert f"{name}: created" in out
    # Then the workers run it, each slot once; list and show say where it comes from
    wait_for(lambda: len(added()) >= 3, timeout=30, what="three runs of the created entry")
    listed = json.loads(ledger_cli(fleet, "list", "--json"))
    [row] = [r for r in listed["schedules"] if r["schedule"] == name]
    assert row["origin"] == "ledger" and row["policy"] == "overlap=skip" and row["last_slot"]
    shown = json.loads(ledger_cli(fleet, "show", name, "--json"))
    assert shown["task"] == "periodic.tick" and shown["origin"] == "ledger"
    # and it survives the worker that ran it: a new worker runs it on, from the ledger
    first.stop()
    before = len(added())
    fleet.worker("runtime-2")
    wait_for(lambda: len(added()) >= before + 3, timeout=60, what="runs after the restart")
    slots = added()
    assert len(set(slots)) == len(slots), f"a slot ran twice: {slots}"
    # When it is deleted, no slot of it runs after (past a read of the controls)
    assert f"{name}: deleted" in ledger_cli(fleet, "delete", name)
    deleted_at = time.time()
    time.sleep(PAUSED_READ_SECONDS + 3 * PERIOD)
    assert not [s for s in added() if s > deleted_at + PAUSED_READ_SECONDS + PERIOD]
    assert name not in ledger_cli(fleet, "list")


def test_a_sensitive_task_scheduled_at_run_time_keeps_its_arguments_sealed(fleet: Fleet) -> None:
    from pymongo import MongoClient

    card = "4111111111111111"
    fleet.worker("sealed-1")
    name = f"charge-{fleet.run}"
    # When an operator schedules a sensitive task with the card as its argument
    out = ledger_cli(
        fleet, "create", name, "--task", "periodic.charge", "--every", "2", "--args",
        json.dumps([card]),
    )  # fmt: skip
    assert f"{name}: created" in out
    # Then its runs get the card
    wait_for(lambda: len(fleet.runs("charge")) >= 2, timeout=30, what="two runs")
    assert {run["last4"] for run in fleet.runs("charge")} == {"1111"}
    # and no document of the app's ledger holds it: the entry, the audit trail's copy, the jobs
    client: MongoClient[dict[str, Any]] = MongoClient(fleet.stack.ledger.url)
    read = []
    for database in client.list_database_names():
        for collection in client[database].list_collection_names():
            if collection.startswith("periodic_ledger"):
                read.append(collection)
                found = list(client[database][collection].find({}))
                assert card not in json.dumps(found, default=str), collection
    assert {"periodic_ledger", "periodic_ledger_schedules", "periodic_ledger_audit"} <= set(read)
    # An operator without the keys (the CLI loads the app without them) still lists, pauses
    # and resumes it; triggering it (a run with its arguments) says what is missing
    keyless = {"LEDGER_ENCRYPTION_KEYS": "[]"}
    listed = json.loads(ledger_cli(fleet, "list", "--json", **keyless))
    assert name in [r["schedule"] for r in listed["schedules"]]
    assert f"{name}: paused" in ledger_cli(fleet, "pause", name, **keyless)
    assert f"{name}: resumed" in ledger_cli(fleet, "resume", name, **keyless)
    refused = subprocess.run(
        [sys.executable, "-m", "celery", "-A", MODULE, "ledger", "schedules", "trigger", name],
        env=app_env(fleet.stack.env, {"LEDGER_ACTOR": "ops-test", **keyless}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "LEDGER_ENCRYPTION_KEYS" in refused.stderr
    assert "Traceback" not in refused.stderr
    ledger_cli(fleet, "delete", name)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tick", "--task", "periodic.tick", "--every", "5"], "declared in the app's code"),
        (["x", "--task", "periodic.nope", "--every", "5"], "no task 'periodic.nope' in this app"),
        (["x", "--task", "periodic.tick", "--cron", "* *"], "five fields"),
        (["x", "--task", "periodic.tick"], "one of them"),
        (["x", "--task", "periodic.tick", "--every", "5", "--policy", "{"], "not JSON"),
    ],
    ids=["code-name", "unknown-task", "bad-cron", "no-schedule", "bad-policy"],
)
def test_a_mistaken_create_says_what_is_wrong_without_a_traceback(
    fleet: Fleet, args: list[str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", MODULE, "ledger", "schedules", "create", *args],
        env=app_env(fleet.stack.env, {"LEDGER_ACTOR": "ops-test"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and message in done.stderr, done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_a_workflow_on_a_schedule_starts_once_per_slot(fleet: Fleet) -> None:
    from celery_ledger.identity import derive_task_id, slot_key

    # Given a durable workflow declared with @app.periodic (every 2 s), on two workers
    for name in ("flow-1", "flow-2"):
        fleet.worker(name, PERIODIC_WORKFLOW="1")
    # Then each slot starts one workflow, keyed by the slot, and each runs its step once
    wait_for(lambda: len(fleet.runs("flow-step")) >= 4, timeout=60, what="four workflows' steps")
    settle(fleet)
    workflows = [run["workflow"] for run in fleet.runs("flow-step")]
    assert len(set(workflows)) == len(workflows), f"a workflow's step ran twice: {workflows}"
    listed = json.loads(ledger_cli(fleet, "show", "flow", "--json", PERIODIC_WORKFLOW="1"))
    assert listed["task"] == "celery_ledger.workflow.start" and listed["last_slot"]
    last = datetime.fromisoformat(listed["last_slot"]).timestamp()
    # (the newest slots' steps may still wait behind a loaded machine's queue: one of the
    # last ten slots' workflows ran, keyed by its slot)
    assert any(
        derive_task_id("periodic.flow", slot_key("flow", last - n * PERIOD)) in workflows
        for n in range(10)
    ), workflows
