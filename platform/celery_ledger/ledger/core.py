"""The ledger's values and constants shared by its stores: claim and enqueue outcomes, the
matches a dead write applies on, the times that mark a record's states, the translation of
MongoDB's errors into the platform's, and the small pure helpers of the record's shape.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, NamedTuple, TypeVar

from bson.errors import BSONError
from pymongo.errors import (
    BulkWriteError,
    ConnectionFailure,
    DuplicateKeyError,
    OperationFailure,
    PyMongoError,
    ServerSelectionTimeoutError,
    WriteConcernError,
)

from .. import headers
from ..errors import LedgerUnavailable, NotApplied, StoreError, brief
from ..locks import ForkSafeLock
from ..tracecontext import ledger_operation
from .message import KeptMessage
from .record import SCHEMA_VERSION, State

FOREVER = datetime(9999, 12, 31, tzinfo=UTC)


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


DUPLICATE_KEY = 11000


INDEX_NOT_FOUND = 27


RECENT_OPS = 4  # operation ids a record keeps (see Ledger._end_attempt)


# A fallback's last good result outlives the records it came from (a result asked for again
# after its record expired still has one to fall back on).
CACHE_RETENTION = timedelta(days=30)


T = TypeVar("T")


logger = logging.getLogger("celery_ledger.ledger")


# A dead job's copy to the dead letters' queue is due this long after its death unless the
# process that buried it confirms the copy (it may die between the two): then the workers'
# housekeeping publishes it.
COPY_GRACE = timedelta(seconds=30)


# A dead record's ``claimable_at`` holds its queue copy's due time moved this far ahead (FOREVER
# once the copy is done), so that the index the sweepers use finds due copies, and no claim
# filter ever matches a dead record (``claimable_at <= now``), that of an earlier release
# included, whose claim did not refuse dead records otherwise: a fleet in a rolling deploy.
COPY_DUE_SHIFT = datetime(5000, 1, 1, tzinfo=UTC) - EPOCH


# A queued record whose message is not sent yet (written in the app's transaction, or whose
# publish failed) has this ``claimable_at``: still claimable (it is long past), and one value of
# the sweepers' ``(state, claimable_at, updated_at)`` index, so the outbox relay's query reads
# those records and nothing else (a backlog of published queued records sits at EPOCH, one
# second below).
UNPUBLISHED = EPOCH + timedelta(seconds=1)


# The sweepers' index on the records (see Indexes.ensure_indexes).
SWEEP_INDEX = "state_claimable_updated"

# The records' indexes of earlier releases, retired by Ledger.finish_upgrade: two sparse ones
# (before 2026-11-26), and the sweepers' index without updated_at (before 2026-11-29; its
# queries are a prefix of SWEEP_INDEX's, so dropping it changes nothing an earlier release reads).
LEGACY_INDEXES = ("objective", "replacement_due", "state_claimable")


# Due objectives one read of Ledger.overdue takes (settled ones are removed page by page).
OBJECTIVE_PAGE = 500


# Unpublished records one outbox read looks through at most (past those, a backlog held by
# backpressure beyond this many records can hide the rest until it drains).
UNPUBLISHED_SCAN = 10_000


# The ends of a workflow whose own record is dead although it did what it was written to do:
# its compensations ran (a saga), or it was cancelled and compensated. Not dead letters.
ENDED_AS_WRITTEN = ("compensated", "cancelled")


def utcnow() -> datetime:
    return datetime.now(UTC)


class ClaimOutcome(StrEnum):
    CLAIMED = "claimed"  # run the body with ``Claim.fence``
    DUPLICATE = "duplicate"  # already succeeded: do not run
    BUSY = "busy"  # held by a live lease: come back at ``retry_at``
    DEAD = "dead"  # dead-lettered: do not run; replay is the way back
    CONFLICT = "conflict"  # the record id names another job (a record of an older version)


@dataclass(frozen=True, slots=True)
class Claim:
    outcome: ClaimOutcome
    fence: int = 0
    retry_at: datetime | None = None
    killed: bool = False  # DEAD: this claim found the job out of budget and buried it
    created: bool = False  # CLAIMED: this claim made the record (nothing earlier is on it)


class EnqueueOutcome(StrEnum):
    NEW = "new"  # the queued record was written: publish
    KNOWN = "known"  # the job is known: publishing again would only make a duplicate
    UNPUBLISHED = "unpublished"  # known, but its first publish failed: publish again


@dataclass(frozen=True, slots=True)
class QueuedJob:
    """One job of a bulk enqueue: what :meth:`Publishing.enqueue` takes, but the session (an
    outbox write is one job in the app's own transaction)."""

    record_id: str
    task: str
    key: str
    tier: str
    message: KeptMessage
    objective: Mapping[str, Any] | None = None
    claimable_at: datetime | None = None

    def arguments(self) -> dict[str, Any]:
        """:meth:`Publishing.enqueue`'s keyword arguments for this job."""
        return {
            "task": self.task,
            "key": self.key,
            "tier": self.tier,
            "message": self.message,
            "objective": self.objective,
            "claimable_at": self.claimable_at,
        }


# Where a dead write may apply (Ledger.bury).
@dataclass(frozen=True, slots=True)
class Fenced:
    """The holder of ``fence`` ends its own attempt."""

    fence: int
    op: str


@dataclass(frozen=True, slots=True)
class HeldBy:
    """Whoever holds the running record as ``owner`` (the worker that ran it, from outside)."""

    owner: str


@dataclass(frozen=True, slots=True)
class Unchanged:
    """The record exactly as it was read (``fence``, ``state`` and, when given, the lease's
    end ``claimable_at``, which a heartbeat moves): a claim's verdict."""

    fence: int
    state: str
    claimable_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Unclaimed:
    """A job nobody runs: a new record, or a queued or retrying one (``kill_waiting``);
    any other record is left as it is and only notes the event."""

    kill_waiting: bool = False


BuryMatch = Fenced | HeldBy | Unchanged | Unclaimed


# (name, keys, options) of the audit trail's indexes (Ledger.ensure_audit_indexes).
AUDIT_INDEXES: list[tuple[str, Any, dict[str, Any]]] = [
    ("one_outcome", "of", {"unique": True, "sparse": True}),
    ("at", "at", {}),
]


def translate_errors(what: str) -> AbstractContextManager[None]:
    """Turn pymongo's errors into the platform's: transient ones (and writes whose outcome is
    unknown) into ``LedgerUnavailable``, the rest into ``StoreError``. The commands sent
    inside are ``what`` to tracing (their spans' name)."""
    return _Translating(what)


class _Translating:
    # A class, not a generator's context manager (a quarter of its cost): every ledger
    # command of every task is sent inside one.
    __slots__ = ("_operation", "_what")

    def __init__(self, what: str) -> None:
        self._what = what
        self._operation = ledger_operation(what)

    def __enter__(self) -> None:
        self._operation.__enter__()

    def __exit__(self, kind: Any, exc: BaseException | None, traceback: Any) -> None:
        self._operation.__exit__(kind, exc, traceback)
        if exc is not None:
            _raise_translated(self._what, exc)


def _raise_translated(what: str, exc: BaseException) -> None:
    """Raise the platform's error for pymongo's ``exc`` (nothing for any other error)."""
    if isinstance(exc, ServerSelectionTimeoutError):
        raise NotApplied(f"ledger unreachable during {what}: {brief(exc)}") from exc
    if isinstance(exc, ConnectionFailure):
        raise LedgerUnavailable(f"ledger connection failed during {what}: {exc}") from exc
    if isinstance(exc, BulkWriteError | DuplicateKeyError):
        return  # the callers read these as protocol signals
    if isinstance(exc, WriteConcernError):
        # The write may have applied: the caller treats the outcome as unknown.
        raise LedgerUnavailable(f"write concern not confirmed during {what}: {exc}") from exc
    if isinstance(exc, OperationFailure):
        if exc.has_error_label("RetryableWriteError") or exc.has_error_label(
            "TransientTransactionError"
        ):
            raise LedgerUnavailable(f"ledger unavailable during {what}: {exc}") from exc
        raise StoreError(f"ledger {what} failed: {exc}") from exc
    if isinstance(exc, PyMongoError | BSONError):  # DocumentTooLarge is a BSON InvalidDocument
        raise StoreError(f"ledger {what} failed: {exc}") from exc


def new_op() -> str:
    """An operation id for a write that ends an attempt (see the module docstring)."""
    # What ``uuid.uuid4().hex[:16]`` gives (64 bits, the 13th digit uuid4's version: 60 random
    # bits), without its UUID object: one ends every attempt.
    text = os.urandom(8).hex()
    return f"{text[:12]}4{text[13:]}"


class _FenceClock:
    """Strictly increasing nanosecond tokens within this process."""

    def __init__(self, clock: Callable[[], datetime]) -> None:
        self._clock = clock
        self._last = 0
        self._lock = ForkSafeLock()

    def next(self, at_least: int = 0) -> int:
        # (read before the lock: a clock's occasional read of its server must not hold up
        # another thread's claim)
        now_ns = int(self._clock().timestamp() * 1_000_000) * 1000
        with self._lock:
            self._last = max(now_ns, self._last + 1, at_least)
            return self._last


class RecordState(NamedTuple):
    """What the reconciler reads of a record whose message a dead worker may hold."""

    state: str
    fleet: str | None  # the queue namespace of the publisher (None: an earlier release's)

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> RecordState:
        fleet = doc.get("fleet")
        return cls(str(doc.get("state")), fleet if isinstance(fleet, str) else None)


def tenant_clauses(tenant: str) -> list[dict[str, Any]]:
    """The ``$or`` that finds ``tenant``'s records: by their ``tenant`` field, or for a record
    written without one (a claim from the message, a poison message, an earlier release) by
    the headers of the message it keeps, where the tenant travels."""
    return [{"tenant": tenant}, {"tenant": None, f"message.headers.{headers.TENANT}": tenant}]


def _replacement_pending(doc: Mapping[str, Any]) -> bool:
    """A degraded result whose replacement is scheduled (claimable at ``replace_at``)."""
    degraded = doc.get("degraded")
    return isinstance(degraded, Mapping) and degraded.get("replace_at") is not None


def _on_one_record(conditions: dict[str, Any]) -> dict[str, Any]:
    """The same filter on ``_id``, in the shape every server matches alike and the embedded
    server plans at once: each clause but ``_id`` that is an equality or a comparison with a
    string, number or date also says ``$exists: true``, which it already implies (such a
    value never matches a missing field, MongoDB comparing within a type). Others (null,
    ``MinKey``, ``MaxKey``, ``$ne``, ``$exists``, lists, documents) stay as they are: a null
    or ``$lte: None`` does match a missing field.

    Why: given a filter of several fields, SecantusDB's planner looks for an index on each
    bare equality or bare comparison before it takes the ``_id`` lookup, re-reading its index
    catalogue every time (measured: about a tenth of its CPU a job, over the claim and the
    completion). A clause with ``$exists`` among its operators is not one it looks at. An
    upsert still copies ``{"$eq": v, ...}`` into the record it inserts, as it does a bare
    ``v`` (MongoDB seeds from whichever operator of a clause implies an equality). ``_id``
    stays bare and first: its lookup is the plan."""
    shaped: dict[str, Any] = {"_id": conditions["_id"]}
    for field, value in conditions.items():
        if field == "_id":
            continue
        if (
            isinstance(value, dict)
            and value
            and all(op in _COMPARISONS and isinstance(bound, _TYPED) for op, bound in value.items())
        ):
            value = {**value, "$exists": True}
        elif isinstance(value, _TYPED):
            value = {"$eq": value, "$exists": True}
        shaped[field] = value
    return shaped


_COMPARISONS = ("$lt", "$lte", "$gt", "$gte")


_TYPED = (str, int, float, datetime)  # values that match only a present field (not null)


def _objective_update(slo_at: datetime, slo_seconds: Any) -> dict[str, Any]:
    """An objective document's upsert: the earliest objective stands (see _track_objective)."""
    return {"$min": {"slo_at": slo_at}, "$set": {"slo_seconds": slo_seconds}}


def _cache_id(task: str, cache_key: str) -> str:
    return f"{task}\x1f{cache_key}"


def _queued(*, task: str, key: str, tier: str, now: datetime, fleet: str | None) -> dict[str, Any]:
    """The fields of a new record that waits for its first claim."""
    return ({} if fleet is None else {"fleet": fleet}) | {
        "v": SCHEMA_VERSION,
        "task": task,
        "key": key,
        "tier": tier,
        "state": State.QUEUED.value,
        "attempts": 0,
        "inflight": 0,
        "fence": 0,
        "claimable_at": EPOCH,
        "created_at": now,
        "updated_at": now,
    }
