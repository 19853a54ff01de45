"""The old path of :mod:`celery_ledger.ledger.trigger_store` (the triggers' resume tokens and
problems), kept for one release: renamed so that ``triggers`` names the engine
(:mod:`celery_ledger.triggers`) only."""

from __future__ import annotations

from .trigger_store import PROBLEMS, TriggerState, TriggerStore

__all__ = ["PROBLEMS", "TriggerState", "TriggerStore"]
