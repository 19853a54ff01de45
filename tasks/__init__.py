"""The reference app: tasks an app team would write on celery-ledger (``celery -A tasks``).

``app`` is built on first use (PEP 562), so ``LEDGER_*`` settings are read then, not when
this package is imported.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    if name == "app":
        from .celery import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
