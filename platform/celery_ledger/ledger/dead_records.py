"""Dead jobs: the one dead write (:meth:`DeadRecords.bury`) for every way a job dies, and
the dead letters' triage, replay and purge.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pymongo import DESCENDING

from .base import LedgerBase
from .core import (
    COPY_DUE_SHIFT,
    COPY_GRACE,
    ENDED_AS_WRITTEN,
    EPOCH,
    FOREVER,
    BuryMatch,
    Fenced,
    HeldBy,
    Unchanged,
    Unclaimed,
    _on_one_record,
    new_op,
    tenant_clauses,
    translate_errors,
)
from .dead import DeadJob
from .record import SCHEMA_VERSION, State


class DeadRecords(LedgerBase):
    """The one dead write, and the dead letters' triage, replay and purge."""

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

    def find_dead(
        self,
        *,
        task: str | None = None,
        since: datetime | None = None,
        reason: str | None = None,
        tenant: str | None = None,
        limit: int = 1000,
        include_purged: bool = False,
        after: tuple[datetime | None, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Dead records, newest first (by death time, then id); every filter (``reason``: a
        case-insensitive substring; ``tenant``: the record's, or its kept message's for a
        record without one) applies before the limit, so a listing is never cut short by what
        it hides. ``after``: only the records after this ``(finished_at, _id)`` in that order
        (the last of the page before: see ``DeadLetters.each``)."""
        query: dict[str, Any] = {"state": State.DEAD.value}
        if task:
            query["task"] = task
        if tenant:  # (an operator's query: no index of its own, see ensure_indexes)
            query["$or"] = tenant_clauses(tenant)
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
        """The dead letter's copy to its queue is due now (its publish failed), or is done
        (``copied_at``: when, for a broker that loses it later)."""
        now = self.now()
        done: dict[str, Any] = {"claimable_at": FOREVER, "copied_at": now}
        with translate_errors("dead-letter copy mark"):
            self.collection.update_one(
                {"_id": record_id, "state": State.DEAD.value, "purged_at": None},
                {"$set": {"claimable_at": now + COPY_DUE_SHIFT} if pending else done},
            )

    def take_copy(self, record_id: str, due: datetime) -> bool:
        """Take a due copy (its record's due time still ``due``, as read) for this process to
        publish: due again after ``COPY_GRACE`` unless confirmed, and no other process's. False
        if another took it, or it is no longer due."""
        with translate_errors("dead-letter copy take"):
            taken = self.collection.update_one(
                {"_id": record_id, "state": State.DEAD.value, "claimable_at": due},
                {"$set": {"claimable_at": self.now() + COPY_GRACE + COPY_DUE_SHIFT}},
            )
        return bool(taken.modified_count)

    def mark_copies_due(self, record_ids: Sequence[str]) -> int:
        """Make these dead letters' copies due now (a broker lost them), unless one is due or
        being made already (not ``FOREVER``: marked again, two workers would publish it);
        returns how many."""
        ids = list(record_ids)
        marked = 0
        with translate_errors("dead-letter copies due"):
            # (pages of 100: the embedded server's $in costs the square of its length)
            for start in range(0, len(ids), 100):
                result = self.collection.update_many(
                    {
                        "_id": {"$in": ids[start : start + 100]},
                        "state": State.DEAD.value,
                        "purged_at": None,
                        "claimable_at": FOREVER,
                    },
                    {"$set": {"claimable_at": self.now() + COPY_DUE_SHIFT}},
                )
                marked += result.modified_count
        return marked

    def copies_pending(self, *, limit: int = 100) -> list[dict[str, Any]]:
        """Dead records whose queue copy is due and was not confirmed (its publish failed, or
        the process that buried the job died before it; see ``COPY_GRACE``)."""
        # A dead record's claimable_at is its copy's due time, shifted (FOREVER once copied).
        due = self.now() + COPY_DUE_SHIFT
        with translate_errors("dead-letter copy query"):
            return list(
                self.collection.find(
                    # ($lt: on the embedded server a $lte over the sweepers' three-key index
                    # drops the records equal to its bound; one due this millisecond is next's)
                    {"state": State.DEAD.value, "claimable_at": {"$lt": due}}
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
