"""Retries with backoff, the dead-letter flow, replay, and poison messages."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from celery_ledger import State
from tasks.effects import record_effect

from .helpers import effect_count, wait_for


def dead_letter_copies(stack: Any) -> list[dict[str, Any]]:
    """The bodies of the messages in the dead_letter queue (kombu's Redis list)."""
    import base64

    broker = redis.Redis.from_url(stack.broker.url)
    return [
        json.loads(base64.b64decode(json.loads(raw)["body"]))
        for raw in broker.lrange("ledger_tests.dead_letter", 0, -1)
    ]


def test_a_permanent_error_dead_letters_at_once(stack: Any, app: Any, token: str) -> None:
    from tests.integration.ledger_app import fails_until_fixed

    with pytest.raises(Exception, match=f"bad data for {token}"):
        fails_until_fixed.delay(token).get(timeout=30)
    record = app.ledger.get(fails_until_fixed.name, token)
    assert (record.state, record.attempts) == (State.DEAD, 1)
    assert record.dead_reason.startswith("permanent error: PermanentError")
    assert [e.action for e in record.errors] == ["dead"]
    raw = app.ledger.find_raw(record.id)
    assert json.loads(raw["message"]["args_json"]) == [token]
    copy = wait_for(
        lambda: [c for c in dead_letter_copies(stack) if c["record_id"] == record.id],
        what="dead-letter copy",
    )[0]
    assert copy["reason"] == record.dead_reason and copy["fingerprint"] == record.fingerprint


def test_exhausted_retries_dead_letter_with_their_history(app: Any, token: str) -> None:
    from tests.integration.ledger_app import always_down

    with pytest.raises(ConnectionError):
        always_down.delay(token).get(timeout=30)
    record = app.ledger.get(always_down.name, token)
    assert record.state is State.DEAD
    assert record.attempts == 3 and effect_count("attempt", token) == 3
    assert record.dead_reason == "retries exhausted after 2 retries"
    assert [e.action for e in record.errors] == ["retry", "retry", "dead"]
    delays = [e.planned_delay_seconds for e in record.errors[:2]]
    assert all(d is not None and 0 <= d <= 0.3 for d in delays)


def test_retry_after_hint_is_honoured(app: Any, token: str) -> None:
    from tests.integration.ledger_app import rate_limited_once

    assert rate_limited_once.delay(token).get(timeout=30) == "through"
    record = app.ledger.get(rate_limited_once.name, token)
    assert record.errors[0].planned_delay_seconds == pytest.approx(1.5)
    gap = (record.finished_at - record.errors[0].at).total_seconds()
    assert gap >= 1.4


def test_replay_runs_a_dead_job_once_and_replaying_again_does_nothing(app: Any, token: str) -> None:
    from tests.integration.ledger_app import fails_until_fixed

    with pytest.raises(Exception, match="bad data"):
        fails_until_fixed.delay(token).get(timeout=30)
    record_effect("fixed", token)  # the operator fixes the data

    doc = app.dead_letters.get(token, task=fails_until_fixed.name)
    outcome = app.dead_letters.replay(doc, actor="test")
    assert outcome.replayed
    result = app.AsyncResult(doc["_id"])
    wait_for(
        lambda: app.ledger.get_by_id(doc["_id"]).state is State.SUCCEEDED,
        what="replayed job succeeded",
    )
    assert result.get(timeout=10) == "fixed"
    assert effect_count("fixed_run", token) == 1
    replayed = app.ledger.find_raw(doc["_id"])
    assert replayed["replays"] == 1 and replayed["audit"][0]["by"] == "test"

    again = app.dead_letters.replay(app.ledger.find_raw(doc["_id"]), actor="test")
    assert not again.replayed and "nothing to do" in again.detail
    assert effect_count("fixed_run", token) == 1


def test_a_message_whose_worker_keeps_dying_becomes_poison(app: Any, token: str) -> None:
    from tests.integration.ledger_app import kills_its_worker

    # Plain Celery requeues such a message forever (reject_on_worker_lost).
    kills_its_worker.delay(token)
    record = wait_for(
        lambda: (
            (r := app.ledger.get(kills_its_worker.name, token)) is not None
            and r.state is State.DEAD
            and r
        ),
        timeout=90,
        what="poison dead-lettered",
    )
    assert record.dead_reason.startswith("poison: delivered 3 times")
    assert effect_count("attempt", token) == 3


def test_the_dead_letters_queue_keeps_only_its_newest_copies(stack: Any) -> None:
    import uuid

    from celery_ledger.ledger.dead import DeadLetter

    from .conftest import producer_app

    # Given an app whose dead letters' queue keeps 3 copies, and nobody consuming it
    namespace = f"cap-{uuid.uuid4().hex[:8]}"
    app = producer_app(stack, "capped", queue_namespace=namespace, dead_letter_queue_max=3)
    queue = app.tiers.dead_letter_queue

    # When five jobs die
    for i in range(5):
        letter = DeadLetter(
            f"r-{i}",
            "billing.charge",
            f"k-{i}",
            "default",
            "boom",
            "failed",
            "f",
            "t",
            None,
            [],
            "now",
        )
        app.dead_letters.announce(letter)

    # Then the queue holds the three newest copies (the ledger keeps every record)
    client = redis.Redis.from_url(stack.broker.url)
    bodies = [json.loads(raw)["body"] for raw in client.lrange(queue, 0, -1)]
    import base64

    ids = [json.loads(base64.b64decode(body))["record_id"] for body in bodies]
    assert ids == ["r-4", "r-3", "r-2"]
    client.delete(queue)


def test_a_queue_copy_never_outlives_its_record(stack: Any) -> None:
    import base64
    import uuid
    from datetime import UTC, datetime, timedelta

    from celery_ledger.ledger.dead import DeadLetter

    from .conftest import producer_app

    # Given copies in the dead letters' queue: two from before the retention, three newer
    namespace = f"life-{uuid.uuid4().hex[:8]}"
    app = producer_app(stack, "copies", queue_namespace=namespace, dead_retention_seconds=3600)
    queue = app.tiers.dead_letter_queue
    now = datetime.now(UTC)
    for i, age in enumerate([7200, 4000, 60, 30, 0]):
        at = (now - timedelta(seconds=age)).isoformat()
        fields = ("billing.charge", f"k-{i}", "default", "boom", "failed", "f", "t", None, [])
        app.dead_letters.announce(DeadLetter(f"r-{i}", *fields, at))
    client = redis.Redis.from_url(stack.broker.url)
    client.lpush(queue, "not a copy of ours")  # a consumer's business, left alone

    def ids() -> list[str]:
        found = []
        for raw in client.lrange(queue, 0, -1):
            try:
                found.append(json.loads(base64.b64decode(json.loads(raw)["body"]))["record_id"])
            except ValueError:
                found.append(raw.decode())
        return found

    # When the housekeeping trims them: the copies past the retention go (their records too)
    assert app.dead_letters.trim_copies() == 2
    assert ids() == ["not a copy of ours", "r-4", "r-3", "r-2"]
    # And a purge takes its records' copies with it
    assert app.dead_letters.drop_copies(["r-3", "r-9"]) == 1
    assert ids() == ["not a copy of ours", "r-4", "r-2"]
    client.delete(queue)
    app.close()


def test_filters_apply_before_the_limit_and_a_purge_is_audited_with_its_ids(
    app: Any, token: str
) -> None:
    from argparse import Namespace

    from click.testing import CliRunner

    from celery_ledger.cli.dlq import dlq
    from tests.integration.ledger_app import fails_until_fixed

    # Given an older dead job, then a newer one
    older, newer = f"{token}-older", f"{token}-newer"
    for key in (older, newer):
        with pytest.raises(Exception, match="bad data"):
            fails_until_fixed.delay(key).get(timeout=30)
    older_id = app.ledger.get(fails_until_fixed.name, older).id

    # Then a reason filter finds the older one even with a limit of one
    found = app.dead_letters.find(reason=older, limit=1)
    assert [d["_id"] for d in found] == [older_id]

    # And a purge by reason names its actor as told and every record id it removed
    result = CliRunner().invoke(
        dlq,
        ["purge", "--reason", older, "--yes", "--actor", "alice"],
        obj=Namespace(app=app),
    )
    assert result.exit_code == 0, result.output
    entry = next(e for e in app.ledger.audit_entries(limit=20) if e["action"] == "purge")
    assert entry["actor"] == "alice [--actor]" and entry["outcome"] == "done"
    assert entry["record_ids"] == [older_id] and entry["purged"] == 1
    assert app.dead_letters.find(reason=older) == []
    assert app.dead_letters.find(reason=newer) != []


def _bury_records(app: Any, token: str, count: int) -> list[str]:
    """``count`` dead jobs of ``record`` (keys ``<token>-<n>``), their messages kept."""
    from celery_ledger.identity import derive_task_id
    from celery_ledger.ledger.dead import DeadJob
    from celery_ledger.ledger.message import KeptMessage
    from celery_ledger.ledger.store import Unclaimed
    from tests.integration.ledger_app import record

    ids = []
    for n in range(count):
        key = f"{token}-{n}"
        kept = KeptMessage.of_call([key], {}, message_headers={"ledger_key": key})
        reason = f"permanent error: declined ({token})"
        dead = DeadJob.of_reason("failed", reason, task=record.name, message=kept)
        record_id = derive_task_id(record.name, key)
        app.ledger.bury(
            record_id, dead, match=Unclaimed(), task=record.name, key=key, tier="default"
        )
        ids.append(record_id)
    return ids


def test_a_replay_by_filter_takes_every_match_page_after_page(app: Any, token: str) -> None:
    from argparse import Namespace

    from click.testing import CliRunner

    from celery_ledger.cli.dlq import dlq

    # Given seven dead jobs, four of them dead in the same instant (their order is by id)
    ids = _bury_records(app, token, 7)
    tie = app.ledger.find_raw(ids[0])["finished_at"]
    app.ledger.collection.update_many({"_id": {"$in": ids[3:]}}, {"$set": {"finished_at": tie}})

    # Then reading them two per query finds each one once
    read = [doc["_id"] for doc in app.dead_letters.each(reason=token, page_size=2)]
    assert sorted(read) == sorted(ids)

    # And a replay by that filter, two per query, runs every one of them, once
    result = CliRunner().invoke(
        dlq,
        ["replay", "--reason", token, "--page-size", "2", "--actor", "test"],
        obj=Namespace(app=app),
    )
    assert result.exit_code == 0, result.output
    assert "7 of 7 replayed" in result.output
    for n in range(7):
        wait_for(
            lambda n=n: effect_count("record", f"{token}-{n}") == 1,
            what=f"replayed job {n} ran",
        )


def test_a_purge_removes_and_names_only_what_is_still_dead(app: Any, token: str) -> None:
    # Given two dead jobs, one of which is replayed after the purge listed them
    first, second = _bury_records(app, token, 2)
    listed = [app.ledger.find_raw(first), app.ledger.find_raw(second)]
    assert app.ledger.reopen(first, actor="someone else") is not None

    # When the purge runs on what it listed
    removed = app.dead_letters.purge_ids(listed, actor="test")

    # Then only the job still dead is removed, and named
    assert removed == [second]
    assert app.ledger.find_raw(first)["state"] == State.QUEUED.value
    assert app.ledger.find_raw(second)["purged_at"] is not None
    assert app.dead_letters.purge_ids(listed, actor="test") == []  # purged already
