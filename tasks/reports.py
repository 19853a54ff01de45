"""Reports: a bulk rebuild of a daily report (default key: hash of the arguments), and a
customer's dashboard served from its last good build while the warehouse is down."""

from __future__ import annotations

import hashlib
import random
import time
from datetime import UTC, datetime
from typing import Any

from celery.schedules import crontab

from celery_ledger import Fallback, LastGood

from .celery import app
from .effects import record_effect


class FakeWarehouse:
    """Answers dashboard queries; unreachable ``outage_rate`` of the time."""

    def __init__(self, outage_rate: float = 0.0) -> None:
        self.outage_rate = outage_rate

    def totals(self, customer_id: int, day: str) -> dict[str, int]:
        if random.random() < self.outage_rate:
            raise ConnectionRefusedError("warehouse unreachable")
        seed = int(hashlib.sha256(f"{customer_id}:{day}".encode()).hexdigest()[:6], 16)
        return {"orders": seed % 97, "revenue_cents": seed % 100_000}


warehouse = FakeWarehouse()


@app.task(
    idempotency_key="dashboard-{customer_id}-{day}",
    breaker="warehouse",
    # While the warehouse's breaker is open (or its retries run out) the customer gets the
    # last good dashboard, up to a week old; the real one is rebuilt under the same key when
    # the warehouse is back and replaces it once. A caller polling the result sees the cached
    # dashboard until then (the record says degraded, and which fallback served it).
    fallback=Fallback(
        (LastGood("dashboard-{customer_id}", max_age_seconds=7 * 24 * 3600),),
        on=frozenset({"circuit-open", "retries-exhausted"}),
        replace_after_seconds=300.0,
    ),
    max_retries=3,
    slo_seconds=120.0,
)
def customer_dashboard(customer_id: int, day: str) -> dict[str, object]:
    """A customer's dashboard for one day, from the warehouse."""
    totals = warehouse.totals(customer_id, day)
    record_effect("dashboard", f"dashboard-{customer_id}-{day}")
    return {"customer_id": customer_id, "day": day, **totals}


@app.task(tier="bulk")
def rebuild_report(report: str, day: str) -> dict[str, str]:
    """Rebuild one report for one day (a few ms of CPU)."""
    digest = hashlib.sha256(f"{report}:{day}".encode()).hexdigest()
    time.sleep(0.005)
    record_effect("report", f"{report}:{day}")
    return {"report": report, "day": day, "digest": digest[:12]}


@app.task(
    tier="bulk",
    idempotency_key="export-{customer_id}-{table}-{day}",
    # Whose job it is: every customer's exports share the bulk tier fairly (fair dispatch,
    # docs/guide/tenants.md), so one customer asking for ten thousand waits behind its own,
    # and another's one export starts within a few jobs. The tenant is a stable id, never a
    # name that changes, and as coarse as the fairness wanted: a customer, not a user.
    tenant="customer-{customer_id}",
)
def customer_export(customer_id: int, table: str, day: str) -> dict[str, object]:
    """Export one table of one customer's day (a few ms of CPU)."""
    time.sleep(0.005)
    record_effect("export", f"export-{customer_id}-{table}-{day}")
    return {"customer_id": customer_id, "table": table, "day": day}


@app.periodic(
    crontab(minute=5),
    name="hourly-rollup",
    # every hour missed in an outage of up to six hours is rolled up after it, one at a time
    catch_up="all",
    catch_up_window_seconds=6 * 3600,
    overlap="buffer_one",
    # many apps' hourly jobs fire at :05: spread over a minute, the same for every scheduler
    jitter_seconds=60,
)
@app.task(bind=True, tier="bulk", max_retries=5)
def hourly_rollup(self: Any) -> dict[str, str]:
    """Roll up one hour of orders, at five past every hour: the workers fire it themselves (no
    celery beat needed). A task without arguments: each run is the job of its slot
    (``schedule:hourly-rollup@<slot>``), so every hour runs once however many workers or beats
    fire it. It works on the hour its slot is for, not on the hour it happens to run in: a
    run retried, or caught up after an outage, rolls up its own."""
    slot = self.scheduled_for or datetime.now(UTC)  # (None when called by hand)
    hour = slot.replace(minute=0, second=0, microsecond=0)
    record_effect("rollup", hour.isoformat())
    return {"hour": hour.isoformat(), "slot": slot.isoformat()}
