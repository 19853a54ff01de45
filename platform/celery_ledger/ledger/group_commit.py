"""Group commit: the ledger writes of one process's concurrent tasks share one bulk write.

A threads or gevent pool runs many tasks in one process, and each claim and completion is a
single-document write on ``_id`` (an update, or a first claim's insert). Sent one by one,
every write pays its own round trip and its own journal flush (``j=True``, ``w=majority``);
sent together as one unordered ``bulk_write``, they pay one (two when the batch holds inserts
and updates: pymongo sends each kind as its own command). Databases call this group commit.

The batching is *natural* (a leader and its followers, the usual group-commit shape): the first
writer to arrive while nothing is being flushed becomes the leader and sends at once what is
queued, its own write included; writers that arrive while that flush is in flight queue up and
go together in the next one. So a process running one task at a time (a prefork child, solo)
sends each write at once, as before, and waits for nothing; only writers that would have waited
for the connection anyway are coalesced. Nothing is delayed by a timer: a linger of even a
fraction of a millisecond would cost every lone write its whole length.

Every writer gets its own statements' outcomes back. An unordered bulk write reports write
errors (a claim's duplicate key, the signal that the record was not claimable) and upserts per
statement, but matched documents only as a total: when the total accounts for every statement
that is not an upsert, each of them matched; otherwise each is reported as unknown and its
writer checks its own (the ledger's fenced writes carry an operation id for that: see
``Ledger._end_attempt``). A failure of the whole batch that could belong to one writer's
statements (a document too large, a server refusal) is retried writer by writer, so that one
writer's bad write never fails another's.

Written here rather than taken from a library: pymongo has no client-side write batching, and
the outcome rules above are the ledger's own.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pymongo import InsertOne, UpdateOne
from pymongo.collection import Collection
from pymongo.errors import BulkWriteError, ConnectionFailure, WriteConcernError

from ..locks import process_generation

# Statements per bulk write: large enough to take a full pool's writes at once, small enough
# that one flush never holds its writers long.
MAX_BATCH = 128


class Statement(NamedTuple):
    """One single-document update, as ``Collection.update_one`` takes it."""

    filter: dict[str, Any]
    update: dict[str, Any]
    upsert: bool = False


class Insert(NamedTuple):
    """One new document, as ``Collection.insert_one`` takes it: its outcome is ``upserted``
    (inserted), or the server's error (a duplicate key: a document with its ``_id`` exists)."""

    document: dict[str, Any]


Write = Statement | Insert


@dataclass(frozen=True, slots=True)
class Outcome:
    """One statement's outcome: ``error`` (the server's write error document), ``upserted`` (it
    inserted a document), or ``matched`` (True, False, or None when the bulk's total could not
    say: the writer checks)."""

    matched: bool | None
    upserted: bool = False
    error: dict[str, Any] | None = None


@dataclass(eq=False)
class _Entry:
    ops: Sequence[Write]
    done: bool = False
    outcomes: list[Outcome] = field(default_factory=list)
    error: BaseException | None = None


class _Queue:
    """The writers waiting in one process (made afresh after a fork)."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.entries: list[_Entry] = []
        self.flushing = False


class GroupCommit:
    """Coalesces concurrent unordered updates of one collection (see the module docstring)."""

    def __init__(
        self, collection: Callable[[], Collection[dict[str, Any]]], *, max_batch: int = MAX_BATCH
    ) -> None:
        self._collection = collection
        self._max_batch = max_batch
        self._generation = process_generation()
        self._queue = _Queue()
        self.flushes = 0  # bulk writes sent (for tests and benchmarks)
        self.statements = 0

    def _here(self) -> _Queue:
        # A forked child starts with one thread and must not inherit a lock held at the fork.
        if self._generation != process_generation():
            self._queue = _Queue()
            self._generation = process_generation()
        return self._queue

    def write(self, ops: Sequence[Write]) -> list[Outcome]:
        """Send ``ops`` (unordered), alone or with other writers' ops; their outcomes in order.

        Raises what ``Collection.bulk_write`` raises for the whole batch (a connection failure,
        or ``WriteConcernError`` when the write concern was not confirmed: outcome unknown).
        """
        entry = _Entry(ops)
        if self._max_batch == 1:  # group commit off: each writer sends its own, concurrently
            self._flush([entry])
        else:
            self._write_in_turn(entry, self._here())
        if entry.error is not None:
            raise entry.error
        return entry.outcomes

    def _write_in_turn(self, entry: _Entry, queue: _Queue) -> None:
        with queue.cond:
            queue.entries.append(entry)
            try:
                while queue.flushing and not entry.done:
                    queue.cond.wait()
            except BaseException:
                # Interrupted while waiting (a timeout, a shutdown): unless a flush has taken
                # it already, its write is never sent.
                if entry in queue.entries:
                    queue.entries.remove(entry)
                raise
            if entry.done:
                return
            queue.flushing = True  # this writer leads until its own write is sent
        try:
            # (the take inside the try: an interrupt of the leader while it takes, a soft time
            # limit's signal, still ends its lead below, or every later write would wait)
            with queue.cond:
                batch = self._take(queue)
            self._flush(batch)
            # (once its own write is done, its followers are woken below, the lead given up)
            while not entry.done:
                with queue.cond:
                    queue.cond.notify_all()
                    batch = self._take(queue)
                self._flush(batch)
        finally:
            with queue.cond:
                if not entry.done and entry in queue.entries:
                    queue.entries.remove(entry)  # interrupted: its write is never sent
                queue.flushing = False
                queue.cond.notify_all()

    def _take(self, queue: _Queue) -> list[_Entry]:
        """The next batch, oldest writers first (called holding ``queue.cond``)."""
        batch: list[_Entry] = []
        size = 0
        while queue.entries and (not batch or size + len(queue.entries[0].ops) <= self._max_batch):
            taken = queue.entries.pop(0)
            batch.append(taken)
            size += len(taken.ops)
        return batch

    def _flush(self, batch: list[_Entry]) -> None:
        try:
            self._send(batch)
        except Exception as exc:
            self._flush_failed(batch, exc)
        finally:
            # Whatever stopped this flush (the leader interrupted by a time limit or a
            # shutdown, even while retrying writers one by one), no writer is left without
            # an answer: one that has none has an unknown outcome, as after a lost connection.
            for entry in batch:
                if entry.error is None and len(entry.outcomes) != len(entry.ops):
                    entry.error = ConnectionFailure("the batch's flush was interrupted")
                entry.done = True

    def _flush_failed(self, batch: list[_Entry], exc: Exception) -> None:
        if isinstance(exc, (ConnectionFailure, WriteConcernError)):
            # Every statement's outcome is unknown alike.
            self._fail(batch, exc)
        elif len(batch) == 1:
            self._fail(batch, exc)
        else:
            # It may be one writer's doing (a document too large): each on its own. (A claim
            # whose statement had applied before the failure is recognised by its fence when
            # sent again: see ``Ledger.claim``.)
            for entry in batch:
                try:
                    self._send([entry])
                except Exception as own:
                    self._fail([entry], own)

    def _fail(self, batch: list[_Entry], exc: BaseException) -> None:
        for i, entry in enumerate(batch):
            # Each writer raises its own copy: one exception object raised in several threads
            # would gather all their tracebacks.
            try:
                entry.error = exc if i == 0 else copy.copy(exc).with_traceback(None)
            except Exception:  # an exception that cannot be copied: the outcome is unknown
                entry.error = ConnectionFailure(f"ledger write failed: {exc!r}")

    def _send(self, batch: list[_Entry]) -> None:
        ops = [op for entry in batch for op in entry.ops]
        self.flushes += 1
        self.statements += len(ops)
        requests = [
            InsertOne(op.document)
            if isinstance(op, Insert)
            else UpdateOne(op.filter, op.update, upsert=op.upsert)
            for op in ops
        ]
        try:
            result = self._collection().bulk_write(requests, ordered=False)
            details: dict[str, Any] = {
                "nMatched": result.matched_count,
                "upserted": [{"index": i} for i in result.upserted_ids or {}],
                "writeErrors": [],
            }
        except BulkWriteError as exc:
            details = dict(exc.details)
            if details.get("writeConcernErrors"):
                raise WriteConcernError(
                    "write concern not confirmed, outcome unknown:"
                    f" {details['writeConcernErrors']}",
                    details=details,
                ) from exc
        outcomes = _outcomes(ops, details)
        start = 0
        for entry in batch:
            entry.outcomes = outcomes[start : start + len(entry.ops)]
            start += len(entry.ops)


def _outcomes(ops: Sequence[Write], details: dict[str, Any]) -> list[Outcome]:
    errors = {int(e["index"]): e for e in details.get("writeErrors", [])}
    upserted = {int(u["index"]) for u in details.get("upserted", [])}
    # One pass over the statements (every write of every task comes through here).
    result: list[Outcome] = []
    plain: list[int] = []
    upserts_matched = 0
    for i, op in enumerate(ops):
        if i in errors:
            result.append(Outcome(matched=False, error=errors[i]))
        elif i in upserted or isinstance(op, Insert):
            # An insert that did not fail inserted; the server counts it in neither total.
            result.append(_INSERTED)
        elif op.upsert:
            # An upsert that neither failed nor inserted matched a document; the rest of the
            # total belongs to the plain updates.
            result.append(_MATCHED)
            upserts_matched += 1
        else:
            plain.append(i)
            result.append(_UNKNOWN)
    if int(details.get("nMatched", 0)) - upserts_matched == len(plain):
        for i in plain:
            result[i] = _MATCHED
    return result


# (frozen: one instance of each outcome without an error serves every statement)
_INSERTED = Outcome(matched=False, upserted=True)
_MATCHED = Outcome(matched=True)
_UNKNOWN = Outcome(matched=None)
