"""Notifications: an email keyed on the recipient and the template, queued while the mail
service is down (its breaker open) and sent once it is back."""

from __future__ import annotations

import random

from celery_ledger import Fallback, Placeholder

from .celery import app
from .effects import record_effect


class FakeMailService:
    """Sends mail; unreachable ``outage_rate`` of the time (a refused connection)."""

    def __init__(self, outage_rate: float = 0.0) -> None:
        self.outage_rate = outage_rate

    def send(self, user_id: int, template: str, *, idempotency_key: str) -> None:
        if random.random() < self.outage_rate:
            raise ConnectionRefusedError("mail service unreachable")
        record_effect("email", idempotency_key, template=template)


mail = FakeMailService()


@app.task(
    bind=True,
    idempotency_key="email-{user_id}-{template}",
    breaker="mail",
    # While the mail service's breaker is open the caller gets "queued" at once (the record
    # says degraded), and the real send runs under the same key when the breaker lets calls
    # through again, replacing "queued" with "sent ...", once.
    fallback=Fallback((Placeholder("queued"),), on=frozenset({"circuit-open"})),
)
def send_email(self, user_id: int, template: str, context: dict[str, str] | None = None) -> str:
    """Send one email per (user, template); a duplicate delivery sends nothing."""
    mail.send(user_id, template, idempotency_key=self.job_key)
    return f"sent {template} to user {user_id}"
