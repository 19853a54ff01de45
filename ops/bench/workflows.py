"""Durable workflows: a 10-step sequential workflow against a Celery chain of the same ten
ledger tasks, in the same run.

    python -m ops.bench.workflows [--repeats 3] [--batch 20] [--concurrency 4] [--steps 1000]

Three measurements:

- **throughput**: a batch of workflows, then a batch of chains (and again, ``--repeats``
  times), on one ``celery worker`` subprocess; each batch is timed from its first start to its
  last end, read from the ledger (the workflow's own record, the chain's last task's record),
  so both are timed the same way. Goal: the workflow's rate >= 0.5x the chain's. The chain is
  not durable (it lives in one message at a time); the workflow is.
- **round trips per step**: an in-process solo worker counts the MongoDB commands of every
  delivery (command monitoring, the worker's thread only). A workflow's cost beyond its steps'
  own claim and completion (2 each) is every command of its wakes plus what its steps issue
  beyond those 2. Reported for 10- and 20-step workflows; the per-step figure is the marginal
  ``(cost(20) - cost(10)) / 10``, so the start and the end are not spread over the steps.
  Goal: <= 3.
- **reads per resume**: one workflow of ``--steps`` steps driven in-process, its step records
  written directly (no broker), every wake's commands and the documents and bytes they
  return counted at 10, 100 and 1,000 events of history. Goal: flat.

Why 3 is the least a durable step costs: a wake must read the log (it may be any worker's
first sight of this workflow, and another wake may have appended since), must read the step's
outcome (the step task's record, which the step's worker wrote; the wake message carries only
the workflow id, so that a wake lost, repeated or reordered changes nothing), and must append
what it decided (the completion and the next step's scheduling, in one insert whose unique
(workflow, position) index is what lets two concurrent wakes never both advance). Folding the
outcome read into the step's own completion would need the step's worker to write the
workflow's log (a second fenced write per step, and a step of another service could not); a
read-free append would need the state cached in a worker, which a crash or another worker's
wake makes stale.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from celery import chain
from pymongo import monitoring

from celery_ledger import LedgerCelery, LedgerUnavailable
from celery_ledger.identity import derive_task_id
from celery_ledger.workflow.engine import Call, WorkflowEngine

from .apps.workflows import build
from .common import (
    CONNECTION_SETUP,
    median,
    print_header,
    print_table,
    pyplot,
    running_servers,
    solo_worker_per_delivery,
    start_worker,
    write_results,
)

GOALS = {"throughput ratio": 0.5, "round trips per step": 3}
APP_MODULE = "ops.bench.apps.workflows"
STEPS = 10
READS = frozenset({"find", "getMore", "aggregate", "count"})


@dataclass
class Commands:
    """The commands one delivery (or one wake) issued."""

    name: str
    commands: list[str] = field(default_factory=list)
    docs_read: int = 0
    bytes_read: int = 0
    max_seq: int = 0
    # A wake run again after the ledger could not serve it: it starts from whatever the failed
    # attempt's last write left (possibly applied), so it is not a steady-state wake.
    retried: bool = False
    # Commands the server did not answer (a socket timeout while it stalled under load). The
    # driver retries a read that failed so once, by itself: the retry is in ``commands``, the
    # failed attempt is not, and such a wake is no steady-state wake either.
    failed: int = 0

    @property
    def reads(self) -> int:
        return sum(1 for c in self.commands if c in READS)


class ThreadCommands(monitoring.CommandListener):
    """MongoDB commands issued by one thread between ``begin`` and ``end``."""

    def __init__(self) -> None:
        self.done: list[Commands] = []
        self._current: Commands | None = None
        self._thread: int | None = None
        self._lock = threading.Lock()

    def begin(self, name: str) -> None:
        self._thread = threading.get_ident()
        self._current = Commands(name)

    def end(self) -> None:
        with self._lock:
            if self._current is not None:
                self.done.append(self._current)
            self._current = None

    def _mine(self) -> Commands | None:
        if self._current is not None and threading.get_ident() == self._thread:
            return self._current
        return None

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        current = self._mine()
        if current is None or event.command_name in CONNECTION_SETUP:
            return
        current.commands.append(event.command_name)
        for doc in event.command.get("documents", ()) or ():
            if isinstance(doc, dict) and isinstance(doc.get("seq"), int):
                current.max_seq = max(current.max_seq, int(doc["seq"]))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        current = self._mine()
        if current is None or event.command_name not in READS:
            return
        cursor = event.reply.get("cursor") or {}
        batch = cursor.get("firstBatch", cursor.get("nextBatch", ())) or ()
        current.docs_read += len(batch)
        from bson import BSON

        current.bytes_read += sum(len(BSON.encode(d)) for d in batch)

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        current = self._mine()
        if current is None or event.command_name in CONNECTION_SETUP:
            return
        # The last started command of that name is the one that failed (one thread: one at a time)
        for i in range(len(current.commands) - 1, -1, -1):
            if current.commands[i] == event.command_name:
                del current.commands[i]
                break
        current.failed += 1


# -- throughput ---------------------------------------------------------------------------------


def _wait_succeeded(app: LedgerCelery, ids: list[str], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    query = {"_id": {"$in": ids}, "state": "succeeded"}
    while app.ledger.collection.count_documents(query) < len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(ids)} jobs did not all succeed in {timeout}s")
        time.sleep(0.02)


def run_workflows(app: LedgerCelery, batch: int) -> float:
    """Seconds from the first start to the last end of ``batch`` 10-step workflows."""
    run = uuid.uuid4().hex[:10]
    began = time.perf_counter()
    handles = [app.workflows["bw.steps"].start(f"{run}-{i}", STEPS) for i in range(batch)]
    _wait_succeeded(app, [h.id for h in handles])
    return time.perf_counter() - began


def run_chains(app: LedgerCelery, batch: int) -> float:
    """Seconds from the first start to the last end of ``batch`` chains of ten ledger tasks."""
    run = uuid.uuid4().hex[:10]
    step = app.tasks["bw.step"]
    began = time.perf_counter()
    for i in range(batch):
        chain(step.si(f"{run}-{i}", s) for s in range(STEPS)).apply_async()
    # The ledger record of the chain's last task (the id a canvas freezes is its alias)
    lasts = [derive_task_id("bw.step", f"{run}-{i}-{STEPS - 1}") for i in range(batch)]
    _wait_succeeded(app, lasts)
    return time.perf_counter() - began


def throughput(servers: Any, *, batch: int, repeats: int, concurrency: int) -> dict[str, Any]:
    env = {"LEDGER_BROKER_URL": servers.broker.url, "LEDGER_MONGO_URI": servers.ledger.url}
    app = build(env)
    queues = ",".join(app.tiers.queues)
    worker = start_worker(
        servers,
        APP_MODULE,
        queue=queues,
        concurrency=concurrency,
        name="bench-workflows",
        env={**env, "LEDGER_TTL_INDEX": "false"},
    )
    try:
        run_workflows(app, 2)  # warm-up: indexes, connections, imports
        run_chains(app, 2)
        seconds: dict[str, list[float]] = defaultdict(list)
        for _ in range(repeats):
            seconds["workflow"].append(run_workflows(app, batch))
            seconds["chain"].append(run_chains(app, batch))
    finally:
        worker.stop()
        app.close()
    rates = {kind: [batch / s for s in values] for kind, values in seconds.items()}
    return {"seconds": dict(seconds), "per_second": rates}


# -- round trips per step ---------------------------------------------------------------------


@contextmanager
def counting_worker(
    broker_url: str, mongo_uri: str, mongo_db: str
) -> Iterator[tuple[LedgerCelery, ThreadCommands]]:
    """The bench app with an in-process solo worker whose commands are counted per delivery."""
    listener = ThreadCommands()
    app = build(
        {
            "LEDGER_BROKER_URL": broker_url,
            "LEDGER_MONGO_URI": mongo_uri,
            "LEDGER_MONGO_DB": mongo_db,
        },
        command_listeners=(listener,),
    )

    try:
        with solo_worker_per_delivery(
            app, app.tiers.queues, lambda _id, task: listener.begin(str(task.name)), listener.end
        ):
            logging.getLogger("celery_ledger").setLevel(logging.ERROR)
            yield app, listener
    finally:
        app.close()


@dataclass
class StepCost:
    steps: int
    wakes: int
    wake_commands: int
    step_deliveries: int
    step_commands: int

    @property
    def beyond_steps(self) -> int:
        """What the workflow costs beyond its steps' own claim and completion (2 each)."""
        return self.wake_commands + self.step_commands - 2 * self.step_deliveries


def workflow_cost(app: LedgerCelery, listener: ThreadCommands, steps: int) -> StepCost:
    """Run one workflow of ``steps`` steps; count its deliveries' commands."""
    listener.done.clear()
    handle = app.workflows["bw.steps"].start(uuid.uuid4().hex[:10], steps)
    assert handle.result(timeout=120) == sum(range(steps))
    time.sleep(0.3)  # the last wake's postrun
    wakes = [d for d in listener.done if d.name == "celery_ledger.workflow.wake"]
    step_runs = [d for d in listener.done if d.name == "bw.step"]
    return StepCost(
        steps=steps,
        wakes=len(wakes),
        wake_commands=sum(len(d.commands) for d in wakes),
        step_deliveries=len(step_runs),
        step_commands=sum(len(d.commands) for d in step_runs),
    )


def round_trips(servers: Any, *, repeats: int) -> dict[str, Any]:
    with counting_worker(servers.broker.url, servers.ledger.url, "bench_wf_rt") as (app, lst):
        workflow_cost(app, lst, 1)  # a probe: collections, indexes, connections
        costs = [(workflow_cost(app, lst, 10), workflow_cost(app, lst, 20)) for _ in range(repeats)]
        workflow_cost(app, lst, 3)  # its wakes are the sample printed
        kinds = ["+".join(d.commands) for d in lst.done if d.name == "celery_ledger.workflow.wake"]
    marginal = [(c20.beyond_steps - c10.beyond_steps) / 10 for c10, c20 in costs]
    return {
        "costs": [[vars(c10), vars(c20)] for c10, c20 in costs],
        "marginal_per_step": marginal,
        "average_per_step_10": [c10.beyond_steps / 10 for c10, _ in costs],
        "wakes_of_a_3_step_workflow": kinds,
        "step_delivery_commands": [c10.step_commands / c10.step_deliveries for c10, _ in costs],
    }


# -- reads per resume -------------------------------------------------------------------------


class DirectPorts:
    """Ports that publish nothing: the driver writes each step's record itself."""

    def __init__(self, app: LedgerCelery) -> None:
        self.app = app
        self.published: list[tuple[str, str]] = []

    def call_of(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        return self.app.workflow_ports.call_of(target, args, kwargs)

    def check_arguments(self, call: Call) -> None:
        self.app.workflow_ports.check_arguments(call)

    def publish_step(
        self, call: Call, *, job_id: str, key: str, workflow_id: str, workflow_tier: str
    ) -> None:
        self.published.append((job_id, call.name))

    def publish_wake(self, workflow_id: str, tier: str, *, delay: float = 0.0) -> None:
        pass


def drive_long_workflow(
    app: LedgerCelery, listener: ThreadCommands, steps: int
) -> tuple[str, list[Commands]]:
    """Run one ``steps``-step workflow wake by wake in this thread, each step's ledger record
    written between wakes as its worker would; returns its id and each wake's commands."""
    import json

    ports = DirectPorts(app)
    engine: WorkflowEngine = app.workflow_engine
    engine.ports = ports
    definition = app.workflows["bw.steps"].definition
    workflow_id, _ = engine.start(definition, (uuid.uuid4().hex[:10], steps), {})
    wakes: list[Commands] = []
    for _ in range(steps + 2):
        # A wake the ledger could not serve (a server that stalled past the socket timeout:
        # seen on the embedded server under a whole test suite's load) runs again, as a
        # worker's deferral would run it; its partial commands are not a wake's cost.
        for attempt in range(1, 6):
            listener.begin("wake")
            try:
                outcome = engine.wake(workflow_id)
            except LedgerUnavailable:
                if attempt == 5:
                    raise
                listener.end()
                listener.done.pop()
                time.sleep(1.0)
                continue
            listener.end()
            wake = listener.done.pop()
            wake.retried = attempt > 1 or wake.failed > 0
            wakes.append(wake)
            break
        if outcome != "suspended":  # ended (or stuck: the caller's assertions say so)
            break
        for job_id, name in ports.published:
            pos = len(wakes) - 1
            app.ledger.collection.insert_one(
                {"_id": job_id, "task": name, "state": "succeeded", "result": json.dumps(pos)}
            )
        ports.published.clear()
    return workflow_id, wakes


def at_marks(wakes: list[Commands], marks: tuple[int, ...]) -> dict[int, Commands]:
    """The first wake whose history (events before it) reached each mark."""
    found: dict[int, Commands] = {}
    history = 0
    for wake in wakes:
        for mark in marks:
            if mark not in found and history >= mark:
                found[mark] = wake
        history = max(history, wake.max_seq)
    return found


def reads_per_resume(servers: Any, *, steps: int) -> dict[str, Any]:
    listener = ThreadCommands()
    app = build(
        {
            "LEDGER_BROKER_URL": servers.broker.url,
            "LEDGER_MONGO_URI": servers.ledger.url,
            "LEDGER_MONGO_DB": "bench_wf_resume",
        },
        command_listeners=(listener,),
    )
    try:
        app.ledger.ensure_indexes()
        app.workflow_engine.log.ensure_indexes()
        _, wakes = drive_long_workflow(app, listener, steps)
    finally:
        app.close()
    marks = tuple(m for m in (10, 100, 1000, 2000) if m <= max(w.max_seq for w in wakes))
    return {
        "wakes": len(wakes),
        "events": max(w.max_seq for w in wakes),
        "marks": {
            mark: {
                "commands": len(w.commands),
                "reads": w.reads,
                "docs_read": w.docs_read,
                "kib_read": round(w.bytes_read / 1024, 1),
                "kinds": "+".join(w.commands),
            }
            for mark, w in at_marks(wakes, marks).items()
        },
        "max_docs_read": max(w.docs_read for w in wakes),
        "max_reads": max(w.reads for w in wakes),
    }


# -- the report -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=20, help="workflows (chains) per timing")
    parser.add_argument("--concurrency", type=int, default=min(os.cpu_count() or 2, 4))
    parser.add_argument("--steps", type=int, default=1000, help="the long workflow's steps")
    args = parser.parse_args(argv)
    config = vars(args)
    facts = print_header("workflows: a 10-step workflow against a chain of ten", config)
    with running_servers("bench-workflows") as servers:
        speed = throughput(
            servers, batch=args.batch, repeats=args.repeats, concurrency=args.concurrency
        )
        trips = round_trips(servers, repeats=args.repeats)
        resume = reads_per_resume(servers, steps=args.steps)

    wf_rate = median(speed["per_second"]["workflow"])
    chain_rate = median(speed["per_second"]["chain"])
    ratio = wf_rate / chain_rate
    per_step = median(trips["marginal_per_step"])
    print_table(
        f"throughput, {args.batch} at a time, median of {args.repeats}",
        ["case", "per second", "runs", "ratio", "goal", "met"],
        [
            ["chain of 10 (not durable)", f"{chain_rate:.2f}", _runs(speed, "chain"), "1", "", ""],
            [
                "workflow of 10 (durable)",
                f"{wf_rate:.2f}",
                _runs(speed, "workflow"),
                f"{ratio:.2f}x",
                ">= 0.5x",
                "yes" if ratio >= GOALS["throughput ratio"] else "NO",
            ],
        ],
    )
    c10, c20 = trips["costs"][-1]
    print_table(
        "ledger round trips beyond the steps' own claim and completion",
        ["workflow", "wakes", "wake commands", "step commands", "beyond steps", "per step"],
        [
            [
                f"{c['steps']} steps",
                c["wakes"],
                c["wake_commands"],
                c["step_commands"],
                _beyond(c),
                f"{_beyond(c) / c['steps']:.2f}",
            ]
            for c in (c10, c20)
        ]
        + [
            [
                "marginal step (20 - 10) / 10",
                "",
                "",
                "",
                "/".join(f"{m:g}" for m in trips["marginal_per_step"]),
                f"{per_step:g} (goal <= 3: {_met(per_step <= GOALS['round trips per step'])})",
            ]
        ],
    )
    print("a 3-step workflow's wakes:", " | ".join(trips["wakes_of_a_3_step_workflow"]))
    print_table(
        f"one wake of a {args.steps}-step workflow"
        f" ({resume['events']} events, {resume['wakes']} wakes)",
        ["events before the wake", "commands", "reads", "documents read", "KiB read", "commands"],
        [
            [mark, m["commands"], m["reads"], m["docs_read"], m["kib_read"], m["kinds"]]
            for mark, m in resume["marks"].items()
        ],
    )
    flat = len({m["reads"] for m in resume["marks"].values()}) == 1
    print(
        f"reads per resume flat: {'yes' if flat else 'NO'} (most documents one wake read:"
        f" {resume['max_docs_read']}, most read commands: {resume['max_reads']})"
    )

    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(["chain", "workflow"], [chain_rate, wf_rate], color=["#999", "#36c"])
    left.axhline(chain_rate * GOALS["throughput ratio"], color="#c33", label="goal (0.5x chain)")
    left.set_ylabel("runs of 10 steps per second")
    left.legend()
    marks = list(resume["marks"])
    right.plot(marks, [resume["marks"][m]["docs_read"] for m in marks], "o-", label="documents")
    right.plot(marks, [resume["marks"][m]["reads"] for m in marks], "s-", label="read commands")
    right.set_xscale("log")
    right.set_xlabel("events in the history")
    right.set_title("one wake's reads")
    right.legend()
    write_results(
        "workflows",
        {
            "configuration": config,
            "machine": facts,
            "goals": GOALS,
            "throughput": {**speed, "ratio": ratio},
            "round_trips": trips,
            "reads_per_resume": resume,
        },
        figure,
    )
    return 0


def _beyond(cost: dict[str, int]) -> int:
    return cost["wake_commands"] + cost["step_commands"] - 2 * cost["step_deliveries"]


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


def _runs(speed: dict[str, Any], kind: str) -> str:
    return "/".join(f"{r:.2f}" for r in speed["per_second"][kind])


if __name__ == "__main__":
    raise SystemExit(main())
