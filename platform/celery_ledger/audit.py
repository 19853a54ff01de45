"""The audit trail: who replayed, purged or forced a breaker, and when (kept by the ledger).

An action is audited before it runs: :func:`action` writes the entry (``outcome: started``)
and only then lets the action go, and records how it ended (``done`` with its details, or
``failed`` with the error). A ledger that cannot take the entry stops the action, so no action
is ever unaudited; an action cut short (the operator's process killed) stays ``started``.

The actor is who the operator says they are, and the entry says how it was told: an explicit
``--actor NAME`` (``NAME [--actor]``), else ``LEDGER_ACTOR`` (``NAME [LEDGER_ACTOR]``), else the
operating system's user and host (``user@host [os user]``).
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

from .ledger.store import Ledger

logger = logging.getLogger("celery_ledger.audit")

ACTOR_VARIABLE = "LEDGER_ACTOR"


class Actor(str):
    """An actor already labelled with where the name came from (``alice [console]``): kept as
    it is. A plain string (``--actor``) is labelled as self-declared; only code can make one
    of these, so no command line can pass itself off as another source."""

    __slots__ = ()

    @classmethod
    def of(cls, name: str, source: str) -> Actor:
        return cls(f"{name} [{source}]")


def current_actor(explicit: str | None = None) -> str:
    """The operator running a command, with where the name came from (module docstring)."""
    if isinstance(explicit, Actor):  # labelled by the code that knows its source
        return str(explicit)
    if explicit:
        return f"{explicit} [--actor]"
    named = os.environ.get(ACTOR_VARIABLE, "").strip()
    if named:
        return f"{named} [{ACTOR_VARIABLE}]"
    return f"{getpass.getuser()}@{socket.gethostname()} [os user]"


class Entry:
    """An audit entry being written: :meth:`note` adds details to its outcome."""

    def __init__(self) -> None:
        self.details: dict[str, Any] = {}

    def note(self, **details: Any) -> None:
        self.details.update(details)


@contextlib.contextmanager
def action(
    ledger: Ledger, name: str, target: str, *, actor: str, **details: Any
) -> Iterator[Entry]:
    """Audit the action run inside the block: the entry first, the outcome after."""
    entry_id = ledger.audit(name, target, actor=actor, outcome="started", **details)
    logger.warning("audit: %s %s by %s %s", name, target, actor, details or "")
    entry = Entry()
    try:
        yield entry
    except BaseException as exc:
        with contextlib.suppress(Exception):  # the entry already says it started
            ledger.audit_outcome(
                entry_id, "failed", error=f"{type(exc).__name__}: {exc}"[:2000], **entry.details
            )
        raise
    ledger.audit_outcome(entry_id, "done", **entry.details)


def record(ledger: Ledger, action_name: str, target: str, *, actor: str, **details: Any) -> None:
    """Audit an action that has nothing to run (one entry, ``done``)."""
    with action(ledger, action_name, target, actor=actor, **details):
        pass


def entries(ledger: Ledger, *, limit: int = 100) -> list[dict[str, Any]]:
    return ledger.audit_entries(limit=limit)
