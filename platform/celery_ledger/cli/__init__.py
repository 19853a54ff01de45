"""``celery -A APP ledger ...``: celery-ledger's commands, a Celery sub-command group.

Installed through the ``celery.commands`` entry point, so they run with the app that ``-A``
names (``ctx.obj.app``).
"""

from __future__ import annotations

from .commands import ledger

__all__ = ["ledger"]
