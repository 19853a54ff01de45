"""The ledger store's protocol, one contract for the real store (SecantusDB) and the in-memory
one the unit tests use (``tests/fakes.py``): the same scenarios must pass on both, so the fake
cannot drift from the store it stands in for. A controllable clock drives leases on both."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pymongo import monitoring
from pymongo.errors import BulkWriteError

from celery_ledger import CommitLost, LeaseLost, LedgerUnavailable, State
from celery_ledger.ledger import ClaimOutcome, Ledger
from celery_ledger.ledger.dead import DeadJob
from celery_ledger.ledger.message import KeptMessage
from celery_ledger.ledger.record import ErrorEntry
from celery_ledger.ledger.store import (
    COPY_GRACE,
    ENQUEUE_BATCH,
    UNPUBLISHED,
    EnqueueOutcome,
    Fenced,
    HeldBy,
    QueuedJob,
    Unchanged,
    Unclaimed,
    new_op,
    utcnow,
)
from tests.fakes import Clock, MemoryLedger

TASK = "t"
FLEET = "shop"  # the queue namespace of the app whose records these are


@pytest.fixture(params=["store", "memory"])
def world(request: pytest.FixtureRequest, stack: Any) -> Iterator[tuple[Any, Clock]]:
    clock = Clock(utcnow())
    if request.param == "memory":
        yield (
            MemoryLedger(
                clock=clock,
                lease_seconds=60,
                max_deliveries=3,
                error_history_limit=3,
                fleet=FLEET,
            ),
            clock,
        )
        return
    store = Ledger(
        uri=stack.ledger.url,
        database="ledger_contract_tests",
        lease_seconds=60,
        max_deliveries=3,
        error_history_limit=3,
        clock=clock,
        fleet=FLEET,
    )
    store.ensure_indexes()
    yield store, clock
    store.close()


def new_id() -> str:
    return uuid.uuid4().hex


def claim(ledger: Any, record_id: str, owner: str = "w:1", **options: Any) -> Any:
    return ledger.claim(record_id, task=TASK, key=record_id, tier="default", owner=owner, **options)


def dead(reason: str = "permanent error: boom") -> DeadJob:
    return DeadJob.of_reason(
        "failed", reason, task=TASK, message=KeptMessage.of_call([1], {}, message_headers={})
    )


def error() -> ErrorEntry:
    return ErrorEntry(type="X", message="failed", at=utcnow())


def test_claim_outcomes_for_each_state(world: tuple[Any, Clock]) -> None:
    ledger, _clock = world
    record_id = new_id()
    first = claim(ledger, record_id)
    assert first.outcome is ClaimOutcome.CLAIMED
    busy = claim(ledger, record_id, "w:2")
    assert busy.outcome is ClaimOutcome.BUSY and busy.retry_at is not None
    ledger.complete(record_id, first.fence, "1", op=new_op())
    assert claim(ledger, record_id).outcome is ClaimOutcome.DUPLICATE
    assert ledger.find_raw(record_id)["duplicates"] == 1
    other = new_id()
    held = claim(ledger, other)
    ledger.bury(
        other, dead(), match=Fenced(held.fence, new_op()), task=TASK, key=other, tier="default"
    )
    assert claim(ledger, other).outcome is ClaimOutcome.DEAD


@pytest.mark.parametrize("new", [False, True], ids=["conditional", "told-new"])
def test_a_claim_told_its_job_is_new_decides_as_the_conditional_claim_in_every_state(
    world: tuple[Any, Clock], new: bool
) -> None:
    # ``new`` is a message's hint (its first publish, no record written): the claim tries an
    # insert first. Whatever the record's state, the outcome and the record are the same.
    ledger, clock = world

    def told(record_id: str, owner: str = "w:1", **options: Any) -> Any:
        return claim(ledger, record_id, owner, new=new, **options)

    fresh = new_id()
    first = told(fresh)
    assert first.outcome is ClaimOutcome.CLAIMED and first.created
    held = told(fresh, "w:2")
    assert held.outcome is ClaimOutcome.BUSY and held.retry_at is not None
    ledger.complete(fresh, first.fence, "1", op=new_op())
    assert told(fresh).outcome is ClaimOutcome.DUPLICATE
    assert ledger.find_raw(fresh)["duplicates"] == 1
    # a retrying record, a queued one (written at publish) and a lease that ended: claimed
    retrying = new_id()
    fence = told(retrying).fence
    ledger.record_retry(retrying, fence, error(), retry_at=utcnow(), op=new_op(), retries=1)
    again = told(retrying)
    assert again.outcome is ClaimOutcome.CLAIMED and not again.created and again.fence > fence
    assert ledger.find_raw(retrying)["attempts"] == 2
    queued = new_id()
    message = KeptMessage.of_call([1], {}, message_headers={"ledger_key": queued})
    ledger.enqueue(queued, task=TASK, key=queued, tier="bulk", message=message)
    taken = told(queued)
    assert taken.outcome is ClaimOutcome.CLAIMED and not taken.created
    assert ledger.find_raw(queued)["state"] == State.RUNNING
    lapsed = new_id()
    lost = told(lapsed).fence
    clock.advance(61)
    took_over = told(lapsed, "w:2")
    assert took_over.outcome is ClaimOutcome.CLAIMED and took_over.fence > lost
    assert ledger.find_raw(lapsed)["inflight"] == 2
    # the attempts budget, a dead job and another job's record: as ever
    budget = new_id()
    ledger.release(budget, told(budget, max_attempts=1).fence, op=new_op())
    assert told(budget, max_attempts=1).killed
    assert told(budget).outcome is ClaimOutcome.DEAD
    other = new_id()
    told(other)
    conflict = ledger.claim(other, task="other", key=other, tier="default", owner="w:2", new=new)
    assert conflict.outcome is ClaimOutcome.CONFLICT
    assert ledger.find_raw(other)["task"] == TASK


def test_the_record_a_first_claims_insert_makes_is_the_one_the_upsert_makes(
    world: tuple[Any, Clock],
) -> None:
    ledger, clock = world
    made = {}
    for new in (False, True):
        record_id, alias = new_id(), new_id()
        message = KeptMessage.of_call([1], {}, message_headers={"ledger_tier": "default"})
        due = clock() + timedelta(days=1)  # never due in the other tests' views
        found = claim(
            ledger, record_id, new=new, message=message, alias=alias, slo_at=due, slo_seconds=5
        )
        assert found.outcome is ClaimOutcome.CLAIMED and found.created
        assert ledger.resolve(alias)["_id"] == record_id
        record = ledger.find_raw(record_id)
        assert (record["key"], record["fence"]) == (record_id, found.fence)
        # the same fields with the same values, but for the job's own id, key and fence, and
        # every time as an offset from the claim's own (the lease's end, the objective, ...)
        started = record["started_at"]
        made[new] = {
            name: type(value)
            if name in ("_id", "key", "fence")
            else value - started
            if isinstance(value, datetime)
            else value
            for name, value in record.items()
        }
        clock.advance(1.5)  # the second claim's times are all later: offsets must still agree
        ledger.complete(record_id, found.fence, "1", op=new_op())  # out of the objectives' view
    assert made[True] == made[False]


def test_every_record_a_publish_or_a_claim_writes_names_its_fleet(
    world: tuple[Any, Clock],
) -> None:
    # (an earlier release's sweeps meet records of tasks they lack in a rolling deploy: the
    # fleet tells this app's, which they bring back for the handoff, from another app's)
    ledger, clock = world
    message = KeptMessage.of_call([1], {}, message_headers={})
    published, deferred, claimed, other = new_id(), new_id(), new_id(), new_id()
    ledger.enqueue(published, task=TASK, key=published, tier="bulk", message=message)
    ledger.record_deferral(
        deferred, task=TASK, key=deferred, tier="default", reason="r", until=clock()
    )
    claim(ledger, claimed)
    states = ledger.states_of([published, deferred, claimed, other])
    assert {record_id: tuple(state) for record_id, state in states.items()} == {
        published: ("queued", FLEET),
        deferred: ("queued", FLEET),
        claimed: ("running", FLEET),
    }
    for record_id in (published, deferred, claimed):
        assert ledger.find_raw(record_id)["fleet"] == FLEET


def test_a_stale_holder_cannot_overwrite_the_new_holder(world: tuple[Any, Clock]) -> None:
    ledger, clock = world
    record_id = new_id()
    first = claim(ledger, record_id, "a:1")
    clock.advance(61)
    second = claim(ledger, record_id, "b:2")
    assert second.outcome is ClaimOutcome.CLAIMED and second.fence > first.fence

    for write in (
        lambda: ledger.complete(record_id, first.fence, '"from A"', op=new_op()),
        lambda: ledger.record_retry(
            record_id, first.fence, error(), retry_at=utcnow(), op=new_op()
        ),
        lambda: ledger.release(record_id, first.fence, op=new_op()),
        lambda: ledger.heartbeat(record_id, first.fence),
        lambda: ledger.save_checkpoint(record_id, first.fence, {"at": 1}),
        lambda: ledger.bury(
            record_id,
            dead(),
            match=Fenced(first.fence, new_op()),
            task=TASK,
            key=record_id,
            tier="d",
        ),
    ):
        with pytest.raises(LeaseLost):
            write()
    # and a retirement by the old holder's worker does nothing
    assert not ledger.bury(
        record_id, dead(), match=HeldBy("a:1"), task=TASK, key=record_id, tier="default"
    )
    ledger.complete(record_id, second.fence, '"from B"', op=new_op())
    assert ledger.get_by_id(record_id).result == "from B"  # type: ignore[union-attr]


def test_a_success_is_not_recorded_without_the_atomic_steps_it_relies_on(
    world: tuple[Any, Clock],
) -> None:
    ledger, clock = world
    record_id = new_id()
    fence = claim(ledger, record_id).fence
    ledger.save_step(record_id, fence, "kept", '"k"')

    # A step the attempt committed but the record no longer has (a server lost the commit)
    with pytest.raises(CommitLost) as lost:
        ledger.complete(record_id, fence, '"r"', op=new_op(), atomic_steps=("kept", "charge"))
    assert lost.value.steps == ("charge",)
    record = ledger.get_by_id(record_id)
    assert record is not None and record.state is State.RUNNING  # nothing was written

    # A newer holder is still a lost lease, whatever the steps say
    clock.advance(61)
    newer = claim(ledger, record_id, "b:2")
    with pytest.raises(LeaseLost):
        ledger.complete(record_id, fence, '"r"', op=new_op(), atomic_steps=("charge",))
    ledger.save_step(record_id, newer.fence, "charge", '"c"')
    op = new_op()
    ledger.complete(record_id, newer.fence, '"r"', op=op, atomic_steps=("kept", "charge"))
    assert ledger.get_by_id(record_id).state is State.SUCCEEDED  # type: ignore[union-attr]
    # and its repeat after a lost reply recognises itself
    ledger.complete(record_id, newer.fence, '"r"', op=op, atomic_steps=("kept", "charge"))

    # A released claim missing a step is a lost lease (another delivery runs the job), not a
    # lost commit
    other = new_id()
    held = claim(ledger, other).fence
    ledger.release(other, held, op=new_op())
    with pytest.raises(LeaseLost):
        ledger.complete(other, held, '"r"', op=new_op(), atomic_steps=("charge",))


def test_an_outcome_write_repeated_after_a_lost_reply_recognises_itself(
    world: tuple[Any, Clock],
) -> None:
    ledger, _ = world
    for write in ("complete", "release", "record_retry", "bury"):
        record_id = new_id()
        fence = claim(ledger, record_id).fence
        op = new_op()

        def again(
            write: str = write, record_id: str = record_id, fence: int = fence, op: str = op
        ) -> None:
            if write == "complete":
                ledger.complete(record_id, fence, "1", op=op)
            elif write == "release":
                ledger.release(record_id, fence, op=op)
            elif write == "record_retry":
                ledger.record_retry(record_id, fence, error(), retry_at=utcnow(), op=op)
            else:
                match = Fenced(fence, op)
                ledger.bury(record_id, dead(), match=match, task=TASK, key=record_id, tier="d")

        again()
        again()  # the same write again: its own, not a lost lease
        if write in ("release", "record_retry"):  # claimable again: a newer claim takes over
            claim(ledger, record_id, "w:2")
            again()  # still its own write, not a lost lease
        with pytest.raises(LeaseLost):  # another write of the same holder is refused
            ledger.release(record_id, fence, op=new_op())


def test_retries_are_claimable_and_keep_a_bounded_error_history(world: tuple[Any, Clock]) -> None:
    ledger, _ = world
    record_id = new_id()
    for _ in range(5):
        fence = claim(ledger, record_id).fence
        ledger.record_retry(record_id, fence, error(), retry_at=utcnow(), op=new_op(), retries=2)
    record = ledger.get_by_id(record_id)
    assert record.state is State.RETRYING and record.attempts == 5  # type: ignore[union-attr]
    assert len(record.errors) == 3  # type: ignore[union-attr]
    assert ledger.find_raw(record_id)["message"]["headers"]["retries"] == 2


def test_lost_deliveries_and_the_attempts_budget_kill_at_the_claim(
    world: tuple[Any, Clock],
) -> None:
    ledger, clock = world
    poison = new_id()
    for _ in range(3):
        assert claim(ledger, poison).outcome is ClaimOutcome.CLAIMED
        clock.advance(61)  # the worker died: no outcome
    killed = claim(ledger, poison)
    assert killed.outcome is ClaimOutcome.DEAD and killed.killed
    assert ledger.find_raw(poison)["death"] == "poison"
    budget = new_id()
    fence = claim(ledger, budget, max_attempts=1).fence
    ledger.release(budget, fence, op=new_op())
    assert claim(ledger, budget, max_attempts=1).killed
    assert ledger.find_raw(budget)["death"] == "retired"


def test_a_record_of_another_job_is_a_conflict_never_claimed(world: tuple[Any, Clock]) -> None:
    ledger, _ = world
    record_id = new_id()
    claim(ledger, record_id)
    conflict = ledger.claim(record_id, task="other", key=record_id, tier="default", owner="w:2")
    assert conflict.outcome is ClaimOutcome.CONFLICT
    assert ledger.find_raw(record_id)["task"] == TASK


def test_an_alias_names_its_job(world: tuple[Any, Clock]) -> None:
    ledger, _ = world
    record_id, alias = new_id(), new_id()
    fence = claim(ledger, record_id, alias=alias).fence
    ledger.complete(record_id, fence, '"done"', op=new_op())
    assert ledger.get_by_id(alias).result == "done"  # type: ignore[union-attr]
    assert ledger.resolve(alias)["_id"] == record_id


def test_the_dead_write_of_a_job_nobody_runs(world: tuple[Any, Clock]) -> None:
    ledger, _ = world
    fresh = new_id()
    assert ledger.bury(fresh, dead(), match=Unclaimed(), task=TASK, key=fresh, tier="bulk")
    assert ledger.find_raw(fresh)["state"] == State.DEAD
    assert not ledger.bury(fresh, dead(), match=Unclaimed(), task=TASK, key=fresh, tier="bulk")
    # a live job is never killed by a poison copy: the copy is only noted
    live = new_id()
    claim(ledger, live)
    assert not ledger.bury(live, dead(), match=Unclaimed(), task=TASK, key=live, tier="bulk")
    assert ledger.find_raw(live)["state"] == State.RUNNING
    assert ledger.find_raw(live)["quarantined"] == 1
    # a waiting one is, when asked (a revoke)
    waiting = new_id()
    ledger.enqueue(waiting, task=TASK, key=waiting, tier="bulk", message=KeptMessage())
    assert ledger.bury(
        waiting, dead(), match=Unclaimed(kill_waiting=True), task=TASK, key=waiting, tier="bulk"
    )
    # a kill at the claim applies only to the record as it was read
    read = new_id()
    claim(ledger, read)
    assert not ledger.bury(
        read, dead(), match=Unchanged(fence=1, state="running"), task=TASK, key=read, tier="d"
    )


def test_a_workflow_that_ended_as_written_is_not_a_dead_letter(world: tuple[Any, Clock]) -> None:
    ledger, _ = world

    def put(doc: dict[str, Any]) -> None:  # (as the workflow log writes a workflow's end)
        if isinstance(ledger, MemoryLedger):
            ledger.docs[doc["_id"]] = doc
        else:
            ledger.collection.insert_one(doc)

    before = ledger.count_dead()
    job = new_id()
    assert ledger.bury(job, dead(), match=Unclaimed(), task=TASK, key=job, tier="bulk")
    for status in ("compensated", "cancelled", "failed", "dead"):
        put({"_id": new_id(), "state": State.DEAD.value, "death": "workflow", "task": TASK,
             "workflow_status": status})  # fmt: skip
    # the dead job and the two workflows that failed are; the saga and the cancelled one not
    assert ledger.count_dead() == before + 3


def test_a_kill_at_the_claim_spares_a_lease_renewed_since_it_was_read(
    world: tuple[Any, Clock],
) -> None:
    ledger, clock = world
    record_id = new_id()
    held = claim(ledger, record_id)
    clock.advance(61)
    read = ledger.find_raw(record_id)  # a claimer reads the expired lease, out of budget...
    ledger.heartbeat(record_id, held.fence)  # ...and the holder's late heartbeat lands first
    as_read = Unchanged(read["fence"], read["state"], read["claimable_at"])
    assert not ledger.bury(record_id, dead(), match=as_read, task=TASK, key=record_id, tier="d")
    assert ledger.find_raw(record_id)["state"] == State.RUNNING


def test_enqueue_tells_new_known_and_unpublished_jobs_apart(world: tuple[Any, Clock]) -> None:
    ledger, clock = world
    record_id = new_id()
    message = KeptMessage.of_call([1], {}, message_headers={"ledger_key": record_id})

    def enqueue():
        return ledger.enqueue(record_id, task=TASK, key=record_id, tier="bulk", message=message)

    assert enqueue() is EnqueueOutcome.NEW
    assert enqueue() is EnqueueOutcome.KNOWN
    ledger.mark_unpublished(record_id)
    assert enqueue() is EnqueueOutcome.UNPUBLISHED
    # the reconciler sees an unpublished job at once, not after its stale time
    clock.advance(1)
    assert record_id in [d["_id"] for d in ledger.stale(State.QUEUED, older_than_seconds=0.5)]
    assert claim(ledger, record_id).outcome is ClaimOutcome.CLAIMED


def test_a_bulk_enqueue_tells_new_known_and_unpublished_jobs_apart_as_one_by_one(
    world: tuple[Any, Clock],
) -> None:
    ledger, clock = world
    ids = [new_id() for _ in range(5)]
    message = KeptMessage.of_call([1], {}, message_headers={})

    def job(record_id: str, **options: Any) -> QueuedJob:
        return QueuedJob(
            record_id, task=TASK, key=record_id, tier="bulk", message=message, **options
        )

    # Given two jobs known (one whose first publish failed) and one claimed
    for record_id in ids[:3]:
        ledger.enqueue(record_id, task=TASK, key=record_id, tier="bulk", message=message)
    ledger.mark_unpublished(ids[1])
    assert claim(ledger, ids[2]).outcome is ClaimOutcome.CLAIMED
    due = clock() + timedelta(minutes=5)
    # When they are enqueued again in one batch with two new ones, one of them for later,
    # and a new one twice
    jobs = [job(ids[0]), job(ids[1]), job(ids[2]), job(ids[3])]
    outcomes = ledger.enqueue_many([*jobs, job(ids[4], claimable_at=due), job(ids[3])])
    # Then each is told as a single enqueue tells it (the job twice: new once), and the new
    # ones are queued
    assert outcomes[:3] == [EnqueueOutcome.KNOWN, EnqueueOutcome.UNPUBLISHED, EnqueueOutcome.KNOWN]
    assert outcomes[4] is EnqueueOutcome.NEW
    assert sorted([outcomes[3], outcomes[5]]) == [EnqueueOutcome.KNOWN, EnqueueOutcome.NEW]
    assert ledger.enqueue_many([]) == []
    assert ledger.find_raw(ids[3])["state"] == State.QUEUED
    kept = ledger.find_raw(ids[4])["claimable_at"].replace(tzinfo=UTC)
    assert abs(kept - due) < timedelta(milliseconds=1)
    # And a batch marked unpublished is in the relay's view, but for a claimed job
    ledger.mark_unpublished_many([ids[0], ids[2], ids[3]])
    waiting = {d["_id"] for d in ledger.unpublished(ids=ids)}
    assert waiting == {ids[0], ids[1], ids[3]}
    with pytest.raises(ValueError, match="at most"):
        ledger.enqueue_many([job(new_id()) for _ in range(ENQUEUE_BATCH + 1)])


def test_a_job_for_later_is_claimable_and_stale_only_from_its_due_time(
    world: tuple[Any, Clock],
) -> None:
    ledger, clock = world
    record_id = new_id()
    message = KeptMessage.of_call([1], {}, message_headers={"ledger_key": record_id})
    due = clock() + timedelta(seconds=60)

    def enqueue() -> EnqueueOutcome:
        return ledger.enqueue(  # type: ignore[no-any-return]
            record_id, task=TASK, key=record_id, tier="bulk", message=message, claimable_at=due
        )

    assert enqueue() is EnqueueOutcome.NEW
    # an early message is told to come back when it is due; the reconciler leaves it till then
    early = claim(ledger, record_id)
    assert early.outcome is ClaimOutcome.BUSY and early.retry_at is not None
    assert abs(early.retry_at - due) < timedelta(milliseconds=1)  # (BSON keeps milliseconds)
    assert record_id not in [d["_id"] for d in ledger.stale(State.QUEUED, older_than_seconds=1)]
    # its schedule failed: a publish tried again goes out, and it is still not due
    ledger.mark_unpublished(record_id, later=True)
    assert enqueue() is EnqueueOutcome.UNPUBLISHED
    assert record_id not in [d["_id"] for d in ledger.unpublished(older_than_seconds=0)]
    assert claim(ledger, record_id).outcome is ClaimOutcome.BUSY
    clock.advance(62)
    assert record_id in [d["_id"] for d in ledger.stale(State.QUEUED, older_than_seconds=1)]
    assert claim(ledger, record_id).outcome is ClaimOutcome.CLAIMED


def test_the_outbox_relay_sees_unpublished_jobs_until_published_or_claimed(
    world: tuple[Any, Clock],
) -> None:
    ledger, clock = world
    failed, published, claimed, plain = new_id(), new_id(), new_id(), new_id()
    for record_id in (failed, published, claimed, plain):
        message = KeptMessage.of_call([1], {}, message_headers={"ledger_key": record_id})
        ledger.enqueue(record_id, task=TASK, key=record_id, tier="bulk", message=message)
    for record_id in (failed, published, claimed):
        ledger.mark_unpublished(record_id)  # as a publish that failed, or an outbox write
    clock.advance(2)

    def seen(**options: Any) -> set[str]:
        return {d["_id"] for d in ledger.unpublished(**options)} & {
            failed,
            published,
            claimed,
            plain,
        }

    assert seen(older_than_seconds=1) == {failed, published, claimed}
    assert seen(older_than_seconds=60) == set()  # within the grace: its committer's
    assert seen(ids=[published, plain]) == {published}
    assert ledger.mark_published([published]) == 1
    assert ledger.mark_published([published]) == 0  # once
    assert claim(ledger, claimed).outcome is ClaimOutcome.CLAIMED  # still claimable
    assert ledger.mark_published([claimed]) == 0  # its claim took it out of the outbox
    assert seen(older_than_seconds=0) == {failed}
    assert ledger.find_raw(published)["state"] == State.QUEUED
    assert claim(ledger, published).outcome is ClaimOutcome.CLAIMED


def test_a_held_outbox_job_and_one_no_relay_can_publish(world: tuple[Any, Clock]) -> None:
    ledger, clock = world
    held, gone, bare = new_id(), new_id(), new_id()
    for record_id in (held, gone, bare):
        message = KeptMessage.of_call([1], {}, message_headers={"ledger_key": record_id})
        ledger.enqueue(record_id, task=TASK, key=record_id, tier="bulk", message=message)
        ledger.mark_unpublished(record_id)
    clock.advance(2)

    def stale() -> set[str]:
        return {d["_id"] for d in ledger.stale(State.QUEUED, older_than_seconds=1)}

    # A record held by backpressure, noted as read (once), leaves the reconciler's stale view
    # for its stale time and stays in the relay's
    [doc] = [d for d in ledger.stale(State.QUEUED, older_than_seconds=1) if d["_id"] == held]
    assert ledger.leave_unpublished(doc) and not ledger.leave_unpublished(doc)
    assert held not in stale()
    assert held in {d["_id"] for d in ledger.unpublished(older_than_seconds=1)}
    clock.advance(2)
    assert held in stale()
    # The relay's skip is applied before its limit
    found = ledger.unpublished(older_than_seconds=1, limit=1, skip=lambda d: d["_id"] != bare)
    assert [d["_id"] for d in found] == [bare]
    # A record recorded dead as the relay read it: only if it is still exactly that
    [read_gone] = ledger.unpublished(ids=[gone])
    [read_bare] = ledger.unpublished(ids=[bare])
    ledger.mark_published([gone])  # published by its committer meanwhile
    dead = DeadJob.of_reason("bad-arguments", "outbox: test", task=TASK)
    for doc, applies in ((read_gone, False), (read_bare, True)):
        match = Unchanged(int(doc.get("fence", 0)), State.QUEUED.value, UNPUBLISHED)
        buried = ledger.bury(doc["_id"], dead, match=match, task=TASK, key=doc["_id"], tier="bulk")
        assert buried is applies
    assert ledger.find_raw(gone)["state"] == State.QUEUED.value
    assert ledger.find_raw(bare)["state"] == State.DEAD.value
    assert bare not in {d["_id"] for d in ledger.unpublished(older_than_seconds=0)}


MS = timedelta(milliseconds=1)


def test_the_sweeps_reads_find_every_kind_of_waiting_job_and_only_those(
    world: tuple[Any, Clock],
) -> None:
    """stale and quiet read one index bound per kind of waiting record (published, publish
    failed, for later, retrying): each kind is found once untouched for the time asked, and
    not before; a limit holds across the kinds."""
    ledger, clock = world
    message = KeptMessage.of_call([1], {}, message_headers={})

    def enqueue(claimable_at: datetime | None = None) -> str:
        record_id = new_id()
        options = {} if claimable_at is None else {"claimable_at": claimable_at}
        ledger.enqueue(record_id, task=TASK, key=record_id, tier="bulk", message=message, **options)
        return record_id

    touched = clock()
    published = enqueue()
    failed = enqueue()
    ledger.mark_unpublished(failed)
    later, much_later = enqueue(clock() + timedelta(seconds=25)), enqueue(clock() + timedelta(1))
    retrying = new_id()
    fence = claim(ledger, retrying).fence
    ledger.record_retry(
        retrying, fence, error(), retry_at=clock() + timedelta(seconds=30), op=new_op()
    )
    running = new_id()
    claim(ledger, running, lease_seconds=3600)

    names = {
        published: "published",
        failed: "failed",
        later: "later",
        much_later: "much later",
        retrying: "retrying",
        running: "running",
    }

    def seen(age: float = 10.0) -> tuple[set[str], set[str]]:
        stale = {
            names[d["_id"]]
            for state in (State.QUEUED, State.RETRYING)
            for d in ledger.stale(state, older_than_seconds=age, limit=10_000)
            if d["_id"] in names
        }
        quiet = {
            names[d["_id"]]
            for d in [
                *ledger.quiet_waiting(older_than_seconds=age, limit=10_000),
                *ledger.quiet_due(older_than_seconds=age, limit=10_000),
            ]
            if d["_id"] in names
        }
        return stale, quiet

    # Young: only the failed publish, at once, and only for the stale read (the relay's)
    assert seen() == ({"failed"}, set())
    clock.advance(20)  # (a retrying job is claimable at once: its message is its timer)
    assert seen() == ({"failed", "published", "retrying"}, {"published", "retrying"})
    clock.advance(20)  # the job for later is due, untouched since well before
    assert seen() == (
        {"failed", "published", "later", "retrying"},
        {"published", "later", "retrying"},
    )
    # due for only 10 s: not yet
    assert seen(age=25) == ({"failed", "published", "retrying"}, {"published", "retrying"})

    # A slice of the waiting ones by their last touch (the ordinary look's reads)
    def sliced(age: float, since: datetime, before: datetime) -> set[str]:
        found = ledger.quiet_waiting(
            older_than_seconds=age, limit=10_000, touched_since=since, touched_before=before
        )
        return {names[d["_id"]] for d in found if d["_id"] in names}

    second = timedelta(seconds=1)
    assert sliced(10, touched - second, touched + second) == {"published"}
    # (the end is not in the slice; the ledger keeps a time to the millisecond)
    assert sliced(10, touched - second, touched - timedelta(milliseconds=1)) == set()
    assert sliced(10, touched + second, clock()) == set()
    # The waiting ones apart from the due ones
    waiting = ledger.quiet_waiting(older_than_seconds=10, limit=10_000)
    assert {names[d["_id"]] for d in waiting if d["_id"] in names} == {"published"}
    due = ledger.quiet_due(older_than_seconds=10, limit=10_000)
    assert {names[d["_id"]] for d in due if d["_id"] in names} == {"later", "retrying"}
    # ...touched since a moment: none of them was touched since
    assert not ledger.quiet_due(older_than_seconds=10, limit=10, touched_since=touched + second)
    # ...and a slice of the due ones by their due time, the latest due first
    due_at = touched + timedelta(seconds=25)
    for low, high, expected in (
        (due_at - second, due_at + second, ["later"]),
        (due_at + MS, due_at + second, []),
        (touched - second, due_at + second, ["later", "retrying"]),
    ):
        sliced_due = ledger.quiet_due(
            older_than_seconds=10, limit=10, due_since=low, due_before=high
        )
        assert [names[d["_id"]] for d in sliced_due if d["_id"] in names] == expected
    # Merged across the two states (a delayed job, a retrying one), the latest due first, and
    # a limit holds across them
    merged = ledger.quiet_due(older_than_seconds=10, limit=10_000)
    assert [names[d["_id"]] for d in merged if d["_id"] in names] == ["later", "retrying"]
    assert len(ledger.quiet_due(older_than_seconds=10, limit=1)) == 1
    # Touched since a moment: those only (the watch after a failover reads the recent ones)
    young = enqueue()
    clock.advance(15)
    since = clock() - timedelta(seconds=20)
    recent = [
        *ledger.quiet_waiting(older_than_seconds=10, limit=10_000, touched_since=since),
        *ledger.quiet_due(older_than_seconds=10, limit=10_000, touched_since=since),
    ]
    assert {d["_id"] for d in recent} & {*names, young} == {young}
    # Newest first: by their last touch, the most recent first, a limit taking the newest
    ordered = [young]
    for _ in range(3):
        clock.advance(1)
        ordered.append(enqueue())
    clock.advance(15)
    newest = ledger.quiet_waiting(older_than_seconds=10, limit=3, touched_since=since)
    assert [d["_id"] for d in newest] == ordered[::-1][:3]
    assert len(ledger.stale(State.QUEUED, older_than_seconds=10, limit=1)) == 1


def test_the_reconcilers_views_and_its_mark(world: tuple[Any, Clock]) -> None:
    ledger, clock = world
    record_id = new_id()
    claim(ledger, record_id)
    clock.advance(60 + 11)
    [doc] = [d for d in ledger.expired_leases(grace_seconds=10) if d["_id"] == record_id]
    assert ledger.mark_reconciled(doc)
    assert not ledger.mark_reconciled(doc)  # a second sweep
    # out of view for a grace period, and claimable by the republished copy
    assert record_id not in [d["_id"] for d in ledger.expired_leases(grace_seconds=10)]
    assert claim(ledger, record_id, "w:2").outcome is ClaimOutcome.CLAIMED


def test_a_sweep_never_cuts_a_lease_renewed_since_it_read_the_record(
    world: tuple[Any, Clock],
) -> None:
    ledger, clock = world
    record_id = new_id()
    fence = claim(ledger, record_id).fence
    clock.advance(60 + 11)
    [doc] = [d for d in ledger.expired_leases(grace_seconds=10) if d["_id"] == record_id]
    ledger.heartbeat(record_id, fence)  # the holder was only slow: it renews its lease
    assert not ledger.mark_reconciled(doc)
    assert claim(ledger, record_id, "w:2").outcome is ClaimOutcome.BUSY


def test_replay_and_purge(world: tuple[Any, Clock]) -> None:
    ledger, _ = world
    record_id = new_id()
    ledger.bury(record_id, dead(), match=Unclaimed(), task=TASK, key=record_id, tier="bulk")
    assert ledger.find_raw(record_id)["expires_at"] is not None  # a dead record's retention
    reopened = ledger.reopen(record_id, actor="ops")
    assert reopened is not None and ledger.find_raw(record_id)["state"] == State.QUEUED
    # a replayed job is live: no retention sweep deletes it under its next holder
    assert ledger.find_raw(record_id).get("expires_at") is None
    assert ledger.reopen(record_id, actor="ops") is None
    ledger.undo_reopen(record_id, reopened)
    assert ledger.find_raw(record_id)["state"] == State.DEAD
    assert ledger.find_raw(record_id)["expires_at"] is not None
    assert ledger.purge([record_id], actor="ops") == 1
    assert record_id not in [d["_id"] for d in ledger.find_dead()]
    assert ledger.reopen(record_id, actor="ops") is None  # nothing kept to replay
    assert claim(ledger, record_id).outcome is ClaimOutcome.DEAD  # the tombstone holds


# -- the real store only ------------------------------------------------------------------------


@pytest.fixture
def store(stack: Any) -> Ledger:
    ledger = Ledger(uri=stack.ledger.url, database="ledger_contract_tests", lease_seconds=0.5)
    ledger.ensure_indexes()
    return ledger


def test_twenty_concurrent_claims_grant_exactly_one_lease(store: Ledger) -> None:
    record_id = new_id()
    with ThreadPoolExecutor(20) as pool:
        # (a lease long enough to outlast the race on a loaded machine: the fixture's half
        # second ran out under a load of 24 and a second claim rightly won)
        outcomes = list(
            pool.map(
                lambda i: claim(store, record_id, f"w:{i}", lease_seconds=60).outcome, range(20)
            )
        )
    assert outcomes.count(ClaimOutcome.CLAIMED) == 1
    assert outcomes.count(ClaimOutcome.BUSY) == 19


def test_a_write_concern_error_on_the_claim_is_never_read_as_a_duplicate(
    store: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a claim that matched a record but whose write concern was not confirmed
    def unconfirmed(*args: Any, **kwargs: Any) -> None:
        raise BulkWriteError(
            {
                "writeErrors": [],
                "writeConcernErrors": [{"code": 64, "errmsg": "waiting for replication"}],
                "nMatched": 1,
                "nModified": 1,
                "nUpserted": 0,
            }
        )

    monkeypatch.setattr(type(store.collection), "bulk_write", unconfirmed)
    # Then the outcome is unknown (the delivery is put off), never "already succeeded"
    with pytest.raises(LedgerUnavailable, match="outcome unknown"):
        claim(store, new_id())


def test_without_a_ttl_index_expire_deletes_only_records_past_their_expiry(stack: Any) -> None:
    database = f"expiry_{uuid.uuid4().hex[:8]}"
    ttl = Ledger(uri=stack.ledger.url, database=database)
    ttl.ensure_indexes()
    # Switching off the TTL index replaces it by a plain one (MongoDB refuses both at once)
    swept = Ledger(uri=stack.ledger.url, database=database, ttl_index=False)
    swept.ensure_indexes()
    indexes = swept.collection.index_information()
    assert "retention" not in indexes
    assert "expireAfterSeconds" not in indexes["retention_sweep"]

    a, b = new_id(), new_id()
    for record_id in (a, b):
        fence = claim(swept, record_id).fence
        swept.complete(record_id, fence, "1", op=new_op())
    swept.collection.update_one({"_id": a}, {"$set": {"expires_at": utcnow()}})
    time.sleep(0.01)

    assert swept.expire() == 1
    assert swept.find_raw(a) is None
    assert swept.get_by_id(b) is not None
    # And back: the TTL index returns
    ttl.ensure_indexes()
    assert ttl.collection.index_information()["retention"]["expireAfterSeconds"] == 0
    groups = ttl.collection.database[f"{ttl.collection.name}_groups"]
    assert groups.index_information()["retention"]["expireAfterSeconds"] == 0
    ttl.client.drop_database(database)


def test_saved_groups_expire_like_results(stack: Any) -> None:
    database = f"groups_{uuid.uuid4().hex[:8]}"
    clock = Clock(utcnow())
    store = Ledger(
        uri=stack.ledger.url,
        database=database,
        ttl_index=False,
        clock=clock,
        result_retention_seconds=3600,
    )
    groups = store.collection.database[f"{store.collection.name}_groups"]
    groups.insert_one({"_id": "from-before", "members": ["x"]})  # saved without an expiry
    store.ensure_indexes()
    store.save_group("g-1", ["a", "b"])
    assert store.group_members("g-1") == ["a", "b"]

    # When the result retention has passed, the housekeeping's expiry removes them all
    clock.advance(3601)
    store.expire()
    assert store.group_members("g-1") is None
    assert groups.count_documents({}) == 0
    store.client.drop_database(database)


def test_a_transaction_a_dead_worker_left_never_locks_its_job_for_good(store: Ledger) -> None:
    # Given a worker killed inside an atomic step: its transaction wrote the job's record and
    # was never committed or aborted (SecantusDB keeps it, and its lock, until it is reaped)
    record_id = new_id()
    fence = claim(store, record_id).fence
    child = f"""
from pymongo import MongoClient
import subprocess
import sys
import time
client = MongoClient({store.uri!r})
session = client.start_session()
session.start_transaction()
client[{store.database_name!r}][{store.collection_name!r}].update_one(
    {{"_id": {record_id!r}}}, {{"$set": {{"steps.charge": {{"result": "1"}}}}}}, session=session
)
print("written", flush=True)
time.sleep(600)
"""
    worker = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE)
    try:
        assert worker.stdout is not None and worker.stdout.readline() == b"written\n"
    finally:
        worker.kill()
        worker.wait()
    # When the workers' housekeeping reaps abandoned transactions past their 60 s lifetime
    time.sleep(61)
    store.reap_abandoned_transactions()
    # Then the job's record takes writes again: the job can finish
    store.complete(record_id, fence, '"done"', op=new_op())
    assert store.get_by_id(record_id).result == "done"  # type: ignore[union-attr]
    assert "steps" not in store.find_raw(record_id)  # the abandoned write was rolled back


def test_a_dead_job_is_never_claimed_while_its_queue_copy_falls_due(
    world: tuple[Any, Clock],
) -> None:
    ledger, clock = world
    record_id = new_id()
    first = claim(ledger, record_id)
    ledger.bury(
        record_id,
        dead(),
        match=Fenced(first.fence, new_op()),
        task=TASK,
        key=record_id,
        tier="default",
    )
    # Its copy falls due (nobody confirmed it), and it is still dead to every claim
    clock.advance(COPY_GRACE.total_seconds() + 1)

    def due() -> list[str]:  # (the store's database is shared with other tests)
        return [d["_id"] for d in ledger.copies_pending(limit=10_000) if d["_id"] == record_id]

    assert due() == [record_id]
    assert claim(ledger, record_id).outcome is ClaimOutcome.DEAD
    if isinstance(ledger, Ledger):
        # and the claim filter of an earlier release (which did not refuse dead records by
        # their state) matches it no more than this one's: a fleet in a rolling deploy
        earlier = {
            "_id": record_id,
            "task": TASK,
            "key": record_id,
            "claimable_at": {"$lte": utcnow()},
            "fence": {"$lt": 2**62},
            "inflight": {"$lt": 3},
        }
        assert ledger.collection.count_documents(earlier) == 0
    # Once copied, it is no longer due; a purge never makes it due again
    ledger.mark_copy_pending(record_id, False)
    assert due() == []
    ledger.mark_copy_pending(record_id, True)
    ledger.purge([record_id], actor="test")
    assert due() == []
    assert claim(ledger, record_id).outcome is ClaimOutcome.DEAD


def test_indexes_made_by_an_earlier_release_are_brought_up_to_date(stack: Any) -> None:
    # Given a ledger whose dead record's pending copy was noted in ``copy_due_at``, indexed
    database = f"upgrade_{uuid.uuid4().hex[:8]}"
    store = Ledger(uri=stack.ledger.url, database=database)
    store.collection.create_index("copy_due_at", name="copy_due")
    due = utcnow() - timedelta(seconds=5)
    store.collection.insert_one(
        {
            "_id": "old-dead",
            "task": TASK,
            "key": "k",
            "state": State.DEAD.value,
            "fence": 1,
            "claimable_at": datetime(9999, 12, 31, tzinfo=UTC),
            "copy_due_at": due,
        }
    )
    # When this release makes its indexes
    store.ensure_indexes()
    # Then the old index is gone (one index fewer written by every job) and the copy is due
    assert "copy_due" not in store.collection.index_information()
    assert [doc["_id"] for doc in store.copies_pending()] == ["old-dead"]
    assert "copy_due_at" not in (store.find_raw("old-dead") or {})
    # and so is a second worker's start, at the same time or later
    store.ensure_indexes()
    Ledger(uri=stack.ledger.url, database=database).ensure_indexes()
    store.client.drop_database(database)


# -- fallbacks and latency objectives ----------------------------------------------------------


def test_a_degraded_result_is_claimable_from_its_replace_time_and_replaced_once(
    world: tuple[Any, Clock],
) -> None:
    ledger, clock = world
    record_id = new_id()
    first = claim(ledger, record_id)
    replace_at = clock() + timedelta(seconds=30)
    degraded = {"reason": "circuit-open", "fallback": "placeholder"}
    ledger.complete(
        record_id, first.fence, '"cached"', op=new_op(), degraded=degraded, replace_at=replace_at
    )
    doc = ledger.find_raw(record_id)
    assert doc["state"] == State.SUCCEEDED and doc["degraded"]["fallback"] == "placeholder"
    early = claim(ledger, record_id)  # its replacement, early: waits until it is due
    assert early.outcome is ClaimOutcome.BUSY and early.retry_at is not None
    assert abs((early.retry_at.replace(tzinfo=UTC) - replace_at).total_seconds()) < 0.002
    assert ledger.find_raw(record_id).get("duplicates", 0) == 0

    clock.advance(31)
    due = [d["_id"] for d in ledger.replacements_due(older_than_seconds=0.5)]
    assert record_id in due  # a lost replacement message is the reconciler's to bring back
    replacement = claim(ledger, record_id, "w:2")
    assert replacement.outcome is ClaimOutcome.CLAIMED
    assert ledger.find_raw(record_id)["result"] == '"cached"'  # still served meanwhile
    ledger.complete(record_id, replacement.fence, '"real"', op=new_op())
    doc = ledger.find_raw(record_id)
    assert doc["result"] == '"real"' and "degraded" not in doc
    assert doc["replaced_degraded"]["fallback"] == "placeholder"
    clock.advance(3600)
    assert record_id not in [d["_id"] for d in ledger.replacements_due(older_than_seconds=1)]
    assert claim(ledger, record_id).outcome is ClaimOutcome.DUPLICATE


def test_a_failed_replacement_keeps_the_degraded_result(world: tuple[Any, Clock]) -> None:
    ledger, clock = world
    record_id = new_id()
    first = claim(ledger, record_id)
    ledger.complete(
        record_id,
        first.fence,
        '"cached"',
        op=new_op(),
        degraded={"reason": "timeout", "fallback": "last-good"},
        replace_at=clock(),
    )
    replacement = claim(ledger, record_id, "w:2")
    ledger.keep_degraded(record_id, replacement.fence, error(), op=new_op(), reason="declined")
    doc = ledger.find_raw(record_id)
    assert doc["state"] == State.SUCCEEDED and doc["result"] == '"cached"'
    assert doc["degraded"]["replacement_failed"] == "declined"
    assert doc["degraded"]["replace_at"] is None and doc["errors"][-1]["type"] == "X"
    clock.advance(3600)
    assert claim(ledger, record_id).outcome is ClaimOutcome.DUPLICATE


def test_a_refunded_release_gives_the_attempt_back(world: tuple[Any, Clock]) -> None:
    ledger, _clock = world
    record_id = new_id()
    held = claim(ledger, record_id)
    ledger.release(record_id, held.fence, op=new_op(), refund_attempt=True)
    doc = ledger.find_raw(record_id)
    assert doc["attempts"] == 0 and doc["state"] == State.QUEUED


def test_last_good_results_only_move_forward(world: tuple[Any, Clock]) -> None:
    ledger, clock = world
    key = new_id()
    assert ledger.last_good(TASK, key) is None
    ledger.remember(TASK, key, '"v1"')
    clock.advance(1)
    ledger.remember(TASK, key, '"v2"')
    result, at = ledger.last_good(TASK, key)
    assert result == '"v2"' and abs((at - clock()).total_seconds()) < 0.002


def test_a_job_is_marked_late_once_and_a_finished_one_leaves_the_view(
    world: tuple[Any, Clock],
) -> None:
    ledger, clock = world
    late, on_time = new_id(), new_id()
    for record_id in (late, on_time):
        claim(ledger, record_id, slo_at=clock() + timedelta(seconds=10), slo_seconds=10.0)
    fence = ledger.find_raw(on_time)["fence"]
    ledger.complete(on_time, fence, "1", op=new_op())
    assert [d for d in ledger.overdue() if d["_id"] in (late, on_time)] == []
    clock.advance(11)

    assert [d["_id"] for d in ledger.overdue() if d["_id"] in (late, on_time)] == [late]
    assert ledger.mark_late(late) is True
    assert ledger.mark_late(late) is False
    assert [d for d in ledger.overdue() if d["_id"] == late] == []
    late_at = ledger.find_raw(late)["late_at"].replace(tzinfo=UTC)
    assert abs((late_at - clock()).total_seconds()) < 0.002


def test_an_objective_from_any_first_write_is_due_and_finished_ones_never_hide_a_late_one(
    world: tuple[Any, Clock],
) -> None:
    """Whatever writes a job's record first (a claim, a publish with its queued record, a
    deferral) puts its objective in view; many jobs that finished in time, due before the late
    one, are settled in the same check instead of filling its page."""
    ledger, clock = world
    objective = {"slo_at": clock() + timedelta(seconds=10), "slo_seconds": 10.0}
    on_time = [new_id() for _ in range(12)]
    for record_id in on_time:
        held = claim(ledger, record_id, **objective)
        ledger.complete(record_id, held.fence, "1", op=new_op())
    clock.advance(1)
    later = {"slo_at": clock() + timedelta(seconds=10), "slo_seconds": 10.0}
    enqueued, deferred, claimed = new_id(), new_id(), new_id()
    message = KeptMessage.of_call([1], {}, message_headers={})
    ledger.enqueue(
        enqueued, task=TASK, key=enqueued, tier="default", message=message, objective=later
    )
    ledger.record_deferral(
        deferred,
        task=TASK,
        key=deferred,
        tier="default",
        reason="circuit open",
        until=clock() + timedelta(seconds=5),
        objective=later,
    )
    claim(ledger, claimed, **later)
    mine = {enqueued, deferred, claimed}
    clock.advance(9.5)  # the twelve finished ones are due, these not yet
    assert [d for d in ledger.overdue(limit=3) if d["_id"] in mine] == []
    clock.advance(1)
    assert {d["_id"] for d in ledger.overdue(limit=3) if d["_id"] in mine} == mine
    for record_id in mine:
        assert ledger.mark_late(record_id) is True
    assert [d for d in ledger.overdue() if d["_id"] in mine | set(on_time)] == []


def test_an_objective_whose_tracking_was_lost_is_tracked_again_by_the_next_claim(
    world: tuple[Any, Clock],
) -> None:
    """A publish whose objective write was lost (its outcome unknown, the process gone) leaves
    a record with ``slo_at`` the checks cannot see; the job's claim tracks it again."""
    ledger, clock = world
    record_id = new_id()
    objective = {"slo_at": clock() + timedelta(seconds=10), "slo_seconds": 10.0}
    message = KeptMessage.of_call([1], {}, message_headers={})
    ledger.enqueue(
        record_id, task=TASK, key=record_id, tier="default", message=message, objective=objective
    )
    if isinstance(ledger, Ledger):
        ledger.client[ledger.database_name][f"{ledger.collection_name}_objectives"].delete_one(
            {"_id": record_id}
        )
    held = claim(ledger, record_id, **objective)  # the same publish time: the same objective
    assert held.outcome is ClaimOutcome.CLAIMED
    clock.advance(11)
    assert [d["_id"] for d in ledger.overdue() if d["_id"] == record_id] == [record_id]
    ledger.complete(record_id, held.fence, "1", op=new_op())  # settled: no other test sees it


def test_a_later_deliverys_later_objective_never_pushes_a_stuck_job_out_of_view(
    world: tuple[Any, Clock],
) -> None:
    """A delivery whose message does not carry its publish time computes its objective from
    now: the earliest tracked stands, or a stuck job would slip out of view with each one."""
    ledger, clock = world
    record_id = new_id()
    message = KeptMessage.of_call([1], {}, message_headers={})
    first = {"slo_at": clock() + timedelta(seconds=10), "slo_seconds": 10.0}
    ledger.enqueue(
        record_id, task=TASK, key=record_id, tier="default", message=message, objective=first
    )
    later = {"slo_at": clock() + timedelta(seconds=100), "slo_seconds": 10.0}
    held = claim(ledger, record_id, **later)
    assert held.outcome is ClaimOutcome.CLAIMED
    clock.advance(11)
    assert [d["_id"] for d in ledger.overdue() if d["_id"] == record_id] == [record_id]
    ledger.complete(record_id, held.fence, "1", op=new_op())


def test_settled_objectives_are_removed_page_by_page_and_open_ones_read_once(
    world: tuple[Any, Clock], monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, clock = world
    monkeypatch.setattr("celery_ledger.ledger.objectives.OBJECTIVE_PAGE", 4)
    finished, open_ = [new_id() for _ in range(11)], [new_id() for _ in range(3)]
    for record_id in finished + open_:
        # The open ones come due last: every page before them holds settled ones only.
        due = clock() + timedelta(seconds=10 if record_id in finished else 11)
        held = claim(ledger, record_id, slo_at=due, slo_seconds=10.0)
        if record_id in finished:
            ledger.complete(record_id, held.fence, "1", op=new_op())
    clock.advance(12)
    first = [d["_id"] for d in ledger.overdue(limit=50) if d["_id"] in finished + open_]
    assert sorted(first) == sorted(open_)  # each once, none of the finished ones
    if isinstance(ledger, Ledger):
        objectives = ledger.client[ledger.database_name][f"{ledger.collection_name}_objectives"]
        left = {d["_id"] for d in objectives.find({"_id": {"$in": finished + open_}})}
        assert left == set(open_)


def test_a_ledger_of_an_earlier_release_keeps_its_sparse_indexes_until_the_upgrade_ends(
    stack: Any,
) -> None:
    """A rolling deploy runs both releases: the earlier one writes ``slo_at`` without an
    objective document and reads its two sparse indexes. Workers of this release leave them
    and read the records due on ``objective`` too; ``finish_upgrade`` (once no earlier release
    runs) copies the open objectives and drops them and its sweepers' index without
    ``updated_at``, leaving the records two secondary indexes
    (every write of every job pays for each: ``ops/bench/indexes.py``)."""
    listings: list[str] = []

    class Listings(monitoring.CommandListener):
        def started(self, event: monitoring.CommandStartedEvent) -> None:
            if event.command_name == "listIndexes":
                listings.append(event.database_name)

        def succeeded(self, event: Any) -> None:
            pass

        def failed(self, event: Any) -> None:
            pass

    store = Ledger(
        uri=stack.ledger.url, database=f"upgrade_{new_id()[:8]}", event_listeners=[Listings()]
    )
    try:
        due_before, due_during = new_id(), new_id()
        past = utcnow() - timedelta(seconds=5)
        store.collection.create_index("slo_at", name="objective", sparse=True)
        store.collection.create_index("replace_due", name="replacement_due", sparse=True)
        # (and its sweepers' index without updated_at, a prefix of this release's)
        store.collection.create_index([("state", 1), ("claimable_at", 1)], name="state_claimable")
        store.collection.insert_one(
            {
                "_id": due_before,
                "state": "running",
                "task": TASK,
                "key": due_before,
                "slo_at": past,
                "slo_seconds": 3.0,
            }
        )
        store.ensure_indexes()  # this release's first worker: the old indexes stay
        assert store.legacy_indexes() == ["objective", "replacement_due", "state_claimable"]
        store.collection.insert_one(  # a worker of the earlier release, meanwhile
            {
                "_id": due_during,
                "state": "queued",
                "task": TASK,
                "key": due_during,
                "slo_at": past,
                "slo_seconds": 3.0,
            }
        )
        assert {d["_id"] for d in store.overdue()} == {due_before, due_during}

        assert store.finish_upgrade() == {"objectives copied": 2, "indexes dropped": 3}
        assert store.finish_upgrade() == {"objectives copied": 0, "indexes dropped": 0}
        indexes = set(store.collection.index_information())
        assert indexes - {"retention", "retention_sweep"} == {"_id_", "state_claimable_updated"}
        assert len(indexes) == 3
        assert {d["_id"] for d in store.overdue()} == {due_before, due_during}
        # Once seen gone, the escalation check stops listing the indexes at every pass
        listings.clear()
        assert {d["_id"] for d in store.overdue()} == {due_before, due_during}
        assert listings == []
    finally:
        store.client.drop_database(store.database_name)
        store.close()


@pytest.mark.parametrize("failure", ["write refused", "ledger unreachable"])
def test_an_upgrade_whose_copy_fails_drops_nothing_and_a_second_run_finishes_it(
    stack: Any, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """finish-upgrade drops the earlier release's indexes only once every open objective is
    copied: a copy the ledger refuses, or one cut off by an outage, fails the command with a
    clear error and leaves both indexes (their objectives are still read from the records);
    run again, it finishes."""
    from pymongo.errors import AutoReconnect

    from celery_ledger.errors import LedgerError

    store = Ledger(uri=stack.ledger.url, database=f"upgrade_{new_id()[:8]}")
    try:
        store.collection.create_index("slo_at", name="objective", sparse=True)
        store.collection.create_index("replace_due", name="replacement_due", sparse=True)
        store.ensure_indexes()
        due = new_id()
        store.collection.insert_one(
            {
                "_id": due,
                "state": "running",
                "task": TASK,
                "key": due,
                "slo_at": utcnow() - timedelta(seconds=5),
                "slo_seconds": 3.0,
            }
        )
        real = store._objectives

        class Failing:
            def bulk_write(self, *args: Any, **kwargs: Any) -> None:
                if failure == "ledger unreachable":
                    raise AutoReconnect("connection refused")
                raise BulkWriteError(
                    {"writeErrors": [{"index": 0, "code": 121, "errmsg": "refused"}]}
                )

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        monkeypatch.setattr(Ledger, "_objectives", property(lambda self: Failing()))
        with pytest.raises(LedgerError) as raised:
            store.finish_upgrade()
        if failure == "write refused":
            assert "nothing dropped" in str(raised.value)
        assert store.legacy_indexes() == ["objective", "replacement_due"]
        assert [d["_id"] for d in store.overdue()] == [due]  # still seen on the record

        monkeypatch.undo()
        assert store.finish_upgrade() == {"objectives copied": 1, "indexes dropped": 2}
        assert store.legacy_indexes() == []
        assert [d["_id"] for d in store.overdue()] == [due]  # now from its copied objective
    finally:
        store.client.drop_database(store.database_name)
        store.close()


def test_an_objective_write_that_fails_never_fails_the_claim_that_holds_the_lease(
    stack: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The ledger gone between the claim and its objective's write: the claim still holds
    the lease and says so (the job runs now); the failure is logged as an error, and the next
    claim tracks the objective again."""
    from pymongo.errors import AutoReconnect

    class Unreachable:
        def update_one(self, *args: Any, **kwargs: Any) -> None:
            raise AutoReconnect("connection refused")

    store = Ledger(uri=stack.ledger.url, database="ledger_contract_tests")
    store.ensure_indexes()
    try:
        # An earlier test's logging set-up (a worker's, a server's) may have disabled or
        # quietened the store's logger: what is asserted is what the store logs.
        store_logger = logging.getLogger("celery_ledger.ledger")
        monkeypatch.setattr(store_logger, "disabled", False)
        caplog.set_level(logging.ERROR, logger=store_logger.name)
        monkeypatch.setattr(Ledger, "_objectives", property(lambda self: Unreachable()))
        record_id = new_id()
        held = claim(store, record_id, slo_at=utcnow(), slo_seconds=1.0)
        assert held.outcome is ClaimOutcome.CLAIMED
        assert store.find_raw(record_id)["fence"] == held.fence
        assert any(r.levelname == "ERROR" and record_id in r.getMessage() for r in caplog.records)
        monkeypatch.undo()
        store.complete(record_id, held.fence, "1", op=new_op())
    finally:
        store.close()


def test_the_single_record_filter_shape_matches_exactly_what_the_plain_filter_matches(
    stack: Any,
) -> None:
    """Single-record writes send their filter in a shape the embedded server plans faster
    (a clause with a string, number or date also says ``$exists: true``). It must match the
    same records as the plain filter, on every kind of value a record's field can hold or
    lack, on the records' own indexed fields, and an upsert must still copy its equalities
    into the record it creates."""
    import itertools
    import math

    from bson import Decimal128, Int64, MaxKey, MinKey

    from celery_ledger.ledger.store import _on_one_record

    store = Ledger(uri=stack.ledger.url, database=f"filter_shape_{new_id()[:8]}")
    # The records' own indexes, (state, claimable_at) among them: the planner's index paths.
    # (Not a sparse index: with one, what a clause that matches a missing field returns
    # depends on the plan, on MongoDB too.)
    store.ensure_indexes()
    collection = store.collection
    at = datetime(2026, 1, 1, tzinfo=UTC)
    values: list[Any] = [
        "missing", None, "t", "u", "", 0, 3, 7, 3.0, Int64(3), Decimal128("3"), math.nan,
        True, False, at, at + timedelta(seconds=1), datetime(2026, 1, 1), ["t"], [3, 7],
        [[3]], {"a": 1}, MinKey(), MaxKey(),
    ]  # fmt: skip
    documents = [
        {"_id": f"r{n}"} | {f: v for f, v in (("state", a), ("claimable_at", b)) if v != "missing"}
        for n, (a, b) in enumerate(itertools.product(values, repeat=2))
    ]
    collection.insert_many(documents)
    # What the filters mean: the same records without secondary indexes. A filter without the
    # _id can be planned wrong on the indexes (on the embedded server a ``$lte`` on
    # claimable_at over the three-key sweepers' index drops the records equal to its bound,
    # and one on None finds nothing): the ledger's filters on that index use ``$lt`` and
    # equalities, and the writes name their record by _id, planned on it (checked below)
    truth = store.companion("filter_truth")
    truth.insert_many(documents)
    clauses: list[Any] = [
        "t", 3, 0, 3.0, Int64(3), math.nan, True, at, {"$lt": 7}, {"$lte": 3}, {"$gt": 0},
        {"$gte": at}, {"$lt": at + timedelta(seconds=1)}, {"$gt": 0, "$lt": 7}, {"$ne": "t"},
        {"$exists": True}, None, {"$lte": None}, {"$gte": None}, {"$gt": MinKey()},
        {"$lt": MaxKey()}, {"$lt": "u"}, ["t"],
    ]  # fmt: skip

    def ids(flt: dict[str, Any], of: Any = collection) -> list[str]:
        return sorted(d["_id"] for d in of.find(flt))

    try:
        for a, b in itertools.chain(
            itertools.product(clauses, clauses[::4]), itertools.product(clauses[::4], clauses)
        ):
            plain = {"state": a, "claimable_at": b}
            shaped = _on_one_record({"_id": "-", **plain})
            assert next(iter(shaped)) == "_id"  # the lookup stays first and bare
            del shaped["_id"]
            assert ids(shaped, truth) == ids(plain, truth), f"{shaped} does not mean {plain}"
        # and with the record's own _id, as the writes send it, on the records' indexes
        for doc, a, b in itertools.product(documents[::37], clauses[::3], clauses[::3]):
            plain = {"_id": doc["_id"], "state": a, "claimable_at": b}
            assert ids(_on_one_record(plain)) == ids(plain, truth), f"{plain} planned wrong"
        created = collection.update_one(
            _on_one_record({"_id": "new", "task": "t", "key": "k", "fence": {"$lt": 5}}),
            {"$set": {"fence": 5}},
            upsert=True,
        )
        assert created.upserted_id == "new"
        assert collection.find_one({"_id": "new"}) == {
            "_id": "new", "task": "t", "key": "k", "fence": 5,
        }  # fmt: skip
    finally:
        store.client.drop_database(store.database_name)
        store.close()
