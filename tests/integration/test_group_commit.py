"""Group commit on the real server: concurrent claims and completions of one process share bulk
writes, and every writer still gets its own outcome (claimed or not, lease lost, a bad write)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_ledger import LeaseLost, State
from celery_ledger.errors import StoreError
from celery_ledger.ledger import ClaimOutcome, Ledger
from celery_ledger.ledger.group_commit import Insert, Statement, Write
from celery_ledger.ledger.store import new_op

WRITERS = 16


@pytest.fixture
def store(stack: Any) -> Iterator[Ledger]:
    ledger = Ledger(uri=stack.ledger.url, database="ledger_group_commit_tests")
    ledger.ensure_indexes()
    yield ledger
    ledger.close()


@pytest.mark.parametrize("new", [False, True], ids=["conditional", "told-new"])
def test_concurrent_writers_share_flushes_and_each_gets_its_own_outcome(
    store: Ledger, new: bool
) -> None:
    # ``new``: every claim is told its job is new (a first publish), so the batches mix inserts
    # (two of which collide with records that exist) with the completions' updates.
    ids = [uuid.uuid4().hex for _ in range(WRITERS)]
    # One record is finished already (a duplicate), one is held by a live lease elsewhere
    done, held = ids[0], ids[1]
    first = store.claim(done, task="t", key=done, tier="default", owner="earlier")
    store.complete(done, first.fence, '"earlier"', op=new_op())
    store.claim(held, task="t", key=held, tier="default", owner="elsewhere")
    flushes, statements = store.writes.flushes, store.writes.statements

    barrier = threading.Barrier(WRITERS)
    outcomes: dict[str, Any] = {}

    def writer(record_id: str, index: int) -> None:
        barrier.wait(10)
        claim = store.claim(
            record_id, task="t", key=record_id, tier="default", owner=f"w{index}", new=new
        )
        outcomes[record_id] = claim.outcome
        if claim.outcome is not ClaimOutcome.CLAIMED:
            return
        barrier_after_claims.wait(10)
        fence = claim.fence if index != 2 else claim.fence - 1  # a stale fence: lease lost
        result = '"x"' * (6_000_000 if index == 3 else 1)  # a result too large to store
        try:
            store.complete(record_id, fence, result, op=new_op())
            outcomes[record_id] = "completed"
        except (LeaseLost, StoreError) as exc:
            outcomes[record_id] = type(exc).__name__

    barrier_after_claims = threading.Barrier(WRITERS - 2)
    threads = [threading.Thread(target=writer, args=(rid, i)) for i, rid in enumerate(ids)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert outcomes[done] is ClaimOutcome.DUPLICATE
    assert outcomes[held] is ClaimOutcome.BUSY
    assert outcomes[ids[2]] == "LeaseLost"
    assert outcomes[ids[3]] == "StoreError"
    assert all(outcomes[rid] == "completed" for rid in ids[4:]), outcomes
    for rid in ids[4:]:
        raw = store.find_raw(rid)
        assert raw is not None and raw["state"] == State.SUCCEEDED and raw["result"] == '"x"'
    for rid in ids[2:4]:
        record = store.get_by_id(rid)
        assert record is not None and record.state == State.RUNNING  # nothing was written
    duplicate = store.find_raw(done)
    assert duplicate is not None and duplicate["duplicates"] == 1

    # 16 claims and 14 completions (plus retries of the batch that held the huge result) went
    # out in fewer bulk writes than there were writes
    sent = store.writes.statements - statements
    assert sent >= 30
    assert store.writes.flushes - flushes < 30, (store.writes.flushes - flushes, sent)


def test_a_batch_of_inserts_upserts_and_updates_gives_each_its_outcome(store: Ledger) -> None:
    # pymongo sends a mixed bulk as two commands (its inserts, then its updates): the outcomes
    # must still line up with the statements, on the real server.
    taken, matched, missing, collides = (uuid.uuid4().hex for _ in range(4))
    store.collection.insert_many([{"_id": taken}, {"_id": matched}, {"_id": collides}])
    fresh, upserted = uuid.uuid4().hex, uuid.uuid4().hex
    ops: list[Write] = [
        Insert({"_id": fresh, "n": 1}),
        Statement({"_id": matched}, {"$set": {"n": 1}}),
        Insert({"_id": taken, "n": 1}),  # exists: a duplicate key
        Statement({"_id": upserted, "n": {"$exists": False}}, {"$set": {"n": 1}}, upsert=True),
        Statement({"_id": collides, "n": 5}, {"$set": {"n": 1}}, upsert=True),  # collides
    ]
    outcomes = store.writes.write(ops)
    assert [(o.upserted, o.matched, (o.error or {}).get("code")) for o in outcomes] == [
        (True, False, None),
        (False, True, None),
        (False, False, 11000),
        (True, False, None),
        (False, False, 11000),
    ]
    # and with an update that matched nothing, the plain ones are unknown (each checks its own)
    unknown = store.writes.write(
        [
            Insert({"_id": uuid.uuid4().hex}),
            *[
                Statement({"_id": record_id}, {"$set": {"n": 2}})
                for record_id in (matched, missing)
            ],
        ]
    )
    assert [o.matched for o in unknown] == [False, None, None] and unknown[0].upserted
    assert store.collection.count_documents({"_id": {"$in": [fresh, upserted]}, "n": 1}) == 2


def test_a_first_claims_insert_sent_again_after_it_applied_is_recognised(
    store: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A flush that failed for another writer's statement is sent again writer by writer: a
    # claim whose insert had applied then collides with its own record. It must claim (its
    # fence, one attempt), never count itself a duplicate or wait for its own lease.
    write = store.writes.write
    sent: list[Any] = []

    def applied_then_sent_again(ops: Any) -> Any:
        if not sent and isinstance(ops[0], Insert):
            sent.append(write(ops))  # applied, its outcome lost with the batch
        return write(ops)

    monkeypatch.setattr(store.writes, "write", applied_then_sent_again)
    record_id = uuid.uuid4().hex
    claim = store.claim(record_id, task="t", key=record_id, tier="default", owner="w", new=True)

    assert sent and sent[0][0].upserted  # the first send inserted it
    assert claim.outcome is ClaimOutcome.CLAIMED
    record = store.find_raw(record_id)
    assert record is not None and record["fence"] == claim.fence
    assert (record["attempts"], record["inflight"], record.get("duplicates")) == (1, 1, None)
