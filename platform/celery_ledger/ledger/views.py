"""What the sweeps and the console read: the reconciler's expired leases, stale records and
replacements due, and their marks; the console's finished jobs per minute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from pymongo import DESCENDING

from .base import LedgerBase
from .core import (
    EPOCH,
    UNPUBLISHED,
    RecordState,
    _replacement_pending,
    tenant_clauses,
    translate_errors,
)
from .record import State


class Views(LedgerBase):
    """What the reconciler and the console read, and the reconciler's marks."""

    def finished_per_minute(
        self, *, minutes: int = 15, limit: int = 50_000
    ) -> dict[str, dict[str, list[int]]]:
        """Jobs that ended in each of the last ``minutes`` minutes, by tier and outcome
        (``succeeded``, ``dead``), oldest minute first (the rows of :meth:`finished_recently`)."""
        now = self.now()
        counts: dict[str, dict[str, list[int]]] = {}
        for doc in self.finished_recently(minutes=minutes, limit=limit, now=now):
            age = int((now - doc["finished_at"]).total_seconds() // 60)
            if not 0 <= age < minutes:
                continue
            tier = str(doc.get("tier") or "default")
            per_state = counts.setdefault(tier, {"succeeded": [0] * minutes, "dead": [0] * minutes})
            per_state[str(doc["state"])][minutes - 1 - age] += 1
        return counts

    def finished_recently(
        self, *, minutes: int = 60, limit: int = 50_000, now: datetime | None = None
    ) -> list[dict[str, Any]]:
        """The records that ended (succeeded or dead) in the last ``minutes`` minutes: their
        ``state``, ``tier``, ``finished_at``, ``started_at`` (the last attempt's claim) and
        ``created_at`` (the first claim), times made aware, at most ``limit`` of each outcome.

        Found through the retention index, a range on ``expires_at``: a finished record expires
        a fixed time after it ended (``result_retention`` for a success, ``dead_retention`` for
        a death), so the window is one bounded range read per outcome and needs no index of
        its own (each index costs every job's writes: see :meth:`ensure_indexes`)."""
        now = self.now() if now is None else now
        window = timedelta(minutes=minutes)
        rows: list[dict[str, Any]] = []
        fields = {"tier": 1, "state": 1, "finished_at": 1, "started_at": 1, "created_at": 1}
        for state, retention in (
            (State.SUCCEEDED, self.result_retention),
            (State.DEAD, self.dead_retention),
        ):
            low, high = now - window + retention, now + retention
            with translate_errors("console query"):
                docs = self.collection.find(
                    {"expires_at": {"$gte": low, "$lte": high}, "state": state.value}, fields
                ).limit(limit)
                for doc in docs:
                    times = {
                        name: _aware(doc.get(name))
                        for name in ("finished_at", "started_at", "created_at")
                    }
                    if times["finished_at"] is None:
                        continue
                    rows.append({**doc, **times, "state": state.value})
        return rows

    def of_tenant(
        self, tenant: str, *, state: State | None = None, limit: int = 50
    ) -> list[dict[str, Any]]:
        """``tenant``'s records (:func:`tenant_clauses`), of ``state`` if given, the most
        recently changed first, at most ``limit``: an operator's look, with no index of its own
        (an index costs every job's writes; this read is rare and bounded by ``limit``)."""
        query: dict[str, Any] = {"$or": tenant_clauses(tenant)}
        if state is not None:
            query["state"] = state.value
        with translate_errors("tenant query"):
            return list(self.collection.find(query).sort("updated_at", DESCENDING).limit(limit))

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
        return self._untouched(state, cutoff, unpublished=True, limit=limit)

    def quiet_waiting(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        touched_before: datetime | None = None,
    ) -> list[dict[str, Any]]:
        """The published jobs waiting in a queue, untouched for ``older_than_seconds`` (and
        last touched since ``touched_since`` and before ``touched_before``, if given: a slice of
        them, see quiet_slices.py), the last touched first, up to ``limit``: those whose message
        the broker may have lost. Their id, task, tier, fleet and times only: the reconciler
        passes over another app's (sharing the ledger) by these, looks for the rest's messages
        in the broker, and reads the few it does not find with :meth:`records`.
        Never-published records are the outbox relay's. Read by their last touch, a bound of
        the sweepers' index."""
        return self._quiet(
            older_than_seconds,
            limit,
            by="updated_at",
            since=touched_since,
            before=touched_before,
            waiting=True,
            due=False,
        )

    def quiet_due(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        due_since: datetime | None = None,
        due_before: datetime | None = None,
    ) -> list[dict[str, Any]]:
        """The delayed and retrying jobs due for ``older_than_seconds`` and untouched since they
        were delayed (and last touched since ``touched_since``, if given), due since
        ``due_since`` and before ``due_before`` (a slice of them), the latest due first, up to
        ``limit``; as :meth:`quiet_waiting` returns them. Read by their due time."""
        return self._quiet(
            older_than_seconds,
            limit,
            by="claimable_at",
            since=touched_since,
            waiting=False,
            due=True,
            due_since=due_since,
            due_before=due_before,
        )

    def _quiet(
        self, older_than_seconds: float, limit: int, *, by: str, **bounds: Any
    ) -> list[dict[str, Any]]:
        """Each claimable state's newest ``limit`` (by ``by``), merged newest first."""
        cutoff = self.now() - timedelta(seconds=older_than_seconds)
        found: list[dict[str, Any]] = []
        for state in (State.QUEUED, State.RETRYING):
            found += self._untouched(
                state,
                cutoff,
                unpublished=False,
                limit=limit,
                projection={"_id": 1, "task": 1, "tier": 1, "fleet": 1},
                newest_first=True,
                **bounds,
            )
        found.sort(key=lambda doc: doc[by])
        found.reverse()
        return found[:limit]

    def _untouched(
        self,
        state: State,
        cutoff: datetime,
        *,
        unpublished: bool,
        limit: int,
        projection: Mapping[str, Any] | None = None,
        since: datetime | None = None,
        before: datetime | None = None,
        waiting: bool = True,
        due: bool = True,
        newest_first: bool = False,
        due_since: datetime | None = None,
        due_before: datetime | None = None,
    ) -> list[dict[str, Any]]:
        """Records of ``state``, claimable and untouched since ``cutoff`` (and touched since
        ``since`` and before ``before``, if given), up to ``limit``: those claimable from an
        instant (``waiting``: published, or not) and those claimable from their due time
        (``due``).

        A published queued record is claimable from EPOCH: read with ``claimable_at`` equal to
        EPOCH, its "untouched since" is a bound of the sweepers' index, and a deep backlog of
        young jobs costs nothing (as a range of ``claimable_at`` from EPOCH it cost every sweep
        a walk of the whole queued backlog for the few untouched). Never-published ones sit at
        UNPUBLISHED (their ``updated_at`` at EPOCH when their publish failed: found at once).
        Delayed queued ones and retrying ones are claimable from their due time: a range of
        ``claimable_at``, whose records are the ones due for the whole wait, few, read with
        ``updated_at`` checked here (the embedded server plans a range there followed by one on
        ``updated_at`` as a scan of the state: 1 s at 10,000 queued records, against 3 ms).
        """
        if limit <= 0:
            return []
        touched_by = cutoff if before is None else min(cutoff, before)
        untouched: dict[str, datetime] = {"$lt": touched_by}
        if since is not None:
            untouched["$gte"] = since
        exact: list[datetime] = []
        due_by: dict[str, datetime] = {"$lt": cutoff}
        if due_before is not None:
            due_by["$lt"] = min(cutoff, due_before)
        if state is State.QUEUED:
            exact = [EPOCH, *([UNPUBLISHED] if unpublished else [])] if waiting else []
            due_by["$gt"] = UNPUBLISHED  # (one bound a side: see the store contract's shapes)
        if due_since is not None and due_since > due_by.get("$gt", EPOCH):
            due_by.pop("$gt", None)
            due_by["$gte"] = due_since
        fields = None if projection is None else {**projection, "updated_at": 1, "claimable_at": 1}
        found: list[dict[str, Any]] = []
        with translate_errors("reconcile query"):
            for claimable in exact:
                query = {"state": state.value, "claimable_at": claimable, "updated_at": untouched}
                cursor = self.collection.find(query, fields).limit(limit - len(found))
                found += cursor.sort("updated_at", DESCENDING) if newest_first else cursor
                if len(found) >= limit:
                    return found
            if not due:
                return found
            dues = self.collection.find({"state": state.value, "claimable_at": due_by}, fields)
            for doc in dues.sort("claimable_at", DESCENDING) if newest_first else dues:
                touched = _aware(doc.get("updated_at"))
                if (
                    touched is not None
                    and touched < touched_by
                    and (since is None or touched >= since)
                ):
                    found.append(doc)
                    if len(found) >= limit:
                        break
        return found

    def records(self, record_ids: Sequence[str]) -> list[dict[str, Any]]:
        """The records of these ids that exist, whole."""
        if not record_ids:
            return []
        with translate_errors("reconcile query"):
            return list(self.collection.find({"_id": {"$in": list(record_ids)}}))

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


def _aware(value: Any) -> datetime | None:
    """A stored time as an aware datetime (None if it is not a time)."""
    if not isinstance(value, datetime):
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)
