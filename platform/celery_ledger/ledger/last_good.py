"""Fallbacks' last good results (``<collection>_cache``): kept at each success, read when a
job falls back.
"""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime

from pymongo.errors import (
    DuplicateKeyError,
)

from .base import LedgerBase
from .core import (
    CACHE_RETENTION,
    _cache_id,
    translate_errors,
)


class LastGood(LedgerBase):
    """Fallbacks' last good results."""

    def remember(self, task: str, cache_key: str, result_json: str) -> None:
        """Keep ``result_json`` as the last good result of ``task`` for ``cache_key`` (an older
        one never overwrites a newer: the write matches only an older entry, or inserts)."""
        now = self.now()
        cache = self.companion("cache")
        with translate_errors("cache write"), contextlib.suppress(DuplicateKeyError):
            cache.update_one(
                {"_id": _cache_id(task, cache_key), "at": {"$lt": now}},
                {
                    "$set": {
                        "task": task,
                        "result": result_json,
                        "at": now,
                        "expires_at": now + max(self.result_retention, CACHE_RETENTION),
                    }
                },
                upsert=True,
            )

    def last_good(self, task: str, cache_key: str) -> tuple[str, datetime] | None:
        """The last good result of ``task`` for ``cache_key`` (stored JSON, when), or None."""
        with translate_errors("cache read"):
            doc = self.companion("cache").find_one({"_id": _cache_id(task, cache_key)})
        if doc is None or not isinstance(doc.get("result"), str):
            return None
        at = doc["at"] if doc["at"].tzinfo else doc["at"].replace(tzinfo=UTC)
        return doc["result"], at
