"""What operators changed of an app's schedules at run time, beside the ledger.

One document per schedule entry an operator changed (``<ledger>_schedules``, ``_id`` = the
entry's name): ``paused``, why, by whom and when; and, for an entry declared at run time rather
than in code (``beat_schedule``), its ``definition`` (a plain document: schedules.py turns it
into an entry). What is stored here survives every restart and deploy, and every scheduler
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
        return self.ledger.companion("schedules")

    def paused(self) -> dict[str, dict[str, Any]]:
        """The paused entries by name: why, by whom, since when. One read on an index."""
        with translate_errors("schedule controls read"):
            return {str(doc["_id"]): doc for doc in self.collection.find({"paused": True})}

    def read(self) -> tuple[frozenset[str], dict[str, dict[str, Any]]]:
        """What a scheduler reads every few seconds, in one read: the paused entries' names,
        and the definitions of the entries declared at run time (by name)."""
        with translate_errors("schedule controls read"):
            docs = list(
                self.collection.find(
                    {"$or": [{"paused": True}, {"definition": {"$exists": True}}]},
                    {"paused": 1, "definition": 1},
                )
            )
        paused = frozenset(str(doc["_id"]) for doc in docs if doc.get("paused") is True)
        declared = {
            str(doc["_id"]): doc["definition"]
            for doc in docs
            if isinstance(doc.get("definition"), dict)
        }
        return paused, declared

    def declared(self) -> dict[str, dict[str, Any]]:
        """The entries declared at run time: each one's whole document, by name."""
        with translate_errors("schedule controls read"):
            found = self.collection.find({"definition": {"$exists": True}})
            return {str(doc["_id"]): doc for doc in found}

    def declare(self, name: str, definition: dict[str, Any], *, actor: str) -> bool:
        """Store entry ``name``'s definition; False if an entry of that name is stored."""
        now: datetime = self.ledger.now()
        fields = {"definition": definition, "declared_by": actor, "declared_at": now}
        with translate_errors("schedule controls write"):
            try:
                found = self.collection.update_one(
                    {"_id": name, "definition": {"$exists": False}}, {"$set": fields}, upsert=True
                )
            except DuplicateKeyError:  # there, with a definition
                return False
            return bool(found.matched_count or found.upserted_id is not None)

    def remove(self, name: str) -> bool:
        """Delete entry ``name`` declared at run time (and its pause); False if none was."""
        with translate_errors("schedule controls write"):
            found = self.collection.delete_one({"_id": name, "definition": {"$exists": True}})
            return bool(found.deleted_count)

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
