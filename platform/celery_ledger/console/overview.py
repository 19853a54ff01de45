"""The console overview's numbers: each tier's depth, age, throughput and state, the last
hour's charts (inline SVG, see ``svg``), and the health checks, each read at most once per a
few seconds however many tabs refresh the panels."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from ..broker import oldest_ages
from ..errors import LedgerError
from ..health import run_checks
from ..policies.backpressure import DEFAULT_TIER_LIMITS
from . import series, svg

SPARK_MINUTES = 15
HEALTH_CACHE_SECONDS = 10.0
HOUR_MINUTES = 60  # the overview's charts
HOUR_CACHE_SECONDS = 10.0  # the hour's read of the ledger, at most once per this
HOUR_LIMIT = 20_000  # records of each outcome the hour's read takes at most (said when reached)


class OverviewData:
    """What the overview shows, over one app."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._health: tuple[float, list[Any]] | None = None
        self._hour: tuple[float, list[dict[str, Any]], datetime] | None = None

    def now(self) -> dict[str, Any]:
        """The overview's context: each tier's row, the hour's charts, health, problems."""
        app, runtime = self.app, self.app.runtime
        settings = app.settings
        tiers = list(app.tiers.names)
        queues = {tier: app.tiers.queue(tier) for tier in tiers}
        problems: list[str] = []
        depths: dict[str, int] = {}
        ages: dict[str, float | None] = {}
        try:
            depths = runtime.queue_depths.refresh()
            ages = oldest_ages(runtime.redis, queues.values(), runtime.message_time())
        except Exception as exc:  # shown, never a broken page
            problems.append(f"broker: {type(exc).__name__}: {exc}")
        try:
            if depths:  # this sample joins the workers' in the depths' history
                runtime.depth_history.record(depths, at=runtime.message_time())
        except Exception as exc:
            problems.append(f"broker: {type(exc).__name__}: {exc}")
        try:
            rows_of_hour, ledger_now = self.hour()
        except LedgerError as exc:
            rows_of_hour, ledger_now = [], runtime.ledger.now()
            problems.append(f"ledger: {exc}")
        recent = series.Window(now=ledger_now, minutes=SPARK_MINUTES)
        finished = series.throughput(rows_of_hour, recent, tiers)
        throttle = runtime.throttle
        rows = []
        for tier in tiers:
            limit = settings.tier_limits.get(tier) or DEFAULT_TIER_LIMITS.get(tier)
            depth = depths.get(tier, depths.get(queues[tier], 0))
            counts = finished[tier]  # (every tier is there)
            done, dead = sum(counts["succeeded"]), sum(counts["dead"])
            rows.append(
                {
                    "tier": tier,
                    "queue": queues[tier],
                    "depth": depth,
                    "oldest": ages.get(queues[tier]),
                    "succeeded": counts["succeeded"],
                    "dead": counts["dead"],
                    "per_minute": (done + dead) / SPARK_MINUTES,
                    "failure_rate": dead / (done + dead) if done + dead else 0.0,
                    "limit": limit,
                    "backpressure": bool(limit and limit.high_water and depth >= limit.high_water),
                    "throttled": tier == "bulk" and quietly(throttle.should_throttle, False),
                    "throttle_reason": quietly(throttle.reason, None) if tier == "bulk" else None,
                }
            )
        breakers = quietly(app.breakers.statuses, [])
        open_breakers = [b for b in breakers if b.state.value != "closed"]
        return {
            "rows": rows,
            "tenants": self.tenants(queues, problems),
            "tenants_top": settings.tenants_top,
            "charts": self.charts(tiers, rows_of_hour, ledger_now, open_breakers, problems),
            "capped": len(rows_of_hour) >= HOUR_LIMIT,
            "health": self.health(),
            "open_breakers": open_breakers,
            "problems": problems,
            "delayed": quietly(runtime.delayed.pending, None),
            "parked": quietly(runtime.parking.count, None),
            "minutes": SPARK_MINUTES,
            "now": runtime.ledger.now(),  # (the records' clock)
        }

    def tenants(self, queues: dict[str, str], problems: list[str]) -> dict[str, list[Any]] | None:
        """Each tier's tenants with work, waiting and running (fairness.py: the most waiting
        by name, the rest as one ``other`` row); None with fair dispatch off."""
        fair = self.app.runtime.fair
        if fair is None:
            return None
        top = self.app.settings.tenants_top
        try:
            return {tier: fair.shares(queue, top=top) for tier, queue in queues.items()}
        except Exception as exc:  # shown, never a broken page
            problems.append(f"broker (tenants): {type(exc).__name__}: {exc}")
            return {}

    def hour(self) -> tuple[list[dict[str, Any]], datetime]:
        """The records that ended in the last hour (cached a few seconds: one bounded range
        read of the retention index, however often the panels refresh), and the ledger's now."""
        now = time.monotonic()
        if self._hour is None or now - self._hour[0] > HOUR_CACHE_SECONDS:
            ledger_now = self.app.ledger.now()
            rows = self.app.ledger.finished_recently(
                minutes=HOUR_MINUTES, limit=HOUR_LIMIT, now=ledger_now
            )
            self._hour = (now, rows, ledger_now)
        return self._hour[1], self._hour[2]

    def charts(
        self,
        tiers: list[str],
        rows: list[dict[str, Any]],
        ledger_now: datetime,
        open_breakers: list[Any],
        problems: list[str],
    ) -> dict[str, Any]:
        """The overview's charts of the last hour (inline SVG: see ``svg``)."""
        runtime = self.app.runtime
        window = series.Window(now=ledger_now, minutes=HOUR_MINUTES)
        per_tier = series.throughput(rows, window, tiers)
        throughput = {
            tier: svg.bars(
                {"succeeded": counts["succeeded"], "dead": counts["dead"]},
                window=window,
                title=f"{tier}: jobs ended per minute",
                chart_id=f"chart-throughput-{tier}",
            )
            for tier, counts in per_tier.items()
        }
        try:
            history = runtime.depth_history.window(minutes=HOUR_MINUTES, now=runtime.message_time())
        except Exception as exc:
            history = {}
            problems.append(f"broker (depth history): {type(exc).__name__}: {exc}")
        depth = svg.lines(
            {tier: history.get(tier, [None] * HOUR_MINUTES) for tier in tiers},
            window=window,
            title="queue depth (highest sample each minute)",
            chart_id="chart-depth",
        )
        latency = svg.lines(
            series.latency(rows, window),
            window=window,
            title="run time percentiles (all tiers)",
            chart_id="chart-latency",
            seconds=True,
        )
        start = window.start
        breakers = svg.spans(
            [
                svg.Span(
                    label=b.name,
                    start=datetime.fromtimestamp(b.opened_at or start.timestamp(), UTC),
                    end=None,
                    outcome="forced" if b.forced else str(b.state.value),
                    kind="breaker",
                )
                for b in open_breakers
            ],
            start=start,
            end=window.end,
            title="breakers open now, since they opened",
            chart_id="chart-breakers",
        )
        return {
            "throughput": throughput,
            "depth": depth,
            "latency": latency,
            "latency_by_tier": series.latency_by_tier(rows, window, tiers),
            "breakers": breakers,
            "minutes": HOUR_MINUTES,
        }

    def health(self) -> list[Any]:
        """The ``ledger health`` checks (cached a few seconds: they ask every worker)."""
        now = time.monotonic()
        if self._health is None or now - self._health[0] > HEALTH_CACHE_SECONDS:
            self._health = (now, run_checks(self.app, required=(), timeout=1.0))
        return self._health[1]


def quietly(call: Callable[[], Any], default: Any) -> Any:
    try:
        return call()
    except Exception:
        return default
