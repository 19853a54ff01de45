"""The old path of :mod:`celery_ledger.fallback_serving` (serving a task's fallback), kept for
one release: renamed apart from :mod:`celery_ledger.policies.fallback` (the options and the
decision)."""

from __future__ import annotations

from .fallback_serving import Fallbacks, Served

__all__ = ["Fallbacks", "Served"]
