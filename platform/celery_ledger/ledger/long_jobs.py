"""Long-lived jobs: heartbeats, checkpoints, steps run once, artefacts, and steps saved in
the app's own transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from pymongo.client_session import ClientSession
from pymongo.errors import (
    ConnectionFailure,
    WriteConcernError,
)
from pymongo.read_concern import ReadConcern

from ..errors import LedgerUnavailable
from .base import LedgerBase
from .core import (
    T,
    _on_one_record,
    translate_errors,
)
from .record import State


class LongJobs(LedgerBase):
    """Heartbeats, checkpoints, steps and artefacts of long-lived jobs."""

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
