"""The audit trail: who replayed, purged or forced a breaker, and when (a MongoDB collection)."""

from __future__ import annotations

import getpass
import logging
import socket
from typing import Any

from .ledger.store import Ledger, translate_errors, utcnow

logger = logging.getLogger("celery_ledger.audit")


def current_actor() -> str:
    """``user@host`` of the operator running a command."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


def record(ledger: Ledger, action: str, target: str, *, actor: str, **details: Any) -> None:
    """Append one audit entry (``<ledger collection>_audit``) and log it."""
    entry = {"action": action, "target": target, "actor": actor, "at": utcnow(), **details}
    logger.warning("audit: %s %s by %s %s", action, target, actor, details or "")
    audit = ledger.collection.database.get_collection(f"{ledger.collection_name}_audit")
    with translate_errors("audit"):
        audit.insert_one(entry)


def entries(ledger: Ledger, *, limit: int = 100) -> list[dict[str, Any]]:
    audit = ledger.collection.database.get_collection(f"{ledger.collection_name}_audit")
    with translate_errors("audit read"):
        return list(audit.find({}, {"_id": 0}).sort("at", -1).limit(limit))
