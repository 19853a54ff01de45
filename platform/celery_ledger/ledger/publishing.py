"""The publish side: a job's ``queued`` record before its message (dedupe on publish, the
outbox; one job at a time or a bulk publish's batch), its unpublished and deferred marks, and
the outbox relay's view.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from pymongo import UpdateOne
from pymongo.client_session import ClientSession
from pymongo.errors import BulkWriteError, DuplicateKeyError

from .. import headers
from ..errors import LedgerUnavailable, StoreError
from .base import LedgerBase
from .core import (
    DUPLICATE_KEY,
    EPOCH,
    UNPUBLISHED,
    UNPUBLISHED_SCAN,
    EnqueueOutcome,
    QueuedJob,
    _objective_update,
    _queued,
    translate_errors,
)
from .message import KeptMessage
from .record import State

logger = logging.getLogger("celery_ledger.ledger")


# The most jobs one bulk enqueue writes: two statements each, one round trip (a server's write
# batch holds 100,000 statements; this keeps a failed batch's redo small).
ENQUEUE_BATCH = 100


class Publishing(LedgerBase):
    """A job's records on the publish side, and the outbox relay's view."""

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
        """Write a ``queued`` record unless the job is known (one round trip; a second for a
        known job, outside a transaction).

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
        fields.update(_tenant_field(message))
        fields.update(objective or {})
        if claimable_at is not None:
            fields["claimable_at"] = claimable_at
        collection = self.collection
        if session is not None:
            fields |= {"claimable_at": UNPUBLISHED, "unpublished_at": now, "outbox": True}
            collection = self.collection_for(session)
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
        # An insert, one statement: a first publish is the common case. Only a job the ledger
        # knows (a duplicate publish) costs a second round trip, to say whether its first
        # publish failed (then this caller publishes it after all).
        with translate_errors("enqueue"):
            try:
                collection.insert_one({"_id": record_id, **fields})
                outcome = EnqueueOutcome.NEW
            except DuplicateKeyError as exc:
                if (exc.details or {}).get("keyPattern", {"_id": 1}) != {"_id": 1}:
                    # (no other unique index today: one added later must not read as known)
                    raise StoreError(f"enqueue of {record_id} failed: {exc.details}") from exc
                retried = collection.update_one(
                    {
                        "_id": record_id,
                        "state": State.QUEUED.value,
                        "unpublished_at": {"$ne": None},
                    },
                    {"$set": {"publish_retried_at": now}},
                )
                outcome = (
                    EnqueueOutcome.UNPUBLISHED if retried.modified_count else EnqueueOutcome.KNOWN
                )
        # A known job's duplicate publish writes nothing more: its claims track it.
        if outcome is not EnqueueOutcome.KNOWN:
            self._track_objective(record_id, objective)
        return outcome

    def enqueue_many(self, jobs: Sequence[QueuedJob]) -> list[EnqueueOutcome]:
        """:meth:`enqueue` for up to ``ENQUEUE_BATCH`` jobs: their outcomes, in order.

        One unordered bulk write of two statements a job (its record's insert, as an upsert,
        and the mark of a known job whose first publish failed, which :meth:`enqueue` sends
        only for a known job), and a second round trip only when it found a known job whose
        first publish failed: the bulk write counts the records it marked
        (``publish_retried_at``) but does not say which, so they are read back by that mark,
        this call's own time. A concurrent upsert of the same new job that loses the race
        (duplicate key) finds it known, as a later one would. Jobs with a latency objective
        add one write for their objectives.

        Raises:
            LedgerUnavailable: the write's outcome is unknown (a write concern error): any of
                the records may have been written.
            StoreError: a record could not be written; those this call wrote are marked
                unpublished (the relay publishes them), and no job's message may be sent.
            ValueError: more than ``ENQUEUE_BATCH`` jobs.
        """
        if len(jobs) > ENQUEUE_BATCH:
            raise ValueError(f"{len(jobs)} jobs; a bulk enqueue writes {ENQUEUE_BATCH} at most")
        if not jobs:
            return []
        now = self.now()
        ops: list[UpdateOne] = []
        for job in jobs:
            fields = _queued(task=job.task, key=job.key, tier=job.tier, now=now, fleet=self.fleet)
            fields["message"] = job.message.document()
            fields.update(_tenant_field(job.message))
            fields.update(job.objective or {})
            if job.claimable_at is not None:
                fields["claimable_at"] = job.claimable_at
            ops.append(UpdateOne({"_id": job.record_id}, {"$setOnInsert": fields}, upsert=True))
            ops.append(
                UpdateOne(
                    {
                        "_id": job.record_id,
                        "state": State.QUEUED.value,
                        "unpublished_at": {"$ne": None},
                    },
                    {"$set": {"publish_retried_at": now}},
                )
            )
        with translate_errors("bulk enqueue"):
            try:
                result = self.collection.bulk_write(ops, ordered=False)
                upserted = {index // 2 for index in result.upserted_ids or {}}
                retried = result.modified_count
            except BulkWriteError as exc:
                upserted, retried = self._partial_enqueue(jobs, exc)
            outcomes = [
                EnqueueOutcome.NEW if i in upserted else EnqueueOutcome.KNOWN
                for i in range(len(jobs))
            ]
            if retried:
                known = [job.record_id for i, job in enumerate(jobs) if i not in upserted]
                # ``_id`` first: SecantusDB reads on the index of a query's first field
                marked = {
                    doc["_id"]
                    for doc in self.collection.find(
                        {"_id": {"$in": known}, "publish_retried_at": now}, {"_id": 1}
                    )
                }
                outcomes = [
                    EnqueueOutcome.UNPUBLISHED
                    if outcome is EnqueueOutcome.KNOWN and job.record_id in marked
                    else outcome
                    for job, outcome in zip(jobs, outcomes, strict=True)
                ]
        tracked = [
            (job.record_id, job.objective)
            for job, outcome in zip(jobs, outcomes, strict=True)
            if outcome is not EnqueueOutcome.KNOWN and (job.objective or {}).get("slo_at")
        ]
        self._track_objectives(tracked)
        return outcomes

    def _partial_enqueue(
        self, jobs: Sequence[QueuedJob], exc: BulkWriteError
    ) -> tuple[set[int], int]:
        """A bulk enqueue's partial failure: the jobs it wrote and the count it marked, when
        every failed statement is a lost race to insert a job (it is known); else raises."""
        details = exc.details
        if details.get("writeConcernErrors"):
            raise LedgerUnavailable(f"bulk enqueue of {len(jobs)} jobs: outcome unknown") from exc
        upserted = {entry["index"] // 2 for entry in details.get("upserted", [])}
        failed = [e for e in details.get("writeErrors", []) if e.get("code") != DUPLICATE_KEY]
        if failed:
            # The records written stay, made due for the relay: another producer may skip its
            # publish because of them, and this caller's error sends none of their messages.
            self.mark_unpublished_many([jobs[i].record_id for i in sorted(upserted)])
            raise StoreError(f"bulk enqueue failed: {failed[:3]}") from exc
        return upserted, int(details.get("nModified", 0))

    def _track_objectives(self, tracked: Sequence[tuple[str, Mapping[str, Any] | None]]) -> None:
        """:meth:`_track_objective` of several jobs in one write; a failure is logged (see
        there: the next claim covers for it)."""
        if not tracked:
            return
        ops = [
            UpdateOne(
                {"_id": record_id},
                _objective_update(objective["slo_at"], objective.get("slo_seconds")),
                upsert=True,
            )
            for record_id, objective in tracked
            if objective
        ]
        try:
            with translate_errors("objectives"):
                self._objectives.bulk_write(ops, ordered=False)
        except (BulkWriteError, StoreError) as exc:
            for record_id, objective in tracked:  # one at a time: each has its own retry
                self._track_objective(record_id, objective)
            logger.debug("objectives tracked one by one after %s", exc)

    def mark_unpublished_many(self, record_ids: Sequence[str], *, later: bool = False) -> None:
        """:meth:`mark_unpublished` of several jobs in one write (a bulk publish's failed
        batch)."""
        if not record_ids:
            return
        fields: dict[str, Any] = {"unpublished_at": self.now(), "updated_at": EPOCH}
        if not later:
            fields["claimable_at"] = UNPUBLISHED
        with translate_errors("unpublished mark"):
            self.collection.update_many(
                {"_id": {"$in": list(record_ids)}, "state": State.QUEUED.value, "fence": 0},
                {"$set": fields},
            )

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


def _tenant_field(message: KeptMessage) -> dict[str, Any]:
    """The record's ``tenant`` (its kept message carries it with its headers), if any."""
    tenant = message.headers.get(headers.TENANT)
    return {"tenant": tenant} if isinstance(tenant, str) else {}
