"""A broker that loses its data, under default settings: wiped while it runs (``FLUSHALL``),
or restarted without its data (its append-only file gone). Jobs published before, waiting in
their queue when it happened, and jobs published right after (their producer had declared its
queues' bindings before, and the broker forgot them): each runs once, soon (the workers'
reconciler notices the broker's marker gone and looks for the jobs whose message is nowhere at
once, not after the stale time meant for deep queues), and no worker ends.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import redis

from celery_ledger import State
from celery_ledger.broker import RedisBroker, Watch, WatchState
from celery_ledger.embedded.stack import EmbeddedStack

from .conftest import broker_client, producer_app, start_healing_worker
from .helpers import effect_count, shared_task, wait_for

RECORD = "tests.integration.ledger_app.record"
FAILS = "tests.integration.ledger_app.fails_until_fixed"
BEFORE, AFTER = 30, 10
# The bound this test holds the platform to, from the loss to the last job's end: the
# reconciler's sweep (every second here) and the jobs' own run time, well under a minute.
RECOVERY_SECONDS = 60.0


def lose_data(stack: EmbeddedStack, how: str) -> None:
    assert stack.broker is not None
    if how == "wiped":
        broker_client(stack).flushall()
        return
    stack.broker.stop()
    for path in stack.broker.data_dir.iterdir():  # the append-only file and any snapshot
        if path.name.startswith("appendonly") or path.suffix in (".aof", ".rdb"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    stack.broker.restart()


@pytest.mark.parametrize("how", ["wiped", "restarted empty"])
def test_jobs_a_broker_lost_run_once_under_default_settings(own: EmbeddedStack, how: str) -> None:
    # Given a worker (its reconciler sweeps every second) and a producer with default settings
    worker = start_healing_worker(own, f"loss-{how.replace(' ', '-')}", concurrency=2)
    producer = producer_app(own, f"loss_{uuid.uuid4().hex[:6]}")
    task = shared_task(producer, RECORD)
    run = uuid.uuid4().hex[:8]
    before = [f"{run}-b{n}" for n in range(BEFORE)]
    after = [f"{run}-a{n}" for n in range(AFTER)]
    for token in before:
        task.apply_async((token,), {"sleep_seconds": 0.3})
    wait_for(
        lambda: sum(effect_count("record", t) for t in before) >= 4,
        timeout=60,
        what="the first jobs running",
    )
    # When the broker loses its data with most of them still waiting in their queue
    lost_at = time.monotonic()
    lose_data(own, how)
    # ...and the producer publishes more right after
    for token in after:
        task.apply_async((token,), {"sleep_seconds": 0.3})

    # Then every job ends succeeded, its body run once, within the bound
    def ended() -> bool:
        return all(
            (r := producer.ledger.get(task.name, t)) is not None and r.state is State.SUCCEEDED
            for t in before + after
        )

    wait_for(ended, timeout=RECOVERY_SECONDS, interval=0.5, what="every job succeeded")
    recovered = time.monotonic() - lost_at
    time.sleep(2.0)  # (a second copy, had one been run, would show)
    assert [t for t in before + after if effect_count("record", t) != 1] == []
    assert worker.alive()
    print(f"{how}: {BEFORE + AFTER} jobs ended {recovered:.1f}s after the loss")
    producer.close()


def dead_letter_records(stack: EmbeddedStack, queue: str) -> list[str]:
    """The record ids the dead letters' queue holds copies of, one per copy."""
    found = []
    for raw in broker_client(stack).lrange(queue, 0, -1):
        body = json.loads(raw)["body"]
        found.append(json.loads(base64.b64decode(body))["record_id"])
    return found


def test_the_dead_letters_copies_a_broker_lost_are_copied_again(own: EmbeddedStack) -> None:
    # Given dead letters whose copies are on the dead letters' queue
    start_healing_worker(own, "loss-dead", concurrency=2)
    producer = producer_app(own, f"loss_dead_{uuid.uuid4().hex[:6]}")
    task = shared_task(producer, FAILS)
    queue = producer.tiers.dead_letter_queue
    run = uuid.uuid4().hex[:8]
    before = [f"{run}-d{n}" for n in range(8)]
    ids = {task.delay(token).id for token in before}
    wait_for(lambda: set(dead_letter_records(own, queue)) == ids, timeout=60, what="copies")

    # When the broker loses its data, and more jobs die after
    lose_data(own, "restarted empty")
    after = [f"{run}-a{n}" for n in range(2)]
    ids |= {task.delay(token).id for token in after}

    # Then every death has its copy on the queue again, once
    wait_for(
        lambda: sorted(dead_letter_records(own, queue)) == sorted(ids),
        timeout=RECOVERY_SECONDS,
        interval=0.5,
        what="every dead letter's copy on the queue again",
    )
    producer.close()


def test_the_copies_a_loss_owes_are_noted_in_the_broker_widened_and_paid_once(
    client: redis.Redis,
) -> None:
    """What the reconciler owes after a loss lives in the broker (any sweeper pays it)."""
    broker = RedisBroker(client, queues=["q"], delayed_key="q:delayed", marker_key="m")
    assert broker.copies_owed() is None
    later = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    broker.owe_copies(later, hold_seconds=2)
    broker.owe_copies(later + timedelta(minutes=5), hold_seconds=2)  # (a narrower one: no wider)
    owed = broker.copies_owed()
    assert owed is not None and owed.since == later and owed.held  # (paid at every sweep)
    time.sleep(2.1)
    assert broker.copies_owed() == dataclasses.replace(owed, held=False)  # (then paid off)
    owed = broker.copies_owed()
    assert owed is not None
    broker.owe_copies(later - timedelta(minutes=5), hold_seconds=0)
    wider = broker.copies_owed()
    assert wider is not None and wider.since == later - timedelta(minutes=5)
    broker.copies_paid(owed)  # paid for an older note: the wider one stays owed
    assert broker.copies_owed() == wider
    broker.owe_copies(None, hold_seconds=0)  # a wipe: every copy
    every = broker.copies_owed()
    assert every is not None and every.since is None
    broker.owe_copies(later, hold_seconds=0)  # ...whatever a later loss owes
    again = broker.copies_owed()
    assert again is not None and again.since is None
    # A sweeper paying the note it read while another loss was noted meanwhile (the lock
    # passed to another worker during a slow sweep) leaves the newer note owed
    broker.copies_paid(every)
    assert broker.copies_owed() == again
    broker.copies_paid(again)
    assert broker.copies_owed() is None
    for foreign in ("garbage", "2026-01-01|x", "nan|x", "1e400|x"):  # not this module's: all
        client.set("m:copies-owed", foreign)
        odd = broker.copies_owed()
        assert odd is not None and odd.since is None, foreign
        broker.owe_copies(later, hold_seconds=0)
        widened = broker.copies_owed()
        assert widened is not None and widened.since is None, foreign


def test_the_watch_after_a_failover_is_the_fleets_widened_and_its_end_kept_until_seen_to(
    client: redis.Redis,
) -> None:
    """The watch after a failover lives in the broker (the sweep lock may move meanwhile); a
    second failover within it widens it; its end stays until a sweep has seen to it."""
    one = RedisBroker(client, queues=["q"], delayed_key="q:delayed", marker_key="w")
    other = RedisBroker(client, queues=["q"], delayed_key="q:delayed", marker_key="w")
    assert one.watch() == WatchState(Watch.NONE)
    at = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    one.watch_after_failover(1.0, at)
    other.watch_after_failover(0.2, at + timedelta(minutes=1))  # (within it: no narrower)
    assert one.watch() == other.watch() == WatchState(Watch.WATCHING, at)
    time.sleep(1.1)
    assert [one.watch(), other.watch()] == [WatchState(Watch.ENDED, at)] * 2  # (until seen to)
    other.watch_done()
    assert one.watch() == WatchState(Watch.NONE)
    client.set("w:watch:end", "garbage")  # (not this module's: the whole window)
    assert one.watch() == WatchState(Watch.ENDED, None)
