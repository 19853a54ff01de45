"""The reconciler's ordinary look for jobs whose message the broker lost, behind a backlog of
more quiet jobs than one look gathers: it reads them a slice at a time (quiet_slices.py), finds
a job lost a moment ago at the first look, and reaches the oldest within a round of looks. (One
read of them all found the oldest 5,000 at every look, and never a newer job lost.)"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import redis

from celery_ledger import Settings, create_app
from celery_ledger import reconciler as reconciler_module
from celery_ledger.embedded.stack import EmbeddedStack

PER_LOOK = 500  # what a look gathers (MISSING_PER_SWEEP, made smaller here)...
JOBS = 1_200  # ...and more quiet jobs than that: a round of three looks
QUIET_SECONDS = 1.0


def test_a_lost_job_is_found_newest_first_and_the_oldest_within_a_round(
    stack: EmbeddedStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert stack.broker is not None and stack.ledger is not None
    # (a new broker database is a broker that may have lost data: the watch that follows reads
    # the recent jobs at once; it is made short here, to see the ordinary look after it)
    monkeypatch.setattr(reconciler_module, "FAILOVER_MARGIN_SECONDS", 0.0)
    monkeypatch.setattr(reconciler_module, "MISSING_PER_SWEEP", PER_LOOK)
    # An app on a broker database no worker reads, its jobs quiet after a second
    broker_url = stack.broker.url.rsplit("/", 1)[0] + "/13"
    name = f"look_{uuid.uuid4().hex[:6]}"
    probe = create_app(
        name,
        settings=Settings(
            broker_url=broker_url,
            mongo_uri=stack.ledger.url,
            mongo_db=name,
            dedupe_on_publish=True,  # (a record per job at its publish)
            reconcile_missing_after_seconds=QUIET_SECONDS,
            reconcile_every_seconds=0.2,
        ),
        set_as_current=False,
    )

    @probe.task(shared=False, name="probe.job", idempotency_key="{token}")
    def job(token: str) -> str:
        return token

    probe.ledger.ensure_indexes()  # (a worker's start makes them)
    queue = probe.tiers.queue("default")
    try:
        with redis.Redis.from_url(broker_url) as broker:
            broker.flushdb()

            def sweep() -> Any:
                return probe.reconciler.sweep(stale_after_seconds=3600, lease_grace_seconds=3600)

            assert sweep().broker_data_lost is not None  # (its watch begins)
            # Given a backlog of quiet jobs...
            results = probe.publish_many([job.s(f"t{n}") for n in range(JOBS)])
            ids = [r.id for r in results]
            time.sleep(QUIET_SECONDS + 0.5)
            assert sweep().missing == 0  # (the watch's end: its last look)
            assert broker.llen(queue) == JOBS

            # ...of which the oldest's and the newest's messages are lost
            def lose(task_id: str) -> None:
                for raw in broker.lrange(queue, 0, -1):
                    if json.loads(raw)["headers"]["id"] == task_id:
                        assert broker.lrem(queue, 1, raw) == 1
                        return
                raise AssertionError(f"{task_id} not in the queue")

            lose(ids[0])
            lose(ids[-1])

            def waiting() -> list[str]:
                return [json.loads(raw)["headers"]["id"] for raw in broker.lrange(queue, 0, -1)]

            # When the reconciler looks (its stale sweep far away)
            time.sleep(QUIET_SECONDS + 0.1)
            first = sweep()
            # Then the job lost a moment ago is back at the first look, once
            assert first.missing == 1, first.as_dict()
            assert ids[-1] in waiting() and ids[0] not in waiting()
            # ...and the oldest within the round (three looks); nothing else published again
            more = []
            while ids[0] not in waiting():
                assert len(more) < 2, [r.as_dict() for r in more]
                time.sleep(QUIET_SECONDS + 0.1)
                more.append(sweep())
            assert sum(r.missing for r in more) == 1
            assert sorted(waiting()) == sorted(ids)
            # A look after the round: nothing missing, nothing published twice
            time.sleep(QUIET_SECONDS + 0.1)
            assert sweep().missing == 0
            assert broker.llen(queue) == JOBS
            broker.flushdb()
    finally:
        probe.close()
