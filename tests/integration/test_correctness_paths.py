"""One regression test per path a review found where a job could be lost, stuck or run twice,
on real servers (valkey-server, SecantusDB, a real prefork worker). Paths 3, 7 and 10 are
store-protocol paths, tested in ``test_store_contract.py`` against SecantusDB:
``test_a_write_concern_error_on_the_claim_is_never_read_as_a_duplicate``,
``test_an_outcome_write_repeated_after_a_lost_reply_recognises_itself`` and
``test_the_dead_write_of_a_job_nobody_runs`` (a kill applies only to the record as read)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from cryptography.fernet import Fernet
from pymongo import MongoClient

from celery_ledger import ConfigurationError, IdentityError, State
from celery_ledger.crypto import Sealer
from celery_ledger.embedded.stack import EmbeddedStack
from celery_ledger.identity import derive_task_id
from celery_ledger.ledger.message import KeptMessage

from .conftest import make_isolated_stack, producer_app
from .helpers import effect_count, shared_task, wait_for
from .test_bad_messages import raw_message

APP = "tests.integration.ledger_app"


def broker_of(stack: EmbeddedStack) -> redis.Redis:
    assert stack.broker is not None
    return redis.Redis.from_url(stack.broker.url)


def settled(app: Any, task: Any, key: str, state: State, timeout: float = 30) -> Any:
    return wait_for(
        lambda: (r := app.ledger.get(task.name, key)) is not None and r.state is state and r,
        timeout=timeout,
        what=f"{task.name}/{key} {state.value}",
    )


def test_path_01_a_stale_holders_hard_limit_never_kills_the_new_holder(
    app: Any, token: str
) -> None:
    from tests.integration.ledger_app import outlived

    # Given a holder that outlives its 2 s lease (no heartbeats) and is killed at its 6 s limit
    result = outlived.delay(token)
    first = settled(app, outlived, token, State.RUNNING)
    time.sleep(2.5)
    # and a newer holder that took the job over meanwhile (the reconciler brought it back)
    app.reconciler.sweep(lease_grace_seconds=0)
    wait_for(
        lambda: (r := app.ledger.get(outlived.name, token)) is not None and r.fence > first.fence,
        what="the takeover",
    )
    # When the old holder's hard limit fires, the job is not retired under the new holder
    assert result.get(timeout=30) == "second holder"
    record = app.ledger.get(outlived.name, token)
    assert record.state is State.SUCCEEDED and record.attempts == 2
    assert effect_count("outlived", token) == 1
    time.sleep(1)  # the old holder's limit (6 s after its start) has certainly passed
    assert app.ledger.get(outlived.name, token).state is State.SUCCEEDED


@pytest.fixture
def isolated(tmp_path: Path, stack: Any) -> Iterator[EmbeddedStack]:
    running = make_isolated_stack(tmp_path)
    try:
        running.start_worker(running.queues_of("default"), concurrency=1, name="paths@127.0.0.1")
        yield running
    finally:
        running.stop()


def test_path_02_a_ledger_outage_during_a_checkpoint_defers_and_never_kills(
    isolated: EmbeddedStack,
) -> None:
    producer = producer_app(isolated, "paths_producer", mongo_timeout_ms=1500)
    checkpointing = shared_task(producer, f"{APP}.checkpointing")
    token = f"outage-{uuid.uuid4().hex[:8]}"
    # Given a job that checkpoints every 0.2 s
    result = checkpointing.delay(token, 40)
    wait_for(
        lambda: (
            (
                (producer.ledger.find_raw(derive_task_id(checkpointing.name, token)) or {}).get(
                    "checkpoint"
                )
                or {}
            ).get("i", 0)
            >= 5
        ),
        what="checkpoints",
    )
    # When the ledger goes away in the middle of it (an election, a restart) and comes back
    isolated.ledger.kill()
    time.sleep(3)
    isolated.ledger.restart()
    # Then the job is put off and resumes: it succeeds, once, and was never dead
    assert result.get(timeout=90) == 40
    record = producer.ledger.get(checkpointing.name, token)
    assert record.state is State.SUCCEEDED and record.errors == []
    world = MongoClient(isolated.ledger.url).get_database("reference_world")
    assert world.effects.count_documents({"kind": "checkpointed", "key": token}) == 1
    assert "ledger unavailable inside the body" in isolated.workers[0].log_path.read_text()
    producer.close()


def test_path_04_ignore_reject_and_replace_from_a_body(app: Any, token: str) -> None:
    from tests.integration.ledger_app import ignores, rejects, replaced

    # Ignore ends the job, terminal, with its reason: a copy or a sweep never runs it again
    ignores.delay(token)
    record = settled(app, ignores, token, State.SUCCEEDED)
    assert app.ledger.find_raw(record.id)["outcome"] == "ignored"
    # Reject(requeue=False) is a dead letter with the reason, replayable
    rejects.delay(token)
    dead = settled(app, rejects, token, State.DEAD)
    assert dead.dead_reason == "rejected by the task: bad order"
    # replace(): the job ends naming its replacement, whose result it then reads
    original = replaced.delay(token)
    assert original.get(timeout=30)["token"] == f"{token}-replacement"
    assert app.ledger.find_raw(original.id)["outcome"] == "replaced"
    report = app.reconciler.sweep(stale_after_seconds=0.01, lease_grace_seconds=0)
    assert original.id not in report.skipped
    ignores.delay(token)
    replaced.delay(token)
    time.sleep(2)
    assert effect_count("ignores", token) == 1
    assert effect_count("replaced", token) == 1  # dedupe-on-publish never loops a replace
    assert effect_count("record", f"{token}-replacement") == 1


def test_path_05_an_oversized_result_is_refused_before_the_effect_repeats(
    app: Any, token: str
) -> None:
    from tests.integration.ledger_app import huge

    huge.delay(token)
    record = settled(app, huge, token, State.DEAD)
    assert record.dead_reason.startswith("result too large: 5000002 bytes")
    huge.delay(token)  # a copy of the message
    time.sleep(1.5)
    assert effect_count("huge", token) == 1


def test_path_06_a_retry_that_cannot_be_published_is_never_dropped(
    stack: Any, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import flaky

    broker = broker_of(stack)
    key = app.runtime.delayed.key
    held = broker.zrange(key, 0, -1, withscores=True)
    # Given a delayed set that refuses writes (the retry's publish fails)
    broker.delete(key)
    broker.set(key, "not a sorted set")
    try:
        result = flaky.delay(token, 1)
        # Then the failing attempt hands its message back instead of dropping it, and the
        # redelivery runs as the retry
        assert result.get(timeout=30) == "ok after 1 failures"
    finally:
        broker.delete(key)
        if held:
            broker.zadd(key, dict(held))
    record = app.ledger.get(flaky.name, token)
    assert record.state is State.SUCCEEDED and record.attempts == 2
    assert effect_count("flaky", token) == 1


def test_path_08_task_track_started_loses_nothing(
    app: Any, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.integration.ledger_app import tracked

    assert tracked.track_started is True
    assert tracked.delay(token).get(timeout=30) == token
    monkeypatch.setattr(tracked, "dedupe_on_publish", False)  # (or a known key is not sent)
    tracked.delay(token)  # a duplicate
    record = wait_for(
        lambda: (r := app.ledger.get(tracked.name, token)) is not None and r.duplicates == 1 and r,
        what="the duplicate suppressed",
    )
    assert record.state is State.SUCCEEDED and record.fence > 0
    assert effect_count("tracked", token) == 1


def test_path_09_a_replayed_poison_record_never_blocks_the_drain(
    stack: Any, app: Any, token: str
) -> None:
    broker = broker_of(stack)
    task = f"{APP}.record"

    def entry(message_id: str, key: str) -> str:
        return json.dumps(
            {
                "queue": "default",
                "reason": "invalid task message: test",
                "at": time.time(),
                "raw_base64": "W1tdLCB7fSwge31d",  # [[], {}, {}]
                "headers": {"task": task, "id": message_id, "ledger_key": key},
            }
        )

    # Given a poison record that was replayed (a live job again)
    first = entry(str(uuid.uuid4()), token)
    broker.lpush(app.dead_letters.poison_key, first)
    record_id = derive_task_id(task, token)
    wait_for(lambda: app.ledger.find_raw(record_id) is not None, what="poison recorded")
    app.ledger.reopen(record_id, actor="test")
    # When another copy of it, then another poison message, are drained
    broker.lpush(app.dead_letters.poison_key, first)
    other = f"{token}-other"
    broker.lpush(app.dead_letters.poison_key, entry(str(uuid.uuid4()), other))
    # Then both are handled: the copy noted on the live job, the other recorded dead
    wait_for(lambda: broker.llen(app.dead_letters.poison_key) == 0, what="the drain")
    assert app.ledger.find_raw(derive_task_id(task, other))["state"] == State.DEAD
    assert app.ledger.find_raw(record_id)["quarantined"] == 1


def test_path_11_one_job_one_identity(stack: Any, app: Any, token: str) -> None:
    from tests.integration.ledger_app import record

    # An explicit task id that is not the key's is refused at publish
    with pytest.raises(IdentityError):
        record.apply_async((token,), task_id="shared-id")
    # Two raw messages with one id but different keys are two jobs, each run once
    broker = broker_of(stack)
    shared = str(uuid.uuid4())
    for suffix in ("a", "b"):
        body = json.dumps([[f"{token}-{suffix}"], {}, {}]).encode()
        message = json.loads(raw_message(body, task=record.name))
        message["headers"].update({"id": shared, "ledger_key": f"{token}-{suffix}"})
        broker.lpush(app.tiers.queue("default"), json.dumps(message))
    for suffix in ("a", "b"):
        settled(app, record, f"{token}-{suffix}", State.SUCCEEDED)
        assert effect_count("record", f"{token}-{suffix}") == 1


def test_path_12_a_failed_publish_after_enqueue_never_loses_the_job(app: Any, token: str) -> None:
    from tests.integration.ledger_app import record_deduped

    record_id = derive_task_id(record_deduped.name, token)
    message = KeptMessage.of_call([token], {}, message_headers={"ledger_key": token})
    # Given producer A's queued record, and producer B that skipped publishing because of it
    app.ledger.enqueue(
        record_id, task=record_deduped.name, key=token, tier="default", message=message
    )
    record_deduped.delay(token)  # B: known, not published
    # When A's publish fails: the record stays, marked for the reconciler
    app.ledger.mark_unpublished(record_id)
    report = app.reconciler.sweep()
    assert report.republished >= 1
    # Then the job runs, once
    settled(app, record_deduped, token, State.SUCCEEDED)
    assert effect_count("deduped", token) == 1


def test_path_13_values_kombu_decodes_are_kept_and_the_job_runs(
    stack: Any, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import describe

    # A producer's JSON with kombu's type markers: the worker gets a datetime argument
    body = json.dumps(
        [[token, {"__type__": "datetime", "__value__": "2026-01-01T00:00:00+00:00"}], {}, {}]
    ).encode()
    item = raw_message(body, task=describe.name)
    broker_of(stack).lpush(app.tiers.queue("default"), item)
    message_id = json.loads(item)["headers"]["id"]
    record = wait_for(
        lambda: (
            (r := app.ledger.get_by_id(message_id)) is not None and r.state is State.SUCCEEDED and r
        ),
        what="the job",
    )
    assert record.result == ["str", "datetime"] and record.fence > 0
    kept = app.ledger.find_raw(record.id)["message"]
    assert "__type__" in kept["args_json"]  # kept as sent: a republish rebuilds the datetime


def test_path_13_a_revoked_job_is_a_replayable_dead_letter(app: Any, token: str) -> None:
    from tests.integration.ledger_app import record

    result = record.apply_async((token,), countdown=2)  # held in the delayed set meanwhile
    app.control.revoke(result.id)
    dead = settled(app, record, token, State.DEAD, timeout=30)
    assert dead.dead_reason == "revoked" and dead.fence == 0
    assert app.ledger.find_raw(dead.id)["message"]["args_json"] == json.dumps([token])
    assert effect_count("record", token) == 0


def test_path_14_a_purged_job_still_stops_a_late_copy(app: Any, token: str) -> None:
    from tests.integration.ledger_app import fails_until_fixed

    fails_until_fixed.delay(token)
    dead = settled(app, fails_until_fixed, token, State.DEAD)
    assert app.dead_letters.purge([app.ledger.find_raw(dead.id)], actor="test") == 1
    fails_until_fixed.delay(token)  # a late copy
    time.sleep(1.5)
    record = app.ledger.get(fails_until_fixed.name, token)
    assert record.state is State.DEAD and record.attempts == 1


def test_path_14_a_poison_replay_is_routed_by_its_task(stack: Any, app: Any, token: str) -> None:
    from tests.integration.ledger_app import bulk_item

    # Given a message of a bulk task that says it belongs on the critical queue, with a
    # header no worker may read (quarantined by the transport as it was received)
    body = json.dumps([[token], {}, {}]).encode()
    message = json.loads(raw_message(body, task=bulk_item.name, headers={"ledger_key": token}))
    message["headers"]["timelimit"] = "forever"
    message["properties"]["delivery_info"]["routing_key"] = app.tiers.queue("critical")
    broker_of(stack).lpush(app.tiers.queue("critical"), json.dumps(message))
    record_id = derive_task_id(bulk_item.name, token)
    wait_for(
        lambda: (app.ledger.find_raw(record_id) or {}).get("state") == State.DEAD,
        what="poison record",
    )
    # When it is replayed, it goes to its task's tier, and runs once
    outcome = app.dead_letters.replay(app.ledger.find_raw(record_id), actor="test")
    assert outcome.replayed and outcome.detail == "replayed to bulk"
    settled(app, bulk_item, token, State.SUCCEEDED)
    assert effect_count("bulk", token) == 1


def test_path_15_map_starmap_and_chunks_are_refused(app: Any) -> None:
    from tests.integration.ledger_app import add

    for call in (lambda: add.map([1]), lambda: add.starmap([(1, 2)]), lambda: add.chunks([], 2)):
        with pytest.raises(ConfigurationError, match="without their ledger claims"):
            call()


def test_path_16_the_reconciler_skips_a_record_it_cannot_open_and_keeps_headers(
    app: Any, token: str
) -> None:
    from tests.integration.ledger_app import record

    # Given a job sealed with a key since rotated out, and a healthy one, whose workers died
    foreign = Sealer([Fernet.generate_key().decode()])  # a key the app does not have
    unreadable = KeptMessage.of_call([f"{token}-sealed"], {}, message_headers={}, sealer=foreign)
    healthy = KeptMessage.of_call(
        [token],
        {},
        message_headers={"ledger_key": token, "ledger_enqueued_at": 1234.5, "retries": 2},
    )
    for key, message in ((f"{token}-sealed", unreadable), (token, healthy)):
        app.ledger.claim(
            derive_task_id(record.name, key),
            task=record.name,
            key=key,
            tier="default",
            owner="dead-host:1",
            lease_seconds=0.01,
            message=message,
        )
    time.sleep(0.1)
    # When the reconciler sweeps, the bad record is counted and the healthy one comes back
    report = app.reconciler.sweep(lease_grace_seconds=0)
    assert report.failed >= 1 and report.republished >= 1
    done = settled(app, record, token, State.SUCCEEDED)
    # with its first-enqueue time and retry count (max age and the retry budget hold)
    kept = app.ledger.find_raw(done.id)["message"]["headers"]
    assert kept["ledger_enqueued_at"] == 1234.5 and kept["retries"] == 2
