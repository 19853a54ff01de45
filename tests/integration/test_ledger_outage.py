"""Ledger down, then up: the body never runs unguarded, and the task completes exactly once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from celery_ledger import State
from celery_ledger.embedded.stack import EmbeddedStack

from .conftest import make_isolated_stack, producer_app
from .helpers import shared_task


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
