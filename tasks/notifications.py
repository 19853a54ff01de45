"""Notifications: an email keyed on the recipient and the template."""

from __future__ import annotations

from .celery import app
from .effects import record_effect


@app.task(idempotency_key="email-{user_id}-{template}")
def send_email(user_id: int, template: str, context: dict[str, str] | None = None) -> str:
    """Send one email per (user, template); a duplicate delivery sends nothing."""
    record_effect("email", f"email-{user_id}-{template}", template=template)
    return f"sent {template} to user {user_id}"
