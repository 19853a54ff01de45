"""Message authentication on real servers: a worker that requires signatures runs what its
producers signed (with either key of a rotation, sealed or not, and what it publishes itself:
retries and callbacks) and dead-letters, with its reason, what someone who can write to the
broker sent: unsigned messages, changed arguments or headers, a new identity for a captured
message. Such a message is filed under its own digest, never under the job it names, so it
never stops that job."""

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


def _quarantined(app: Any, message_id: str) -> dict[str, Any]:
    """The dead record of a refused message that named ``message_id``: filed under its own
    digest (the job it names has no dead record because of it)."""

    def found() -> dict[str, Any] | None:
        app.dead_letters.drain_poison()
        doc: dict[str, Any] | None = app.ledger.collection.find_one(
            {"state": State.DEAD.value, "claimed.id": message_id}
        )
        return doc

    doc = wait_for(found, what=f"{message_id} dead-lettered", timeout=60)
    assert doc["_id"].startswith("poison-") and doc["unauthenticated"]
    job = app.ledger.find_raw(message_id)
    assert job is None or job.get("state") != State.DEAD.value
    return doc


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
        # ...and in the delayed set, which a worker publishes (and signs) when due: an entry
        # added by hand, and a copy of a signed countdown's entry with other arguments
        held = after.runtime.delayed.key
        later = shared_task(after, TASKS + "record").apply_async((f"{token}-later",), countdown=1)
        forged_id = f"forged-{token}"
        added = {"task": TASKS + "record", "args": [f"{token}-added"], "kwargs": {}}
        added.update(id="added", options={"task_id": forged_id, "queue": queue})
        (signed_entry,) = [m for m in broker.zrange(held, 0, -1) if later.id.encode() in m]
        tampered = {**json.loads(signed_entry), "id": "tampered", "args": [f"{token}-tampered"]}
        broker.zadd(held, {json.dumps(added): 0, json.dumps(tampered): 0})

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
        assert later.get(timeout=60)["token"] == f"{token}-later"
        assert _effects(running, "record", f"{token}-captured") == 1

        # And each forgery is dead with its reason, its effect never happened
        forged = _quarantined(after, unsigned.id)
        assert "unsigned message" in forged["dead_reason"]
        assert "bad message signature" in _quarantined(after, changed.id)["dead_reason"]
        assert _effects(running, "record", f"{token}-unsigned") == 0
        assert _effects(running, "record", f"{token}-changed") == 0
        assert _effects(running, "record", f"{token}-captured-again") == 0
        added_reason = _quarantined(after, forged_id)["dead_reason"]
        assert "delayed entry: unsigned message" in added_reason
        tampered_reason = _quarantined(after, later.id)["dead_reason"]
        assert "delayed entry: bad message signature" in tampered_reason
        assert _effects(running, "record", f"{token}-added") == 0
        assert _effects(running, "record", f"{token}-tampered") == 0
        assert _effects(running, "record", f"{token}-later") == 1
        # and a replay would sign it: refused without an operator's --force-unsigned
        refused = after.dead_letters.replay(forged, actor="test")
        assert not refused.replayed and "failed authentication" in refused.detail
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
            env={
                "LEDGER_SIGNING_KEYS": json.dumps([NEW]),
                "LEDGER_SIGNATURES_REQUIRED": required,
                # parked for a worker that holds the key (the handoff), none does: dead after
                "LEDGER_UNRUNNABLE_WINDOW_SECONDS": "3",
            },
        )
        probe = producer_app(running, "probe", signing_keys=[NEW])
        assert "not listed in LEDGER_SIGNING_KEYS" in _quarantined(probe, job.id)["dead_reason"]
        assert _effects(running, "record", token) == 0
        again = shared_task(probe, TASKS + "record").delay(f"{token}-after")
        assert again.get(timeout=60)["token"] == f"{token}-after"  # the worker is still up
        stray.close()
        probe.close()
    finally:
        running.stop()


def _tampered(name: str) -> Any:
    """What a writer to the broker changes a bound header to (see tests/unit/test_signing.py),
    for a task this worker runs, so that the signature check is what refuses it."""
    from tests.unit.test_signing import TAMPERED

    if name == "task":
        return TASKS + "add"
    return TAMPERED.get(name, {"changed": name})


def test_changing_any_bound_header_dead_letters_the_copy_and_never_stops_its_job(
    tmp_path: Path, stack: Any, token: str
) -> None:
    from celery_ledger.identity import derive_task_id
    from celery_ledger.signing import BOUND_HEADERS

    running = make_isolated_stack(tmp_path)
    try:
        assert running.broker is not None
        broker = redis.Redis.from_url(running.broker.url)
        producer = producer_app(running, "tampering", signing_keys=[NEW])
        record = shared_task(producer, TASKS + "record")
        queue = producer.tiers.queue("default")
        # Given one signed job per bound header, each with that header changed in the queue
        tokens = {name: f"{token}-{index}" for index, name in enumerate(BOUND_HEADERS)}
        for name, job_token in tokens.items():
            sent = record.delay(job_token)

            def change(headers: dict[str, Any], body: list[Any], name: str = name) -> None:
                headers[name] = _tampered(name)

            _rewrite_queued(broker, queue, sent.id, change)
        # and a message forged for a job not yet published (its key guessed)
        future = f"{token}-future"
        future_id = derive_task_id(TASKS + "record", future)
        forged = json.loads(broker.lrange(queue, 0, 0)[0])
        forged["headers"].update(task=TASKS + "record", id=future_id, ledger_key=future)
        forged["body"] = base64.b64encode(json.dumps([[future], {}, {}]).encode()).decode()
        broker.lpush(queue, json.dumps(forged))

        # When a worker that requires signatures consumes them
        running.start_worker(
            running.queues_of(),
            concurrency=2,
            env={"LEDGER_SIGNING_KEYS": json.dumps([NEW]), "LEDGER_SIGNATURES_REQUIRED": "true"},
        )

        # Then every changed copy is dead under its own digest, and none of them ran
        def quarantined() -> list[dict[str, Any]] | None:
            producer.dead_letters.drain_poison()
            docs = list(producer.ledger.collection.find({"unauthenticated": {"$exists": True}}))
            return docs if len(docs) == len(tokens) + 1 else None

        docs = wait_for(quarantined, what="every changed copy dead-lettered", timeout=90)
        assert all(doc["_id"].startswith("poison-") for doc in docs)
        for name, job_token in tokens.items():
            assert _effects(running, "record", job_token) == 0, name
        assert _effects(running, "record", future) == 0
        # And no job was stopped: each one published now runs, once (published again as sent:
        # its record, queued at its first publish, would have a default producer skip it, and
        # the reconciler, off here, bring it back from the record)
        record.dedupe_on_publish = False
        for name, job_token in [*tokens.items(), ("future", future)]:
            job_id = derive_task_id(TASKS + "record", job_token)
            job = producer.ledger.find_raw(job_id)
            assert job is None or job.get("state") != State.DEAD.value, name
            assert record.delay(job_token).get(timeout=60)["token"] == job_token, name
            assert _effects(running, "record", job_token) == 1, name
        producer.close()
    finally:
        running.stop()


def test_a_job_signed_with_a_key_some_workers_lack_reaches_one_that_holds_it(
    tmp_path: Path, stack: Any, token: str
) -> None:
    """A key rotation under way: producers sign with the newest key, which only the workers
    already redeployed hold. The others park the job for them (the handoff) instead of
    refusing it, and it runs once on a worker that can check its signature."""
    running = make_isolated_stack(tmp_path)
    try:
        running.start_worker(
            running.queues_of(),
            name="stale@127.0.0.1",
            env={"LEDGER_SIGNING_KEYS": json.dumps([OLD]), "LEDGER_SIGNATURES_REQUIRED": "true"},
        )
        producer = producer_app(running, "rotated", signing_keys=[NEW, OLD])
        jobs = [shared_task(producer, TASKS + "record").delay(f"{token}-{i}") for i in range(3)]
        wait_for(lambda: producer.runtime.parking.count() >= 1, what="the stale worker parking")
        running.start_worker(
            running.queues_of(),
            name="current@127.0.0.1",
            env={
                "LEDGER_SIGNING_KEYS": json.dumps([NEW, OLD]),
                "LEDGER_SIGNATURES_REQUIRED": "true",
            },
        )
        for i, job in enumerate(jobs):
            assert job.get(timeout=30)["token"] == f"{token}-{i}"
            assert _effects(running, "record", f"{token}-{i}") == 1
        producer.close()
    finally:
        running.stop()
