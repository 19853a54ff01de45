"""An optional step whose dependency is down is skipped and recorded as skipped, and the job
succeeds once; with the dependency up the same step runs (real worker, real ledger)."""

from __future__ import annotations

import time
from typing import Any

from celery_ledger import State
from tasks.effects import record_effect

from .helpers import effect_count


def test_an_optional_step_is_skipped_while_its_dependency_is_down(app: Any, token: str) -> None:
    from tests.integration.ledger_app import enriched_order

    # Given the enrichment service down for this order
    record_effect("outage", f"enrichment-{token}")

    # When the order runs, it succeeds without the enrichment, once
    assert enriched_order.delay(token).get(timeout=30) == {"score": None}
    record = app.ledger.get(enriched_order.name, token)
    assert record is not None and record.state is State.SUCCEEDED and record.attempts == 1
    step = app.ledger.find_raw(record.id)["steps"]["enrich"]
    assert step["skipped"] == "dependency down: ConnectionError"  # its type, not its text
    assert effect_count("order", token) == 1
    assert effect_count("enrich_call", token) == 1


def test_with_its_dependency_up_the_optional_step_runs(app: Any, token: str) -> None:
    from tests.integration.ledger_app import enriched_order

    assert enriched_order.delay(token).get(timeout=30) == {"score": 1}
    record = app.ledger.get(enriched_order.name, token)
    assert record is not None
    assert "skipped" not in app.ledger.find_raw(record.id)["steps"]["enrich"]


def test_a_slow_dependency_past_the_tasks_deadline_skips_its_optional_step(
    app: Any, token: str
) -> None:
    from tests.integration.ledger_app import slow_recommendations

    # Given a dependency that takes 5 s, called through bounded() under a 0.5 s deadline
    started = time.monotonic()
    assert slow_recommendations.delay(token).get(timeout=30) == []

    # Then the job did not wait for it: the step is skipped as past the deadline, once
    assert time.monotonic() - started < 4.5
    record = app.ledger.get(slow_recommendations.name, token)
    assert record is not None and record.state is State.SUCCEEDED and record.attempts == 1
    step = app.ledger.find_raw(record.id)["steps"]["recommend"]
    assert step["skipped"] == "dependency down: DeadlineExceeded"
    assert effect_count("page", token) == 1
