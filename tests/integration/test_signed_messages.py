"""Message authentication on real servers: a worker that requires signatures runs what its
producers signed (with either key of a rotation, sealed or not, and what it publishes itself:
retries and callbacks) and dead-letters, with its reason, what someone who can write to the
broker sent: unsigned messages, changed arguments, a new identity for a captured message."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ledger import State

from .conftest import make_isolated_stack, producer_app
from .helpers import shared_task, wait_for

NEW = "signing-key-after-rotation-0123456789abcdef"
OLD = "signing-key-before-rotation-0123456789abcdef"
TASKS = "tests.integration.ledger_app."


def _effects(running: Any, kind: str, key: str) -> int:
    """Effects the isolated stack's workers recorded (in its own ledger server)."""
    from pymongo import MongoClient

    with MongoClient(running.ledger.url) as client:
        return int(client.reference_world.effects.count_documents({"kind": kind, "key": key}))


def _dead_reason(app: Any, record_id: str) -> str:
    def dead() -> bool:
        app.dead_letters.drain_poison()
        raw = app.ledger.find_raw(record_id)
        return raw is not None and raw.get("state") == State.DEAD.value

    wait_for(dead, what=f"{record_id} dead-lettered", timeout=60)
    return str(app.ledger.find_raw(record_id)["dead_reason"])


def _rewrite_queued(broker: redis.Redis, queue: str, message_id: str, change: Any) -> None:
    """What a writer to the broker can do: change a queued message in place."""
    for index, raw in enumerate(broker.lrange(queue, 0, -1)):
        envelope = json.loads(raw)
        if envelope["headers"]["id"] == message_id:
            body = json.loads(base64.b64decode(envelope["body"]))
            change(envelope["headers"], body)
            envelope["body"] = base64.b64encode(json.dumps(body).encode()).decode()
            broker.lset(queue, index, json.dumps(envelope))
            return
    raise AssertionError(f"{message_id} is not queued")


def _copy_queued(broker: redis.Redis, queue: str, message_id: str, change: Any) -> None:
    """A captured message sent again, changed: a second copy on the queue."""
    for raw in broker.lrange(queue, 0, -1):
        envelope = json.loads(raw)
        if envelope["headers"]["id"] == message_id:
            change(envelope["headers"])
            broker.lpush(queue, json.dumps(envelope))
            return
    raise AssertionError(f"{message_id} is not queued")


def test_a_worker_requiring_signatures_runs_signed_jobs_and_dead_letters_forgeries(
    tmp_path: Path, stack: Any, token: str
) -> None:
    running = make_isolated_stack(tmp_path)
    try:
        assert running.broker is not None
        broker = redis.Redis.from_url(running.broker.url)
        before = producer_app(running, "signed_before", signing_keys=[OLD])
        after = producer_app(running, "signed_after", signing_keys=[NEW, OLD])
        stranger = producer_app(running, "unsigned", signing_keys=[])
        queue = after.tiers.queue("default")

        # Given jobs signed with either key of a rotation, a sensitive one among them, a job
        # that retries (the worker's own republish) and one with a callback...
        old_signed = shared_task(before, TASKS + "record").delay(f"{token}-old")
        new_signed = shared_task(after, TASKS + "record").delay(f"{token}-new")
        sealed = shared_task(after, TASKS + "store_card").delay(f"{token}-card", "4111")
        retried = shared_task(after, TASKS + "flaky").delay(f"{token}-flaky", 2)
        chained = (
            shared_task(after, TASKS + "add").s(1, 2) | shared_task(after, TASKS + "add").s(4)
        ).delay()
        # ...and what a writer to the broker sends: an unsigned message, a signed message with
        # its arguments changed, and a captured message given a new identity (its key)
        unsigned = shared_task(stranger, TASKS + "record").delay(f"{token}-unsigned")
        changed = shared_task(after, TASKS + "record").delay(f"{token}-changed")

        captured = shared_task(after, TASKS + "record").delay(f"{token}-captured")

        def new_args(headers: dict[str, Any], body: list[Any]) -> None:
            body[0] = [f"{token}-changed", 5.0]

        def new_identity(headers: dict[str, Any]) -> None:
            headers["ledger_key"] = f"{token}-captured-again"

        _rewrite_queued(broker, queue, changed.id, new_args)
        _copy_queued(broker, queue, captured.id, new_identity)

        # When a worker that lists [new, old] and requires signatures runs the queue
        running.start_worker(
            running.queues_of(),
            concurrency=2,
            env={
                "LEDGER_SIGNING_KEYS": json.dumps([NEW, OLD]),
                "LEDGER_SIGNATURES_REQUIRED": "true",
            },
        )

        # Then every signed job ran, once
        assert old_signed.get(timeout=60)["token"] == f"{token}-old"
        assert new_signed.get(timeout=60)["token"] == f"{token}-new"
        assert after.AsyncResult(sealed.id).get(timeout=60)["last4"] == "4111"
        assert retried.get(timeout=60) == "ok after 2 failures"
        assert chained.get(timeout=60) == 7
        assert captured.get(timeout=60)["token"] == f"{token}-captured"
        assert _effects(running, "record", f"{token}-captured") == 1

        # And each forgery is dead with its reason, its effect never happened
        assert "unsigned message" in _dead_reason(after, unsigned.id)
        assert "bad message signature" in _dead_reason(after, changed.id)
        assert _effects(running, "record", f"{token}-unsigned") == 0
        assert _effects(running, "record", f"{token}-changed") == 0
        assert _effects(running, "record", f"{token}-captured-again") == 0
        for app in (before, after, stranger):
            app.close()
    finally:
        running.stop()


@pytest.mark.parametrize("required", ["true", "false"])
def test_a_signature_made_with_a_key_no_worker_lists_is_refused(
    tmp_path: Path, stack: Any, token: str, required: str
) -> None:
    """Rotated out too early (or a stranger's key): refused even while unsigned messages are
    still accepted during a rollout."""
    running = make_isolated_stack(tmp_path)
    try:
        stray = producer_app(running, "stray_key", signing_keys=["x" * 40])
        job = shared_task(stray, TASKS + "record").delay(token)
        running.start_worker(
            running.queues_of(),
            env={"LEDGER_SIGNING_KEYS": json.dumps([NEW]), "LEDGER_SIGNATURES_REQUIRED": required},
        )
        probe = producer_app(running, "probe", signing_keys=[NEW])
        assert "not listed in LEDGER_SIGNING_KEYS" in _dead_reason(probe, job.id)
        assert _effects(running, "record", token) == 0
        again = shared_task(probe, TASKS + "record").delay(f"{token}-after")
        assert again.get(timeout=60)["token"] == f"{token}-after"  # the worker is still up
        stray.close()
        probe.close()
    finally:
        running.stop()
