"""Where change-stream triggers keep their place: one document per trigger in the ledger's
companion collection ``<ledger collection>_triggers``, owned by :class:`TriggerStore` (nothing
else queries it).

A document holds the resume token of the last change whose job is recorded, the fencing token of
the watcher that wrote it, and, once a stream cannot go on, the problem (``invalidated``,
``history_lost``, ``invalid_token``) that stops every watcher of the trigger until an operator
resets it. Every write is conditional on the writer's fencing token (a watcher paused past its
lease can never move the token back) and journaled, like the ledger's own writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pymongo.collection import Collection
from pymongo.errors import DuplicateKeyError

from .store import Ledger, translate_errors

PROBLEMS = ("invalidated", "history_lost", "invalid_token", "stuck")


@dataclass(frozen=True, slots=True)
class TriggerState:
    """A trigger's stored place: ``token`` None means "start from now"."""

    name: str
    token: dict[str, Any] | None
    fence: int
    changes: int = 0
    problem: str | None = None
    detail: str | None = None
    updated_at: datetime | None = None
    problem_at: datetime | None = None

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> TriggerState:
        token = doc.get("token")
        return cls(
            name=str(doc["_id"]),
            token=dict(token) if isinstance(token, Mapping) else None,
            fence=int(doc.get("fence") or 0),
            changes=int(doc.get("changes") or 0),
            problem=doc.get("problem"),
            detail=doc.get("detail"),
            updated_at=doc.get("updated_at"),
            problem_at=doc.get("problem_at"),
        )


class TriggerStore:
    """The triggers' resume tokens and problems (see the module docstring)."""

    SUFFIX = "triggers"

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    @property
    def collection(self) -> Collection[dict[str, Any]]:
        # The ledger's companion: same database, client and journaled write concern.
        return self._ledger.companion(self.SUFFIX)

    def load(self, name: str) -> TriggerState | None:
        with translate_errors("trigger load"):
            doc = self.collection.find_one({"_id": name})
        return None if doc is None else TriggerState.of(doc)

    def all(self) -> list[TriggerState]:
        with translate_errors("trigger list"):
            return [TriggerState.of(doc) for doc in self.collection.find({}).sort("_id", 1)]

    def save_token(
        self, name: str, token: Mapping[str, Any], *, fence: int, holder: str, changes: int
    ) -> bool:
        """Store ``token`` (every change before it has its job recorded) if no watcher with a
        higher fencing token wrote since; False if one did (this watcher lost its lease)."""
        update = {
            "$set": {
                "token": dict(token),
                "fence": fence,
                "holder": holder,
                "updated_at": self._ledger.now(),
            },
            "$inc": {"changes": changes},
        }
        return self._fenced(name, fence, update)

    def report_problem(self, name: str, problem: str, detail: str, *, fence: int) -> bool:
        """Stop the trigger with ``problem`` (one of :data:`PROBLEMS`) until :meth:`reset`."""
        if problem not in PROBLEMS:
            raise ValueError(f"unknown trigger problem {problem!r}")
        now = self._ledger.now()
        update = {
            "$set": {"problem": problem, "detail": detail[:1000], "problem_at": now, "fence": fence}
        }
        return self._fenced(name, fence, update)

    def reset(self, name: str) -> bool:
        """Forget the trigger's token and problem: its next watcher starts from now (the
        documented recovery, with a backfill over the collection for what was missed). The
        fence is kept, so a watcher that held the trigger before cannot write after this."""
        with translate_errors("trigger reset"):
            result = self.collection.update_one(
                {"_id": name},
                {
                    "$unset": {"token": "", "problem": "", "detail": "", "problem_at": ""},
                    "$set": {"reset_at": self._ledger.now()},
                },
            )
        return result.matched_count == 1

    def _fenced(self, name: str, fence: int, update: dict[str, Any]) -> bool:
        # One operation on ``_id``: an existing document with a higher fence does not match, so
        # the upsert tries to insert a second document with that ``_id`` and is refused.
        with translate_errors("trigger save"):
            try:
                self.collection.update_one(
                    {"_id": name, "fence": {"$lte": fence}}, update, upsert=True
                )
            except DuplicateKeyError:
                return False
        return True

    def highest_fence(self, name: str) -> int:
        state = self.load(name)
        return 0 if state is None else state.fence


__all__ = ["PROBLEMS", "TriggerState", "TriggerStore"]
