"""A threads-pool or gevent-pool worker (what teams run for I/O-bound tasks), end to end: with
group commit coalescing the ledger writes of the tasks running at once (its batching and
per-writer outcomes are tested in test_group_commit.py), duplicates delivered together still run
each body once and every job ends with its own outcome. (Under gevent the ledger's threads, the
heartbeat's and pymongo's, are greenlets, and the worker drains the broker without an event
loop; how soon it takes work when a slot frees is test_transport_credit.py's.)"""

from __future__ import annotations

import threading
import uuid

import pytest
from pymongo import MongoClient

from celery_ledger import State
from celery_ledger.embedded.stack import EmbeddedStack

from .conftest import producer_app
from .helpers import shared_task, wait_for

JOBS = 60
COPIES = 3


@pytest.mark.parametrize("pool", ["threads", "gevent"])
def test_duplicates_on_a_threads_or_gevent_pool_run_each_body_once(
    isolated: EmbeddedStack, pool: str
) -> None:
    assert isolated.ledger is not None
    isolated.start_worker(
        isolated.queues_of("default"), concurrency=16, pool=pool, name=f"{pool}@127.0.0.1"
    )
    # (dedupe on publish off: every copy reaches the worker, whose claims suppress them)
    producer = producer_app(isolated, "threads_producer", dedupe_on_publish=False)
    record = shared_task(producer, "tests.integration.ledger_app.record")
    flaky = shared_task(producer, "tests.integration.ledger_app.flaky")
    run = uuid.uuid4().hex[:8]
    tokens = [f"{run}-{i}" for i in range(JOBS)]

    # Given every job published three times at once (a retrying producer), and jobs that fail
    # once and retry, all on one worker of 16 threads or greenlets
    def publish(token: str) -> None:
        record.apply_async((token, 0.05))

    threads = [threading.Thread(target=publish, args=(t,)) for t in tokens for _ in range(COPIES)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    retried = [flaky.delay(f"{run}-flaky-{i}", 1) for i in range(10)]

    # Then every job succeeds with one effect, and the two other copies count as duplicates
    def ended() -> bool:
        records = [producer.ledger.get(record.name, t) for t in tokens]
        return all(r is not None and r.duplicates == COPIES - 1 for r in records)

    wait_for(ended, timeout=120, what="every job done and its copies suppressed")
    world = MongoClient(isolated.ledger.url).get_database("reference_world")
    counts = {
        doc["_id"]: doc["n"]
        for doc in world.effects.aggregate(
            [
                {"$match": {"kind": "record", "key": {"$in": tokens}}},
                {"$group": {"_id": "$key", "n": {"$sum": 1}}},
            ]
        )
    }
    assert counts == dict.fromkeys(tokens, 1)
    for token in tokens:
        done = producer.ledger.get(record.name, token)
        assert done is not None and done.state is State.SUCCEEDED and done.attempts == 1
    assert [r.get(timeout=60) for r in retried] == ["ok after 1 failures"] * 10
    producer.close()
