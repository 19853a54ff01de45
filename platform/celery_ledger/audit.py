"""The audit trail: who replayed, purged or forced a breaker, and when (kept by the ledger)."""

from __future__ import annotations

import getpass
import logging
import socket
from typing import Any

from .ledger.store import Ledger

logger = logging.getLogger("celery_ledger.audit")


def current_actor() -> str:
    """``user@host`` of the operator running a command."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


def record(ledger: Ledger, action: str, target: str, *, actor: str, **details: Any) -> None:
    """Append one audit entry and log it."""
    logger.warning("audit: %s %s by %s %s", action, target, actor, details or "")
    ledger.audit(action, target, actor=actor, **details)


def entries(ledger: Ledger, *, limit: int = 100) -> list[dict[str, Any]]:
    return ledger.audit_entries(limit=limit)
