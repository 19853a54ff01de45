"""A breaker opened in one worker process stops the calls of every other process."""

from __future__ import annotations

import time
from typing import Any

from celery_ledger import State
from celery_ledger.policies.breaker import BreakerState
from tasks.effects import effects, record_effect

from .helpers import effect_count, wait_for


def test_open_breaker_defers_without_calls_or_attempts_then_a_probe_closes_it(
    app: Any, token: str
) -> None:
    from tests.integration.ledger_app import call_payments

    breaker = app.breakers["payments"]
    breaker.reset()
    record_effect("outage", "payments")
    try:
        # Given a job whose calls fail until the breaker opens (3 consecutive failures)
        first = call_payments.delay(f"{token}-a")
        wait_for(
            lambda: breaker.status().state is BreakerState.OPEN, timeout=20, what="breaker open"
        )
        calls_when_open = effect_count("payment_call", f"{token}-a")
        assert calls_when_open == 3

        # When another job arrives while it is open, it is deferred: no call, no attempt
        second = call_payments.delay(f"{token}-b")
        wait_for(
            lambda: (
                (r := app.ledger.find_raw(second.id)) is not None and r.get("deferrals", 0) >= 1
            ),
            what="deferral recorded",
        )
        time.sleep(1.0)
        assert effect_count("payment_call", f"{token}-b") == 0
        assert effect_count("payment_call", f"{token}-a") == calls_when_open
        assert app.ledger.find_raw(second.id)["attempts"] == 0
    finally:
        effects().delete_many({"kind": "outage", "key": "payments"})

    # Then after the cooldown a probe succeeds, the breaker closes and both jobs finish
    assert first.get(timeout=30) == "paid"
    assert second.get(timeout=30) == "paid"
    assert breaker.status().state is BreakerState.CLOSED
    done_b = app.ledger.get(call_payments.name, f"{token}-b")
    assert (done_b.state, done_b.attempts, done_b.errors) == (State.SUCCEEDED, 1, [])
    done_a = app.ledger.get(call_payments.name, f"{token}-a")
    assert len(done_a.errors) == 3  # only real failures count; deferrals did not
    assert effect_count("payment_call", f"{token}-b") == 1
