"""Ledger round trips per task, counted with pymongo's command monitoring."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from pymongo import monitoring

from celery_ledger import Settings, create_app
from celery_ledger.ledger import Ledger

from .helpers import wait_for

QUEUE = "roundtrips"


class WorkerThreadCommands(monitoring.CommandListener):
    """Ledger commands issued from the worker's thread, by record id."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, str]] = []
        self.worker_thread: str | None = None
        self.seen: set[str] = set()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.seen.add(threading.current_thread().name)
        if threading.current_thread().name == self.worker_thread:
            self.commands.append((event.command_name, str(event.command)))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def count(self, record_id: str) -> int:
        return sum(1 for _, text in self.commands if record_id in text)


@pytest.fixture(scope="module")
def counted(stack: Any) -> Iterator[tuple[Any, WorkerThreadCommands]]:
    settings = Settings(
        broker_url=stack.broker.url,
        mongo_uri=stack.ledger.url,
        mongo_db="ledger_tests",
        defer_poll_seconds=0.2,
    )
    app = create_app("roundtrips", settings=settings, set_as_current=False)
    listener = WorkerThreadCommands()
    app.ledger = Ledger(
        uri=settings.mongo_uri, database=settings.mongo_db, event_listeners=[listener]
    )
    failures: dict[str, int] = {}

    @app.task(shared=False, name="rt.happy", idempotency_key="{token}")
    def happy(token: str) -> str:
        return token

    @app.task(
        shared=False,
        name="rt.flaky",
        idempotency_key="{token}",
        autoretry_for=(ConnectionError,),
        default_retry_delay=0.1,
        retry_backoff=False,
        max_retries=3,
    )
    def flaky(token: str) -> str:
        failures[token] = failures.get(token, 0) + 1
        if failures[token] == 1:
            raise ConnectionError("first attempt fails")
        return token

    @app.task(shared=False, name="rt.boom", idempotency_key="{token}")
    def boom(token: str) -> None:
        raise ValueError(token)

    with start_worker(
        app,
        pool="solo",
        queues=[QUEUE],
        perform_ping_check=False,
        loglevel="WARNING",
        shutdown_timeout=10,
    ):
        yield app, listener


def test_round_trips_per_task(counted: tuple[Any, WorkerThreadCommands], token: str) -> None:
    app, listener = counted
    happy, flaky, boom = app.tasks["rt.happy"], app.tasks["rt.flaky"], app.tasks["rt.boom"]

    # The solo worker runs tasks on its own thread: the one that issued the probe's commands
    happy.apply_async((f"{token}-probe",), queue=QUEUE).get(timeout=30)
    # (housekeeping expires old records from its own thread: not a delivery's round trip)
    workers = listener.seen - {threading.main_thread().name, "ledger-housekeeping"}
    assert len(workers) == 1, workers
    listener.worker_thread = workers.pop()
    observed: dict[str, int] = {}

    # Happy path: claim + complete
    listener.commands.clear()
    result = happy.apply_async((token,), queue=QUEUE)
    assert result.get(timeout=30) == token
    observed["happy path"] = listener.count(result.id)

    # A suppressed duplicate: one claim that finds the record succeeded
    listener.commands.clear()
    happy.apply_async((token,), queue=QUEUE)
    wait_for(lambda: app.ledger.get("rt.happy", token).duplicates == 1, timeout=30)
    observed["suppressed duplicate"] = listener.count(result.id)

    # One retry: (claim + retry record) then (claim + complete)
    listener.commands.clear()
    retried = flaky.apply_async((token,), queue=QUEUE)
    assert retried.get(timeout=30) == token
    observed["one retry (both attempts)"] = listener.count(retried.id)

    # Dead: claim + failure record
    listener.commands.clear()
    dead = boom.apply_async((token,), queue=QUEUE)
    with pytest.raises(ValueError):
        dead.get(timeout=30)
    observed["dead"] = listener.count(dead.id)

    print("\nledger round trips per task:", observed)
    assert observed == {
        "happy path": 2,
        "suppressed duplicate": 1,
        "one retry (both attempts)": 4,
        "dead": 2,
    }
