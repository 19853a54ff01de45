"""The dead-letter flow without servers: the poison drain, announcements, replay and purge,
over an in-memory ledger and Redis."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace
from typing import Any

import bson
import pytest

from celery_ledger import Settings
from celery_ledger.crypto import Sealer
from celery_ledger.deadletter import DeadLetters
from celery_ledger.errors import LedgerUnavailable, StoreError
from celery_ledger.identity import derive_task_id, identity_of
from celery_ledger.ledger.dead import DeadJob
from celery_ledger.ledger.message import KeptMessage
from celery_ledger.ledger.record import State
from celery_ledger.ledger.store import COPY_DUE_SHIFT, COPY_GRACE, Unclaimed
from celery_ledger.routing import TIERS, Tiers
from celery_ledger.signing import Signer
from tests.fakes import Clock, MemoryLedger, MemoryRedis, Outbox, server_clocks

TASK = "shop.charge"
KEYS = ["0qFzQc5xoZQhPWiz7RlXDGRcus0k650e5VRXFgPRCH8="]


class World:
    def __init__(self, signer: Signer | None = None) -> None:
        self.ledger = MemoryLedger(clock=Clock())
        self.redis = MemoryRedis()
        self.outbox = Outbox()
        self.runtime = SimpleNamespace(
            **server_clocks(self.ledger.now),
            name="unit",
            ledger=self.ledger,
            redis=self.redis,
            settings=Settings(),
            sealer=Sealer(KEYS),
            signer=signer or Signer([]),  # no keys: nothing is authenticated
            tiers=Tiers(TIERS, default="default"),
            publish=self.outbox.publish,
            tier_of=lambda name: "bulk" if name == TASK else None,
            observers=SimpleNamespace(dead=lambda job, letter: self.dead.append(letter)),
        )
        self.dead: list[Any] = []
        self.letters = DeadLetters(self.runtime, self.outbox.publish_raw)  # type: ignore[arg-type]

    def poison(self, task: str = TASK, message_id: str = "m-1", **headers: Any) -> str:
        entry = json.dumps(
            {
                "queue": "critical",  # what the message claimed for itself
                "reason": f"unknown task {task!r}" if task != TASK else "invalid task message",
                "at": 0.0,
                "raw_base64": base64.b64encode(b"[[7, 100], {}, {}]").decode(),
                "headers": {"task": task, "id": message_id, **headers},
            }
        )
        self.redis.lpush(self.letters.poison_key, entry)
        return entry


@pytest.fixture
def world() -> World:
    return World()


def test_a_poison_message_of_a_known_job_is_recorded_under_its_identity(world: World) -> None:
    world.poison(ledger_key="order-7")

    assert world.letters.drain_poison() == 1

    record_id = derive_task_id(TASK, "order-7")
    doc = world.ledger.docs[record_id]
    assert doc["state"] == State.DEAD and doc["death"] == "poison"
    assert doc["dead_reason"] == "invalid task message"
    # the message's own id finds it (AsyncResult, dlq show)
    assert world.ledger.resolve("m-1")["_id"] == record_id  # type: ignore[index]
    # and it was announced once: the queue copy and the observers
    assert [q for q, _, _ in world.outbox.raw] == ["dead_letter"] and len(world.dead) == 1
    assert world.redis.lists[world.letters.poison_key] == []


def test_two_workers_draining_the_same_entry_make_one_record_and_one_announcement(
    world: World,
) -> None:
    entry = world.poison(ledger_key="order-7")
    world.redis.lpush(world.letters.poison_key, entry)  # both drains read the same oldest entry

    world.letters.drain_poison()

    assert sum(1 for d in world.ledger.docs.values() if d.get("state") == State.DEAD) == 1
    assert len(world.outbox.raw) == 1


def test_a_replayed_poison_record_never_blocks_the_drain(world: World) -> None:
    # Given a poison record that an operator replayed (no longer dead)
    world.poison(ledger_key="order-7")
    world.letters.drain_poison()
    record_id = derive_task_id(TASK, "order-7")
    world.ledger.docs[record_id]["state"] = State.QUEUED.value
    # When another copy of the same message turns up as poison
    world.poison(ledger_key="order-7")
    # Then it is noted on the live job and the drain moves on
    assert world.letters.drain_poison() == 1
    assert world.ledger.docs[record_id]["quarantined"] == 1
    assert world.ledger.docs[record_id]["state"] == State.QUEUED


def test_a_poison_entry_too_large_to_keep_never_blocks_the_drain(world: World) -> None:
    # Given a poison entry the ledger refuses as it is and sanitized (a huge message)
    world.poison(ledger_key="order-7")
    world.poison(ledger_key="order-8")
    world.ledger.fail("bury", StoreError("document too large"), times=2)
    # Then it is kept by its size and digest, and the entry behind it is drained too
    assert world.letters.drain_poison() == 2
    [kept] = [
        d for d in world.ledger.docs.values() if "without its bytes" in d.get("dead_reason", "")
    ]
    assert kept["state"] == State.DEAD and "sha256" in kept["dead_reason"]
    assert world.ledger.docs[derive_task_id(TASK, "order-8")]["state"] == State.DEAD
    assert world.redis.lindex(world.letters.poison_key, -1) is None


def test_a_poison_copy_of_a_job_that_succeeded_leaves_it_alone(world: World) -> None:
    record_id = derive_task_id(TASK, "order-7")
    world.ledger.docs[record_id] = {
        "_id": record_id,
        "task": TASK,
        "key": "order-7",
        "state": State.SUCCEEDED.value,
        "result": "1",
    }
    world.poison(ledger_key="order-7")
    world.letters.drain_poison()
    assert world.ledger.docs[record_id]["state"] == State.SUCCEEDED
    assert world.outbox.raw == []


@pytest.mark.parametrize("bad", [{"x\x00y": 1}, {"x-big": 2**70}], ids=["NUL key", "huge int"])
def test_headers_bson_cannot_hold_are_stored_in_a_form_it_can(
    world: World, bad: dict[str, Any]
) -> None:
    world.poison(**bad)
    world.letters.drain_poison()
    [doc] = [d for d in world.ledger.docs.values() if d.get("state") == State.DEAD]
    bson.encode(doc)


def test_an_entry_that_is_not_json_is_kept_as_an_unreadable_entry(world: World) -> None:
    world.redis.lpush(world.letters.poison_key, b"\xff not an entry")

    assert world.letters.drain_poison() == 1

    [doc] = world.ledger.docs.values()
    assert doc["dead_reason"].startswith("unreadable poison entry")
    assert base64.b64decode(doc["message"]["raw_base64"]) == b"\xff not an entry"
    assert not KeptMessage.from_document(doc["message"]).replayable  # type: ignore[union-attr]


def test_a_ledger_outage_leaves_the_entry_for_the_next_tick(world: World) -> None:
    world.poison()
    world.ledger.fail("bury", LedgerUnavailable("down"))

    with pytest.raises(LedgerUnavailable):
        world.letters.drain_poison()

    assert len(world.redis.lists[world.letters.poison_key]) == 1


# -- replay and purge ------------------------------------------------------------------------------


def dead_job(world: World, *, death: str = "failed", tier: str = "critical", **kept: Any) -> str:
    record_id = derive_task_id(TASK, "order-9")
    message = KeptMessage.of_call(
        [9, 0], {}, message_headers={"ledger_key": "order-9", "ledger_enqueued_at": 3.0}, **kept
    )
    dead = DeadJob.of_reason(death, "permanent error: declined", task=TASK, message=message)  # type: ignore[arg-type]
    world.ledger.bury(record_id, dead, match=Unclaimed(), task=TASK, key="order-9", tier=tier)
    return record_id


def test_a_replay_publishes_the_job_under_its_own_identity_once(world: World) -> None:
    record_id = dead_job(world)
    doc = world.letters.get(record_id)
    assert doc is not None

    outcome = world.letters.replay(doc, actor="ops@host")

    assert outcome.replayed and outcome.detail == "replayed to critical"
    [sent] = world.outbox.tasks
    assert sent.options["task_id"] == record_id and sent.args == [9, 0]
    assert sent.options["headers"]["ledger_enqueued_at"] == 3.0
    assert world.ledger.docs[record_id]["state"] == State.QUEUED
    # replaying again finds nothing to do
    again = world.letters.replay(world.letters.get(record_id), actor="ops")  # type: ignore[arg-type]
    assert not again.replayed and "not dead" in again.detail


def test_a_poison_replay_is_routed_by_its_task_not_by_what_the_message_said(
    world: World,
) -> None:
    world.poison(ledger_key="order-7")  # the message claimed queue "critical"
    world.letters.drain_poison()
    doc = world.letters.get("m-1")
    assert doc is not None

    outcome = world.letters.replay(doc, actor="ops")

    assert outcome.replayed and world.outbox.tasks[0].options["tier"] == "bulk"


def test_a_replay_whose_publish_fails_leaves_the_job_dead(world: World) -> None:
    record_id = dead_job(world)
    world.outbox.broken = ConnectionError("broker down")

    outcome = world.letters.replay(world.letters.get(record_id), actor="ops")  # type: ignore[arg-type]

    assert not outcome.replayed and world.ledger.docs[record_id]["state"] == State.DEAD


def test_a_sealed_message_whose_key_was_rotated_out_is_not_replayed(world: World) -> None:
    other = Sealer(["AcKyJ2oLnrAAy_LZcIqJcLFxu0NMYeTJnp7JIrpzIs4="])
    record_id = dead_job(world, sealer=other)

    outcome = world.letters.replay(world.letters.get(record_id), actor="ops")  # type: ignore[arg-type]

    assert not outcome.replayed and "cannot rebuild the arguments" in outcome.detail
    assert world.ledger.docs[record_id]["state"] == State.DEAD


def test_purge_keeps_a_tombstone_that_still_stops_a_late_copy(world: World) -> None:
    record_id = dead_job(world, death="poison")
    doc = world.letters.get(record_id)

    assert world.letters.purge([doc], actor="ops") == 1  # type: ignore[list-item]

    tombstone = world.ledger.docs[record_id]
    assert tombstone["state"] == State.DEAD and "message" not in tombstone
    assert world.letters.find() == []  # gone from triage
    # a late copy of the job is still refused, and a replay has nothing to send
    claim = world.ledger.claim(record_id, task=TASK, key="order-9", tier="bulk", owner="w:1")
    assert claim.outcome == "dead"
    assert not world.letters.replay(tombstone, actor="ops").replayed


def test_poison_identity_matches_the_guards(world: World) -> None:
    # The drain and the guard derive the same record id for a message without a key header
    identity = identity_of(TASK, "m-2", key_header=None)
    world.poison(message_id="m-2")
    world.letters.drain_poison()
    assert identity.record_id in world.ledger.docs


def test_an_unreadable_store_entry_is_refused_cleanly(world: World) -> None:
    world.poison()
    world.ledger.fail("bury", StoreError("refused"), times=1)
    # the sanitized form is stored instead, so nothing blocks
    assert world.letters.drain_poison() == 1


def test_a_copy_the_broker_refused_is_published_later(world: World) -> None:
    # Given a broker that refuses the dead letter's copy when the job dies
    def refuse(queue: str, payload: dict[str, Any], headers: dict[str, Any]) -> None:
        raise ConnectionError("broker away")

    world.letters._publish_raw = refuse  # type: ignore[method-assign]
    world.poison(ledger_key="order-7")
    world.letters.drain_poison()
    record_id = derive_task_id(TASK, "order-7")
    due = world.ledger.docs[record_id]["claimable_at"] - COPY_DUE_SHIFT
    assert due <= world.ledger.now()  # due at once
    assert len(world.dead) == 1  # observers were told at once
    # When the broker is back, the housekeeping publishes it, once
    world.letters._publish_raw = world.outbox.publish_raw  # type: ignore[method-assign]
    assert world.letters.copy_pending() == 1
    assert world.letters.copy_pending() == 0
    assert [letter["record_id"] for _, letter, _ in world.outbox.raw] == [record_id]


def test_a_copy_whose_announcer_died_is_published_after_the_grace(world: World) -> None:
    # Given a job buried by a process that died before it announced the death (no copy)
    record_id = derive_task_id(TASK, "order-8")
    dead = DeadJob.of_reason("failed", "permanent error: declined", task=TASK)
    world.ledger.bury(record_id, dead, match=Unclaimed(), task=TASK, key="order-8", tier="default")
    # and another one announced as usual
    world.poison(ledger_key="order-9")
    world.letters.drain_poison()
    announced = len(world.outbox.raw)
    # Then nothing is copied again before the grace, and only the lost copy after it
    assert world.letters.copy_pending() == 0
    world.ledger.now.advance(COPY_GRACE.total_seconds() + 1)
    assert world.letters.copy_pending() == 1
    assert world.letters.copy_pending() == 0
    assert [letter["record_id"] for _, letter, _ in world.outbox.raw[announced:]] == [record_id]
