"""The look for missing messages reads the quiet jobs a slice at a time: bounded reads, and
every quiet job looked at once a round, whatever their number and spread."""

from __future__ import annotations

import bisect
from datetime import UTC, datetime, timedelta
from typing import Any

from celery_ledger.quiet_slices import TARGET, QuietSlices

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
QUIET = 30.0
LIMIT = 5_000


class Ledger:
    """Quiet jobs by their last touch; counts what each read makes the server walk (the whole
    range, as the embedded server does before it applies a limit)."""

    def __init__(self, touched: list[datetime]) -> None:
        self.touched = sorted(touched)
        self.walked: list[int] = []

    def now(self) -> datetime:
        return NOW

    def quiet(
        self, *, older_than_seconds: float, limit: int, touched_since: datetime | None = None
    ) -> list[dict[str, Any]]:
        before = NOW - timedelta(seconds=older_than_seconds)
        low = 0 if touched_since is None else bisect.bisect_left(self.touched, touched_since)
        high = bisect.bisect_left(self.touched, before)
        self.walked.append(max(high - low, 0))
        return [{"_id": i} for i in range(low, high)][:limit]


def rounds(ledger: Ledger, looks: int) -> tuple[list[set[int]], list[int]]:
    """What each look found, and the reads' sizes, over ``looks`` looks."""
    slices = QuietSlices()
    found = [{doc["_id"] for doc in slices.look(ledger, QUIET, limit=LIMIT)} for _ in range(looks)]
    return found, ledger.walked


def test_a_few_quiet_jobs_are_all_looked_at_in_one_look_however_spread() -> None:
    # 300 jobs, from a minute to 200 days old
    ages = [timedelta(minutes=1) * 1.07**n for n in range(300)]
    ledger = Ledger([NOW - age for age in ages if age < timedelta(days=200)])
    found, _ = rounds(ledger, 2)
    assert found[0] == set(range(len(ledger.touched)))
    assert found[1] == found[0]  # (the round ended: the next starts again at the newest)


def test_behind_a_deep_backlog_each_read_is_bounded_and_a_round_covers_every_job() -> None:
    # 40,000 jobs touched over 80 s, the newest 30 s ago
    start = NOW - timedelta(seconds=QUIET + 80)
    ledger = Ledger([start + timedelta(seconds=80 * n / 40_000) for n in range(40_000)])
    found, walked = rounds(ledger, 80)
    # No read walks more than a few times the target (the whole backlog was one read of 40,000)
    assert max(walked) <= 4 * TARGET, max(walked)
    # ...and a round looks at every job: within 40,000 / 1,000 looks and a few
    seen: set[int] = set()
    looks = 0
    while len(seen) < 40_000 and looks < len(found):
        seen |= found[looks]
        looks += 1
    assert len(seen) == 40_000 and looks <= 50, looks


def test_a_second_holding_more_than_the_limit_is_passed_not_read_for_ever() -> None:
    # a bulk publish: 12,000 jobs in the same second, then older ones
    burst = [NOW - timedelta(seconds=QUIET + 5)] * 12_000
    older = [NOW - timedelta(hours=h) for h in range(1, 100)]
    ledger = Ledger(burst + older)
    found, _ = rounds(ledger, 30)
    seen = set().union(*found)
    assert set(range(99)) <= seen  # (the older ones, sorted first: ids 0..98)
