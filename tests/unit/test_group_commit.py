"""Group commit's decision logic: which writer gets which outcome, and how the batching
behaves when writers overlap (a scripted collection stands in for the server: the outcome rules
are checked against the real server in ``tests/integration/test_group_commit.py``)."""

from __future__ import annotations

import copy
import threading
import time
import types
from typing import Any

import pytest
from bson.errors import InvalidDocument
from pymongo.errors import AutoReconnect, BulkWriteError, ConnectionFailure, WriteConcernError

from celery_ledger.ledger.group_commit import GroupCommit, Insert, Outcome, Statement, _outcomes

CLAIM = Statement({"_id": "a"}, {"$set": {"x": 1}}, upsert=True)
END = Statement({"_id": "b", "fence": 1}, {"$set": {"x": 1}})


def test_each_statement_gets_its_own_outcome() -> None:
    ops = [CLAIM, CLAIM, CLAIM, END, END]
    details = {
        "writeErrors": [{"index": 1, "code": 11000}],
        "upserted": [{"index": 2}],
        "nMatched": 3,  # the matched upsert (0) and both plain updates
    }
    assert _outcomes(ops, details) == [
        Outcome(matched=True),
        Outcome(matched=False, error={"index": 1, "code": 11000}),
        Outcome(matched=False, upserted=True),
        Outcome(matched=True),
        Outcome(matched=True),
    ]


def test_an_insert_inserted_unless_it_failed_and_is_never_in_the_matched_total() -> None:
    new = Insert({"_id": "c", "x": 1})
    details = {
        "writeErrors": [{"index": 1, "code": 11000}],  # a document with its _id exists
        "upserted": [],  # the server lists upserts only, never inserts
        "nMatched": 1,  # the plain update
    }
    assert _outcomes([new, new, END], details) == [
        Outcome(matched=False, upserted=True),
        Outcome(matched=False, error={"index": 1, "code": 11000}),
        Outcome(matched=True),
    ]


def test_a_total_short_of_the_plain_updates_leaves_each_of_them_unknown() -> None:
    # One of the two fenced updates did not match; the total cannot say which.
    outcomes = _outcomes([CLAIM, END, END], {"upserted": [{"index": 0}], "nMatched": 1})
    assert outcomes[0] == Outcome(matched=False, upserted=True)
    assert outcomes[1:] == [Outcome(matched=None), Outcome(matched=None)]


class Scripted:
    """``bulk_write`` that holds the first call until released, so that writers queue."""

    def __init__(self, fail: Any = None) -> None:
        self.calls: list[list[Any]] = []
        self.first = threading.Event()
        self.release = threading.Event()
        self.fail = fail

    def bulk_write(self, requests: list[Any], ordered: bool) -> Any:
        assert ordered is False
        self.calls.append(requests)
        if len(self.calls) == 1:
            self.first.set()
            assert self.release.wait(5)
        if self.fail is not None:
            problem = self.fail(requests)
            if problem is not None:
                raise problem

        result = types.SimpleNamespace()
        result.matched_count = sum(1 for r in requests if not r._upsert)
        result.upserted_ids = {i: None for i, r in enumerate(requests) if r._upsert}
        return result


def run_writers(group: GroupCommit, scripted: Scripted, n: int) -> list[Any]:
    """One writer that leads, then ``n`` that arrive while its flush is in flight."""
    results: list[Any] = [None] * (n + 1)

    def writer(i: int) -> None:
        try:
            results[i] = group.write([END if i % 2 else CLAIM])
        except Exception as exc:
            results[i] = exc
        except BaseException:
            pass  # an interruption ends the writer's thread (results[i] stays None)

    first = threading.Thread(target=writer, args=(0,))
    first.start()
    assert scripted.first.wait(5)
    others = [threading.Thread(target=writer, args=(i,)) for i in range(1, n + 1)]
    for thread in others:
        thread.start()
    deadline = time.monotonic() + 5
    while len(group._queue.entries) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    scripted.release.set()
    for thread in [first, *others]:
        thread.join(5)
    return results


def test_writers_that_arrive_during_a_flush_share_the_next_one() -> None:
    scripted = Scripted()
    group = GroupCommit(lambda: scripted)  # type: ignore[arg-type,return-value]
    results = run_writers(group, scripted, 10)
    # the lone first write went at once; the ten that queued behind it went as one
    assert [len(call) for call in scripted.calls] == [1, 10]
    assert all(r == [Outcome(matched=False, upserted=True)] for r in results[::2])
    assert all(r == [Outcome(matched=True)] for r in results[1::2])


def test_a_lone_writer_is_sent_at_once() -> None:
    scripted = Scripted()
    scripted.release.set()
    group = GroupCommit(lambda: scripted)  # type: ignore[arg-type,return-value]
    started = time.perf_counter()
    assert group.write([END]) == [Outcome(matched=True)]
    assert time.perf_counter() - started < 1  # no timer: generous bound, only catches a hang
    assert group.flushes == 1


def test_one_writers_bad_document_fails_only_that_writer() -> None:
    def too_large(requests: list[Any]) -> Exception | None:
        if any(r._filter.get("_id") == "huge" for r in requests):
            return InvalidDocument("document too large")
        return None

    scripted = Scripted(fail=too_large)
    group = GroupCommit(lambda: scripted)  # type: ignore[arg-type,return-value]
    results: dict[str, Any] = {}

    def writer(name: str, op: Statement) -> None:
        try:
            results[name] = group.write([op])
        except Exception as exc:
            results[name] = exc

    lead = threading.Thread(target=writer, args=("lead", END))
    lead.start()
    assert scripted.first.wait(5)
    huge = threading.Thread(target=writer, args=("huge", Statement({"_id": "huge"}, {})))
    fine = threading.Thread(target=writer, args=("fine", END))
    huge.start()
    fine.start()
    deadline = time.monotonic() + 5
    while len(group._queue.entries) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    scripted.release.set()
    for thread in (lead, huge, fine):
        thread.join(5)
    assert isinstance(results["huge"], InvalidDocument)
    assert results["fine"] == [Outcome(matched=True)]
    assert results["lead"] == [Outcome(matched=True)]


@pytest.mark.parametrize(
    "failure",
    [
        AutoReconnect("connection reset"),
        BulkWriteError({"writeErrors": [], "writeConcernErrors": [{"code": 64}], "nMatched": 1}),
    ],
)
def test_a_batch_whose_outcome_is_unknown_tells_every_writer_so(failure: Exception) -> None:
    scripted = Scripted(fail=lambda requests: copy.copy(failure))
    group = GroupCommit(lambda: scripted)  # type: ignore[arg-type,return-value]
    results = run_writers(group, scripted, 4)
    expected = AutoReconnect if isinstance(failure, AutoReconnect) else WriteConcernError
    assert all(isinstance(r, expected) for r in results), results
    # each writer raises its own exception object
    assert len({id(r) for r in results}) == len(results)


def test_an_interrupted_leader_leaves_the_writers_it_carried_unknown() -> None:
    class Interrupted(BaseException):
        pass

    scripted = Scripted(fail=lambda requests: Interrupted())
    group = GroupCommit(lambda: scripted)  # type: ignore[arg-type,return-value]
    results = run_writers(group, scripted, 3)
    # every flush is interrupted: each leader raises the interruption itself (its thread ends
    # with it, leaving no result), and every writer a leader carried learns that its outcome
    # is unknown; nothing is left waiting
    leaders = [r for r in results if r is None]
    carried = [r for r in results if r is not None]
    assert len(leaders) == len(scripted.calls) >= 2, results
    assert carried and all(isinstance(r, ConnectionFailure) for r in carried), results
    assert not group._queue.entries and not group._queue.flushing


def test_a_writer_interrupted_while_it_waits_is_never_sent() -> None:
    class Interrupted(BaseException):
        pass

    scripted = Scripted()
    group = GroupCommit(lambda: scripted)  # type: ignore[arg-type,return-value]
    lead = threading.Thread(target=group.write, args=([END],))
    lead.start()
    assert scripted.first.wait(5)
    queue = group._queue
    original_wait = queue.cond.wait

    def interrupted_wait(timeout: float | None = None) -> bool:
        queue.cond.wait = original_wait  # type: ignore[method-assign]
        raise Interrupted

    queue.cond.wait = interrupted_wait  # type: ignore[method-assign]
    with pytest.raises(Interrupted):
        group.write([CLAIM])
    scripted.release.set()
    lead.join(5)
    assert [len(call) for call in scripted.calls] == [1]  # the interrupted claim never went
    assert not queue.entries


def test_with_group_commit_off_writers_do_not_wait_for_each_other() -> None:
    scripted = Scripted()
    group = GroupCommit(lambda: scripted, max_batch=1)  # type: ignore[arg-type,return-value]
    first = threading.Thread(target=group.write, args=([END],))
    first.start()
    assert scripted.first.wait(5)
    # while the first write is held by the server, a second one goes at once
    assert group.write([CLAIM]) == [Outcome(matched=False, upserted=True)]
    scripted.release.set()
    first.join(5)


def test_an_interrupted_leader_leaves_the_others_unknown_and_its_own_write_unsent() -> None:
    class Interrupted(BaseException):
        pass

    calls = 0

    class Collection:
        def bulk_write(self, requests: list[Any], ordered: bool) -> Any:
            nonlocal calls
            calls += 1
            raise Interrupted

    group = GroupCommit(lambda: Collection(), max_batch=1)  # type: ignore[arg-type,return-value]
    with pytest.raises(Interrupted):
        group.write([END])
    assert calls == 1 and not group._queue.entries and not group._queue.flushing
