"""The ledger's connection and the helpers every concern of the store shares: the collection
and its companions, one attempt's fenced ending, the objectives' index. The concerns are mixins
of :class:`LedgerBase`, composed into :class:`celery_ledger.ledger.store.Ledger`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from pymongo import MongoClient, WriteConcern
from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.errors import (
    DuplicateKeyError,
)
from pymongo.monitoring import CommandListener

from ..clock import ServerClock, mongo_time
from ..errors import CommitLost, LeaseLost, StoreError
from ..locks import ForkSafeLock
from .core import (
    RECENT_OPS,
    _FenceClock,
    _objective_update,
    _on_one_record,
    translate_errors,
)
from .group_commit import MAX_BATCH, GroupCommit, Statement
from .record import State

logger = logging.getLogger("celery_ledger.ledger")


class LedgerBase:
    """The ledger's connection and shared helpers (see the module docstring)."""

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

    def _alias(self, record_id: str, task: str, key: str, now: datetime) -> dict[str, Any]:
        """An alias document: another id (a canvas member's frozen task id) naming a job."""
        return {
            "alias_of": record_id,
            "task": task,
            "key": key,
            "created_at": now,
            "expires_at": now + self.dead_retention,
        }

    def _fenced_update(self, record_id: str, fence: int, update: dict[str, Any], what: str) -> None:
        """A write of the holder of ``fence`` that leaves the record running (repeatable)."""
        with translate_errors(what):
            result = self.collection.update_one(
                _on_one_record({"_id": record_id, "fence": fence, "state": State.RUNNING.value}),
                update,
            )
        if result.matched_count == 0:
            raise LeaseLost(record_id, fence)
