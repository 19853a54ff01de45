"""Graceful degradation on real servers: while a breaker is open the fallback is served and the
record says so; the real job replaces a degraded result once; an alternate provider is used
behind its own breaker; a late job is escalated exactly once and polls as late."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_ledger import State
from celery_ledger.policies.breaker import BreakerState
from tasks.effects import effects, record_effect

from .helpers import effect_count, wait_for

OPEN = BreakerState.OPEN


@pytest.fixture
def breakers(app: Any) -> Iterator[Any]:
    """The test app's fallback breakers, closed and idle before and after each test."""
    names = ("warehouse", "primary", "backup")
    for name in names:
        app.breakers[name].reset()
    yield app.breakers
    for name in names:
        app.breakers[name].reset()


def test_a_report_is_served_from_cache_while_down_then_rebuilt_once(
    app: Any, token: str, breakers: Any
) -> None:
    from tests.integration.ledger_app import dashboard

    customer = f"c-{token}"
    # Given a good report of the customer built while the warehouse was up
    first = dashboard.delay(customer, f"{token}-1").get(timeout=30)
    assert first == {"customer": customer, "built_for": f"{token}-1"}

    # When the warehouse's breaker is open, the next report is the last good one, at once
    breakers["warehouse"].force(OPEN)
    result = dashboard.delay(customer, f"{token}-2")
    assert result.get(timeout=30) == first
    assert effect_count("dashboard_build", f"{token}-2") == 0  # the warehouse was not called
    record = app.ledger.get(dashboard.name, f"{token}-2")
    assert record is not None and record.state is State.SUCCEEDED
    assert record.degraded is not None
    assert (record.degraded["reason"], record.degraded["fallback"]) == ("circuit-open", "last-good")
    assert result.state == "SUCCESS"

    # While the breaker stays open, its replacement waits (the degraded result still served)
    time.sleep(2.5)
    assert effect_count("dashboard_build", f"{token}-2") == 0
    assert app.AsyncResult(result.id).get(timeout=5) == first

    # Then once calls go through again, the real job replaces the degraded result, once
    breakers["warehouse"].force(None)
    wait_for(
        lambda: app.ledger.get(dashboard.name, f"{token}-2").degraded is None,
        timeout=30,
        what="the degraded report replaced",
    )
    replaced = app.ledger.get(dashboard.name, f"{token}-2")
    assert replaced.result == {"customer": customer, "built_for": f"{token}-2"}
    assert replaced.replaced_degraded is not None
    assert replaced.replaced_degraded["fallback"] == "last-good"
    assert app.AsyncResult(result.id).get(timeout=5) == replaced.result
    # and never again: further copies (a reconciler sweep, a duplicate) change nothing
    app.reconciler.sweep(stale_after_seconds=0.1, lease_grace_seconds=0.1)
    dashboard.delay(customer, f"{token}-2")
    time.sleep(2.0)
    assert effect_count("dashboard_build", f"{token}-2") == 1
    # the replaced report is the customer's last good one now
    breakers["warehouse"].force(OPEN)
    assert dashboard.delay(customer, f"{token}-3").get(timeout=30) == replaced.result


def test_an_alternate_provider_is_used_while_the_primarys_breaker_is_open(
    app: Any, token: str, breakers: Any
) -> None:
    from tests.integration.ledger_app import charge_with_backup

    # Given the primary gateway's breaker open
    breakers["primary"].force(OPEN)

    # When a charge runs, the backup gateway charges it, once, and for good (not replaced)
    result = charge_with_backup.delay(f"{token}-a")
    assert result.get(timeout=30) == {"paid": f"{token}-a", "via": "backup"}
    record = app.ledger.get(charge_with_backup.name, f"{token}-a")
    assert record is not None and record.state is State.SUCCEEDED
    assert record.degraded is not None and record.degraded["fallback"] == "backup"
    assert record.degraded["replace_at"] is None
    assert effect_count("backup_charge", f"{token}-a") == 1
    assert effect_count("primary_charge", f"{token}-a") == 0

    # And with the backup's own breaker open too, the job waits instead, then runs on the
    # primary once it is back: no option served, nothing charged twice
    breakers["backup"].force(OPEN)
    waiting = charge_with_backup.delay(f"{token}-b")
    wait_for(
        lambda: (r := app.ledger.find_raw(waiting.id)) is not None and r.get("deferrals", 0) >= 1,
        what="the charge put off",
    )
    assert effect_count("backup_charge", f"{token}-b") == 0
    breakers["primary"].force(None)
    assert waiting.get(timeout=30) == {"paid": f"{token}-b", "via": "primary"}
    done = app.ledger.get(charge_with_backup.name, f"{token}-b")
    assert done.degraded is None and done.replaced_degraded is None
    assert effect_count("primary_charge", f"{token}-b") == 1
    time.sleep(2.0)
    assert effect_count("primary_charge", f"{token}-a") == 0  # the backup's charge stands


def test_a_late_job_is_escalated_exactly_once_and_polls_as_late(app: Any, token: str) -> None:
    from tests.integration.ledger_app import slow_report

    # Given a job with a 1 s objective that takes 5 s
    result = slow_report.delay(token, 5.0)

    # Then while it runs past its objective, a poller sees it late
    wait_for(lambda: result.state == "LATE", timeout=15, what="the job polled as late")
    record = app.ledger.get(slow_report.name, token)
    assert record is not None and record.status == "late" and record.late_at is not None
    assert result.result["slo_seconds"] == 1.0

    # however many checkers look at once (the worker's housekeeping and these threads)
    checks = [threading.Thread(target=app.escalation.check) for _ in range(4)]
    for check in checks:
        check.start()
    for check in checks:
        check.join()

    # And it is reported once, and ends succeeded as usual
    assert result.get(timeout=30) == token
    assert app.ledger.get(slow_report.name, token).status == "succeeded"
    time.sleep(1.5)
    assert effect_count("late", token) == 1
    assert effect_count("slow_report", token) == 1


def test_a_job_that_finishes_within_its_objective_is_never_late(app: Any, token: str) -> None:
    from tests.integration.ledger_app import slow_report

    assert slow_report.delay(token, 0.0).get(timeout=30) == token
    time.sleep(2.0)
    record = app.ledger.get(slow_report.name, token)
    assert record is not None and record.late_at is None
    assert "slo_at" not in app.ledger.find_raw(record.id)
    assert effect_count("late", token) == 0


def test_a_replacement_whose_message_is_lost_is_brought_back_by_the_reconciler(
    app: Any, token: str, breakers: Any
) -> None:
    from tests.integration.ledger_app import dashboard

    customer = f"c-{token}"
    breakers["warehouse"].force(OPEN)
    record_effect("seed", token)
    # No last good result for this customer: seed one so the fallback can serve
    app.ledger.remember(dashboard.name, f"dashboard-{customer}", '{"seeded": true}')
    result = dashboard.delay(customer, token)
    assert result.get(timeout=30) == {"seeded": True}
    # Given the replacement's message lost (dropped from the delayed set before it was due)
    wait_for(lambda: _drop_delayed(app, result.id) > 0, timeout=10, what="the replacement dropped")
    breakers["warehouse"].force(None)
    time.sleep(2.0)
    assert effect_count("dashboard_build", token) == 0

    # When the reconciler sweeps, it republishes the job, and the real one replaces it once
    report = app.reconciler.sweep(stale_after_seconds=0.5, lease_grace_seconds=0.5)
    assert report.stale_replacements >= 1
    wait_for(
        lambda: app.ledger.get(dashboard.name, token).degraded is None,
        timeout=30,
        what="the degraded report replaced",
    )
    assert effect_count("dashboard_build", token) == 1
    effects().delete_many({"kind": "seed", "key": token})


def _drop_delayed(app: Any, task_id: str) -> int:
    """Remove the delayed deliveries of ``task_id``; how many were removed."""
    delayed = app.runtime.delayed
    client = app.runtime.redis
    dropped = 0
    for member in client.zrange(delayed.key, 0, -1):
        if task_id.encode() in member:
            dropped += client.zrem(delayed.key, member)
    return dropped
