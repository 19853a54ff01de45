"""The broker away for a while (paused: it does not answer; or stopped and restarted on its port
with its data) at the points of a job's life that need it: a job's acknowledgement after its
success, and a producer's publish with dedupe on. Each job ends succeeded with its effect once,
and no worker ends. (A broker at its memory limit: test_broker_full.py; one that loses its data:
test_broker_data_loss.py.)
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from kombu.exceptions import OperationalError

from celery_ledger import State
from celery_ledger.embedded.stack import EmbeddedStack

from .conftest import UNACKED, broker_client, producer_app, start_healing_worker
from .helpers import effect_count, shared_task, wait_for

OUTAGE_SECONDS = 10.0
BROKER_TIMEOUT = 1.0  # (LEDGER_BROKER_TIMEOUT_SECONDS of the producers here)
# The workers' reconciler also sends again a queued job whose message is gone after this.
STALE = {"LEDGER_RECONCILE_STALE_AFTER_SECONDS": "5"}


def down(stack: EmbeddedStack, how: str) -> None:
    assert stack.broker is not None
    if how == "paused":
        os.kill(stack.broker.pid, signal.SIGSTOP)
    else:
        stack.broker.stop()


def up(stack: EmbeddedStack, how: str) -> None:
    assert stack.broker is not None
    if how == "paused":
        os.kill(stack.broker.pid, signal.SIGCONT)
    else:
        stack.broker.restart()


@pytest.mark.parametrize("how", ["paused", "stopped"])
def test_a_broker_away_at_a_jobs_acknowledgement_loses_nothing(
    own: EmbeddedStack, how: str
) -> None:
    # Given a job whose body ends while the broker is away
    worker = start_healing_worker(own, f"ack-{how}", concurrency=1, env=STALE)
    producer = producer_app(own, f"ack_{how}")
    task = shared_task(producer, "tests.integration.ledger_app.long_sleeper")
    token = f"ack-{how}-{random.randint(0, 10**9)}"
    task.apply_async((token, 3.0))
    wait_for(
        lambda: (
            (r := producer.ledger.get(task.name, token)) is not None and r.state is State.RUNNING
        ),
        timeout=60,
        interval=0.05,
        what="the job running",
    )
    time.sleep(2.0)
    down(own, how)
    try:
        time.sleep(OUTAGE_SECONDS)
    finally:
        up(own, how)
    # Then it ends succeeded once, its message is not left unacknowledged (a second delivery,
    # if any, is a suppressed duplicate), and the worker is up
    wait_for(
        lambda: producer.ledger.get(task.name, token).state is State.SUCCEEDED,
        timeout=120,
        what="the job succeeded",
    )
    b = broker_client(own)
    wait_for(lambda: b.hlen(UNACKED) == 0, timeout=90, what="nothing left unacknowledged")
    record = producer.ledger.get(task.name, token)
    assert effect_count("slept", token) == 1 and record.attempts == 1
    assert worker.alive()
    producer.close()


@pytest.mark.parametrize("how", ["stopped", "paused"])
def test_a_deduplicated_publish_while_the_broker_is_down_is_told_and_runs_once(
    own: EmbeddedStack, how: str
) -> None:
    worker = start_healing_worker(own, f"publish-{how}", concurrency=1, env=STALE)
    producer = producer_app(
        own, f"publish_{how}", dedupe_on_publish=True, broker_timeout_seconds=BROKER_TIMEOUT
    )
    task = shared_task(producer, "tests.integration.ledger_app.record")
    task.apply_async((f"pub-warm-{random.randint(0, 10**9)}",))  # (its connections made)
    token = f"pub-{random.randint(0, 10**9)}"
    # When a producer publishes with the broker down (stopped: its connections refused; or
    # paused: it takes them and never answers): the caller is told, within a few broker
    # timeouts, not held for as long as the broker hangs
    down(own, how)
    try:
        began = time.monotonic()
        with pytest.raises(OperationalError):
            task.apply_async((token,))
        assert time.monotonic() - began < 8 * BROKER_TIMEOUT, "the publish hung"
        # ...and the job's record waits for the broker, marked unpublished
        assert producer.ledger.get(task.name, token).state is State.QUEUED
    finally:
        up(own, how)
    # Then once the broker is back the workers' reconciler publishes it: it runs once
    wait_for(
        lambda: producer.ledger.get(task.name, token).state is State.SUCCEEDED,
        timeout=90,
        what="the job succeeded",
    )
    time.sleep(2)
    assert effect_count("record", token) == 1
    assert worker.alive()
    producer.close()
