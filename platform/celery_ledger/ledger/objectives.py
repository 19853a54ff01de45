"""Latency objectives (``<collection>_objectives``): the jobs past their objective, marked late
once.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from pymongo import ASCENDING, DeleteOne
from pymongo.errors import (
    BulkWriteError,
)

from ..errors import StoreError
from .core import (
    OBJECTIVE_PAGE,
    translate_errors,
)
from .indexes import Indexes


def objective(slo_seconds: float | None, since: datetime) -> dict[str, Any]:
    """The latency objective fields of a new record (``slo_at``, ``slo_seconds``): due
    ``slo_seconds`` after ``since``, the job's first enqueue (its publish, or its due time when
    published for later; now, when the message does not say) on the ledger's clock (see
    ``Runtime.on_ledger_clock``)."""
    if slo_seconds is None:
        return {}
    return {
        "slo_at": since + timedelta(seconds=slo_seconds),
        "slo_seconds": slo_seconds,
    }


class Objectives(Indexes):
    """Latency objectives: the jobs past theirs, each marked late once (the index they are
    read by differs before ``ledger finish-upgrade``)."""

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
