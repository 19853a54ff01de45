"""Ledger operations and round trips per task, counted with pymongo's command monitoring.

    python -m ops.bench.roundtrips [--repeats 3]

An in-process solo worker runs the tasks on its own thread; every MongoDB command that thread
issues between ``task_prerun`` and ``task_postrun`` is attributed to that delivery (so commands
that do not name the record, such as reads of other collections, count too). Cases: the happy
path, a suppressed duplicate, one retry (the failing attempt alone, and both attempts), a
dead-letter.
"""

from __future__ import annotations

import argparse
import logging
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pymongo import monitoring

from celery_ledger import LedgerCelery, Settings, create_app

from .common import (
    CONNECTION_SETUP,
    median,
    print_header,
    print_table,
    pyplot,
    running_servers,
    solo_worker_per_delivery,
    write_results,
)

QUEUE = "bench_roundtrips"
# The goals, in store operations (statements: a bulk write of two counts two, since each costs
# the server its own write); the retry goal (3) is for the failing attempt, the total has none.
GOALS: dict[str, int | None] = {
    "happy path": 2,
    "suppressed duplicate": 2,
    "one retry: failing attempt": 3,
    "one retry: both attempts": None,
    "dead-letter": 3,
}


@dataclass
class Attempt:
    task_id: str
    commands: list[str] = field(default_factory=list)
    # Commands the server did not answer (a socket timeout while it stalled under load): what
    # follows them (pymongo's own retry of a read, the ledger's retry or deferral) is not what
    # a delivery costs, so a pass with one is measured again (``measure_clean``).
    failed: int = 0


# Where each write command carries its statements.
STATEMENTS = {"update": "updates", "delete": "deletes", "insert": "documents"}


class DeliveryCommands(monitoring.CommandListener):
    """MongoDB commands issued by the worker thread while it runs a delivery."""

    def __init__(self) -> None:
        self.attempts: dict[str, list[Attempt]] = defaultdict(list)
        self._current: Attempt | None = None
        self._thread: int | None = None

    def begin(self, task_id: str) -> None:
        self._thread = threading.get_ident()
        self._current = Attempt(task_id)
        self.attempts[task_id].append(self._current)

    def end(self) -> None:
        self._current = None

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in CONNECTION_SETUP:
            return
        if self._current is not None and threading.get_ident() == self._thread:
            detail = event.command_name
            statements = STATEMENTS.get(event.command_name)
            if statements is not None:
                detail += f"x{len(event.command.get(statements, []) or [])}"
            self._current.commands.append(f"{detail}:{event.command.get(event.command_name)}")

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        if self._current is not None and threading.get_ident() == self._thread:
            self._current.failed += 1


@contextmanager
def counting_worker(
    broker_url: str, mongo_uri: str, mongo_db: str = "bench_roundtrips"
) -> Iterator[tuple[LedgerCelery, DeliveryCommands]]:
    """An app and an in-process solo worker whose ledger commands are counted per delivery
    (the benchmark's and the round-trip test's one counter)."""
    settings = Settings(
        broker_url=broker_url, mongo_uri=mongo_uri, mongo_db=mongo_db, defer_poll_seconds=0.1
    )
    listener = DeliveryCommands()
    app = create_app(
        "bench_roundtrips", settings=settings, set_as_current=False, command_listeners=[listener]
    )
    failures: dict[str, int] = defaultdict(int)

    @app.task(  # type: ignore[untyped-decorator]
        shared=False, name="rt.happy", idempotency_key="{token}"
    )
    def happy(token: str) -> str:
        return token

    @app.task(  # type: ignore[untyped-decorator]
        shared=False,
        name="rt.flaky",
        idempotency_key="{token}",
        autoretry_for=(ConnectionError,),
        default_retry_delay=0.1,
        retry_backoff=False,
        max_retries=3,
    )
    def flaky(token: str) -> str:
        failures[token] += 1
        if failures[token] == 1:
            raise ConnectionError("the first attempt fails")
        return token

    @app.task(  # type: ignore[untyped-decorator]
        shared=False, name="rt.boom", idempotency_key="{token}"
    )
    def boom(token: str) -> None:
        raise ValueError(token)

    try:
        with solo_worker_per_delivery(
            app, [QUEUE], lambda task_id, _task: listener.begin(task_id), listener.end
        ):
            # The dead-letter case fails on purpose: keep its traceback out of the report.
            for name in ("celery.app.trace", "celery_ledger"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
            yield app, listener
    finally:
        app.close()


def operations(commands: list[str]) -> int:
    """Store operations in ``commands``: each statement of a write, each read."""
    total = 0
    for command in commands:
        kind = command.split(":", 1)[0]
        total += int(kind.split("x", 1)[1]) if "x" in kind else 1
    return total


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.05)


def measure(app: LedgerCelery, listener: DeliveryCommands) -> dict[str, list[str]]:
    """One pass over the cases, with fresh keys; returns the commands of each case."""
    token = uuid.uuid4().hex[:12]
    happy, flaky, boom = app.tasks["rt.happy"], app.tasks["rt.flaky"], app.tasks["rt.boom"]
    seen: dict[str, list[str]] = {}

    result = happy.apply_async((token,), queue=QUEUE)
    assert result.get(timeout=30) == token
    wait_for(lambda: len(listener.attempts[result.id]) == 1 and listener._current is None)
    seen["happy path"] = listener.attempts[result.id][0].commands

    # A second message of the job (a duplicate publish, a redelivery): with dedupe on publish
    # (the default) a producer would skip it, its record known; sent all the same
    happy.dedupe_on_publish = False
    try:
        happy.apply_async((token,), queue=QUEUE)
    finally:
        happy.dedupe_on_publish = None
    wait_for(lambda: len(listener.attempts[result.id]) == 2 and listener._current is None)
    seen["suppressed duplicate"] = listener.attempts[result.id][1].commands

    retried = flaky.apply_async((token,), queue=QUEUE)
    assert retried.get(timeout=30) == token
    wait_for(lambda: len(listener.attempts[retried.id]) == 2 and listener._current is None)
    first, second = listener.attempts[retried.id]
    seen["one retry: failing attempt"] = first.commands
    seen["one retry: both attempts"] = first.commands + second.commands

    dead = boom.apply_async((token,), queue=QUEUE)
    wait_for(lambda: len(listener.attempts[dead.id]) == 1 and listener._current is None)
    record = app.ledger.get_by_id(dead.id)
    assert record is not None and record.state == "dead", record
    seen["dead-letter"] = listener.attempts[dead.id][0].commands
    return seen


def measure_clean(
    app: LedgerCelery, listener: DeliveryCommands, *, tries: int = 3
) -> dict[str, list[str]]:
    """A pass of :func:`measure` in which the server answered every command (a server stalled
    past the socket timeout makes a pass count the stall's retries); the last pass if none."""
    for _ in range(tries):
        before = {id(a) for attempts in listener.attempts.values() for a in attempts}
        seen = measure(app, listener)
        new = [a for at in listener.attempts.values() for a in at if id(a) not in before]
        if not any(a.failed for a in new):
            return seen
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    config = {"worker": "in-process solo worker", "repeats": args.repeats}
    facts = print_header("roundtrips: ledger round trips per delivery", config)
    passes: list[dict[str, list[str]]] = []
    with (
        running_servers("bench-roundtrips") as servers,
        counting_worker(servers.broker.url, servers.ledger.url) as (app, lst),
    ):
        # A probe: the first delivery also creates the collection and its indexes.
        app.tasks["rt.happy"].apply_async(("probe",), queue=QUEUE).get(timeout=60)
        for _ in range(args.repeats):
            passes.append(measure_clean(app, lst))

    counts = {case: [operations(p[case]) for p in passes] for case in GOALS}
    trips = {case: [len(p[case]) for p in passes] for case in GOALS}
    medians = {case: median(values) for case, values in counts.items()}
    rows = []
    for case, goal in GOALS.items():
        kinds = [c.split(":", 1)[0] for c in passes[-1][case]]
        rows.append(
            [
                case,
                f"{medians[case]:g}",
                f"{median(trips[case]):g}",
                "/".join(str(v) for v in counts[case]),
                "-" if goal is None else f"<= {goal}",
                "-" if goal is None else ("yes" if medians[case] <= goal else "NO"),
                " + ".join(kinds),
            ]
        )
    print_table(
        f"ledger operations per delivery, median of {args.repeats} passes",
        ["case", "operations", "round trips", "per pass", "goal", "met", "commands (last pass)"],
        rows,
    )

    plt = pyplot()
    figure, axes = plt.subplots(figsize=(8, 4))
    names = list(GOALS)
    axes.bar(names, [medians[n] for n in names], color="#36c", label="measured")
    goals = [(n, g) for n, g in GOALS.items() if g is not None]
    axes.scatter(*zip(*goals, strict=True), color="#c33", marker="_", s=900, label="goal")
    axes.set_ylabel("MongoDB operations")
    axes.tick_params(axis="x", labelrotation=20)
    axes.legend()
    write_results(
        "roundtrips",
        {
            "configuration": config,
            "machine": facts,
            "goals": GOALS,
            "median": medians,
            "per_pass": counts,
            "round_trips_per_pass": trips,
            "commands": passes,
        },
        figure,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
