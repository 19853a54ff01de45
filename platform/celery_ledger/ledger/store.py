"""The MongoDB ledger store: claim, complete and fail, each one round trip.

Op shapes are chosen for both real MongoDB and SecantusDB (see ``shared/FACTS.md``): every
write is an ``update`` filtered on ``_id`` (never ``findAndModify``, which scans the whole
collection on SecantusDB), and a read happens only on the rare paths.

A claim is one unordered bulk write of two conditional updates:

1. the claim itself: an upsert on ``_id`` that matches only while the record is claimable
   (``claimable_at <= now``) and its fencing token is older than ours. It inserts a new
   record, or takes a queued, retrying or lease-expired one. When the record exists but is
   not claimable, the upsert collides with it on ``_id`` (duplicate key), which is the signal.
2. a duplicate marker: ``$inc duplicates`` on the same ``_id`` if it already ``succeeded``.

So a claim costs one round trip, and so does a suppressed duplicate. Only a record held by a
live lease or a dead record needs a second round trip (a read) to say why.

Fencing tokens are nanosecond timestamps: known to the claimer without a read, and the claim
filter (``fence < token``) guarantees they only grow. A claimer whose clock lags falls back
to ``stored token + 1``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, TypeVar

from pymongo import ASCENDING, MongoClient, UpdateOne, WriteConcern
from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.errors import (
    BulkWriteError,
    ConnectionFailure,
    DuplicateKeyError,
    OperationFailure,
    PyMongoError,
)
from pymongo.monitoring import CommandListener
from pymongo.read_concern import ReadConcern

from ..errors import LeaseLost, LedgerUnavailable, StoreError
from .record import SCHEMA_VERSION, ErrorEntry, LedgerRecord, State

FOREVER = datetime(9999, 12, 31, tzinfo=UTC)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
DUPLICATE_KEY = 11000
T = TypeVar("T")


class ClaimOutcome(StrEnum):
    CLAIMED = "claimed"  # run the body with ``Claim.fence``
    DUPLICATE = "duplicate"  # already succeeded: do not run
    BUSY = "busy"  # held by a live lease (or a pending retry): come back at ``retry_at``
    DEAD = "dead"  # dead-lettered: do not run; replay is the way back


@dataclass(frozen=True, slots=True)
class Claim:
    outcome: ClaimOutcome
    fence: int = 0
    retry_at: datetime | None = None
    killed_reason: str | None = None  # DEAD: this claim found the delivery limit and killed it


def utcnow() -> datetime:
    return datetime.now(UTC)


class _FenceClock:
    """Strictly increasing nanosecond tokens within this process."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def next(self, at_least: int = 0) -> int:
        with self._lock:
            self._last = max(time.time_ns(), self._last + 1, at_least)
            return self._last


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Turn pymongo's errors into the platform's: transient ones into ``LedgerUnavailable``."""
    try:
        yield
    except ConnectionFailure as exc:
        raise LedgerUnavailable(f"ledger unreachable during {what}: {exc}") from exc
    except (BulkWriteError, DuplicateKeyError):
        raise  # the callers read these as protocol signals
    except OperationFailure as exc:
        if exc.has_error_label("RetryableWriteError") or exc.has_error_label(
            "TransientTransactionError"
        ):
            raise LedgerUnavailable(f"ledger unavailable during {what}: {exc}") from exc
        raise StoreError(f"ledger {what} failed: {exc}") from exc
    except PyMongoError as exc:
        raise StoreError(f"ledger {what} failed: {exc}") from exc


def queued_record(*, task: str, key: str, tier: str, now: datetime) -> dict[str, Any]:
    """The fields of a new record that waits for its first claim."""
    return {
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


class Ledger:
    """The ledger of one app: a MongoDB collection of :class:`LedgerRecord` documents.

    Safe to share across threads; a forked process opens its own connection pool.
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
        event_listeners: Sequence[CommandListener] = (),
    ) -> None:
        self.uri = uri
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
        self._fences = _FenceClock()
        # Opens sealed values (sensitive tasks); the app sets it to its Sealer's ``open``.
        self.open_text: Callable[[str], str] = lambda text: text
        self._lock = threading.Lock()
        self._pid = -1
        self._client: MongoClient[dict[str, Any]] | None = None
        self._collection: Collection[dict[str, Any]] | None = None

    # -- connection -------------------------------------------------------------------------

    @property
    def client(self) -> MongoClient[dict[str, Any]]:
        self._connect()
        assert self._client is not None
        return self._client

    @property
    def collection(self) -> Collection[dict[str, Any]]:
        self._connect()
        assert self._collection is not None
        return self._collection

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
        with translate_errors("index creation"):
            if other in self.collection.index_information():
                self.collection.drop_index(other)
            if self.ttl_index:
                self.collection.create_index("expires_at", expireAfterSeconds=0, name=wanted)
            else:
                self.collection.create_index("expires_at", name=wanted)
            self.collection.create_index(
                [("state", ASCENDING), ("claimable_at", ASCENDING)], name="state_claimable"
            )

    def expire(self) -> int:
        """Delete records past their ``expires_at`` (what the TTL index does when it is on).

        One indexed range delete. SecantusDB's TTL sweeper instead reads the whole collection
        under its global lock, stalling every write for seconds per 100k records.
        """
        with translate_errors("expiry"):
            return self.collection.delete_many({"expires_at": {"$lt": utcnow()}}).deleted_count

    # -- reads ------------------------------------------------------------------------------

    def get(self, task_name: str, key: str) -> LedgerRecord | None:
        """The record of job ``(task_name, key)``, or ``None`` if the ledger has none."""
        from ..keys import derive_task_id

        return self.get_by_id(derive_task_id(task_name, key))

    def get_by_id(self, record_id: str) -> LedgerRecord | None:
        doc = self.find_raw(record_id)
        if doc is None:
            return None
        if isinstance(doc.get("result"), str):
            doc["result"] = self.open_text(doc["result"])
        return LedgerRecord.model_validate(doc)

    def find_raw(self, record_id: str) -> dict[str, Any] | None:
        with translate_errors("read"):
            return self.collection.find_one({"_id": record_id})

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
        message: dict[str, Any] | None = None,
        max_attempts: int | None = None,
    ) -> Claim:
        """Try to take the exclusive lease on a record (creating it if needed). See module doc.

        ``message`` (arguments as JSON) is kept on the record so that the reconciler can
        republish a job whose message is gone; ``max_attempts`` is the job's attempts budget.
        """
        lease = timedelta(seconds=lease_seconds or self.lease_seconds)
        at_least = 0
        for _ in range(3):
            now = utcnow()
            fence = self._fences.next(at_least)
            outcome = self._try_claim(
                record_id, fence, now, now + lease, task, key, tier, owner, message, max_attempts
            )
            if outcome is not None:
                return outcome
            doc = self.find_raw(record_id)  # the rare path: why was it not claimable?
            if doc is None:
                continue  # expired by TTL between the two calls: claim afresh
            state = doc.get("state")
            if state == State.SUCCEEDED:
                continue  # it finished between our two calls: the claim bulk now counts it
            if state == State.DEAD:
                return Claim(ClaimOutcome.DEAD)
            claimable_at: datetime = doc.get("claimable_at") or EPOCH
            if claimable_at > utcnow():
                return Claim(ClaimOutcome.BUSY, retry_at=claimable_at)
            if int(doc.get("inflight", 0)) >= self.max_deliveries:
                return self._kill(
                    doc,
                    f"poison: delivered {doc.get('inflight')} times without"
                    " an outcome (the worker was lost each time)",
                )
            if max_attempts is not None and int(doc.get("attempts", 0)) >= max_attempts:
                return self._kill(
                    doc, f"attempts budget exhausted ({doc.get('attempts')} attempts)"
                )
            at_least = int(doc.get("fence", 0)) + 1  # our clock lags the last claimer's
        raise StoreError(f"could not claim {record_id}: the record keeps changing under us")

    def _kill(self, doc: dict[str, Any], reason: str) -> Claim:
        """Dead-letter a record that must not be claimed again (poison, attempts budget)."""
        now = utcnow()
        with translate_errors("poison record"):
            self.collection.update_one(
                {"_id": doc["_id"], "fence": doc.get("fence", 0), "state": doc.get("state")},
                {"$set": self._dead(now, reason)},
            )
        return Claim(ClaimOutcome.DEAD, killed_reason=reason)

    def _dead(self, now: datetime, reason: str) -> dict[str, Any]:
        """The fields that make a record dead (terminal, kept for the dead retention)."""
        return {
            "state": State.DEAD.value,
            "claimable_at": FOREVER,
            "finished_at": now,
            "updated_at": now,
            "expires_at": now + self.dead_retention,
            "dead_reason": reason,
            "lease_owner": None,
            "lease_expires_at": None,
            "inflight": 0,
        }

    def _try_claim(
        self,
        record_id: str,
        fence: int,
        now: datetime,
        lease_until: datetime,
        task: str,
        key: str,
        tier: str,
        owner: str,
        message: dict[str, Any] | None = None,
        max_attempts: int | None = None,
    ) -> Claim | None:
        claim_filter: dict[str, Any] = {
            "_id": record_id,
            "claimable_at": {"$lte": now},
            "fence": {"$lt": fence},
            "inflight": {"$lt": self.max_deliveries},
        }
        if max_attempts is not None:
            claim_filter["attempts"] = {"$lt": max_attempts}
        extra = {} if message is None else {"message": message}
        claim = UpdateOne(
            claim_filter,
            {
                "$set": {
                    "v": SCHEMA_VERSION,
                    "task": task,
                    "key": key,
                    "tier": tier,
                    "state": State.RUNNING.value,
                    "fence": fence,
                    "lease_owner": owner,
                    "lease_expires_at": lease_until,
                    "claimable_at": lease_until,
                    "started_at": now,
                    "updated_at": now,
                    **extra,
                },
                "$inc": {"attempts": 1, "inflight": 1},
                "$setOnInsert": {"created_at": now},
            },
            upsert=True,
        )
        mark_duplicate = UpdateOne(
            {"_id": record_id, "state": State.SUCCEEDED.value},
            {"$inc": {"duplicates": 1}, "$set": {"last_duplicate_at": now}},
        )
        try:
            with translate_errors("claim"):
                self.collection.bulk_write([claim, mark_duplicate], ordered=False)
        except BulkWriteError as exc:
            errors = exc.details.get("writeErrors", [])
            if any(e.get("index") != 0 or e.get("code") != DUPLICATE_KEY for e in errors):
                raise StoreError(f"ledger claim of {record_id} failed: {errors}") from exc
            if exc.details.get("nMatched", 0) >= 1:
                return Claim(ClaimOutcome.DUPLICATE)
            return None
        return Claim(ClaimOutcome.CLAIMED, fence=fence)

    def complete(self, record_id: str, fence: int, result_json: str) -> None:
        """Store the result and mark the record succeeded, if ``fence`` still holds the lease."""
        now = utcnow()
        update = {
            "$set": {
                "state": State.SUCCEEDED.value,
                "result": result_json,
                "claimable_at": FOREVER,
                "finished_at": now,
                "updated_at": now,
                "expires_at": now + self.result_retention,
                "lease_owner": None,
                "lease_expires_at": None,
                "inflight": 0,
            }
        }
        self._fenced_update(record_id, fence, update, "completion")

    def record_failure(
        self,
        record_id: str,
        fence: int,
        error: ErrorEntry,
        *,
        retry_at: datetime | None,
        traceback: str = "",
        reason: str = "",
        dead_fields: dict[str, Any] | None = None,
    ) -> None:
        """Append ``error`` to the history; ``retrying`` when ``retry_at`` is set, else ``dead``."""
        now = utcnow()
        fields: dict[str, Any] = {
            "updated_at": now,
            "lease_owner": None,
            "lease_expires_at": None,
            "inflight": 0,
            "traceback": traceback[-8000:],
        }
        if retry_at is None:
            fields |= {
                **self._dead(now, reason or error.type),
                **(dead_fields or {}),
            }
        else:
            # Claimable at once: the retry message itself is the timer, and an early duplicate
            # delivery that claims first is as good as the retry.
            fields |= {
                "state": State.RETRYING.value,
                "claimable_at": now,
                "next_attempt_at": retry_at,
            }
        update = {
            "$set": fields,
            "$push": {
                "errors": {"$each": [error.model_dump()], "$slice": -self.error_history_limit}
            },
        }
        self._fenced_update(record_id, fence, update, "failure record")

    def release(self, record_id: str, fence: int) -> None:
        """Give a claim back without an outcome (the message goes back to the queue)."""
        now = utcnow()
        update = {
            "$set": {
                "state": State.QUEUED.value,
                "claimable_at": now,
                "updated_at": now,
                "lease_owner": None,
                "lease_expires_at": None,
                "inflight": 0,
            }
        }
        self._fenced_update(record_id, fence, update, "release")

    # -- long-lived jobs: heartbeats, progress, retirement -----------------------------------

    def heartbeat(self, record_id: str, fence: int, lease_seconds: float | None = None) -> datetime:
        """Extend the lease held with ``fence``; returns the new expiry (LeaseLost if taken)."""
        until = utcnow() + timedelta(seconds=lease_seconds or self.lease_seconds)
        self._fenced_update(
            record_id,
            fence,
            {"$set": {"lease_expires_at": until, "claimable_at": until}},
            "heartbeat",
        )
        return until

    def save_checkpoint(
        self, record_id: str, fence: int, state: dict[str, Any], lease_seconds: float | None = None
    ) -> None:
        """Store progress (and extend the lease: a checkpoint is a sign of life)."""
        now = utcnow()
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

    def save_step(self, record_id: str, fence: int, name: str, result_json: str) -> None:
        self._fenced_update(
            record_id,
            fence,
            {"$set": {f"steps.{name}": {"result": result_json, "at": utcnow()}}},
            "step record",
        )

    def run_transaction(self, callback: Callable[[ClientSession], T]) -> T:
        """Run ``callback(session)`` in one MongoDB transaction on the ledger's deployment.

        pymongo's ``with_transaction`` retries the callback on transient errors (write
        conflicts, elections) and the commit on an unknown result; anything else aborts and
        propagates as raised (pymongo's errors too: the callback's own writes may raise them).
        """
        with self.client.start_session() as session:
            return session.with_transaction(
                callback,
                read_concern=ReadConcern("majority"),
                write_concern=self._write_concern,
            )

    def save_step_in(
        self, session: ClientSession, record_id: str, fence: int, name: str, result_json: str
    ) -> bool:
        """In ``session``'s transaction: record step ``name`` under ``fence``.

        False if the fence no longer holds or the step is already recorded (the caller aborts).
        """
        result = self.collection.update_one(
            {
                "_id": record_id,
                "fence": fence,
                "state": State.RUNNING.value,
                f"steps.{name}": {"$exists": False},
            },
            {"$set": {f"steps.{name}": {"result": result_json, "at": utcnow(), "atomic": True}}},
            session=session,
        )
        return result.matched_count == 1

    def add_artefact(self, record_id: str, fence: int, path: str) -> None:
        self._fenced_update(record_id, fence, {"$addToSet": {"artefacts": path}}, "artefact")

    def load_progress(self, record_id: str) -> dict[str, Any]:
        """The record's checkpoint, completed steps and artefacts (one read)."""
        with translate_errors("progress read"):
            doc = self.collection.find_one(
                {"_id": record_id}, {"checkpoint": 1, "steps": 1, "artefacts": 1}
            )
        return doc or {}

    def retire(
        self,
        record_id: str,
        fence: int | None,
        reason: str,
        dead_fields: dict[str, Any] | None = None,
    ) -> bool:
        """Dead-letter a running job (time budget, age). With ``fence=None``: only while its
        lease is live (the worker that held it was stopped by its own parent). True if done."""
        now = utcnow()
        flt: dict[str, Any] = {"_id": record_id, "state": State.RUNNING.value}
        if fence is None:
            flt["lease_expires_at"] = {"$gt": now}
        else:
            flt["fence"] = fence
        with translate_errors("retirement"):
            result = self.collection.update_one(
                flt,
                {
                    "$set": {
                        **self._dead(now, reason),
                        "fingerprint": reason.split(":", 1)[0].split(" (", 1)[0].replace(" ", "-"),
                        "fingerprint_text": reason.split(":", 1)[0],
                        **(dead_fields or {}),
                    }
                },
            )
        return result.matched_count == 1

    # -- the reconciler's view -----------------------------------------------------------------

    def expired_leases(self, *, grace_seconds: float, limit: int = 500) -> list[dict[str, Any]]:
        """Running records whose lease ended more than ``grace_seconds`` ago."""
        cutoff = utcnow() - timedelta(seconds=grace_seconds)
        with translate_errors("reconcile query"):
            return list(
                self.collection.find(
                    {"state": State.RUNNING.value, "claimable_at": {"$lt": cutoff}}
                ).limit(limit)
            )

    def stale(
        self, state: State, *, older_than_seconds: float, limit: int = 500
    ) -> list[dict[str, Any]]:
        """Queued or retrying records untouched for ``older_than_seconds``."""
        cutoff = utcnow() - timedelta(seconds=older_than_seconds)
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

    def touch(self, record_id: str, expected_updated_at: Any) -> bool:
        """Mark a record as reconciled now, if nobody changed it since we read it."""
        with translate_errors("reconcile mark"):
            result = self.collection.update_one(
                {"_id": record_id, "updated_at": expected_updated_at},
                {
                    "$set": {"updated_at": utcnow(), "reconciled_at": utcnow()},
                    "$inc": {"reconciled": 1},
                },
            )
        return result.matched_count == 1

    def _fenced_update(self, record_id: str, fence: int, update: dict[str, Any], what: str) -> None:
        with translate_errors(what):
            result = self.collection.update_one(
                {"_id": record_id, "fence": fence, "state": State.RUNNING.value}, update
            )
        if result.matched_count == 0:
            raise LeaseLost(record_id, fence)

    # -- publish side -----------------------------------------------------------------------

    def enqueue(
        self,
        record_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        message: dict[str, Any] | None = None,
    ) -> bool:
        """Write a ``queued`` record unless the job is known; True if it was new (one trip).

        ``message`` (arguments as JSON) lets the reconciler republish the job if its message
        is lost before the first claim.
        """
        now = utcnow()
        fields = queued_record(task=task, key=key, tier=tier, now=now)
        if message is not None:
            fields["message"] = message
        with translate_errors("enqueue"):
            result = self.collection.update_one(
                {"_id": record_id}, {"$setOnInsert": fields}, upsert=True
            )
        return result.upserted_id is not None

    def record_deferral(
        self, record_id: str, *, task: str, key: str, tier: str, reason: str, until: datetime
    ) -> None:
        """Note that a delivery was put off (no attempt used), creating the record if needed."""
        now = utcnow()
        with translate_errors("deferral record"):
            self.collection.update_one(
                {"_id": record_id},
                {
                    "$inc": {"deferrals": 1},
                    "$set": {"last_deferral": {"reason": reason, "until": until, "at": now}},
                    "$setOnInsert": queued_record(task=task, key=key, tier=tier, now=now),
                },
                upsert=True,
            )

    def record_shed(
        self,
        record_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        reason: str,
        args: Any,
        kwargs: Any,
        headers: dict[str, Any],
    ) -> None:
        """Record a job shed by backpressure: dead with its message, so it can be replayed."""
        import json

        now = utcnow()
        with translate_errors("shed record"):
            self.collection.update_one(
                {"_id": record_id},
                {
                    "$setOnInsert": {
                        "v": SCHEMA_VERSION,
                        "task": task,
                        "key": key,
                        "tier": tier,
                        "state": State.DEAD.value,
                        "attempts": 0,
                        "inflight": 0,
                        "fence": 0,
                        "claimable_at": FOREVER,
                        "created_at": now,
                        "updated_at": now,
                        "finished_at": now,
                        "expires_at": now + self.dead_retention,
                        "dead_reason": reason,
                        "fingerprint": "shed",
                        "fingerprint_text": f"shed by backpressure ({tier})",
                        "shed": True,
                        "message": {
                            "args_json": json.dumps(args),
                            "kwargs_json": json.dumps(kwargs),
                            "headers": json.loads(json.dumps(headers, default=str)),
                        },
                    }
                },
                upsert=True,
            )

    def forget_queued(self, record_id: str) -> None:
        """Undo :meth:`enqueue` when the publish that followed it failed."""
        with translate_errors("enqueue rollback"):
            self.collection.delete_one({"_id": record_id, "state": State.QUEUED.value, "fence": 0})

    # -- results of tasks outside the ledger protocol (Celery's own, plain tasks) ------------

    def store_plain(self, task_id: str, fields: dict[str, Any]) -> None:
        """Upsert a plain result; never touches a record that the claim protocol owns."""
        now = utcnow()
        # DuplicateKeyError: a ledger record owns this id; its protocol records the outcome.
        with translate_errors("result store"), contextlib.suppress(DuplicateKeyError):
            self.collection.update_one(
                {"_id": task_id, "fence": {"$exists": False}},
                {
                    "$set": {
                        **fields,
                        "updated_at": now,
                        "expires_at": now + self.result_retention,
                    }
                },
                upsert=True,
            )
