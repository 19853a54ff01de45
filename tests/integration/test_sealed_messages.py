"""A sensitive task's arguments are sealed by the publisher: every byte the broker holds (its
queues, the delayed set, the unacknowledged hash, its AOF on disk) and every ledger collection
is read raw, and the secret is in none of them, while the worker still runs the job."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from bson import BSON
from cryptography.fernet import Fernet

from celery_ledger import State
from celery_ledger.crypto import SEALED_CONTENT_TYPE

from .conftest import TEST_ENV, make_isolated_stack, producer_app
from .helpers import shared_task, wait_for

STORE_CARD = "tests.integration.ledger_app.store_card"
ECHO = "tests.integration.ledger_app.echo"


def _secret() -> str:
    # Unique, and shares nothing with the token (the idempotency key is not secret here).
    return f"pan-{uuid.uuid4().hex}"


def _broker_bytes(client: redis.Redis) -> bytes:
    """Everything the broker holds, whatever the key's type."""
    found: list[bytes] = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == b"list":
            found += client.lrange(key, 0, -1)
        elif kind == b"zset":
            found += client.zrange(key, 0, -1)
        elif kind == b"hash":
            for field, value in client.hgetall(key).items():
                found += [field, value]
        elif kind == b"set":
            found += list(client.smembers(key))
        elif kind == b"string":
            found.append(client.get(key) or b"")
        found.append(key)
    return b"\n".join(found)


def _files_bytes(directory: Path) -> bytes:
    return b"\n".join(p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file())


def _ledger_bytes(app: Any) -> bytes:
    """Every document of every collection of every database of the ledger, as BSON."""
    client = app.ledger.collection.database.client
    found: list[bytes] = []
    for name in client.list_database_names():
        database = client[name]
        for collection in database.list_collection_names():
            found += [BSON.encode(doc) for doc in database[collection].find()]
    return b"\n".join(found)


def test_a_sensitive_tasks_arguments_are_ciphertext_everywhere_outside_the_worker(
    tmp_path: Path, stack: Any, token: str
) -> None:
    secret = _secret()
    running = make_isolated_stack(tmp_path)
    try:
        assert running.broker is not None
        producer = producer_app(running, "sealed_probe")
        broker = redis.Redis.from_url(running.broker.url)
        store_card = shared_task(producer, STORE_CARD)

        # Given a job queued now and one delayed 10 s, with no worker running yet (its record,
        # written at its publish, keeps its due time: a copy that came early would wait for it)
        now = store_card.delay(token, secret)
        later = store_card.apply_async((f"{token}-later", secret), countdown=10)
        control = _secret()  # the same path, for a task that is not sensitive
        echo = shared_task(producer, ECHO).delay(f"{token}-plain", control)

        # Then the queue holds them sealed and the delayed set holds its sealed entry; the
        # broker and its AOF hold the control's text (the reading sees plaintext) and not
        # the secret
        queued = [json.loads(m) for m in broker.lrange(producer.tiers.queue("default"), 0, -1)]
        by_id = {m["headers"]["id"]: m for m in queued}
        assert by_id[now.id]["content-type"] == SEALED_CONTENT_TYPE
        assert by_id[now.id]["headers"]["argsrepr"] == by_id[now.id]["headers"]["kwargsrepr"]
        assert by_id[echo.id]["content-type"] == "application/json"
        assert broker.zcard(producer.runtime.delayed.key) == 1
        time.sleep(1.5)  # appendfsync everysec: the AOF has what the server has
        held, on_disk = _broker_bytes(broker), _files_bytes(tmp_path)
        assert control.encode() in held and control.encode() in on_disk
        assert secret.encode() not in held
        assert secret.encode() not in on_disk

        # When a worker runs them (the delayed one once due)
        running.start_worker(running.queues_of(), concurrency=1)

        # Then both ran once with the arguments they were given
        assert echo.get(timeout=60) == [[f"{token}-plain", control], {}]
        assert now.get(timeout=60) == {"last4": secret[-4:], "echo": secret}
        assert later.get(timeout=60) == {"last4": secret[-4:], "echo": secret}
        for job in (token, f"{token}-later"):
            assert producer.ledger.get(store_card.name, job).state is State.SUCCEEDED

        # And no byte of the broker, its AOF, the ledger or the worker's log holds the secret
        time.sleep(1.5)
        assert secret.encode() not in _broker_bytes(broker)
        # every server's data directory (the AOF, SecantusDB's files) and the worker's log
        assert any(p.name == "appendonlydir" for p in tmp_path.rglob("*"))
        assert secret.encode() not in _files_bytes(tmp_path)
        ledger = _ledger_bytes(producer)
        assert control.encode() in ledger  # the plain task's record holds its arguments
        assert secret.encode() not in ledger
        producer.close()
    finally:
        running.stop()


def test_a_message_sealed_with_a_key_no_worker_holds_is_dead_lettered_alone(
    tmp_path: Path, stack: Any, token: str
) -> None:
    """Key rotation: a worker listing ``[new, old]`` opens messages sealed with either; one
    sealed with a key rotated out is kept dead with its reason, and the others still run."""
    listed = json.loads(TEST_ENV["LEDGER_ENCRYPTION_KEYS"])
    new, old = Fernet.generate_key().decode(), listed[0]
    gone = Fernet.generate_key().decode()
    secret = _secret()
    running = make_isolated_stack(tmp_path)
    try:
        before = producer_app(running, "before_rotation", encryption_keys=[old])
        after = producer_app(running, "after_rotation", encryption_keys=[new, old])
        stray = producer_app(running, "rotated_out", encryption_keys=[gone])
        sealed_old = shared_task(before, STORE_CARD).delay(f"{token}-old", secret)
        sealed_gone = shared_task(stray, STORE_CARD).delay(f"{token}-gone", secret)
        sealed_new = shared_task(after, STORE_CARD).delay(f"{token}-new", secret)

        running.start_worker(
            running.queues_of(),
            concurrency=1,
            env={
                "LEDGER_ENCRYPTION_KEYS": json.dumps([new, old]),
                # parked for a worker that holds the key (the handoff), none does: dead after
                "LEDGER_UNRUNNABLE_WINDOW_SECONDS": "3",
            },
        )

        # (results are sealed with the worker's newest key: read them with the new key list)
        assert after.AsyncResult(sealed_old.id).get(timeout=60)["echo"] == secret
        assert after.AsyncResult(sealed_new.id).get(timeout=60)["echo"] == secret
        after.dead_letters.drain_poison()
        # (its publish wrote its record, queued: dedupe on publish, the default)
        wait_for(
            lambda: (after.ledger.find_raw(sealed_gone.id) or {}).get("state") == State.DEAD.value,
            what="the unopenable message's dead record",
            timeout=60,
        )
        dead = after.ledger.find_raw(sealed_gone.id)
        assert dead["state"] == State.DEAD.value
        assert "cannot be opened with LEDGER_ENCRYPTION_KEYS" in dead["dead_reason"]
        assert secret.encode() not in BSON.encode(dead)
        # The worker is alive and still runs sealed jobs after it
        again = shared_task(after, STORE_CARD).delay(f"{token}-again", secret)
        assert again.get(timeout=60)["echo"] == secret
        for producer in (before, after, stray):
            producer.close()
    finally:
        running.stop()


def test_a_message_sealed_with_a_key_some_workers_lack_reaches_one_that_holds_it(
    tmp_path: Path, stack: Any, token: str
) -> None:
    """An encryption key rotation under way: producers seal with the newest key, which only
    the workers already redeployed hold. The others park the job (the handoff) instead of
    dead-lettering it, and it runs once on a worker that opens it."""
    listed = json.loads(TEST_ENV["LEDGER_ENCRYPTION_KEYS"])
    new, old = Fernet.generate_key().decode(), listed[0]
    secret = _secret()
    running = make_isolated_stack(tmp_path)
    try:
        running.start_worker(
            running.queues_of(),
            name="stale@127.0.0.1",
            env={"LEDGER_ENCRYPTION_KEYS": json.dumps([old])},
        )
        after = producer_app(running, "after_rotation", encryption_keys=[new, old])
        job = shared_task(after, STORE_CARD).delay(f"{token}-new", secret)
        wait_for(lambda: after.runtime.parking.count() >= 1, what="the stale worker parking")
        running.start_worker(
            running.queues_of(),
            name="current@127.0.0.1",
            env={"LEDGER_ENCRYPTION_KEYS": json.dumps([new, old])},
        )
        assert job.get(timeout=30)["echo"] == secret
        record = after.ledger.find_raw(job.id)
        assert record["state"] == State.SUCCEEDED.value and record["attempts"] == 1
        after.close()
    finally:
        running.stop()
