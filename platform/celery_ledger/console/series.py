"""The overview's numbers over the last hour, in per-minute buckets (pure: no I/O, no clock).

The rows come from :meth:`celery_ledger.ledger.store.Ledger.finished_recently` (one bounded
range read of the retention index); everything here is arithmetic on them, so it is tested
without servers. Buckets are the clock's minutes: the last bucket is the minute ``now`` is in
(still filling), the first is ``minutes - 1`` minutes before it; the queue depths' history
(:mod:`celery_ledger.depth_history`) uses the same minutes, so the charts line up.

Latency is a job's run time: its last attempt's claim (``started_at``) to its end
(``finished_at``). ``created_at`` is the first claim, so ``finished_at - created_at`` is the
time from first claim to end, retries included; neither includes the wait in the queue (the
ledger does not know when a message was published).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

OUTCOMES = ("succeeded", "dead")
PERCENTILES = (50, 95, 99)


def minute_of(when: datetime) -> datetime:
    """The start of the clock minute ``when`` is in (aware, UTC)."""
    aware = when if when.tzinfo else when.replace(tzinfo=UTC)
    return aware.astimezone(UTC).replace(second=0, microsecond=0)


@dataclass(frozen=True)
class Window:
    """``minutes`` clock minutes ending with the one ``now`` is in."""

    now: datetime
    minutes: int

    @property
    def start(self) -> datetime:
        """The first bucket's start."""
        return minute_of(self.now) - timedelta(minutes=self.minutes - 1)

    @property
    def end(self) -> datetime:
        """The last bucket's end (a little after ``now``)."""
        return minute_of(self.now) + timedelta(minutes=1)

    def bucket(self, when: datetime | None) -> int | None:
        """The index of the bucket ``when`` falls in (None outside the window, or no time)."""
        if when is None:
            return None
        index = int((minute_of(when) - self.start).total_seconds() // 60)
        return index if 0 <= index < self.minutes else None


def throughput(
    rows: Iterable[Mapping[str, Any]], window: Window, tiers: Sequence[str]
) -> dict[str, dict[str, list[int]]]:
    """Jobs ended per minute, by tier and outcome (``succeeded``, ``dead``), oldest first.

    Every tier of ``tiers`` is present (zeros when idle); a row of another tier adds one."""
    counts = {tier: {o: [0] * window.minutes for o in OUTCOMES} for tier in tiers}
    for row in rows:
        state = str(row.get("state"))
        index = window.bucket(row.get("finished_at"))
        if state not in OUTCOMES or index is None:
            continue
        tier = str(row.get("tier") or "default")
        per_tier = counts.setdefault(tier, {o: [0] * window.minutes for o in OUTCOMES})
        per_tier[state][index] += 1
    return counts


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` by nearest rank (None for no values): the
    smallest value with at least ``q`` % of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def run_seconds(row: Mapping[str, Any], since: str = "started_at") -> float | None:
    """A row's duration from ``since`` to ``finished_at`` in seconds (None without both,
    or a negative span: clocks of two hosts)."""
    begun, ended = row.get(since), row.get("finished_at")
    if not isinstance(begun, datetime) or not isinstance(ended, datetime):
        return None
    seconds = (ended - begun).total_seconds()
    return seconds if seconds >= 0 else None


def latency(rows: Iterable[Mapping[str, Any]], window: Window) -> dict[str, list[float | None]]:
    """Run-time percentiles (``p50``, ``p95``, ``p99``, seconds) of the jobs ended in each
    minute, every tier and outcome together; None for a minute in which none ended."""
    per_minute: list[list[float]] = [[] for _ in range(window.minutes)]
    for row in rows:
        index = window.bucket(row.get("finished_at"))
        seconds = run_seconds(row)
        if index is not None and seconds is not None:
            per_minute[index].append(seconds)
    return {f"p{q}": [percentile(values, q) for values in per_minute] for q in PERCENTILES}


def latency_by_tier(
    rows: Iterable[Mapping[str, Any]], window: Window, tiers: Sequence[str]
) -> dict[str, dict[str, float | int | None]]:
    """Per tier over the whole window: ``count`` of jobs ended, and the run-time ``p50``,
    ``p95``, ``p99`` (seconds, None when none ended)."""
    spans: dict[str, list[float]] = {tier: [] for tier in tiers}
    for row in rows:
        seconds = run_seconds(row)
        if window.bucket(row.get("finished_at")) is None or seconds is None:
            continue
        spans.setdefault(str(row.get("tier") or "default"), []).append(seconds)
    return {
        tier: {"count": len(values), **{f"p{q}": percentile(values, q) for q in PERCENTILES}}
        for tier, values in spans.items()
    }
