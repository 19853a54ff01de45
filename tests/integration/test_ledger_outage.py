"""Ledger down, then up: the body never runs unguarded, and the task completes exactly once."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from celery_ledger import State
from celery_ledger.embedded.stack import EmbeddedStack

from .conftest import make_isolated_stack, producer_app
from .helpers import shared_task, wait_for


@pytest.fixture
def isolated(tmp_path: Path, stack: Any) -> Iterator[EmbeddedStack]:
    running = make_isolated_stack(tmp_path)
    try:
        running.start_worker(running.queues_of("default"), concurrency=1, name="outage@127.0.0.1")
        yield running
    finally:
        running.stop()


def test_ledger_down_then_up_runs_the_task_exactly_once(isolated: EmbeddedStack) -> None:
    assert isolated.ledger is not None
    producer = producer_app(isolated, "outage_producer", mongo_timeout_ms=1500)

    record = shared_task(producer, "tests.integration.ledger_app.record")

    # Given the ledger crashes
    isolated.ledger.kill()

    # When a task is published (publishing does not need the ledger)
    result = record.delay("outage-1")
    time.sleep(6)  # the worker keeps deferring the message with backoff meanwhile
    log = isolated.workers[0].log_path.read_text()
    assert "ledger unavailable at the claim" in log and "deferred by" in log

    # Then, once the ledger is back, the task completes exactly once
    isolated.ledger.restart()
    assert result.get(timeout=60)["token"] == "outage-1"
    record_after = producer.ledger.get(record.name, "outage-1")
    assert record_after is not None and record_after.state is State.SUCCEEDED
    assert record_after.attempts == 1
    with MongoClient(isolated.ledger.url) as client:
        assert client.reference_world.effects.count_documents({"key": "outage-1"}) == 1


@pytest.mark.parametrize("server_keeps_commits", [True, False], ids=["synced", "unsynced"])
def test_an_atomic_step_acknowledged_just_before_the_ledger_dies_is_kept(
    isolated: EmbeddedStack, server_keeps_commits: bool
) -> None:
    """The job's completion is written after the restart, from the worker's memory: it may say
    "succeeded" only with the step's effect and record. The embedded server keeps an
    acknowledged transaction across SIGKILL only with ``--sync-on-commit`` (which the platform
    starts it with); without it, the completion sees the step gone and the job runs again."""
    assert isolated.ledger is not None
    if not server_keeps_commits:
        isolated.ledger.stop()
        isolated.ledger.argv.remove("--sync-on-commit")
        isolated.ledger.restart()
    producer = producer_app(isolated, "atomic_crash_producer", mongo_timeout_ms=1500)
    atomic_effect = shared_task(producer, "tests.integration.ledger_app.atomic_effect")
    token = f"atomic-crash-{time.time_ns()}"

    # Given a job whose atomic step commits, and the ledger is SIGKILLed as the commit is acked
    result = atomic_effect.delay(token, "kill-ledger-after", isolated.ledger.pid)
    deadline = time.monotonic() + 30
    while isolated.ledger.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not isolated.ledger.alive(), "the job did not kill the ledger"

    # When the ledger comes back
    isolated.ledger.restart()

    # Then the job succeeds with its effect and its step record, each once
    assert result.get(timeout=60)["receipt"] == f"r-{token}"
    record = producer.ledger.get(atomic_effect.name, token)
    assert record is not None and record.state is State.SUCCEEDED
    with MongoClient(isolated.ledger.url) as client:
        assert client.reference_world.effects.count_documents({"kind": "atomic", "key": token}) == 1
    assert producer.ledger.find_raw(result.id)["steps"]["charge"]["atomic"] is True
    log = isolated.workers[0].log_path.read_text()
    if server_keeps_commits:  # with the flag the commit is never lost
        assert "the ledger lost the acknowledged commit" not in log
    # (without it, a journaled write landing between the commit and the kill may save the
    # commit: the guard's refusal is then not needed; the outcome above holds either way)
    (Path(tempfile.gettempdir()) / f"celery-ledger-test-{token}").unlink(missing_ok=True)


def test_workers_that_outlive_ledger_outages_are_not_counted_as_lost(
    tmp_path: Path, stack: Any
) -> None:
    """Each attempt's worker stays alive but cannot record how the attempt ended (the ledger
    dies as the body returns): it hands the message back when most of the lease is spent. More
    such attempts than LEDGER_MAX_DELIVERIES, and the job still runs to its result: only
    deliveries whose worker was lost make a job poison."""
    running = make_isolated_stack(tmp_path)
    token = f"outlived-{time.time_ns()}"
    try:
        assert running.ledger is not None
        running.start_worker(
            running.queues_of("default"),
            concurrency=1,
            name="outlived@127.0.0.1",
            env={"LEDGER_MAX_DELIVERIES": "2"},
        )
        producer = producer_app(running, "outlived_producer", mongo_timeout_ms=1500)
        task = shared_task(producer, "tests.integration.ledger_app.outlasted_by_its_ledger")
        pid_file = tmp_path / "ledger.pid"
        pid_file.write_text(str(running.ledger.pid))

        # Given a job whose first 3 attempts each outlive the ledger
        result = task.delay(token, str(pid_file), 3)
        log_path = running.workers[0].log_path
        for killed in range(1, 4):
            deadline = time.monotonic() + 60
            while running.ledger.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if running.ledger.alive():
                doc = producer.ledger.find_raw(result.id) or {}
                pytest.fail(
                    f"no attempt came to kill the ledger; the job is {doc.get('state')}:"
                    f" {doc.get('dead_reason')}"
                )
            # The worker hands the message back once most of the lease is spent; the ledger
            # comes back only then (a fixed pause raced the worker's last write under load)
            wait_for(
                lambda n=killed: log_path.read_text().count("handing the message back") >= n,
                timeout=30,
                what=f"attempt {killed}'s worker handing its message back",
            )
            running.ledger.restart()
            pid_file.write_text(str(running.ledger.pid))

        # Then the fourth attempt's result is recorded: the job is not dead as poison
        assert result.get(timeout=90) == 4
        record = producer.ledger.get(task.name, token)
        assert record is not None and record.state is State.SUCCEEDED, record
        log = running.workers[0].log_path.read_text()
        assert "handing the message back" in log
    finally:
        running.stop()
        (Path(tempfile.gettempdir()) / f"celery-ledger-test-{token}").unlink(missing_ok=True)
