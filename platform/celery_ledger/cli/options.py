"""Options that several ``celery ledger`` commands share (one definition each)."""

from __future__ import annotations

import click

#: Who runs an audited command (``celery_ledger.audit.current_actor`` records its source).
actor_option = click.option(
    "--actor",
    "actor_name",
    default=None,
    help="Who runs this, for the audit trail (default: $LEDGER_ACTOR, else user@host).",
)
