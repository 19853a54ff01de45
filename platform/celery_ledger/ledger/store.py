"""The MongoDB ledger store: the only code that reads or writes the ledger's collections.

Op shapes are chosen for both real MongoDB and SecantusDB: every write is an ``update``
filtered on ``_id`` or an ``insert`` (never ``findAndModify``, which scans the whole collection
on SecantusDB), and a read happens only on the rare paths.

A claim is one write on the common path (a claim that succeeds):

1. the claim itself: an upsert on ``_id`` that matches only while the record is claimable
   (``claimable_at <= now``), names the same job (task and key) and its fencing token is older
   than ours. It inserts a new record, or takes a queued, retrying or lease-expired one. When the
   record exists but is not claimable, the upsert collides with it on ``_id`` (duplicate key),
   which is the signal. A message whose own id is not the record's (an alias) writes its alias
   document in the same unordered bulk write.
   A message that says it is its job's first publish with no record written for it
   (``new``: see ``Delivery.first_publish``) is claimed by a plain insert of the record the
   upsert would have made: on a new record that is the same document, and the cheapest write
   a server has (no filter to evaluate, no update to apply: on the embedded server the upsert
   claim costs 1.16x-1.20x the CPU per job, ``ops.bench.indexes``). If a record exists after all (a
   client's duplicate publish), the insert collides on ``_id`` and changes nothing; then the
   marker below, and only if that does not match either, the conditional upsert: a wrong hint
   costs up to two writes (on a claimable record: the insert and the marker), never a wrong
   claim.
2. only when the claim did not match, a duplicate marker: ``$inc duplicates`` on the same
   ``_id`` if it already ``succeeded`` (a suppressed duplicate: two operations).

Only a record held by a live lease or a dead record needs a third operation (a read) to say why.

Claims and the writes that end an attempt go through :class:`GroupCommit`: when several tasks of
one process (a threads or gevent pool) write at once, their updates share one unordered bulk
write, so one journal flush; a process running one task at a time sends each at once.

Fencing tokens are nanosecond timestamps: known to the claimer without a read, and the claim
filter (``fence < token``) guarantees they only grow. A claimer whose clock lags falls back to
``stored token + 1``.

Writes that end a holder's attempt (completion, retry, release, death) carry an operation id,
kept among the record's last few (``ops``): when a write's reply is lost and the write is
repeated, the repeat recognises the first one as its own instead of mistaking it for a lost
lease, even once a newer claim has taken the job over.

A dead job is written by one method, :meth:`Ledger.bury`, for every way a job can die.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, NamedTuple, TypeVar

from bson.errors import BSONError
from pymongo import ASCENDING, DESCENDING, DeleteOne, MongoClient, UpdateOne, WriteConcern
from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.errors import (
    BulkWriteError,
    ConnectionFailure,
    DuplicateKeyError,
    OperationFailure,
    PyMongoError,
    ServerSelectionTimeoutError,
    WriteConcernError,
)
from pymongo.monitoring import CommandListener
from pymongo.read_concern import ReadConcern

from ..clock import ServerClock, mongo_time
from ..errors import CommitLost, LeaseLost, LedgerUnavailable, NotApplied, StoreError
from ..locks import ForkSafeLock
from ..reseal import Reseal, Tally, reseal_tree
from ..tracecontext import ledger_operation
from .dead import DeadJob
from .group_commit import MAX_BATCH, GroupCommit, Insert, Outcome, Statement, Write
from .message import KeptMessage
from .record import SCHEMA_VERSION, ErrorEntry, LedgerRecord, State

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
# the sweepers' ``(state, claimable_at)`` index, so the outbox relay's query reads those records
# and nothing else (a backlog of published queued records sits at EPOCH, one second below).
UNPUBLISHED = EPOCH + timedelta(seconds=1)
# The records' indexes of releases before 2026-11-26, retired by Ledger.finish_upgrade.
LEGACY_INDEXES = ("objective", "replacement_due")
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


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Turn pymongo's errors into the platform's: transient ones (and writes whose outcome is
    unknown) into ``LedgerUnavailable``, the rest into ``StoreError``. The commands sent
    inside are ``what`` to tracing (their spans' name)."""
    try:
        with ledger_operation(what):
            yield
    except ServerSelectionTimeoutError as exc:
        raise NotApplied(f"ledger unreachable during {what}: {exc}") from exc
    except ConnectionFailure as exc:
        raise LedgerUnavailable(f"ledger connection failed during {what}: {exc}") from exc
    except (BulkWriteError, DuplicateKeyError):
        raise  # the callers read these as protocol signals
    except WriteConcernError as exc:
        # The write may have applied: the caller treats the outcome as unknown.
        raise LedgerUnavailable(f"write concern not confirmed during {what}: {exc}") from exc
    except OperationFailure as exc:
        if exc.has_error_label("RetryableWriteError") or exc.has_error_label(
            "TransientTransactionError"
        ):
            raise LedgerUnavailable(f"ledger unavailable during {what}: {exc}") from exc
        raise StoreError(f"ledger {what} failed: {exc}") from exc
    except (PyMongoError, BSONError) as exc:  # DocumentTooLarge is a BSON InvalidDocument
        raise StoreError(f"ledger {what} failed: {exc}") from exc


def new_op() -> str:
    """An operation id for a write that ends an attempt (see the module docstring)."""
    return uuid.uuid4().hex[:16]


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


class Ledger:
    """The ledger of one app: a MongoDB collection of :class:`LedgerRecord` documents, plus
    its groups and audit collections (``<collection>_groups``, ``<collection>_audit``).

    Safe to share across threads; a forked process opens its own connection pool.
    ``clock`` (UTC now) is injectable for tests of the protocol.
    """

    def __init__(
        self,
        *,
        uri: str,
        database: str,
        collection: str = "ledger",
        write_concern: str = "majority",
        timeout_ms: int = 5000,
        lease_seconds: float = 60.0,
        result_retention_seconds: int = 7 * 24 * 3600,
        dead_retention_seconds: int = 30 * 24 * 3600,
        error_history_limit: int = 20,
        max_deliveries: int = 5,
        ttl_index: bool = True,
        group_commit_max: int = MAX_BATCH,
        event_listeners: Sequence[CommandListener] = (),
        clock: Callable[[], datetime] | None = None,
        fleet: str | None = None,
    ) -> None:
        self.uri = uri
        # The queue namespace of the workers that run these records' jobs, written on every
        # record a publish or a claim writes: a reconciler or an outbox relay of an earlier
        # release meets records of tasks it does not have during a rolling deploy, and tells
        # its own fleet's (which it republishes for the handoff) from another app's sharing
        # the ledger (which that app's own sweeps handle) by it.
        self.fleet = fleet
        self.database_name = database
        self.collection_name = collection
        self.lease_seconds = lease_seconds
        self.result_retention = timedelta(seconds=result_retention_seconds)
        self.dead_retention = timedelta(seconds=dead_retention_seconds)
        self.error_history_limit = error_history_limit
        self.max_deliveries = max_deliveries
        self.ttl_index = ttl_index
        self._write_concern = WriteConcern(
            w=int(write_concern) if write_concern.isdigit() else write_concern, j=True
        )
        self._timeout_ms = timeout_ms
        self._event_listeners = list(event_listeners)
        # Every time kept on a record (leases, due times, ages, retention) is the server's:
        # one clock for every worker however far their hosts' clocks are apart (clock.py)
        self.clock = ServerClock(
            "ledger", lambda: mongo_time(self.client), resolution_seconds=0.001
        )
        self.now: Callable[[], datetime] = clock or self.clock.now_datetime
        self._fences = _FenceClock(self.now)
        # Opens sealed results (sensitive tasks); the runtime sets it to its Sealer's ``open``.
        self.open_text: Callable[[str], str] = lambda text: text
        self._lock = ForkSafeLock()
        self._pid = -1
        self._client: MongoClient[dict[str, Any]] | None = None
        self._collection: Collection[dict[str, Any]] | None = None
        # Claims and attempt endings of this process's concurrent tasks share bulk writes.
        self.writes = GroupCommit(lambda: self.collection, max_batch=group_commit_max)
        # Once an earlier release's ``objective`` index is seen gone it stays gone (only
        # ``ledger finish-upgrade`` drops it, once no such release runs): the escalation
        # check stops listing the indexes at every pass.
        self._objective_index_gone = False

    # -- connection -------------------------------------------------------------------------

    @property
    def client(self) -> MongoClient[dict[str, Any]]:
        self._connect()
        assert self._client is not None
        return self._client

    @property
    def collection(self) -> Collection[dict[str, Any]]:
        """The records collection (for tests and benchmarks; the platform goes through methods)."""
        self._connect()
        assert self._collection is not None
        return self._collection

    @property
    def write_concern(self) -> WriteConcern:
        """What every write the guarantees depend on waits for (journaled)."""
        return self._write_concern

    def collection_for(
        self, session: ClientSession, suffix: str | None = None
    ) -> Collection[dict[str, Any]]:
        """The records collection (or a companion's: ``<collection>_<suffix>``) on the client
        of ``session`` (an app's own, for a write in its transaction: a session works only with
        the client that started it). That client must reach the ledger's deployment."""
        name = self.collection_name if suffix is None else f"{self.collection_name}_{suffix}"
        return session.client.get_database(self.database_name).get_collection(name)

    def companion(self, suffix: str) -> Collection[dict[str, Any]]:
        """A companion collection of the ledger (``<collection>_<suffix>``: groups, cache,
        audit, objectives, and the stores of the ledger package: workflows, triggers,
        schedules), with the ledger's write concern. For the ``celery_ledger.ledger`` package's
        own stores; the engines go through their methods."""
        return self.collection.database.get_collection(
            f"{self.collection_name}_{suffix}", write_concern=self._write_concern
        )

    def _connect(self) -> None:
        if self._pid == os.getpid() and self._collection is not None:
            return
        with self._lock:
            if self._pid == os.getpid() and self._collection is not None:
                return
            # After a fork the parent's pool is unusable: drop it (not close: it is the parent's).
            self._client = MongoClient(
                self.uri,
                tz_aware=True,
                appname="celery-ledger",
                serverSelectionTimeoutMS=self._timeout_ms,
                connectTimeoutMS=self._timeout_ms,
                socketTimeoutMS=max(self._timeout_ms, 10_000),
                event_listeners=self._event_listeners,
            )
            database = self._client.get_database(self.database_name)
            self._collection = database.get_collection(
                self.collection_name, write_concern=self._write_concern
            )
            self._pid = os.getpid()

    def close(self) -> None:
        with self._lock:
            if self._client is not None and self._pid == os.getpid():
                self._client.close()
            self._client = self._collection = None
            self._pid = -1

    def ping(self) -> None:
        with translate_errors("ping"):
            self.client.admin.command("ping")

    def ensure_indexes(self) -> None:
        """Create the retention index (TTL, or plain for :meth:`expire`) and the sweepers' index.

        Switching ``ttl_index`` drops the other kind first: MongoDB refuses two indexes on
        ``expires_at`` with different options.
        """
        wanted, other = ("retention", "retention_sweep")
        if not self.ttl_index:
            wanted, other = other, wanted
        groups, cache = self.companion("groups"), self.companion("cache")
        with translate_errors("index creation"):
            # A group's members expire with them; a last good result like a result.
            for collection in (self.collection, groups, cache):
                if other in collection.index_information():
                    collection.drop_index(other)
                if self.ttl_index:
                    collection.create_index("expires_at", expireAfterSeconds=0, name=wanted)
                else:
                    collection.create_index("expires_at", name=wanted)
            # Groups saved before they expired: from now on, like a result
            groups.update_many(
                {"expires_at": {"$exists": False}},
                {"$set": {"expires_at": self.now() + self.result_retention}},
            )
            # The records carry two secondary indexes and no more: on the embedded server every
            # write of every job pays for each index, whether or not it changes its key (about
            # 0.1-0.15 ms a write an index, sparse ones on a field no record has too: see
            # ops/bench/indexes.py). Whatever only some jobs need has its own companion
            # collection instead (``_objectives``), or rides this one (degraded results
            # awaiting their replacement: see replacements_due). A ledger made by an earlier
            # release keeps its two sparse indexes until finish_upgrade (LEGACY_INDEXES).
            self.collection.create_index(
                [("state", ASCENDING), ("claimable_at", ASCENDING)], name="state_claimable"
            )
            self._objectives.create_index("slo_at", name="due")
            self._retire_copy_due_index()
        self.ensure_audit_indexes(self.companion("audit"))

    def _retire_copy_due_index(self) -> None:
        """Dead records' pending queue copies had an index of their own (``copy_due_at``);
        ``state_claimable`` finds them now, one index fewer to write on every job. While the
        old index exists (the first start of this release), the records buried before carry
        their due time in ``copy_due_at``: it moves to ``claimable_at``, then the index goes.
        Several workers may do this at once: each move is conditional, a second drop is fine."""
        if "copy_due" not in self.collection.index_information():
            return
        for doc in self.collection.find(
            {"copy_due_at": {"$exists": True}}, {"copy_due_at": 1, "state": 1}
        ):
            update: dict[str, Any] = {"$unset": {"copy_due_at": ""}}
            if doc.get("state") == State.DEAD.value:
                update["$set"] = {"claimable_at": doc["copy_due_at"] + COPY_DUE_SHIFT}
            self.collection.update_one(
                {"_id": doc["_id"], "copy_due_at": doc["copy_due_at"]}, update
            )
        try:
            self.collection.drop_index("copy_due")
        except OperationFailure as exc:
            if exc.code != INDEX_NOT_FOUND:  # another worker dropped it first
                raise

    def legacy_indexes(self) -> list[str]:
        """The records' indexes an earlier release made that this one no longer needs."""
        with translate_errors("index listing"):
            found = [n for n in LEGACY_INDEXES if n in self.collection.index_information()]
        self._objective_index_gone = "objective" not in found
        return found

    def finish_upgrade(self) -> dict[str, int]:
        """Retire the records' sparse ``objective`` and ``replacement_due`` indexes, once no
        worker or producer of a release before 2026-11-26 runs (``ledger finish-upgrade``).

        Such a release writes ``slo_at`` on records without an objective document, and its
        workers read both indexes; so while ``objective`` exists, :meth:`overdue` also reads
        the records on it, and nothing is retired at a worker's start (a rolling deploy runs
        both releases at once). This copies the open objectives to ``_objectives`` and drops
        both indexes; ``replace_due`` needs no copy (a degraded result awaiting its
        replacement has ``claimable_at`` at its replacement time). Idempotent.

        Returns:
            ``{"objectives copied": n, "indexes dropped": n}``.
        """
        copied = dropped = 0
        with translate_errors("upgrade"):
            if "objective" in self.legacy_indexes():
                # Read to the end before anything is dropped (a cursor on a dropped index dies).
                open_ones = list(
                    self.collection.find(
                        {"slo_at": {"$exists": True}}, {"slo_at": 1, "slo_seconds": 1}
                    )
                )
                # Copied writes that raise (not _track_objective's best effort): an index is
                # dropped only once every open objective is in _objectives.
                for start in range(0, len(open_ones), 500):
                    chunk = open_ones[start : start + 500]
                    try:
                        self._objectives.bulk_write(
                            [
                                UpdateOne(
                                    {"_id": doc["_id"]},
                                    _objective_update(doc["slo_at"], doc.get("slo_seconds")),
                                    upsert=True,
                                )
                                for doc in chunk
                            ],
                            ordered=False,
                        )
                    except BulkWriteError as exc:
                        raise StoreError(
                            f"the open objectives could not be copied; nothing dropped: {exc}"
                        ) from exc
                    copied += len(chunk)
            for name in self.legacy_indexes():
                try:
                    self.collection.drop_index(name)
                    dropped += 1
                except OperationFailure as exc:
                    if exc.code != INDEX_NOT_FOUND:  # another run dropped it first
                        raise
        return {"objectives copied": copied, "indexes dropped": dropped}

    @property
    def _objectives(self) -> Collection[dict[str, Any]]:
        """Jobs with a latency objective not yet settled, by when they are due (``slo_at``).

        Only jobs with an objective have a document here, so that the records need no index
        for them (see ensure_indexes). Written after the record that holds the objective
        (``slo_at`` on the record stays the truth: a finish or a late mark removes it there,
        in the write that does it), and removed by :meth:`overdue` once due and settled."""
        return self.companion("objectives")

    def _track_objective(
        self,
        record_id: str,
        objective: Mapping[str, Any] | None,
        *,
        session: ClientSession | None = None,
    ) -> None:
        """Put a job's objective in the escalation's view. Every claim of a job with an
        objective does it, not only the one that made its record, so that a write whose
        outcome was lost (the record's, or this one) is made good by the next attempt. The
        earliest objective stands (``$min``): a later call computing a later one (a message
        without its publish time) never pushes a stuck job out of the checks' view, and
        :meth:`overdue` moves an objective forward to its record's own when that is later (an
        id used anew). Outside a transaction it does not raise: the record was written and the
        caller must not see it fail (a claim that raised would be put off though it holds its
        lease); the next claim, or the attempt that finishes the job late, covers for it."""
        if not objective or objective.get("slo_at") is None:
            return  # the job has no objective
        update = _objective_update(objective["slo_at"], objective.get("slo_seconds"))
        if session is not None:
            objectives = self.collection_for(session, "objectives")
            objectives.update_one({"_id": record_id}, update, upsert=True, session=session)
            return
        for _ in range(2):  # two upserts of a missing document at once: one loses, then matches
            try:
                with translate_errors("objective"):
                    self._objectives.update_one({"_id": record_id}, update, upsert=True)
                return
            except DuplicateKeyError:
                continue
            except StoreError as exc:
                logger.error(
                    "the latency objective of %s is not tracked (%s): until its next claim,"
                    " only the attempt that finishes it reports it late",
                    record_id,
                    exc,
                )
                return
        logger.error("the latency objective of %s is not tracked (a write race)", record_id)

    @staticmethod
    def ensure_audit_indexes(audit: Collection[dict[str, Any]], *, strict: bool = False) -> None:
        """The audit trail's indexes: one outcome per action (a unique index on ``of``, which
        actions leave out), and its time. Where the app's role may not create indexes on the
        trail (``ledger.access``: a TTL index would delete it), the provisioning step made
        them with the administrator's connection, and this is a no-op; ``strict`` (that
        step): it is not.

        Raises:
            StoreError: the indexes could not be made (the trail holds two outcomes of one
                action, or, with ``strict``, this connection may not create indexes).
        """
        try:
            with translate_errors("audit index creation"):
                for name, keys, options in AUDIT_INDEXES:
                    audit.create_index(keys, name=name, **options)
        except DuplicateKeyError as exc:
            raise StoreError(
                "the audit trail holds two outcomes of one action (a second writer's): its"
                f" one-outcome index cannot be made until an operator reviews them: {exc}"
            ) from exc
        except StoreError as exc:
            unauthorized = isinstance(exc.__cause__, OperationFailure) and exc.__cause__.code == 13
            if strict or not unauthorized:
                raise

    def expire(self) -> int:
        """Delete records past their ``expires_at`` (what the TTL index does when it is on).

        One indexed range delete. SecantusDB's TTL sweeper instead reads the whole collection
        under its global lock, stalling every write for seconds per 100k records.
        """
        past = {"expires_at": {"$lt": self.now()}}
        with translate_errors("expiry"):
            self.companion("groups").delete_many(past)
            self.companion("cache").delete_many(past)
            return self.collection.delete_many(past).deleted_count

    # -- reads ------------------------------------------------------------------------------

    def get(self, task_name: str, key: str) -> LedgerRecord | None:
        """The record of job ``(task_name, key)``, or ``None`` if the ledger has none."""
        from ..keys import derive_task_id

        return self.get_by_id(derive_task_id(task_name, key))

    def get_by_id(self, record_id: str) -> LedgerRecord | None:
        """The record with this id, or the one it is an alias of (a message id)."""
        doc = self.resolve(record_id)
        if doc is None:
            return None
        if isinstance(doc.get("result"), str):
            doc["result"] = self.open_text(doc["result"])
        return LedgerRecord.model_validate(doc)

    def find_raw(self, record_id: str) -> dict[str, Any] | None:
        """The stored document with this ``_id`` as it is (an alias document stays one)."""
        with translate_errors("read"):
            return self.collection.find_one({"_id": record_id})

    def resolve(self, ident: str) -> dict[str, Any] | None:
        """The record named by ``ident``: its own id, or an alias of it (one more read)."""
        doc = self.find_raw(ident)
        if doc is not None and isinstance(doc.get("alias_of"), str) and "state" not in doc:
            return self.find_raw(doc["alias_of"])
        return doc

    def load_progress(self, record_id: str) -> dict[str, Any]:
        """The record's checkpoint, completed steps and artefacts (one read)."""
        with translate_errors("progress read"):
            doc = self.collection.find_one(
                {"_id": record_id}, {"checkpoint": 1, "steps": 1, "artefacts": 1}
            )
        return doc or {}

    # -- the claim protocol -----------------------------------------------------------------

    def claim(
        self,
        record_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        owner: str,
        lease_seconds: float | None = None,
        message: KeptMessage | None = None,
        max_attempts: int | None = None,
        alias: str | None = None,
        slo_at: datetime | None = None,
        slo_seconds: float | None = None,
        new: bool = False,
        handed_back: int = 0,
    ) -> Claim:
        """Try to take the exclusive lease on a record (creating it if needed). See module doc.

        ``message`` is kept on the record so that the reconciler can republish a job whose
        message is gone; ``max_attempts`` is the job's attempts budget; ``alias`` the message's
        own id when it is not ``record_id``; ``slo_at`` when a new record's job is late (its
        latency objective from its enqueue time). ``new``: the message says no record was
        written for the job (its first publish): the claim is tried as an insert first. A
        hint only: wrong, it costs up to two writes and claims the same. ``handed_back``: how
        many earlier deliveries of the job were handed back alive while the ledger could not
        record it (the message says so): not counted as lost workers by the poison check.

        Raises:
            LedgerUnavailable: unreachable, or the claim's outcome is unknown (the caller puts
                the delivery off; a claim that did apply holds its lease until it ends).
        """
        lease = timedelta(seconds=lease_seconds or self.lease_seconds)
        at_least = 0
        for turn in range(5):
            now = self.now()
            fence = self._fences.next(at_least)
            outcome = self._try_claim(
                record_id,
                fence,
                now,
                now + lease,
                insert=new and turn == 0,
                task=task,
                key=key,
                tier=tier,
                owner=owner,
                message=message,
                max_attempts=max_attempts,
                alias=alias,
                slo_at=slo_at,
                slo_seconds=slo_seconds,
                handed_back=handed_back,
            )
            if outcome is not None:
                return outcome
            doc = self.find_raw(record_id)  # the rare path: why was it not claimable?
            if doc is None:
                continue  # expired between the two calls: claim afresh
            if (
                doc.get("fence") == fence
                and doc.get("lease_owner") == owner
                and doc.get("state") == State.RUNNING.value
            ):
                # Our own claim, applied by a bulk write whose outcome we did not learn and
                # sent again (see GroupCommit): fences are unique, so the lease is ours.
                self._track_objective(record_id, {"slo_at": slo_at, "slo_seconds": slo_seconds})
                return Claim(ClaimOutcome.CLAIMED, fence=fence)
            if doc.get("task") != task or doc.get("key") != key:
                return Claim(ClaimOutcome.CONFLICT)
            state = doc.get("state")
            claimable_at: datetime = doc.get("claimable_at") or EPOCH
            if state == State.SUCCEEDED:
                if _replacement_pending(doc):
                    if claimable_at > self.now():  # early: back when it is due
                        return Claim(ClaimOutcome.BUSY, retry_at=claimable_at)
                    at_least = int(doc.get("fence", 0)) + 1  # due: claim it (a lagging clock)
                continue  # it finished between our two calls: the next claim counts the duplicate
            if state == State.DEAD:
                return Claim(ClaimOutcome.DEAD)
            if claimable_at > self.now():
                return Claim(ClaimOutcome.BUSY, retry_at=claimable_at)
            verdict = self._out_of_budget(
                doc, task=task, max_attempts=max_attempts, handed_back=handed_back
            )
            if verdict is not None:
                if self.bury(
                    record_id,
                    verdict,
                    # A holder's heartbeat since the read renews the lease: then it stands.
                    match=Unchanged(int(doc.get("fence", 0)), str(state), claimable_at),
                    task=task,
                    key=key,
                    tier=tier,
                ):
                    return Claim(ClaimOutcome.DEAD, killed=True)
                continue  # the record moved on under us: decide again
            at_least = int(doc.get("fence", 0)) + 1  # our clock lags the last claimer's
        raise NotApplied(f"could not claim {record_id}: the record keeps changing under us")

    def _out_of_budget(
        self, doc: Mapping[str, Any], *, task: str, max_attempts: int | None, handed_back: int
    ) -> DeadJob | None:
        """Why a claimable record must not be claimed again (poison, attempts budget)."""
        message = KeptMessage.from_document(doc.get("message"))
        inflight = int(doc.get("inflight", 0))
        if inflight >= self.max_deliveries + handed_back:
            return DeadJob.of_reason(
                "poison",
                f"poison: delivered {inflight - handed_back} times without an outcome"
                " (the worker was lost each time)",
                task=task,
                message=message,
            )
        if max_attempts is not None and int(doc.get("attempts", 0)) >= max_attempts:
            return DeadJob.of_reason(
                "retired",
                f"attempts budget exhausted ({doc.get('attempts')} attempts)",
                task=task,
                message=message,
            )
        return None

    def _try_claim(
        self,
        record_id: str,
        fence: int,
        now: datetime,
        lease_until: datetime,
        *,
        insert: bool = False,
        task: str,
        key: str,
        tier: str,
        owner: str,
        message: KeptMessage | None,
        max_attempts: int | None,
        alias: str | None,
        slo_at: datetime | None = None,
        slo_seconds: float | None = None,
        handed_back: int = 0,
    ) -> Claim | None:
        """One claim write (``insert``: as a new record's insert first; see the module doc),
        and the duplicate marker when it did not apply; None when only a read can say why."""
        claim_filter: dict[str, Any] = {
            "_id": record_id,
            "task": task,
            "key": key,
            "claimable_at": {"$lte": now},
            # A dead record's claimable_at is its queue copy's due time (see bury): never a claim.
            "state": {"$ne": State.DEAD.value},
            "fence": {"$lt": fence},
            "inflight": {"$lt": self.max_deliveries + handed_back},
        }
        if max_attempts is not None:
            claim_filter["attempts"] = {"$lt": max_attempts}
        claim_filter = _on_one_record(claim_filter)
        fields: dict[str, Any] = {
            "v": SCHEMA_VERSION,
            "tier": tier,
            "state": State.RUNNING.value,
            "fence": fence,
            "lease_owner": owner,
            "lease_expires_at": lease_until,
            "claimable_at": lease_until,
            "started_at": now,
            "updated_at": now,
        }
        if message is not None:
            fields["message"] = message.document()
        if self.fleet is not None:
            fields["fleet"] = self.fleet
        on_insert: dict[str, Any] = {"created_at": now}
        if slo_at is not None:  # a job's objective, from its publish (see escalation.py)
            on_insert |= {"slo_at": slo_at, "slo_seconds": slo_seconds}
        update = {
            "$set": fields,
            "$inc": {"attempts": 1, "inflight": 1},
            "$setOnInsert": on_insert,
            "$unset": {"unpublished_at": ""},
        }
        first: Write = Statement(claim_filter, update, upsert=True)
        if insert:
            # The record the upsert makes of a missing one: the filter's equalities, the update.
            first = Insert(
                {"_id": record_id, "task": task, "key": key, **fields}
                | {"attempts": 1, "inflight": 1, **on_insert}
            )
        ops = [first]
        if alias is not None:
            ops.append(
                Statement(
                    {"_id": alias},
                    {"$setOnInsert": self._alias(record_id, task, key, now)},
                    upsert=True,
                )
            )
        claim = self._write_claim(record_id, ops)
        if claim.error is not None:
            # Not claimable. A duplicate of a finished job is the common reason: count it
            # (the marker modifies the record iff it succeeded); anything else needs a read.
            # A degraded result awaiting its replacement is not a duplicate's: read it.
            with translate_errors("claim"):
                marked = self.collection.update_one(
                    _on_one_record(
                        {
                            "_id": record_id,
                            "task": task,
                            "key": key,
                            "state": State.SUCCEEDED.value,
                            "degraded.replace_at": None,
                        }
                    ),
                    {"$inc": {"duplicates": 1}, "$set": {"last_duplicate_at": now}},
                )
            if marked.modified_count == 1:
                return Claim(ClaimOutcome.DUPLICATE)
            if not insert:
                return None
            # A record exists that no success marks (queued, retrying, held, dead, or this
            # claim's own insert applied by a write sent again): the conditional claim decides.
            # Its marker is not sent twice: a job that ended meanwhile is read, then counted.
            claim = self._write_claim(record_id, [Statement(claim_filter, update, upsert=True)])
            if claim.error is not None:
                return None
        self._track_objective(record_id, {"slo_at": slo_at, "slo_seconds": slo_seconds})
        return Claim(ClaimOutcome.CLAIMED, fence=fence, created=claim.upserted)

    def _write_claim(self, record_id: str, ops: list[Write]) -> Outcome:
        """Send a claim's statements (the claim first, an alias after it); the claim's outcome.
        Only the claim may fail, and only on a duplicate key (the record is not claimable)."""
        with translate_errors("claim"):
            claim, *others = self.writes.write(ops)
        errors = [o.error for o in (claim, *others) if o.error is not None]
        if any(e is not claim.error or e.get("code") != DUPLICATE_KEY for e in errors):
            raise StoreError(f"ledger claim of {record_id} failed: {errors}")
        return claim

    # -- outcomes of an attempt (fenced; each recognises its own applied write) --------------

    def complete(
        self,
        record_id: str,
        fence: int,
        result_json: str,
        *,
        op: str,
        atomic_steps: Sequence[str] = (),
        degraded: Mapping[str, Any] | None = None,
        replace_at: datetime | None = None,
    ) -> None:
        """Store the result and mark the record succeeded, if ``fence`` still holds the lease
        and the record still has ``atomic_steps`` (the steps this attempt's result relies on).

        ``degraded``: the result is a fallback's (its trigger and option, kept on the record).
        With ``replace_at`` the record becomes claimable again then, so the real job runs under
        the same key; until a claim takes it, deliveries are suppressed duplicates as for any
        success. A result that is not degraded moves an earlier ``degraded`` to
        ``replaced_degraded``: the real result replaced it (fencing makes that happen once).

        Raises:
            LeaseLost: a newer claim took the job over.
            CommitLost: the record lost one of ``atomic_steps``; nothing was written.
        """
        now = self.now()
        fields: dict[str, Any] = {
            "state": State.SUCCEEDED.value,
            "result": result_json,
            **self._ended(now, FOREVER),
            "finished_at": now,
            "expires_at": now + self.result_retention,
        }
        unset = {"slo_at": "", "replace_due": ""}
        update: dict[str, Any] = {"$set": fields, "$unset": unset}
        if degraded is not None:
            fields["degraded"] = {**degraded, "at": now, "replace_at": replace_at}
            if replace_at is not None:
                # Its replacement is a fresh run: a budget of attempts spent getting here
                # (max_attempts) must not stop it. ``replace_due`` puts it in the reconciler's
                # view (a sparse index: a query on the state of successes would read them all).
                fields |= {"claimable_at": replace_at, "attempts": 0, "replace_due": replace_at}
                del unset["replace_due"]
        else:
            # Renaming a field the record does not have changes nothing: one write either way.
            update["$rename"] = {"degraded": "replaced_degraded"}
        self._end_attempt(record_id, fence, op, update, "completion", atomic_steps=atomic_steps)

    def keep_degraded(
        self, record_id: str, fence: int, error: ErrorEntry | None, *, op: str, reason: str
    ) -> None:
        """End a replacement attempt that failed for good: the degraded result stands (the
        record is ``succeeded`` again, not claimable), with the error in its history."""
        now = self.now()
        update: dict[str, Any] = {
            "$set": {
                "state": State.SUCCEEDED.value,
                **self._ended(now, FOREVER),
                "degraded.replace_at": None,
                "degraded.replacement_failed": reason[:2000],
            },
            "$unset": {"replace_due": ""},
        }
        if error is not None:
            update["$push"] = {
                "errors": {"$each": [error.model_dump()], "$slice": -self.error_history_limit}
            }
        self._end_attempt(record_id, fence, op, update, "degraded record")

    # -- fallbacks' last good results -----------------------------------------------------

    def remember(self, task: str, cache_key: str, result_json: str) -> None:
        """Keep ``result_json`` as the last good result of ``task`` for ``cache_key`` (an older
        one never overwrites a newer: the write matches only an older entry, or inserts)."""
        now = self.now()
        cache = self.companion("cache")
        with translate_errors("cache write"), contextlib.suppress(DuplicateKeyError):
            cache.update_one(
                {"_id": _cache_id(task, cache_key), "at": {"$lt": now}},
                {
                    "$set": {
                        "task": task,
                        "result": result_json,
                        "at": now,
                        "expires_at": now + max(self.result_retention, CACHE_RETENTION),
                    }
                },
                upsert=True,
            )

    def last_good(self, task: str, cache_key: str) -> tuple[str, datetime] | None:
        """The last good result of ``task`` for ``cache_key`` (stored JSON, when), or None."""
        with translate_errors("cache read"):
            doc = self.companion("cache").find_one({"_id": _cache_id(task, cache_key)})
        if doc is None or not isinstance(doc.get("result"), str):
            return None
        at = doc["at"] if doc["at"].tzinfo else doc["at"].replace(tzinfo=UTC)
        return doc["result"], at

    # -- latency objectives -----------------------------------------------------------------

    def overdue(self, *, limit: int = 200) -> list[dict[str, Any]]:
        """Records past their latency objective (``slo_at``) not yet reported late.

        Reads the due objectives (``_objectives``) a page at a time and the records they name;
        an objective whose record no longer has ``slo_at`` (the job finished, or was reported)
        or no longer exists is settled and removed here, in the same pass, so that settled
        objectives never pile up ahead of open ones however many jobs finish in time. While an
        earlier release's ``objective`` index exists (see :meth:`finish_upgrade`), the records
        due on it are read too: that release's writers track no objective."""
        fields = dict.fromkeys(
            ("task", "key", "tier", "state", "slo_at", "slo_seconds", "created_at"), 1
        )
        now = self.now()
        found: dict[Any, dict[str, Any]] = {}
        with translate_errors("escalation query"):
            if not self._objective_index_gone and "objective" in self.legacy_indexes():
                for doc in self.collection.find({"slo_at": {"$lte": now}}, fields).limit(limit):
                    found[doc["_id"]] = doc
            while len(found) < limit:
                query: dict[str, Any] = {"slo_at": {"$lte": now}}
                if found:  # open ones stay due: a second page must not read them again
                    query["_id"] = {"$nin": list(found)}
                due = {
                    d["_id"]: d["slo_at"]
                    for d in self._objectives.find(query, {"slo_at": 1})
                    .sort("slo_at", ASCENDING)
                    .limit(OBJECTIVE_PAGE)
                }
                if not due:
                    break
                records = {
                    d["_id"]: d for d in self.collection.find({"_id": {"$in": list(due)}}, fields)
                }
                settled: list[DeleteOne] = []
                for record_id, tracked_at in due.items():
                    record = records.get(record_id)
                    slo_at = record.get("slo_at") if record else None
                    if record is None or slo_at is None:
                        # Filtered on what was read: an objective tracked anew since (the same
                        # id used again) stays.
                        settled.append(DeleteOne({"_id": record_id, "slo_at": tracked_at}))
                    elif slo_at > now:  # tracked ahead of the record's own: follow the record
                        self._objectives.update_one(
                            {"_id": record_id}, {"$set": {"slo_at": slo_at}}
                        )
                    else:
                        found[record_id] = record
                if settled:
                    try:
                        self._objectives.bulk_write(settled, ordered=False)
                    except BulkWriteError as exc:
                        raise StoreError(f"settled objectives not removed: {exc}") from exc
                if len(due) < OBJECTIVE_PAGE or not settled:
                    break  # every due objective read, or what is left is open
        return list(found.values())[:limit]

    def mark_late(self, record_id: str, *, slo_seconds: float | None = None) -> bool:
        """Mark a job late, once: True only for the call that marked it (so it is reported
        once whoever notices it: any worker's sweep, or the attempt that finished it)."""
        now = self.now()
        fields: dict[str, Any] = {"late_at": now}
        if slo_seconds is not None:
            fields["slo_seconds"] = slo_seconds
        with translate_errors("late mark"):
            marked = self.collection.update_one(
                {"_id": record_id, "late_at": {"$exists": False}},
                {"$set": fields, "$unset": {"slo_at": ""}},
            )
        return marked.modified_count == 1

    def forget_objective(self, record_id: str) -> None:
        """A finished job found past its objective is not late (it finished in time, or it
        is dead, which is reported as such): drop it from the escalation's view."""
        with translate_errors("late mark"):
            self.collection.update_one({"_id": record_id}, {"$unset": {"slo_at": ""}})

    def finish_without_result(
        self,
        record_id: str,
        fence: int,
        *,
        outcome: str,
        note: str,
        op: str,
        replaced_by: str | None = None,
        atomic_steps: Sequence[str] = (),
    ) -> None:
        """Mark the job finished by its body's own say (``ignored``, ``replaced``): terminal
        like a success, without a result of its own (``atomic_steps`` as for :meth:`complete`)."""
        now = self.now()
        fields: dict[str, Any] = {
            "state": State.SUCCEEDED.value,
            "outcome": outcome,
            "note": note[:2000],
            **self._ended(now, FOREVER),
            "finished_at": now,
            "expires_at": now + self.result_retention,
        }
        if replaced_by is not None:
            fields["replaced_by"] = replaced_by
        self._end_attempt(
            record_id, fence, op, {"$set": fields}, "finish", atomic_steps=atomic_steps
        )

    def record_retry(
        self,
        record_id: str,
        fence: int,
        error: ErrorEntry,
        *,
        retry_at: datetime,
        op: str,
        traceback: str = "",
        retries: int | None = None,
        previous_delay: float | None = None,
    ) -> None:
        """Append ``error`` to the history and mark the record ``retrying`` (claimable at once:
        the retry message is the timer, and an early delivery that claims first is as good).

        ``retries`` and ``previous_delay`` update the kept message's headers, so a republish
        by the reconciler continues the retry budget instead of restarting it.
        """
        now = self.now()
        fields: dict[str, Any] = {
            "state": State.RETRYING.value,
            **self._ended(now, now),
            "next_attempt_at": retry_at,
            "traceback": traceback[-8000:],
        }
        if retries is not None:
            fields["message.headers.retries"] = retries
        if previous_delay is not None:
            fields["message.headers.ledger_previous_delay"] = previous_delay
        update = {
            "$set": fields,
            "$push": {
                "errors": {"$each": [error.model_dump()], "$slice": -self.error_history_limit}
            },
        }
        self._end_attempt(record_id, fence, op, update, "retry record")

    def release(self, record_id: str, fence: int, *, op: str, refund_attempt: bool = False) -> None:
        """Give a claim back without an outcome (the message goes back to the queue);
        ``refund_attempt``: the claim did not count as an attempt (nothing was run)."""
        now = self.now()
        update: dict[str, Any] = {"$set": {"state": State.QUEUED.value, **self._ended(now, now)}}
        if refund_attempt:
            update["$inc"] = {"attempts": -1}
        self._end_attempt(record_id, fence, op, update, "release")

    def _ended(self, now: datetime, claimable_at: datetime) -> dict[str, Any]:
        """The fields that end the current holder's lease."""
        return {
            "claimable_at": claimable_at,
            "updated_at": now,
            "lease_owner": None,
            "lease_expires_at": None,
            "inflight": 0,
        }

    def _end_attempt(
        self,
        record_id: str,
        fence: int,
        op: str,
        update: dict[str, Any],
        what: str,
        *,
        atomic_steps: Sequence[str] = (),
    ) -> None:
        # The last few operation ids: a repeat recognises its write even after a newer claim
        # took the job over (then the repeat has nothing more to do).
        update.setdefault("$push", {})["ops"] = {"$each": [op], "$slice": -RECENT_OPS}
        match: dict[str, Any] = {"_id": record_id, "fence": fence, "state": State.RUNNING.value}
        # A success must not outlive the atomic steps it relies on: a server that acknowledged
        # their transaction and then lost it in a crash would otherwise keep the outcome and
        # not the effect (measured on the embedded server without --sync-on-commit).
        match.update({f"steps.{name}": {"$exists": True} for name in atomic_steps})
        with translate_errors(what):
            (outcome,) = self.writes.write([Statement(_on_one_record(match), update)])
        if outcome.error is not None:
            raise StoreError(f"ledger {what} of {record_id} failed: {outcome.error}")
        if outcome.matched or self._applied(record_id, fence, op, what):
            return
        if atomic_steps:
            with translate_errors(what):
                doc = self.collection.find_one(
                    {"_id": record_id}, {"fence": 1, "state": 1, "steps": 1}
                )
            if doc and doc.get("fence") == fence and doc.get("state") == State.RUNNING.value:
                saved = doc.get("steps") or {}
                missing = tuple(name for name in atomic_steps if name not in saved)
                if missing:
                    raise CommitLost(record_id, missing)
        raise LeaseLost(record_id, fence)

    def _applied(self, record_id: str, fence: int, op: str, what: str) -> bool:
        """Whether write ``op`` already applied (a repeat after a lost reply): the rare path."""
        with translate_errors(what):
            return self.collection.find_one({"_id": record_id, "ops": op}) is not None

    # -- the one dead write ---------------------------------------------------------------------

    def bury(
        self,
        record_id: str,
        dead: DeadJob,
        *,
        match: BuryMatch,
        task: str,
        key: str,
        tier: str,
    ) -> bool:
        """Record the job dead with ``dead``'s reason, fingerprint, kept message and error.

        ``match`` says when the write applies: the holder ending its attempt (:class:`Fenced`),
        the worker that held it (:class:`HeldBy`), the record as a claim read it
        (:class:`Unchanged`), or a job nobody runs (:class:`Unclaimed`). True if this call made
        the record dead; False if it did not apply (the record moved on, belongs to a live job,
        or was already dead), in which case an :class:`Unclaimed` write notes the event on it.

        Raises:
            LeaseLost: a :class:`Fenced` write whose lease was taken over.
        """
        now = self.now()
        fields = {
            "state": State.DEAD.value,
            # On a dead record, when its queue copy falls due (see COPY_DUE_SHIFT): the
            # state-and-time index finds due copies without an index of their own.
            **self._ended(now, now + COPY_GRACE + COPY_DUE_SHIFT),
            "finished_at": now,
            "expires_at": now + self.dead_retention,
            **dead.fields(),
        }
        push = (
            {"errors": {"$each": [dead.error.model_dump()], "$slice": -self.error_history_limit}}
            if dead.error is not None
            else None
        )
        if isinstance(match, Fenced):
            update: dict[str, Any] = {"$set": fields}
            if push:
                update["$push"] = push
            self._end_attempt(record_id, match.fence, match.op, update, "dead record")
            return True
        if isinstance(match, HeldBy | Unchanged):
            flt: dict[str, Any] = {"_id": record_id}
            if isinstance(match, HeldBy):
                flt |= {"state": State.RUNNING.value, "lease_owner": match.owner}
            else:
                flt |= {"fence": match.fence, "state": match.state}
                if match.claimable_at is not None:
                    flt["claimable_at"] = match.claimable_at
            update = {"$set": fields}
            if push:
                update["$push"] = push
            with translate_errors("dead record"):
                return self.collection.update_one(_on_one_record(flt), update).matched_count == 1
        return self._bury_unclaimed(record_id, fields, push, match, task, key, tier, now, dead)

    def _bury_unclaimed(
        self,
        record_id: str,
        fields: dict[str, Any],
        push: dict[str, Any] | None,
        match: Unclaimed,
        task: str,
        key: str,
        tier: str,
        now: datetime,
        dead: DeadJob,
    ) -> bool:
        with translate_errors("dead record"):
            if match.kill_waiting:
                waiting = self.collection.update_one(
                    {
                        "_id": record_id,
                        "task": task,
                        "key": key,
                        "state": {"$in": [State.QUEUED.value, State.RETRYING.value]},
                        "degraded": None,  # a degraded result waiting for its replacement
                    },
                    {"$set": fields, **({"$push": push} if push else {})},
                )
                if waiting.matched_count == 1:
                    return True
            document = {
                "v": SCHEMA_VERSION,
                "task": task,
                "key": key,
                "tier": tier,
                "attempts": 0,
                "fence": 0,
                "created_at": now,
                "errors": [dead.error.model_dump()] if dead.error is not None else [],
                **fields,
            }
            inserted = self.collection.update_one(
                {"_id": record_id}, {"$setOnInsert": document}, upsert=True
            )
            if inserted.upserted_id is not None:
                return True
            # The job has a record already (it ran or runs): this copy only notes it there.
            self.collection.update_one(
                {"_id": record_id, "state": {"$ne": State.DEAD.value}},
                {
                    "$inc": {"quarantined": 1},
                    "$set": {"last_quarantined": {"reason": dead.reason, "at": now}},
                },
            )
        return False

    def alias(self, alias: str, *, record_id: str, task: str, key: str) -> None:
        """Record that message id ``alias`` names job ``record_id`` (a claim does this in its
        own round trip; this is for the paths that never claim, such as a poison message)."""
        now = self.now()
        with translate_errors("alias"):
            self.collection.update_one(
                {"_id": alias},
                {"$setOnInsert": self._alias(record_id, task, key, now)},
                upsert=True,
            )

    def _alias(self, record_id: str, task: str, key: str, now: datetime) -> dict[str, Any]:
        """An alias document: another id (a canvas member's frozen task id) naming a job."""
        return {
            "alias_of": record_id,
            "task": task,
            "key": key,
            "created_at": now,
            "expires_at": now + self.dead_retention,
        }

    # -- long-lived jobs: heartbeats, progress -------------------------------------------------

    def heartbeat(self, record_id: str, fence: int, lease_seconds: float | None = None) -> datetime:
        """Extend the lease held with ``fence``; returns the new expiry (LeaseLost if taken)."""
        until = self.now() + timedelta(seconds=lease_seconds or self.lease_seconds)
        self._fenced_update(
            record_id,
            fence,
            {"$set": {"lease_expires_at": until, "claimable_at": until}},
            "heartbeat",
        )
        return until

    def save_checkpoint(
        self,
        record_id: str,
        fence: int,
        state: dict[str, Any] | str,
        lease_seconds: float | None = None,
    ) -> None:
        """Store progress (and extend the lease: a checkpoint is a sign of life); ``state`` is
        a document, or a sensitive task's sealed text."""
        now = self.now()
        until = now + timedelta(seconds=lease_seconds or self.lease_seconds)
        self._fenced_update(
            record_id,
            fence,
            {
                "$set": {
                    "checkpoint": state,
                    "checkpoint_at": now,
                    "lease_expires_at": until,
                    "claimable_at": until,
                }
            },
            "checkpoint",
        )

    def save_step(
        self, record_id: str, fence: int, name: str, result_json: str, *, skipped: str = ""
    ) -> None:
        """Record step ``name`` with its result, or (``skipped``: why) as an optional step that
        was skipped with ``result_json`` as its result."""
        step: dict[str, Any] = {"result": result_json, "at": self.now()}
        if skipped:
            step["skipped"] = skipped
        self._fenced_update(record_id, fence, {"$set": {f"steps.{name}": step}}, "step record")

    def add_artefact(self, record_id: str, fence: int, path: str) -> None:
        self._fenced_update(record_id, fence, {"$addToSet": {"artefacts": path}}, "artefact")

    def _fenced_update(self, record_id: str, fence: int, update: dict[str, Any], what: str) -> None:
        """A write of the holder of ``fence`` that leaves the record running (repeatable)."""
        with translate_errors(what):
            result = self.collection.update_one(
                _on_one_record({"_id": record_id, "fence": fence, "state": State.RUNNING.value}),
                update,
            )
        if result.matched_count == 0:
            raise LeaseLost(record_id, fence)

    def run_transaction(self, callback: Callable[[ClientSession], T]) -> T:
        """Run ``callback(session)`` in one MongoDB transaction on the ledger's deployment.

        pymongo's ``with_transaction`` retries the callback on transient errors (write
        conflicts, elections) and the commit on an unknown result. An unreachable ledger raises
        ``LedgerUnavailable``; anything else the callback raises propagates as raised.
        """
        try:
            with self.client.start_session() as session:
                return session.with_transaction(
                    callback,
                    read_concern=ReadConcern("majority"),
                    write_concern=self._write_concern,
                )
        except (ConnectionFailure, WriteConcernError) as exc:
            raise LedgerUnavailable(f"ledger unavailable during a transaction: {exc}") from exc

    def reap_abandoned_transactions(self) -> None:
        """Let the server abort transactions whose client died (a worker killed inside an
        atomic step), so that the job's record is not locked for good.

        MongoDB aborts a transaction idle past ``transactionLifetimeLimitSeconds`` (60 s) in the
        background. SecantusDB, the embedded ledger, does the same only when its transaction
        registry is next used: until another transaction runs, every write to the abandoned
        transaction's documents blocks (measured). An empty transaction that reads nothing and
        aborts is that use; each worker's housekeeping runs one every half minute.
        """
        with translate_errors("transaction reaping"), self.client.start_session() as session:
            session.start_transaction()
            try:
                self.collection.find_one({"_id": "celery-ledger:reap"}, session=session)
            finally:
                session.abort_transaction()

    def save_step_in(
        self, session: ClientSession, record_id: str, fence: int, name: str, result_json: str
    ) -> bool:
        """In ``session``'s transaction: record step ``name`` under ``fence``.

        False if the fence no longer holds or the step is already recorded (the caller aborts).
        """
        result = self.collection.update_one(
            _on_one_record(
                {
                    "_id": record_id,
                    "fence": fence,
                    "state": State.RUNNING.value,
                    f"steps.{name}": {"$exists": False},
                }
            ),
            {"$set": {f"steps.{name}": {"result": result_json, "at": self.now(), "atomic": True}}},
            session=session,
        )
        return result.matched_count == 1

    # -- publish side -----------------------------------------------------------------------

    def enqueue(
        self,
        record_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        message: KeptMessage,
        objective: Mapping[str, Any] | None = None,
        session: ClientSession | None = None,
        claimable_at: datetime | None = None,
    ) -> EnqueueOutcome:
        """Write a ``queued`` record unless the job is known (one round trip).

        ``claimable_at``: a job published for later, claimable when it is due (an early
        message is told to come back then, and the reconciler looks for its message only once
        it is due and stale).

        ``message`` lets the reconciler republish the job if its message is lost before the
        first claim. A known job whose first publish failed (:meth:`mark_unpublished`) says so,
        so that the caller publishes it after all.

        ``session``: in that session's transaction (the app's own: an outbox write), on the
        session's client, which must reach the ledger's deployment. The record is written
        unpublished (``UNPUBLISHED``): it exists only if the transaction commits, and then
        whoever publishes it (the committing process, or the relay) marks it published.
        """
        now = self.now()
        fields = _queued(task=task, key=key, tier=tier, now=now, fleet=self.fleet)
        fields["message"] = message.document()
        fields.update(objective or {})
        if claimable_at is not None:
            fields["claimable_at"] = claimable_at
        collection = self.collection
        if session is not None:
            fields |= {"claimable_at": UNPUBLISHED, "unpublished_at": now, "outbox": True}
            collection = self.collection_for(session)
        ops = [
            UpdateOne({"_id": record_id}, {"$setOnInsert": fields}, upsert=True),
            UpdateOne(
                {"_id": record_id, "state": State.QUEUED.value, "unpublished_at": {"$ne": None}},
                {"$set": {"publish_retried_at": now}},
            ),
        ]
        if session is not None:
            # pymongo's own errors, untranslated: the app's ``with_transaction`` retries the
            # whole transaction on those labelled transient (a write conflict, an election).
            # A known job is left as it is: if its publish failed, the relay already has it.
            inserted = collection.update_one(
                {"_id": record_id}, {"$setOnInsert": fields}, upsert=True, session=session
            )
            if inserted.upserted_id is None:
                return EnqueueOutcome.KNOWN
            self._track_objective(record_id, objective, session=session)
            return EnqueueOutcome.NEW
        else:
            with translate_errors("enqueue"):
                try:
                    result = collection.bulk_write(ops, ordered=False)
                except BulkWriteError as exc:
                    if exc.details.get("writeConcernErrors"):
                        raise LedgerUnavailable(f"enqueue of {record_id}: outcome unknown") from exc
                    raise StoreError(f"enqueue of {record_id} failed: {exc.details}") from exc
        outcome = (
            EnqueueOutcome.NEW
            if result.upserted_count
            else EnqueueOutcome.UNPUBLISHED
            if result.modified_count
            else EnqueueOutcome.KNOWN
        )
        # A known job's duplicate publish writes nothing more: its claims track it.
        if outcome is not EnqueueOutcome.KNOWN:
            self._track_objective(record_id, objective)
        return outcome

    def mark_unpublished(self, record_id: str, *, later: bool = False) -> None:
        """The publish after :meth:`enqueue` failed: keep the record (another producer may have
        skipped its own publish because of it) and make it due for the outbox relay (and the
        reconciler) now. ``later``: a job for later, which stays claimable from its due time
        (the reconciler's, then); either way the next :meth:`enqueue` of it says
        ``UNPUBLISHED``, so a publish tried again goes out."""
        fields: dict[str, Any] = {"unpublished_at": self.now(), "updated_at": EPOCH}
        if not later:
            fields["claimable_at"] = UNPUBLISHED
        with translate_errors("unpublished mark"):
            self.collection.update_one(
                {"_id": record_id, "state": State.QUEUED.value, "fence": 0}, {"$set": fields}
            )

    def unpublished(
        self,
        *,
        ids: Sequence[str] | None = None,
        older_than_seconds: float = 0.0,
        limit: int = 500,
        skip: Callable[[Mapping[str, Any]], bool] | None = None,
    ) -> list[dict[str, Any]]:
        """Queued records whose message is not sent yet (committed outbox writes, failed
        publishes): those of ``ids``, or up to ``limit`` of those marked ``older_than_seconds``
        ago or more that ``skip`` does not pass over (a tier held by backpressure, another
        app's task), so that records left waiting never fill the window and hide the rest.

        Read on the sweepers' index, equalities only: SecantusDB reads a range on a field
        outside the index (``unpublished_at``) by scanning every queued record (436 ms at 10k
        queued, against 2 ms, measured), so the time and ``skip`` are applied here, over at
        most ``UNPUBLISHED_SCAN`` records."""
        query: dict[str, Any] = {"state": State.QUEUED.value, "claimable_at": UNPUBLISHED}
        if ids is not None:
            # ``_id`` first: SecantusDB reads on the index of a query's first field, and with
            # ``state`` first this read took 9 ms at 200 unpublished records, 72 ms in a
            # benchmark's growing backlog, against 1 ms (measured)
            with translate_errors("outbox read"):
                return list(self.collection.find({"_id": {"$in": list(ids)}, **query}))
        cutoff = self.now() - timedelta(seconds=older_than_seconds)
        found: list[dict[str, Any]] = []
        with translate_errors("outbox read"):
            for doc in self.collection.find(query).limit(UNPUBLISHED_SCAN):
                marked = doc.get("unpublished_at")
                if not isinstance(marked, datetime) or marked > cutoff:
                    continue  # within its committer's grace
                if skip is not None and skip(doc):
                    continue
                found.append(doc)
                if len(found) >= limit:
                    break
        return found

    def mark_published(self, record_ids: Sequence[str]) -> int:
        """Their messages are sent: out of the relay's view (one write for them all). A record
        claimed meanwhile left the outbox with its claim and is not touched."""
        if not record_ids:
            return 0
        now = self.now()
        with translate_errors("outbox published mark"):
            result = self.collection.update_many(
                {
                    "_id": {"$in": list(record_ids)},
                    "state": State.QUEUED.value,
                    "claimable_at": UNPUBLISHED,
                },
                {
                    "$set": {"claimable_at": EPOCH, "updated_at": now, "published_at": now},
                    "$unset": {"unpublished_at": ""},
                },
            )
        return result.modified_count

    def record_deferral(
        self,
        record_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        reason: str,
        until: datetime,
        objective: Mapping[str, Any] | None = None,
    ) -> None:
        """Note that a delivery was put off (no attempt used), creating the record if needed
        (with its latency ``objective``: ``slo_at``, ``slo_seconds``)."""
        now = self.now()
        with translate_errors("deferral record"):
            self.collection.update_one(
                {"_id": record_id},
                {
                    "$inc": {"deferrals": 1},
                    "$set": {"last_deferral": {"reason": reason, "until": until, "at": now}},
                    "$setOnInsert": {
                        **_queued(task=task, key=key, tier=tier, now=now, fleet=self.fleet),
                        **(objective or {}),
                    },
                },
                upsert=True,
            )
        self._track_objective(record_id, objective)

    # -- dead letters: triage, replay, purge -------------------------------------------------

    def find_dead(
        self,
        *,
        task: str | None = None,
        since: datetime | None = None,
        reason: str | None = None,
        limit: int = 1000,
        include_purged: bool = False,
        after: tuple[datetime | None, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Dead records, newest first (by death time, then id); every filter (``reason``: a
        case-insensitive substring) applies before the limit, so a listing is never cut short
        by what it hides. ``after``: only the records after this ``(finished_at, _id)`` in that
        order (the last of the page before: see ``DeadLetters.each``)."""
        query: dict[str, Any] = {"state": State.DEAD.value}
        if task:
            query["task"] = task
        if since:
            query["finished_at"] = {"$gte": since}
        if reason:
            query["dead_reason"] = {"$regex": re.escape(reason), "$options": "i"}
        if not include_purged:
            query["purged_at"] = None  # absent
        if after is not None:
            at, last_id = after
            # A comparison matches values of its own type only: records without a death time
            # come last in the order, so they follow any page that ends with a dated one.
            later: list[dict[str, Any]] = [{"finished_at": None, "_id": {"$lt": last_id}}]
            if at is not None:
                later = [
                    {"finished_at": {"$lt": at}},
                    {"finished_at": at, "_id": {"$lt": last_id}},
                    {"finished_at": None},
                ]
            query = {"$and": [query, {"$or": later}]}
        order = [("finished_at", DESCENDING), ("_id", DESCENDING)]
        with translate_errors("dead-letter query"):
            return list(self.collection.find(query).sort(order).limit(limit))

    def find_dead_by_key(self, key: str, *, task: str | None = None) -> dict[str, Any] | None:
        query: dict[str, Any] = {"state": State.DEAD.value, "key": key}
        if task:
            query["task"] = task
        with translate_errors("dead-letter lookup"):
            return self.collection.find_one(query)

    def mark_copy_pending(self, record_id: str, pending: bool) -> None:
        """The dead letter's copy to its queue is due now (its publish failed), or is done."""
        due = self.now() + COPY_DUE_SHIFT if pending else FOREVER
        with translate_errors("dead-letter copy mark"):
            self.collection.update_one(
                {"_id": record_id, "state": State.DEAD.value, "purged_at": None},
                {"$set": {"claimable_at": due}},
            )

    def copies_pending(self, *, limit: int = 100) -> list[dict[str, Any]]:
        """Dead records whose queue copy is due and was not confirmed (its publish failed, or
        the process that buried the job died before it; see ``COPY_GRACE``)."""
        # A dead record's claimable_at is its copy's due time, shifted (FOREVER once copied).
        due = self.now() + COPY_DUE_SHIFT
        with translate_errors("dead-letter copy query"):
            return list(
                self.collection.find(
                    {"state": State.DEAD.value, "claimable_at": {"$lte": due}}
                ).limit(limit)
            )

    def count_dead(self) -> int:
        """Dead letters: dead records but those of workflows that ended as written (a saga
        that compensated, a cancelled workflow): nothing is left for an operator there."""
        with translate_errors("dead-letter count"):
            return self.collection.count_documents(
                {"state": State.DEAD.value, "workflow_status": {"$nin": list(ENDED_AS_WRITTEN)}}
            )

    def reopen(self, record_id: str, *, actor: str) -> datetime | None:
        """Make a dead (not purged) record claimable again, attempts reset, for a replay;
        returns the reopening's time (to undo it), or None if the record is not dead."""
        now = self.now()
        with translate_errors("replay"):
            reset = self.collection.update_one(
                {"_id": record_id, "state": State.DEAD.value, "purged_at": None},
                {
                    "$set": {
                        "state": State.QUEUED.value,
                        "attempts": 0,
                        "inflight": 0,
                        "claimable_at": EPOCH,
                        "updated_at": now,
                        "replayed_at": now,
                    },
                    # A replayed job is live again: the dead record's retention no longer applies
                    # (the TTL sweep would delete it under its new holder).
                    "$unset": {"expires_at": ""},
                    "$inc": {"replays": 1},
                    "$push": {"audit": {"action": "replay", "by": actor, "at": now}},
                },
            )
        return now if reset.matched_count else None

    def undo_reopen(self, record_id: str, reopened_at: datetime) -> None:
        """Put a reopened record back to dead (its replay could not be published)."""
        now = self.now()
        with translate_errors("replay rollback"):
            self.collection.update_one(
                {"_id": record_id, "state": State.QUEUED.value, "replayed_at": reopened_at},
                {
                    "$set": {
                        "state": State.DEAD.value,
                        "claimable_at": FOREVER,
                        "updated_at": now,
                        "expires_at": now + self.dead_retention,
                    }
                },
            )

    def purge(self, record_ids: Sequence[str], *, actor: str) -> int:
        """:meth:`purge_dead`, returning how many records it removed."""
        return len(self.purge_dead(record_ids, actor=actor))

    def purge_dead(self, record_ids: Sequence[str], *, actor: str) -> list[str]:
        """Drop dead records from triage, keeping each as a tombstone until its retention ends:
        it still stops a late copy of the job from running. Its message, result, errors and
        traceback are deleted.

        Returns the ids this call removed. A record that is no longer dead (replayed since it
        was listed) or already purged is left as it is and not returned: each removal is
        marked with this call's operation id and read back by it.
        """
        now, op = self.now(), new_op()
        ids = list(record_ids)
        with translate_errors("purge"):
            self.collection.update_many(
                {"_id": {"$in": ids}, "state": State.DEAD.value, "purged_at": None},
                {
                    "$set": {
                        "purged_at": now,
                        "purged_by": actor,
                        "purge_op": op,
                        "claimable_at": FOREVER,  # no queue copy is due any more
                    },
                    "$unset": {"message": "", "result": "", "errors": "", "traceback": ""},
                },
            )
            removed = self.collection.find({"_id": {"$in": ids}, "purge_op": op}, {"_id": 1})
            return [str(doc["_id"]) for doc in removed]

    # -- key rotation --------------------------------------------------------------------------

    def reseal(self, reseal: Reseal, *, apply: bool) -> dict[str, Tally]:
        """Seal every stored value again with the newest key (``apply``), or count the values
        that need it; by collection: the records and their companions (groups, workflows and
        their events). The audit trail is append-only and holds no sealed values.

        A document is rewritten field by field, each write filtered on the field's value as
        read: a worker that changed it meanwhile (a checkpoint, a result) keeps its write, and
        the document is counted as changed meanwhile for the next pass.
        """
        database = self.collection.database
        prefix = f"{self.collection_name}_"
        with translate_errors("collection listing"):
            names = [
                name
                for name in database.list_collection_names()
                if name == self.collection_name
                or (name.startswith(prefix) and name != f"{prefix}audit")
            ]
        tallies: dict[str, Tally] = {}
        for name in sorted(names):
            collection = database.get_collection(name, write_concern=self._write_concern)
            tally = tallies[name] = Tally()
            # One pass in natural order: a document rewritten in place is not met again, and
            # one inserted meanwhile was sealed with the newest key by its writer anyway.
            with translate_errors("reseal"):
                for doc in collection.find({}, batch_size=500):
                    changes = {}
                    for field_name, value in doc.items():
                        new = value if field_name == "_id" else reseal_tree(value, reseal, tally)
                        if new is not value:
                            changes[field_name] = (value, new)
                    for field_name, (old, new) in changes.items() if apply else ():
                        done = collection.update_one(
                            {"_id": doc["_id"], field_name: old}, {"$set": {field_name: new}}
                        )
                        tally.changed_meanwhile += 1 - done.matched_count
        return tallies

    # -- the console's view ---------------------------------------------------------------------

    def finished_per_minute(
        self, *, minutes: int = 15, limit: int = 50_000
    ) -> dict[str, dict[str, list[int]]]:
        """Jobs that ended in each of the last ``minutes`` minutes, by tier and outcome
        (``succeeded``, ``dead``), oldest minute first. Found through the retention index: a
        finished record expires a fixed time after it ended (``result_retention`` for a
        success, ``dead_retention`` for a death), so no index of its own is needed."""
        now = self.now()
        window = timedelta(minutes=minutes)
        counts: dict[str, dict[str, list[int]]] = {}
        for state, retention in (
            (State.SUCCEEDED, self.result_retention),
            (State.DEAD, self.dead_retention),
        ):
            low, high = now - window + retention, now + retention
            with translate_errors("console query"):
                docs = self.collection.find(
                    {"expires_at": {"$gte": low, "$lte": high}, "state": state.value},
                    {"tier": 1, "finished_at": 1},
                ).limit(limit)
                for doc in docs:
                    ended = doc.get("finished_at")
                    if not isinstance(ended, datetime):
                        continue
                    ended = ended if ended.tzinfo else ended.replace(tzinfo=UTC)
                    age = int((now - ended).total_seconds() // 60)
                    if not 0 <= age < minutes:
                        continue
                    tier = str(doc.get("tier") or "default")
                    per_state = counts.setdefault(
                        tier, {"succeeded": [0] * minutes, "dead": [0] * minutes}
                    )
                    per_state[state.value][minutes - 1 - age] += 1
        return counts

    # -- the reconciler's view -----------------------------------------------------------------

    def expired_leases(self, *, grace_seconds: float, limit: int = 500) -> list[dict[str, Any]]:
        """Running records whose lease ended more than ``grace_seconds`` ago."""
        cutoff = self.now() - timedelta(seconds=grace_seconds)
        with translate_errors("reconcile query"):
            return list(
                self.collection.find(
                    {"state": State.RUNNING.value, "claimable_at": {"$lt": cutoff}}
                ).limit(limit)
            )

    def states_of(self, record_ids: Sequence[str]) -> dict[str, RecordState]:
        """Each existing record's state and fleet, by id."""
        if not record_ids:
            return {}
        with translate_errors("reconcile query"):
            docs = self.collection.find(
                {"_id": {"$in": list(record_ids)}}, {"state": 1, "fleet": 1}
            )
            return {str(doc["_id"]): RecordState.of(doc) for doc in docs}

    def stale(
        self, state: State, *, older_than_seconds: float, limit: int = 500
    ) -> list[dict[str, Any]]:
        """Queued or retrying records untouched for ``older_than_seconds`` (and queued records
        whose publish failed, at once: see :meth:`mark_unpublished`)."""
        cutoff = self.now() - timedelta(seconds=older_than_seconds)
        with translate_errors("reconcile query"):
            return list(
                self.collection.find(
                    {
                        "state": state.value,
                        "claimable_at": {"$lt": cutoff},
                        "updated_at": {"$lt": cutoff},
                    }
                ).limit(limit)
            )

    def replacements_due(
        self, *, older_than_seconds: float, limit: int = 500
    ) -> list[dict[str, Any]]:
        """Degraded results whose replacement is overdue by ``older_than_seconds`` and that
        nothing claimed meanwhile (its message was lost)."""
        cutoff = self.now() - timedelta(seconds=older_than_seconds)
        # A success is claimable again (claimable_at short of FOREVER) only while a degraded
        # result awaits its replacement: the sweepers' index finds them among all successes.
        # Equalities and one range only (see unpublished): updated_at is checked here.
        found: list[dict[str, Any]] = []
        with translate_errors("reconcile query"):
            for doc in self.collection.find(
                {"state": State.SUCCEEDED.value, "claimable_at": {"$lt": cutoff}}
            ):
                if _replacement_pending(doc) and (doc.get("updated_at") or EPOCH) < cutoff:
                    found.append(doc)
                    if len(found) == limit:
                        break
        return found

    def mark_reconciled(self, doc: Mapping[str, Any]) -> bool:
        """Note that the reconciler brought the job back now, if nobody changed it since it
        was read as ``doc`` (so two sweeps never both republish it, and a lease renewed since,
        which moves ``claimable_at``, is never cut short). The job stays claimable, and out of
        the reconciler's view until its grace (or stale time) has passed again, so a copy is
        not republished at every sweep while it waits for a worker."""
        now = self.now()
        with translate_errors("reconcile mark"):
            result = self.collection.update_one(
                {
                    "_id": doc["_id"],
                    "updated_at": doc.get("updated_at"),
                    "claimable_at": doc.get("claimable_at"),
                },
                {
                    "$set": {"updated_at": now, "reconciled_at": now, "claimable_at": now},
                    "$inc": {"reconciled": 1},
                },
            )
        return result.matched_count == 1

    def leave_unpublished(self, doc: Mapping[str, Any]) -> bool:
        """A never-published record the reconciler leaves to the outbox relay (its tier held
        by backpressure, or its message sealed with a key the sweeper lacks), as read in
        ``doc``: untouched again for the reconciler's stale time (out of its stale view
        meanwhile, so that such records never fill a sweep's window and hide the rest), still
        in the relay's (``claimable_at`` and ``unpublished_at`` are left as they are)."""
        with translate_errors("reconcile mark"):
            result = self.collection.update_one(
                {
                    "_id": doc["_id"],
                    "state": State.QUEUED.value,
                    "claimable_at": UNPUBLISHED,
                    "updated_at": doc.get("updated_at"),
                },
                {"$set": {"updated_at": self.now()}},
            )
        return result.matched_count == 1

    # -- results of tasks outside the ledger protocol (Celery's own, plain tasks) ------------

    def store_plain(self, task_id: str, fields: dict[str, Any]) -> None:
        """Upsert a plain result; never touches a record that the claim protocol owns."""
        now = self.now()
        # DuplicateKeyError: a ledger record owns this id; its protocol records the outcome.
        with translate_errors("result store"), contextlib.suppress(DuplicateKeyError):
            self.collection.update_one(
                {"_id": task_id, "fence": {"$exists": False}, "alias_of": {"$exists": False}},
                {"$set": {**fields, "updated_at": now, "expires_at": now + self.result_retention}},
                upsert=True,
            )

    def forget_result(self, record_id: str) -> None:
        """Drop a stored result; the record stays (it is what keeps the job from running twice)."""
        with translate_errors("forget"):
            self.collection.update_one({"_id": record_id}, {"$unset": {"result": ""}})

    def save_group(self, group_id: str, member_ids: Sequence[str]) -> None:
        """Keep a group's members (Celery's ``GroupResult.save``), as long as a result."""
        doc = {
            "_id": group_id,
            "members": list(member_ids),
            "expires_at": self.now() + self.result_retention,
        }
        with translate_errors("group save"):
            self.companion("groups").replace_one({"_id": group_id}, doc, upsert=True)

    def group_members(self, group_id: str) -> list[str] | None:
        with translate_errors("group read"):
            doc = self.companion("groups").find_one({"_id": group_id})
        if doc is None:
            return None
        members = doc.get("members")
        if members is None and isinstance(doc.get("results"), str):  # schema 1
            import json

            members = json.loads(doc["results"])
        return [str(member) for member in members or []]

    def delete_group(self, group_id: str) -> None:
        with translate_errors("group delete"):
            self.companion("groups").delete_one({"_id": group_id})

    # -- the audit trail ----------------------------------------------------------------------

    def audit(self, action: str, target: str, *, actor: str, **details: Any) -> Any:
        """Append one audit entry (who replayed, purged or forced a breaker, and when);
        returns its id, for :meth:`audit_outcome`."""
        entry = {"action": action, "target": target, "actor": actor, "at": self.now(), **details}
        with translate_errors("audit"):
            return self.companion("audit").insert_one(entry).inserted_id

    def audit_outcome(self, entry_id: Any, outcome: str, **details: Any) -> None:
        """Record how the audited action ended (``done`` or ``failed``), with its details: a
        second entry pointing at the first (``of``), as the trail is append-only (the app's
        database role may add entries, never change one: ``ledger.access``)."""
        fields = {"of": entry_id, "outcome": outcome, "at": self.now(), **details}
        try:
            with translate_errors("audit"):
                self.companion("audit").insert_one(fields)
        except DuplicateKeyError:
            # One outcome per action (AUDIT_INDEXES): an outcome already there was written by
            # someone else before this one, which is evidence of tampering, never overwritten.
            raise StoreError(
                f"the audit trail already holds an outcome for action {entry_id}: written by"
                f" another writer before this one ({outcome}); the trail keeps the first"
            ) from None

    def audit_entries(self, *, limit: int = 100) -> list[dict[str, Any]]:
        """The newest actions, each with its outcome's fields (``ended_at``, details) merged
        in; an action without an outcome entry is still ``started``."""
        audit = self.companion("audit")
        with translate_errors("audit read"):
            actions = list(
                audit.find({"of": None}).sort("at", DESCENDING).limit(limit)  # absent: an action
            )
            outcomes = {
                doc["of"]: doc for doc in audit.find({"of": {"$in": [a["_id"] for a in actions]}})
            }
        merged = []
        for entry in actions:
            ended = outcomes.get(entry["_id"])
            if ended is not None:
                fields = {k: v for k, v in ended.items() if k not in ("_id", "of", "at")}
                entry.update(fields, ended_at=ended["at"])
            entry.pop("_id")
            merged.append(entry)
        return merged


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
