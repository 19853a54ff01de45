"""Payments: a charge keyed on the order id, against a gateway that sometimes times out, with
a backup gateway (behind its own breaker) used while the primary's breaker is open."""

from __future__ import annotations

import random

from celery_ledger import Alternate, Fallback, PermanentError

from .celery import app
from .effects import record_effect


class GatewayTimeout(TimeoutError):
    """The fake gateway did not answer in time (retryable)."""


class InvalidAmount(PermanentError):
    """The order's amount cannot be charged; retrying will not help."""


class FakeGateway:
    """Charges cards; fails with a timeout ``failure_rate`` of the time, before charging."""

    def __init__(self, failure_rate: float = 0.2) -> None:
        self.failure_rate = failure_rate

    def charge(self, order_id: int, amount_cents: int, *, idempotency_key: str) -> str:
        """A real gateway takes an idempotency key: a repeat of the same key charges once."""
        if amount_cents <= 0:
            raise InvalidAmount(f"order {order_id}: cannot charge {amount_cents} cents")
        if random.random() < self.failure_rate:
            raise GatewayTimeout(f"gateway timed out charging order {order_id}")
        record_effect("charge", idempotency_key, amount_cents=amount_cents)
        return f"ch_{order_id}_{amount_cents}"


gateway = FakeGateway()
backup_gateway = FakeGateway(failure_rate=0.0)


def order_key(order_id: int, amount_cents: int = 0) -> str:
    """The charge's idempotency key: one charge per order, whichever gateway makes it."""
    return f"order-{order_id}"


def charge_on_backup(order_id: int, amount_cents: int) -> dict[str, object]:
    """The charge made by the backup gateway, with the same idempotency key."""
    charge_id = backup_gateway.charge(order_id, amount_cents, idempotency_key=order_key(order_id))
    return {
        "order_id": order_id,
        "charge_id": charge_id,
        "amount_cents": amount_cents,
        "fraud_score": None,
        "gateway": "backup",
    }


class FakeFraudService:
    """Scores orders; down ``outage_rate`` of the time (a connection refused)."""

    def __init__(self, outage_rate: float = 0.1) -> None:
        self.outage_rate = outage_rate

    def score(self, order_id: int) -> float:
        if random.random() < self.outage_rate:
            raise ConnectionRefusedError("fraud service unreachable")
        return round(random.random(), 3)


fraud = FakeFraudService()


@app.task(
    bind=True,
    idempotency_key=order_key,
    tier="critical",
    breaker="gateway",
    max_retries=8,
    retry_base_seconds=0.5,
    retry_cap_seconds=5.0,
    # While the primary gateway's breaker is open, the backup gateway charges instead (behind
    # a breaker of its own: down too, the charge waits for the primary). Only on an open
    # breaker: a timed-out charge may have gone through, so it is retried on the same gateway
    # with the same key. And never replaced: the backup's charge is the real one.
    fallback=Fallback(
        (Alternate(charge_on_backup, breaker="backup-gateway", name="backup-gateway"),),
        on=frozenset({"circuit-open"}),
        replace=False,
    ),
    slo_seconds=60.0,  # a charge not done within a minute is escalated (metric, Sentry, alert)
)
def charge(self, order_id: int, amount_cents: int) -> dict[str, object]:
    """Charge an order exactly once, however often the message is delivered."""

    # A fraud score is nice to have, not worth a lost sale: an optional step behind a breaker
    # of its own. While the fraud service is down (its breaker open, or a refused connection)
    # the step is skipped and recorded as skipped, and the charge goes on with no score.
    def score() -> float:
        with app.breakers["fraud"]:
            return fraud.score(order_id)

    risk = self.step("fraud_score", optional=True, default=None).run(score)
    # The job's key travels to the receiver of the effect (see the README's limits)
    charge_id = gateway.charge(order_id, amount_cents, idempotency_key=self.job_key)
    return {
        "order_id": order_id,
        "charge_id": charge_id,
        "amount_cents": amount_cents,
        "fraud_score": risk,
        "gateway": "primary",
    }


@app.task(sensitive=True, tier="critical")
def store_card(customer_id: int, card_number: str) -> dict[str, object]:
    """Vault a customer's card. ``sensitive=True``: the number is sealed by the publisher
    before it reaches the broker and stays sealed in the ledger; monitoring, logs and Sentry
    never see it, and the idempotency key derived from the arguments is a keyed HMAC
    (``LEDGER_KEY_SECRET``), not a hash anyone could recompute from a guessed number."""
    record_effect("card", f"customer-{customer_id}")
    return {"customer_id": customer_id, "last4": card_number[-4:]}
