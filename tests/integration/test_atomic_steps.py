"""Atomic steps: an effect in the ledger's MongoDB commits with its step record, exactly once."""

from __future__ import annotations

from typing import Any

import pytest

from celery_ledger import State

from .helpers import effect_count, wait_for


def test_an_atomic_effect_is_not_repeated_after_the_worker_dies_past_it(
    app: Any, token: str
) -> None:
    from tests.integration.ledger_app import atomic_effect

    # Given a job whose pool process is SIGKILLed after its atomic step committed
    result = atomic_effect.delay(token, "kill-after")

    # Then the next attempt skips the step, returns its recorded result, and the effect is once
    receipt = result.get(timeout=60)
    record = app.ledger.get(atomic_effect.name, token)
    assert record.state is State.SUCCEEDED
    assert record.attempts == 2
    assert effect_count("atomic-attempt", token) == 2
    assert effect_count("atomic", token) == 1
    assert receipt["receipt"] == f"r-{token}"
    assert app.ledger.find_raw(result.id)["steps"]["charge"]["atomic"] is True


def test_a_retry_after_an_atomic_step_reuses_its_result(app: Any, token: str) -> None:
    from tests.integration.ledger_app import atomic_effect

    receipt = atomic_effect.delay(token, "fail-after").get(timeout=30)

    assert effect_count("atomic-attempt", token) == 2
    assert effect_count("atomic", token) == 1
    assert receipt["receipt"] == f"r-{token}"


def test_a_failing_atomic_step_leaves_no_effect(app: Any, token: str) -> None:
    from tests.integration.ledger_app import atomic_effect

    result = atomic_effect.delay(token, "fail-inside")
    with pytest.raises(Exception, match="declined after the write"):
        result.get(timeout=30)

    record = wait_for(
        lambda: (r := app.ledger.get(atomic_effect.name, token)) and r.state is State.DEAD and r,
        what="dead record",
    )
    assert "permanent error" in record.dead_reason
    assert effect_count("atomic", token) == 0  # the write inside the step was rolled back
    assert "charge" not in (app.ledger.find_raw(result.id).get("steps") or {})


def test_a_failed_atomic_step_the_body_handles_does_not_hold_its_success_back(
    app: Any, token: str
) -> None:
    from tests.integration.ledger_app import atomic_effect

    # Given a body that catches its atomic step's failure and returns (a declined card)
    receipt = atomic_effect.delay(token, "fail-inside-caught").get(timeout=30)

    # Then the job succeeds at once: a rolled-back step is not one its success relies on
    assert receipt == {"receipt": None}
    record = app.ledger.get(atomic_effect.name, token)
    assert record.state is State.SUCCEEDED and record.attempts == 1
    assert effect_count("atomic", token) == 0
