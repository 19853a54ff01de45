"""The ordinary look for missing messages reads the quiet jobs a slice at a time: every read
bounded, pauses between reads, and still as many jobs a look as one read of them all gave, the
newest first, every quiet job reached within a round."""

from __future__ import annotations

import bisect
from datetime import UTC, datetime, timedelta
from typing import Any

from celery_ledger.quiet_slices import TARGET, QuietSlices

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
QUIET = 30.0
LIMIT = 5_000
READ_SECONDS = 0.02  # what one read of the fake takes, by its clock


class Ledger:
    """Quiet jobs by their last touch (ids in that order); counts what each read makes the
    server walk (the whole range, as the embedded server does before it applies a limit)."""

    def __init__(self, touched: list[datetime]) -> None:
        self.touched = sorted(touched)
        self.walked: list[int] = []
        self.clock = 0.0
        self.slept: list[float] = []

    def now(self) -> datetime:
        return NOW

    def quiet(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        touched_before: datetime | None = None,
    ) -> list[dict[str, Any]]:
        self.clock += READ_SECONDS
        cutoff = NOW - timedelta(seconds=older_than_seconds)
        if touched_before is not None:
            cutoff = min(cutoff, touched_before)
        low = 0 if touched_since is None else bisect.bisect_left(self.touched, touched_since)
        high = bisect.bisect_left(self.touched, cutoff)
        self.walked.append(max(high - low, 0))
        return [{"_id": i} for i in range(low, high)][:limit]

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.clock += seconds

    def slices(self) -> QuietSlices:
        return QuietSlices(sleep=self.sleep, monotonic=lambda: self.clock)


def looks(ledger: Ledger, count: int) -> list[set[int]]:
    slices = ledger.slices()
    return [{doc["_id"] for doc in slices.look(ledger, QUIET, limit=LIMIT)} for _ in range(count)]


def test_a_few_quiet_jobs_are_all_looked_at_in_one_look_however_spread() -> None:
    # 300 jobs, from a minute to 200 days old
    ages = [timedelta(minutes=1) * 1.07**n for n in range(300)]
    ledger = Ledger([NOW - age for age in ages if age < timedelta(days=200)])
    found = looks(ledger, 2)
    assert found[0] == set(range(len(ledger.touched)))
    assert found[1] == found[0]  # (the round ended: the next starts again at the newest)


def test_behind_a_deep_backlog_reads_are_bounded_and_a_look_gathers_the_whole_limit() -> None:
    # 40,000 jobs touched over 80 s, the newest 30 s ago
    start = NOW - timedelta(seconds=QUIET + 80)
    ledger = Ledger([start + timedelta(seconds=80 * n / 40_000) for n in range(40_000)])
    found = looks(ledger, 9)
    # No read walks more than a few times the target (one read of them all walked 40,000)...
    assert max(ledger.walked) <= 4 * TARGET, max(ledger.walked)
    # ...and between two reads the look pauses as long as a read took: others take the lock
    assert ledger.slept and min(ledger.slept) >= READ_SECONDS * 0.999
    # Each look gathers as many as one read of them all did, the newest first...
    assert all(len(f) >= LIMIT for f in found[:8]), [len(f) for f in found]
    assert max(found[0]) == 39_999
    # ...and a round reaches every job (one read of them all saw the oldest 5,000, always)
    assert set().union(*found[:8]) == set(range(40_000))
    assert max(found[8]) == 39_999  # the next round starts at the newest


def test_a_job_quiet_since_a_round_began_is_reached_by_the_next_round() -> None:
    start = NOW - timedelta(seconds=QUIET + 80)
    touched = [start + timedelta(seconds=80 * n / 12_000) for n in range(12_000)]
    ledger = Ledger(touched)
    slices = ledger.slices()
    first = slices.look(ledger, QUIET, limit=LIMIT)
    assert len(first) == LIMIT
    # A job lost now: quiet (touched 31 s ago) while the round walks the older ones
    ledger.touched.append(NOW - timedelta(seconds=QUIET + 1) + timedelta(microseconds=1))
    seen = [{doc["_id"] for doc in slices.look(ledger, QUIET, limit=LIMIT)} for _ in range(3)]
    assert 12_000 in set().union(*seen)


def test_jobs_touched_in_one_instant_past_the_limit_are_passed_not_read_for_ever() -> None:
    # a bulk publish: 12,000 jobs in the same instant, then older ones
    burst = [NOW - timedelta(seconds=QUIET + 5)] * 12_000
    older = [NOW - timedelta(hours=h) for h in range(1, 100)]
    ledger = Ledger(burst + older)
    found = looks(ledger, 4)
    assert set(range(99)) <= set().union(*found)  # (the older ones, sorted first: ids 0..98)


def test_no_job_falls_between_two_slices() -> None:
    # jobs touched a microsecond apart around every slice's edge: each read's bounds are exact
    base = NOW - timedelta(seconds=QUIET)
    touched = [base - timedelta(microseconds=n) for n in range(1, 3_000)]
    touched += [base - timedelta(seconds=s) for s in range(1, 2_000)]
    ledger = Ledger(touched)
    found = looks(ledger, 1)
    assert found[0] == set(range(len(touched)))


def test_a_round_that_ends_within_a_look_is_followed_by_the_next_from_the_newest() -> None:
    start = NOW - timedelta(seconds=QUIET + 70)
    ledger = Ledger([start + timedelta(seconds=70 * n / 7_000) for n in range(7_000)])
    first, second = looks(ledger, 2)
    assert first == set(range(2_000, 7_000))  # the newest
    # the older 2,000, then the newest 3,000 again: each job once
    assert second == set(range(2_000)) | set(range(4_000, 7_000))
