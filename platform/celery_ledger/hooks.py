"""Platform events for observability: metrics, Sentry, logs subscribe here.

Events (keyword fields):
    claimed(task, tier, record_id, fence)          succeeded(task, tier, record_id, seconds)
    duplicate(task, tier, record_id)               retried(task, tier, record_id, delay, error)
    deferred(task, tier, record_id, reason, delay) dead(task, tier, record_id, reason, entry)
    lease_lost(task, tier, record_id, fence)       breaker(name, old, new)
    ledger_unavailable(task, tier, record_id)

A handler's exception is logged and swallowed: observing can never fail a task.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("celery_ledger.hooks")

Handler = Callable[..., None]


class Hooks:
    def __init__(self) -> None:
        self._handlers: dict[str, list[Handler]] = defaultdict(list)

    def on(self, event: str, handler: Handler) -> Handler:
        """Subscribe ``handler`` to ``event`` (``"*"`` for all; it then gets ``event=``)."""
        self._handlers[event].append(handler)
        return handler

    def emit(self, event: str, **fields: Any) -> None:
        for handler in self._handlers.get(event, ()):
            self._call(handler, event, fields)
        for handler in self._handlers.get("*", ()):
            self._call(handler, event, {"event": event, **fields})

    @staticmethod
    def _call(handler: Handler, event: str, fields: dict[str, Any]) -> None:
        try:
            handler(**fields)
        except Exception:
            logger.warning("hook %r for %s failed", handler, event, exc_info=True)
