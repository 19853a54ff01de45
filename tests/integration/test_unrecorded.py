"""Jobs published while the ledger is away, on the real servers: their records are kept in
the broker until the ledger is back, the workers' reconciler writes them, and from there a job
whose message was lost before its claim (kombu pops, then books: a kill or a connection reset
between the two drops the message) is published again and runs once, like any recorded job.
Every way a publish meets the ledger away: a bulk publish whose write fails, a single publish
whose write fails, publishes while the ledger is seen away (not tried), and one for later."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from celery_ledger import State
from celery_ledger.embedded.stack import EmbeddedStack
from celery_ledger.runtime import LEDGER_AWAY_SECONDS
from celery_ledger.unrecorded import unrecorded_key

from .conftest import NAMESPACE, broker_client, producer_app, start_healing_worker
from .helpers import effect_count, shared_task, wait_for

RECORD = "tests.integration.ledger_app.record"


def queued_ids(client: Any, queue: str) -> dict[bytes, str]:
    """The queue's items by the task id each carries."""
    found: dict[bytes, str] = {}
    for item in client.lrange(queue, 0, -1):
        found[item] = json.loads(item)["headers"]["id"]
    return found


def test_jobs_published_while_the_ledger_is_away_are_recorded_and_a_lost_message_comes_back(
    own: EmbeddedStack,
) -> None:
    assert own.ledger is not None
    producer = producer_app(own, f"unrecorded_{uuid.uuid4().hex[:6]}", mongo_timeout_ms=1000)
    task = shared_task(producer, RECORD)
    run = uuid.uuid4().hex[:8]
    broker = broker_client(own)

    # Given the ledger is down
    own.ledger.kill()
    # When jobs are published every way a publish can meet it: a bulk publish (its write
    # fails), single publishes while it is seen away (not tried), one for later, and, the
    # hold over, a single publish whose write fails
    bulk = [f"{run}-bulk{n}" for n in range(6)]
    published = producer.publish_many([task.s(t) for t in bulk])
    ids = {r.id: t for r, t in zip(published, bulk, strict=True)}
    single = [f"{run}-one{n}" for n in range(6)]
    ids |= {task.apply_async((t,)).id: t for t in single}
    later = f"{run}-later"
    ids[task.apply_async((later,), countdown=1).id] = later
    time.sleep(LEDGER_AWAY_SECONDS + 0.5)
    tried = f"{run}-tried"
    ids[task.apply_async((tried,)).id] = tried
    tokens = [*bulk, *single, later, tried]

    # Then each has its record kept in the broker
    assert broker.hlen(unrecorded_key(NAMESPACE)) == len(tokens)

    # And when half of their messages are lost before any claim (the one for later with them:
    # the delayed set, where it waits, is lost)
    queue, delayed = f"{NAMESPACE}.default", producer.runtime.delayed.key
    waiting = queued_ids(broker, queue)
    assert len(waiting) == len(tokens) - 1 and broker.zcard(delayed) == 1
    lost = {t for n, t in enumerate(tokens) if n % 2 == 0} | {later}
    assert broker.delete(delayed) == 1
    for item, task_id in waiting.items():
        if ids[task_id] in lost:
            assert broker.lrem(queue, 1, item) == 1
    assert len(broker.lrange(queue, 0, -1)) == len(tokens) - len(lost)

    # and the ledger comes back, with a worker (its reconciler sweeping every second)
    own.ledger.restart()
    worker = start_healing_worker(
        own, "unrecorded", env={"LEDGER_RECONCILE_MISSING_AFTER_SECONDS": "3"}
    )

    # Then every job ends succeeded, its body run once, and no record is left in the broker
    def ended() -> bool:
        return all(
            (r := producer.ledger.get(task.name, t)) is not None and r.state is State.SUCCEEDED
            for t in tokens
        )

    wait_for(ended, timeout=90, interval=0.5, what="every job succeeded")
    time.sleep(2.0)  # (a second copy, had one been run, would show)
    assert {t: effect_count("record", t) for t in tokens} == dict.fromkeys(tokens, 1)
    assert broker.hlen(unrecorded_key(NAMESPACE)) == 0
    assert worker.alive()
    producer.close()
