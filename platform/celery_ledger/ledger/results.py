"""Results outside the ledger protocol (Celery's own tasks, plain tasks), Celery's groups, and
the audit trail of operator actions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from pymongo import DESCENDING
from pymongo.errors import (
    DuplicateKeyError,
)

from ..errors import StoreError
from .base import LedgerBase
from .core import (
    translate_errors,
)


class Results(LedgerBase):
    """Plain tasks' results, Celery's groups and the audit trail."""

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
