"""The claim protocol against the real ledger store (SecantusDB), without workers."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from celery_ledger import LeaseLost, State
from celery_ledger.ledger import ClaimOutcome, Ledger
from celery_ledger.ledger.record import ErrorEntry
from celery_ledger.ledger.store import utcnow


@pytest.fixture
def ledger(stack: Any) -> Ledger:
    store = Ledger(
        uri=stack.ledger.url,
        database="ledger_store_tests",
        lease_seconds=0.5,
        error_history_limit=3,
    )
    store.ensure_indexes()
    return store


def claim(ledger: Ledger, record_id: str, owner: str = "w:1") -> Any:
    return ledger.claim(record_id, task="t", key=record_id, tier="default", owner=owner)


def test_twenty_concurrent_claims_grant_exactly_one_lease(ledger: Ledger) -> None:
    record_id = uuid.uuid4().hex
    with ThreadPoolExecutor(20) as pool:
        outcomes = list(pool.map(lambda i: claim(ledger, record_id, f"w:{i}").outcome, range(20)))
    assert outcomes.count(ClaimOutcome.CLAIMED) == 1
    assert outcomes.count(ClaimOutcome.BUSY) == 19


def test_a_stale_holder_cannot_overwrite_the_new_holder(ledger: Ledger) -> None:
    record_id = uuid.uuid4().hex
    # Given holder A whose lease expired, and holder B that took over
    first = claim(ledger, record_id, "a:1")
    time.sleep(0.6)
    second = claim(ledger, record_id, "b:2")
    assert second.outcome is ClaimOutcome.CLAIMED
    assert second.fence > first.fence

    # When A finishes late, its completion (and its failure record) is refused
    with pytest.raises(LeaseLost):
        ledger.complete(record_id, first.fence, '"from A"')
    error = ErrorEntry(type="X", message="late", at=utcnow())
    with pytest.raises(LeaseLost):
        ledger.record_failure(record_id, first.fence, error, retry_at=None)

    # Then B's result stands
    ledger.complete(record_id, second.fence, '"from B"')
    record = ledger.get_by_id(record_id)
    assert record is not None
    assert (record.state, record.result, record.attempts) == (State.SUCCEEDED, "from B", 2)


def test_claim_outcomes_for_each_state(ledger: Ledger) -> None:
    record_id = uuid.uuid4().hex
    held = claim(ledger, record_id)
    busy = claim(ledger, record_id)
    assert busy.outcome is ClaimOutcome.BUSY
    assert busy.retry_at is not None and busy.retry_at > utcnow()

    ledger.complete(record_id, held.fence, "1")
    assert claim(ledger, record_id).outcome is ClaimOutcome.DUPLICATE
    assert ledger.get_by_id(record_id).duplicates == 1  # type: ignore[union-attr]

    dead_id = uuid.uuid4().hex
    held = claim(ledger, dead_id)
    ledger.record_failure(
        dead_id, held.fence, ErrorEntry(type="E", message="m", at=utcnow()), retry_at=None
    )
    assert claim(ledger, dead_id).outcome is ClaimOutcome.DEAD


def test_retrying_records_are_claimable_and_keep_a_bounded_error_history(ledger: Ledger) -> None:
    record_id = uuid.uuid4().hex
    for attempt in range(5):
        held = claim(ledger, record_id)
        assert held.outcome is ClaimOutcome.CLAIMED
        ledger.record_failure(
            record_id,
            held.fence,
            ErrorEntry(type="E", message=f"attempt {attempt}", at=utcnow(), attempt=attempt),
            retry_at=utcnow(),
        )
    record = ledger.get_by_id(record_id)
    assert record is not None
    assert record.state is State.RETRYING
    assert record.attempts == 5
    assert [e.message for e in record.errors] == ["attempt 2", "attempt 3", "attempt 4"]


def test_enqueue_tells_new_jobs_from_known_ones_in_one_call(ledger: Ledger) -> None:
    record_id = uuid.uuid4().hex
    assert ledger.enqueue(record_id, task="t", key="k", tier="bulk") is True
    assert ledger.enqueue(record_id, task="t", key="k", tier="bulk") is False
    assert ledger.get_by_id(record_id).state is State.QUEUED  # type: ignore[union-attr]
    assert claim(ledger, record_id).outcome is ClaimOutcome.CLAIMED


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

    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    for record_id in (a, b):
        claim(swept, record_id)
        swept.complete(record_id, swept.find_raw(record_id)["fence"], "1")
    swept.collection.update_one({"_id": a}, {"$set": {"expires_at": utcnow()}})
    time.sleep(0.01)

    assert swept.expire() == 1
    assert swept.find_raw(a) is None
    assert swept.get_by_id(b) is not None
    # And back: the TTL index returns
    ttl.ensure_indexes()
    assert ttl.collection.index_information()["retention"]["expireAfterSeconds"] == 0
    ttl.client.drop_database(database)
