"""Long-lived jobs: checkpoints, steps, heartbeats, budgets, shutdown, the reconciler."""

from __future__ import annotations

import json
import os
import random
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ledger import State
from tasks.effects import effects

from .helpers import effect_count, wait_for

N_DOCS = 5000


def make_source(token: str, n: int = N_DOCS) -> None:
    source = effects().database.get_collection(f"source_{token}")
    source.insert_many([{"_id": i, "payload": i * 7} for i in range(n)])


def running_record(app: Any, task: Any, token: str, *, after_fence: int = 0) -> Any:
    record = app.ledger.get(task.name, token)
    if record is not None and record.state is State.RUNNING and record.fence > after_fence:
        return record
    return None


def reads(token: str) -> int:
    return sum(d["n"] for d in effects().find({"kind": "read", "key": token}))


def processed(token: str) -> int:
    return effects().database.processed.count_documents({"_id": {"$regex": f"^{token}:"}})


def pool_pid(record: Any) -> int:
    return int(record.lease_owner.rsplit(":", 1)[1])


def test_a_backfill_killed_twice_resumes_and_processes_every_document_once(
    app: Any, token: str
) -> None:
    from tests.integration.ledger_app import backfill_docs

    make_source(token)
    result = backfill_docs.delay(token)
    fence = 0
    for _ in range(2):
        # Let it get somewhere (random point), then SIGKILL the pool process running it
        record = wait_for(
            lambda f=fence: running_record(app, backfill_docs, token, after_fence=f),
            timeout=60,
            what="backfill running",
        )
        target = reads(token) + random.randint(250, 1250)
        wait_for(lambda t=target: reads(token) >= t, timeout=60, what="progress")
        os.kill(pool_pid(app.ledger.get(backfill_docs.name, token)), signal.SIGKILL)
        fence = record.fence
    assert result.get(timeout=120) > 0
    final = app.ledger.get(backfill_docs.name, token)
    assert final.state is State.SUCCEEDED and final.attempts == 3
    assert processed(token) == N_DOCS  # every document exactly once
    # Resumed from checkpoints: at most the batch in flight is read again at each kill
    assert N_DOCS <= reads(token) <= N_DOCS + 2 * 250


def test_a_completed_step_is_not_repeated_after_a_crash(app: Any, token: str) -> None:
    from tests.integration.ledger_app import two_steps

    result = two_steps.delay(token, 3.0)
    wait_for(lambda: effect_count("charge", token) == 1, what="charge step done")
    record = wait_for(lambda: running_record(app, two_steps, token), what="running")
    os.kill(pool_pid(record), signal.SIGKILL)  # crash in the pause after the step
    assert result.get(timeout=60) == {"charge": f"ch-{token}", "receipt": "sent"}
    assert app.ledger.get(two_steps.name, token).attempts == 2
    assert effect_count("charge", token) == 1
    assert effect_count("receipt", token) == 1


def test_heartbeats_keep_a_job_longer_than_its_lease(app: Any, token: str) -> None:
    from tests.integration.ledger_app import long_sleeper

    result = long_sleeper.delay(token, 9.0)  # the lease is 4 s
    assert result.get(timeout=60) > 0
    record = app.ledger.get(long_sleeper.name, token)
    assert (record.attempts, record.duplicates) == (1, 0)
    assert effect_count("slept", token) == 1


def test_a_slow_holder_without_heartbeats_is_fenced_out_after_reconcile(
    app: Any, token: str
) -> None:
    from tests.integration.ledger_app import slow_without_heartbeat

    result = slow_without_heartbeat.delay(token, 8.0)
    first = wait_for(lambda: running_record(app, slow_without_heartbeat, token), what="running")
    time.sleep(4.5)  # its 4 s lease has ended while it still runs
    report = app.reconciler.sweep(lease_grace_seconds=0)
    assert report.expired_leases >= 1 and report.restored_from_broker >= 1
    second = wait_for(
        lambda: running_record(app, slow_without_heartbeat, token, after_fence=first.fence),
        what="taken over",
    )
    assert pool_pid(second) != pool_pid(first)
    # The second holder has no heartbeats either: its lease can end in turn and a later
    # delivery take over (kombu restores its message too). Whoever completes (the record's
    # fence is the completer's), it is not the first, slow holder.
    winner = result.get(timeout=60)
    time.sleep(4)  # the slow holder finishes late: its completion is refused by fencing
    final = app.ledger.get(slow_without_heartbeat.name, token)
    assert final.state is State.SUCCEEDED and final.result == winner
    assert final.fence >= second.fence > first.fence


@pytest.fixture
def victim_workers(stack: Any) -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for worker in started:
        worker.kill()
        stack.workers.remove(worker)


def test_the_reconciler_restores_the_message_of_a_killed_worker(
    stack: Any, app: Any, token: str, victim_workers: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.integration.ledger_app import long_sleeper

    # A first publish that wrote no record (dedupe on publish off): its message says so
    monkeypatch.setattr(long_sleeper, "dedupe_on_publish", False)

    queue = f"victim-{uuid.uuid4().hex[:6]}"
    victim = stack.start_worker(queue, concurrency=1, name=f"{queue}@127.0.0.1")
    victim_workers.append(victim)
    result = long_sleeper.apply_async((token, 3.0), queue=queue)
    wait_for(lambda: running_record(app, long_sleeper, token), what="running")
    victim.kill()  # the whole worker: Redis would redeliver only after its visibility timeout
    time.sleep(4.5)  # lease 4 s, no heartbeat any more
    report = app.reconciler.sweep(lease_grace_seconds=0)
    assert report.restored_from_broker == 1
    # The copy says it is one, as kombu's own restores do: its job's record exists, so its
    # claim is not tried as an insert though the message says its publish wrote no record.
    with redis.Redis.from_url(stack.broker.url) as broker:
        (restored,) = (json.loads(raw) for raw in broker.lrange(queue, 0, -1))
    assert restored["properties"]["ledger_new"] is True
    assert restored["headers"]["redelivered"] is True
    assert restored["properties"]["delivery_info"]["redelivered"] is True
    rescuer = stack.start_worker(queue, concurrency=1, name=f"{queue}-2@127.0.0.1")
    victim_workers.append(rescuer)
    assert result.get(timeout=60) > 0
    assert app.ledger.get(long_sleeper.name, token).attempts == 2
    assert effect_count("slept", token) == 1


def test_max_age_and_time_limits_retire_to_the_dead_letter_flow(
    app: Any, token: str, tmp_path: Path
) -> None:
    from tests.integration.ledger_app import expiring, hard_limited, soft_limited

    old = expiring.apply_async((token,), headers={"ledger_enqueued_at": time.time() - 3600})
    with pytest.raises(Exception):  # noqa: B017 - the job never runs, its record is dead
        wait_for(
            lambda: (
                app.ledger.get_by_id(old.id) is not None
                and app.ledger.get_by_id(old.id).state is State.DEAD
            ),
            what="expired",
        )
        old.get(timeout=5)
    assert app.ledger.get_by_id(old.id).dead_reason.startswith("expired: enqueued 3600s ago")
    assert effect_count("expiring", token) == 0

    artefact = tmp_path / "partial.csv"
    artefact.write_text("half done")
    soft = soft_limited.delay(token, str(artefact))
    with pytest.raises(Exception, match=r"SoftTimeLimitExceeded|soft"):
        soft.get(timeout=30)
    record = app.ledger.get(soft_limited.name, token)
    assert record.state is State.DEAD
    assert record.dead_reason == "time limit exceeded (soft, 1s)"
    # The cleanup hook removed the job's temporary file (it runs once the record is dead: wait)
    wait_for(lambda: not artefact.exists(), timeout=10, what="the artefact removed")

    hard = hard_limited.delay(token)
    wait_for(
        lambda: (r := app.ledger.get_by_id(hard.id)) is not None and r.state is State.DEAD,
        timeout=30,
        what="hard limit retirement",
    )
    assert app.ledger.get_by_id(hard.id).dead_reason == "time limit exceeded (hard, 2s)"
    assert effect_count("hard", token) == 0


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_sigterm_checkpoints_requeues_and_another_worker_finishes(
    stack: Any, app: Any, token: str, victim_workers: list[Any], pool: str
) -> None:
    """On every pool: a prefork body runs in a child of the worker's main process, a threads
    (gevent, solo) body in that process itself; each hears of its warm shutdown."""
    from tests.integration.ledger_app import backfill_docs

    make_source(token)
    queue = f"long-{uuid.uuid4().hex[:6]}"
    first = stack.start_worker(queue, concurrency=1, pool=pool, name=f"{queue}-a@127.0.0.1")
    victim_workers.append(first)
    result = backfill_docs.apply_async((token,), queue=queue)
    wait_for(lambda: reads(token) >= 1000, timeout=60, what="progress")
    second = stack.start_worker(queue, concurrency=1, name=f"{queue}-b@127.0.0.1")
    victim_workers.append(second)
    first.expect_exit()
    os.kill(first.pid, signal.SIGTERM)  # warm shutdown
    first.process.wait(30)
    assert "interrupted by shutdown" in first.log_path.read_text()
    assert result.get(timeout=120) > 0
    assert processed(token) == N_DOCS
    assert reads(token) <= N_DOCS + 250  # resumed from its checkpoint, not from zero
    assert app.ledger.get(backfill_docs.name, token).attempts == 2
