"""What operators changed of an app's schedules at run time, beside the ledger.

One document per schedule entry an operator paused (``<ledger>_schedules``, ``_id`` = the
entry's name): ``paused``, why, by whom and when. The schedule itself stays declared in code
(``beat_schedule``); what is stored here survives every restart and deploy, and every scheduler
(``celery beat`` with celery-ledger's scheduler, the workers' fleet scheduler) reads it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pymongo.errors import DuplicateKeyError

from .store import Ledger, translate_errors


class ScheduleControls:
    """The stored run-time changes of the schedules of one app (see the module docstring)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    @property
    def collection(self) -> Any:
        return self.ledger._companion("schedules")

    def paused(self) -> dict[str, dict[str, Any]]:
        """The paused entries by name: why, by whom, since when. One read on an index."""
        with translate_errors("schedule controls read"):
            return {str(doc["_id"]): doc for doc in self.collection.find({"paused": True})}

    def set_paused(self, name: str, paused: bool, *, actor: str, reason: str = "") -> bool:
        """Pause or resume ``name``; False if it already was so."""
        now: datetime = self.ledger.now()
        fields: dict[str, Any] = {"paused": paused, "changed_by": actor, "changed_at": now}
        if paused:
            fields["reason"] = reason
        with translate_errors("schedule controls write"):
            if not paused:  # resume: only what is paused
                found = self.collection.update_one({"_id": name, "paused": True}, {"$set": fields})
                return bool(found.matched_count)
            try:
                found = self.collection.update_one(
                    {"_id": name, "paused": {"$ne": True}}, {"$set": fields}, upsert=True
                )
            except DuplicateKeyError:  # there, and paused already
                return False
            return bool(found.matched_count or found.upserted_id is not None)
