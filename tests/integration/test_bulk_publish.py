"""Bulk publish against the real servers: its round trips (MongoDB commands by pymongo's
command monitoring, Redis round trips by a counting connection), and every job it publishes
run once by a real worker, also when its pipeline failed after its records were written."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import group
from pymongo import monitoring

from celery_ledger import Settings, State, create_app
from celery_ledger.clock import REPORT_EVERY_SECONDS, RESYNC_SECONDS
from ops.bench.bulk_publish import broker_round_trips
from tasks.effects import effects

from .conftest import NAMESPACE
from .helpers import shared_task, wait_for

RECORD = "tests.integration.ledger_app.record"
# A connection's own set-up, not a ledger operation
_SETUP = frozenset({"hello", "ismaster", "isMaster", "ping", "saslStart", "saslContinue"})


class LedgerCommands(monitoring.CommandListener):
    """The MongoDB commands this thread sends while counting."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.on = False
        self.thread = threading.get_ident()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if self.on and threading.get_ident() == self.thread and event.command_name not in _SETUP:
            self.counts[event.command_name] += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def counting_producer(stack: Any, name: str, **settings: Any) -> tuple[Any, LedgerCommands]:
    """A producer app of the test app's namespace whose ledger commands are counted."""
    listener = LedgerCommands()
    settings = {
        "queue_namespace": NAMESPACE,
        "broker_url": stack.broker.url,
        "mongo_uri": stack.ledger.url,
        "mongo_db": "ledger_tests",
        **settings,
    }
    app = create_app(
        name, settings=Settings(**settings), set_as_current=False, command_listeners=[listener]
    )
    return app, listener


def runs_of(tokens: list[str]) -> Counter[str]:
    found = effects().find({"kind": "record", "key": {"$in": tokens}}, {"key": 1})
    return Counter(doc["key"] for doc in found)


def every_job_ran_once(tokens: list[str], *, timeout: float) -> None:
    wait_for(lambda: len(runs_of(tokens)) == len(tokens), timeout=timeout, what="every job run")
    runs = runs_of(tokens)
    assert set(runs) == set(tokens)
    assert set(runs.values()) == {1}, {k: n for k, n in runs.items() if n != 1}


def test_a_bulk_publish_of_1000_jobs_costs_2_ledger_and_1_broker_round_trips_per_100(
    stack: Any, app: Any
) -> None:
    producer, ledger_commands = counting_producer(stack, "bulk_producer")
    record = shared_task(producer, RECORD)
    record.delay(f"warm-{uuid.uuid4().hex[:8]}")  # (connections made, queues declared)
    tokens = [f"b-{uuid.uuid4().hex[:12]}" for _ in range(1000)]

    # When 1,000 new jobs are published as one bulk publish
    ledger_commands.on = True
    started = time.monotonic()
    with broker_round_trips() as broker:
        results = producer.publish_many([record.s(token) for token in tokens])
    elapsed = time.monotonic() - started
    ledger_commands.on = False

    # Then the ledger saw one bulk write per 100 jobs, and the broker one pipeline per 100
    assert dict(ledger_commands.counts) == {"update": 10}
    assert broker["LPUSH"] == 10, broker
    # and besides, only what any producer does by the clock, not per job (so a slow machine
    # may see a few more): the backpressure gate's sample of the queues' depths (one pipeline
    # of LLENs a second at most), the broker's clock read again (TIME, every RESYNC_SECONDS
    # per clock) and this process's clock offsets reported (HSET, every REPORT_EVERY_SECONDS)
    assert set(broker) <= {"LPUSH", "LLEN", "TIME", "HSET"}, broker
    assert broker["LLEN"] <= elapsed / producer.runtime.queue_depths.ttl_seconds + 1, broker
    assert broker["TIME"] <= elapsed / RESYNC_SECONDS + 2, broker
    assert broker["HSET"] <= elapsed / REPORT_EVERY_SECONDS + 1, broker
    assert len({r.id for r in results}) == 1000
    # And a real worker runs every job once
    every_job_ran_once(tokens, timeout=300)

    # And publishing them again (all known) costs one bulk write per 100 and no message
    ledger_commands.counts.clear()
    ledger_commands.on = True
    with broker_round_trips() as again:
        producer.publish_many([record.s(token) for token in tokens[:300]])
    ledger_commands.on = False
    assert dict(ledger_commands.counts) == {"update": 3}
    assert again["LPUSH"] == 0, again


def test_a_group_is_one_bulk_publish_and_its_members_run_once(stack: Any, app: Any) -> None:
    producer, ledger_commands = counting_producer(stack, "bulk_group_producer")
    record = shared_task(producer, RECORD)
    record.delay(f"warm-{uuid.uuid4().hex[:8]}")
    tokens = [f"g-{uuid.uuid4().hex[:12]}" for _ in range(250)]

    ledger_commands.on = True
    with broker_round_trips() as broker:
        result = group(record.s(token) for token in tokens).apply_async()
    ledger_commands.on = False

    assert dict(ledger_commands.counts) == {"update": 3}
    assert broker["LPUSH"] == 3 and set(broker) <= {"LPUSH", "LLEN", "TIME", "HSET"}, broker
    assert len(result.results) == 250
    every_job_ran_once(tokens, timeout=180)


def test_a_failed_pipeline_leaves_its_jobs_to_the_relay_and_each_runs_once(
    stack: Any, app: Any
) -> None:
    # Given a producer whose broker is gone (nothing listens on its port) but whose ledger is up
    with socket_nobody_listens_on() as port:
        producer, _ = counting_producer(
            stack, "bulk_broken_producer", broker_url=f"redis://127.0.0.1:{port}/0"
        )
        record = shared_task(producer, RECORD)
        tokens = [f"f-{uuid.uuid4().hex[:12]}" for _ in range(30)]
        # When its bulk publish's pipeline fails after the records were written
        with pytest.raises(Exception) as raised:  # (kombu's or redis-py's, whichever notices)
            producer.publish_many([record.s(token) for token in tokens])
        assert "onnect" in repr(raised.value), raised.value  # (a connection error)
    # Then the records stay, queued and marked unpublished, in the relay's view
    records = [app.ledger.get(RECORD, token) for token in tokens]
    assert all(r is not None and r.state == State.QUEUED for r in records)
    waiting = {doc["_id"] for doc in app.ledger.unpublished(ids=[r.id for r in records])}
    assert len(waiting) == 30
    # And the relay (after its grace) publishes them, and the session's worker runs each once
    relayed = [0]

    def relay_all() -> bool:
        relayed[0] += app.outbox.relay()
        return relayed[0] >= 30

    wait_for(relay_all, timeout=60, interval=0.5, what="the relay's publish")
    every_job_ran_once(tokens, timeout=120)


@contextmanager
def socket_nobody_listens_on() -> Iterator[int]:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    yield port
