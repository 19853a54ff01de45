"""Poison messages and signatures: a message no signature vouches for is never filed under the
job its headers name (which would stop that job for good), and is not replayed, which would
sign it, unless its signature checks by then or an operator forces it."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from kombu.utils import json as kombu_json

from celery_ledger.crypto import Sealer
from celery_ledger.identity import derive_task_id
from celery_ledger.ledger.dead import DeadJob
from celery_ledger.ledger.message import KeptMessage
from celery_ledger.ledger.record import State
from celery_ledger.ledger.store import ClaimOutcome, Unclaimed
from celery_ledger.signing import HEADER, Signer
from tests.unit.test_dead_letters import KEYS, TASK, World

NEW, OLD = "n" * 40, "o" * 40
BAD_SIGNATURE = "invalid task message: bad message signature (the message was changed, or forged)"
REAL_KEY = "order-7"
REAL_ID = derive_task_id(TASK, REAL_KEY)
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def message(
    *,
    signer: Signer | None = None,
    args: list[Any] | None = None,
    message_id: str = REAL_ID,
    key: str = REAL_KEY,
    sealer: Sealer | None = None,
) -> tuple[dict[str, Any], bytes]:
    """A task message's headers and body bytes (signed with ``signer``, sealed with
    ``sealer``), as a worker's consumer keeps them when it refuses the message."""
    found: dict[str, Any] = {
        "task": TASK,
        "id": message_id,
        "ledger_key": key,
        "ledger_enqueued_at": 1767225600.0,
    }
    body = [args or [7, 100], {}, EMBED]
    if signer is not None:
        found[HEADER] = signer.sign(found, body)
    raw = kombu_json.dumps(body).encode()
    if sealer is not None:
        raw = sealer.seal(raw.decode()).encode()
    return found, raw


def keep(world: World, found: dict[str, Any], raw: bytes, reason: str = BAD_SIGNATURE) -> str:
    """What the consumer does with a refused message, then the housekeeping's drain; returns
    the record id the drain filed it under."""

    def dead() -> set[str]:
        return {i for i, d in world.ledger.docs.items() if d.get("state") == State.DEAD}

    before = dead()
    world.letters.push_poison(queue="critical", reason=reason, raw=raw, message_headers=found)
    assert world.letters.drain_poison() == 1
    [record_id] = dead() - before
    return record_id


def required() -> World:
    return World(signer=Signer([NEW], required=True))


# -- where a refused message is filed --------------------------------------------------------------


def test_a_forgery_claiming_a_real_jobs_id_is_filed_under_its_own_digest() -> None:
    # Given a worker that requires signatures, and a message forged for job order-7 (its key
    # guessed: an order number), with the attacker's arguments and a signature of their own
    world = required()
    found, raw = message(signer=Signer(["x" * 40]), args=[7, 999_999])
    world.letters.push_poison(
        queue="critical",
        reason="invalid task message: message signed with key 'abc'",
        raw=raw,
        message_headers=found,
    )

    # When the housekeeping moves it into the ledger
    assert world.letters.drain_poison() == 1

    # Then it is dead under a digest of its bytes, saying why and what it claimed
    [doc] = [d for d in world.ledger.docs.values() if d.get("state") == State.DEAD]
    assert doc["_id"].startswith("poison-") and doc["_id"] != REAL_ID
    assert "not listed in LEDGER_SIGNING_KEYS" in doc["unauthenticated"]
    assert doc["claimed"] == {"task": TASK, "id": REAL_ID, "key": REAL_KEY}
    # and the real job has no record, and no alias points its id at the forgery
    assert REAL_ID not in world.ledger.docs
    # So the real job, published later, is claimed and runs
    claim = world.ledger.claim(REAL_ID, task=TASK, key=REAL_KEY, tier="bulk", owner="w:1")
    assert claim.outcome is ClaimOutcome.CLAIMED


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: message(), id="unsigned"),
        pytest.param(
            lambda: (
                {**message(signer=Signer([NEW]))[0], "ledger_key": "order-8"},
                message(signer=Signer([NEW]))[1],
            ),
            id="identity changed under a good signature",
        ),
        pytest.param(
            lambda: (message(signer=Signer([NEW]))[0], b"\xff not the signed body"),
            id="signed headers on a body that cannot be read",
        ),
    ],
)
def test_no_unauthenticated_message_stops_the_job_it_names(make: Any) -> None:
    world = required()
    found, raw = make()

    record_id = keep(world, found, raw, reason="undecodable or refused content")

    assert record_id.startswith("poison-")
    assert world.ledger.docs[record_id]["unauthenticated"]
    for job_key in (REAL_KEY, "order-8"):
        assert derive_task_id(TASK, job_key) not in world.ledger.docs


def test_a_forgery_of_a_queued_job_leaves_the_job_queued() -> None:
    world = required()
    world.ledger.enqueue(
        REAL_ID,
        task=TASK,
        key=REAL_KEY,
        tier="bulk",
        message=KeptMessage.of_call([7, 100], {}, message_headers={}),
    )

    keep(world, *message(args=[7, 999_999]))

    assert world.ledger.docs[REAL_ID]["state"] == State.QUEUED
    assert "quarantined" not in world.ledger.docs[REAL_ID]  # not even noted on it


def test_the_same_forgery_sent_twice_is_one_record_announced_once() -> None:
    world = required()
    found, raw = message(args=[7, 999_999])
    first = keep(world, found, raw)
    world.letters.push_poison(
        queue="critical", reason=BAD_SIGNATURE, raw=raw, message_headers=found
    )
    world.letters.drain_poison()

    assert [d["_id"] for d in world.ledger.docs.values() if d.get("state") == State.DEAD] == [first]
    assert len(world.dead) == 1 and world.dead[0].unauthenticated


def test_a_message_whose_signature_checks_is_filed_under_its_job() -> None:
    """Refused for another reason (a task this worker does not know), its identity is sound."""
    world = required()
    found, raw = message(signer=Signer([NEW]))

    record_id = keep(world, found, raw, reason="unknown task 'shop.charge': no worker ran it")

    assert record_id == REAL_ID
    assert "unauthenticated" not in world.ledger.docs[REAL_ID]


def test_a_sealed_message_is_checked_against_its_opened_body() -> None:
    world = required()
    found, raw = message(signer=Signer([NEW]), sealer=Sealer(KEYS))

    assert keep(world, found, raw, reason="unknown task 'shop.charge'") == REAL_ID


@pytest.mark.parametrize(
    ("signer", "trusted"),
    [
        (Signer([]), True),  # no keys: nothing is authenticated, as before
        (Signer([NEW], required=False), True),  # a rollout: unsigned messages run too
        (Signer([NEW], required=True), False),
    ],
    ids=["no keys", "rollout", "required"],
)
def test_whether_an_unsigned_message_is_trusted_follows_what_a_worker_would_run(
    signer: Signer, trusted: bool
) -> None:
    world = World(signer=signer)

    record_id = keep(world, *message(), reason="invalid task message: body is not a triple")

    assert (record_id == REAL_ID) is trusted


def test_a_bad_signature_is_never_trusted_even_in_a_rollout() -> None:
    world = World(signer=Signer([NEW], required=False))
    found, raw = message(signer=Signer([NEW]))
    found["ledger_key"] = "order-8"

    assert keep(world, found, raw).startswith("poison-")


# -- replay ------------------------------------------------------------------------------------


def test_a_forgery_is_not_replayed_unless_forced() -> None:
    world = required()
    record_id = keep(world, *message(args=[7, 999_999]))
    doc = world.letters.get(record_id)
    assert doc is not None

    for dry_run in (True, False):
        refused = world.letters.replay(doc, dry_run=dry_run, actor="ops")
        assert not refused.replayed and "failed authentication" in refused.detail
        assert "--force-unsigned" in refused.detail
    assert world.outbox.tasks == []
    assert world.ledger.docs[record_id]["state"] == State.DEAD


def test_a_forced_replay_runs_the_message_as_the_job_it_claims_once() -> None:
    world = required()
    record_id = keep(world, *message(args=[7, 100]))  # say, a producer that had no key yet

    outcome = world.letters.replay(world.letters.get(record_id), actor="ops", force_unsigned=True)  # type: ignore[arg-type]

    assert outcome.replayed and outcome.forced
    [sent] = world.outbox.tasks
    assert sent.options["task_id"] == REAL_ID and sent.options["headers"]["ledger_key"] == REAL_KEY
    assert sent.args == [7, 100] and sent.options["tier"] == "bulk"
    # The quarantine record leaves triage; replaying it again has nothing to send
    assert world.ledger.docs[record_id]["purged_at"] is not None
    again = world.letters.replay(world.ledger.docs[record_id], actor="ops", force_unsigned=True)
    assert not again.replayed and len(world.outbox.tasks) == 1


def test_a_message_whose_key_is_listed_since_replays_without_force() -> None:
    # Given a message signed with a key the worker did not list yet (a rotation done in the
    # wrong order): dead, under its digest
    world = required()
    record_id = keep(world, *message(signer=Signer([OLD])))
    # When the key is listed, a replay checks the signature again, and it holds
    world.runtime.signer = Signer([NEW, OLD])

    outcome = world.letters.replay(world.letters.get(record_id), actor="ops")  # type: ignore[arg-type]

    assert outcome.replayed and not outcome.forced
    assert [t.options["task_id"] for t in world.outbox.tasks] == [REAL_ID]


def test_a_forgery_recorded_under_a_jobs_id_before_this_check_is_not_replayed() -> None:
    """A record an older release filed under the identity a forgery claimed: the replay checks
    the kept message's signature itself."""
    world = required()
    found, raw = message(args=[7, 999_999])
    kept = KeptMessage.of_raw(raw, kind="body", queue="critical", message_headers=found)
    dead = DeadJob.of_reason("poison", BAD_SIGNATURE, task=TASK, message=kept)
    world.ledger.bury(REAL_ID, dead, match=Unclaimed(), task=TASK, key=REAL_KEY, tier="bulk")

    outcome = world.letters.replay(world.letters.get(REAL_ID), actor="ops")  # type: ignore[arg-type]

    assert not outcome.replayed and "failed authentication" in outcome.detail
    assert world.outbox.tasks == []


def test_a_poison_record_naming_no_job_replays_into_a_job_keyed_by_its_digest() -> None:
    """Not into its own record, which no delivery would claim (it would stay queued)."""
    world = World()
    entry = {
        "queue": "critical",
        "reason": "invalid task message",
        "at": 0.0,
        "raw_base64": base64.b64encode(b"[[1], {}, {}]").decode(),
        "headers": {"task": TASK},
    }  # no id
    world.redis.lpush(world.letters.poison_key, json.dumps(entry))
    world.letters.drain_poison()
    [doc] = [d for d in world.ledger.docs.values() if d.get("state") == State.DEAD]

    outcome = world.letters.replay(doc, actor="ops")

    assert outcome.replayed
    [sent] = world.outbox.tasks
    assert sent.options["task_id"] == derive_task_id(TASK, doc["_id"])
    assert world.ledger.docs[doc["_id"]]["state"] == State.DEAD  # a tombstone, purged
    assert world.ledger.docs[doc["_id"]]["purged_at"] is not None


def test_a_process_that_accepts_unsigned_messages_still_refuses_to_replay_a_refused_one() -> None:
    """A CLI run during a rollout (unsigned accepted) replays what a worker requiring
    signatures refused only if its signature checks: its own leniency vouches for nothing."""
    world = required()
    record_id = keep(world, *message(args=[7, 999_999]))
    world.runtime.signer = Signer([NEW], required=False)

    outcome = world.letters.replay(world.letters.get(record_id), actor="ops")  # type: ignore[arg-type]

    assert not outcome.replayed and "unsigned message" in outcome.detail
    assert world.outbox.tasks == []
