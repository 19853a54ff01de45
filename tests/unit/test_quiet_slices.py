"""The ordinary look for missing messages reads the quiet jobs a slice at a time: reads bounded
by what they hold, a pause between two, the due jobs at once, the waiting ones newest first, and
every job quiet when a round began reached within that round, whatever their number and spread
and however the clock moves between looks."""

from __future__ import annotations

import bisect
import contextlib
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_ledger.quiet_slices import TARGET, QuietLook
from tests.conftest import examples

START = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
QUIET = 30.0
LIMIT = 5_000
READ_SECONDS = 0.02  # what one read of the fake takes, by its clock
MS = timedelta(milliseconds=1)


class Ledger:
    """Quiet jobs by their last touch (the waiting ones) or their due time (the delayed and
    retrying ones), in a ledger that keeps milliseconds; counts what each read of the waiting
    ones makes the server walk (the whole range, as the embedded server does before it applies
    a limit), and returns them as its index does (oldest touch first)."""

    def __init__(self, touched: list[datetime], due: dict[str, tuple[datetime, datetime]]) -> None:
        self.touched = sorted(_ms(t) for t in touched)  # job i: the i-th oldest
        self.due = due  # id: (last touch, due time)
        self.at = START
        self.walked: list[int] = []
        self.clock = 0.0
        self.slept: list[float] = []

    def now(self) -> datetime:
        return self.at

    def quiet_waiting(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        touched_before: datetime | None = None,
    ) -> list[dict[str, Any]]:
        return self._quiet(
            older_than_seconds=older_than_seconds,
            limit=limit,
            touched_since=touched_since,
            touched_before=touched_before,
            published=True,
            due=False,
        )

    def quiet_due(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        due_since: datetime | None = None,
        due_before: datetime | None = None,
    ) -> list[dict[str, Any]]:
        return self._quiet(
            older_than_seconds=older_than_seconds,
            limit=limit,
            touched_since=touched_since,
            published=False,
            due=True,
            due_since=due_since,
            due_before=due_before,
        )

    def _quiet(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        touched_before: datetime | None = None,
        published: bool,
        due: bool,
        due_since: datetime | None = None,
        due_before: datetime | None = None,
    ) -> list[dict[str, Any]]:
        """Newest first, as the views promise."""
        newest_first = True
        self.clock += READ_SECONDS
        cutoff = self.at - timedelta(seconds=older_than_seconds)
        by = _ms(cutoff if touched_before is None else min(cutoff, touched_before))
        since = None if touched_since is None else _ms(touched_since)
        found: list[dict[str, Any]] = []
        if due:
            due_by = _ms(cutoff if due_before is None else min(cutoff, due_before))
            low = None if due_since is None else _ms(due_since)
            jobs = [
                {"_id": key, "updated_at": touched, "claimable_at": due_at}
                for key, (touched, due_at) in self.due.items()
                if due_at < due_by and (low is None or due_at >= low)
            ]
            self.walked.append(len(jobs))
            jobs.sort(key=lambda doc: doc["claimable_at"], reverse=newest_first)
            found += [
                doc
                for doc in jobs
                if doc["updated_at"] < by and (since is None or doc["updated_at"] >= since)
            ]
        if published:
            low_i = 0 if since is None else bisect.bisect_left(self.touched, since)
            high = bisect.bisect_left(self.touched, by)
            self.walked.append(max(high - low_i, 0))
            order = range(high - 1, low_i - 1, -1) if newest_first else range(low_i, high)
            found += [{"_id": i, "updated_at": self.touched[i]} for i in order]
        return found[:limit]

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.clock += seconds

    def slices(self) -> QuietLook:
        return QuietLook(sleep=self.sleep, monotonic=lambda: self.clock)

    def quiet_ids(self) -> set[int]:
        cutoff = _ms(self.at - timedelta(seconds=QUIET))
        return set(range(bisect.bisect_left(self.touched, cutoff)))


def _ms(at: datetime) -> datetime:
    """As the ledger keeps a time: to the millisecond."""
    return at.replace(microsecond=at.microsecond // 1000 * 1000)


def looks(ledger: Ledger, count: int, *, every: float = QUIET) -> list[list[Any]]:
    """What each of ``count`` looks found, the clock moving ``every`` seconds between two."""
    slices = ledger.slices()
    found = []
    for _ in range(count):
        found.append([doc["_id"] for doc in slices.look(ledger, QUIET, limit=LIMIT)])
        ledger.at += timedelta(seconds=every)
    return found


def assert_rounds_cover(ledger: Ledger, slices: QuietLook, rounds: int = 2) -> int:
    """Every job quiet when a round began is found within it, each look finds a job once;
    returns the looks the last round took."""
    taken = 0
    for _ in range(rounds):
        wanted, seen, taken = ledger.quiet_ids(), set(), 0
        while True:
            found = [doc["_id"] for doc in slices.look(ledger, QUIET, limit=LIMIT)]
            taken += 1
            assert len(found) == len(set(found)), "a job found twice in one look"
            seen |= set(found)
            ledger.at += timedelta(seconds=QUIET)
            if slices._waiting._before is None or wanted <= seen:
                break
            assert taken < 100, "the round does not end"
        assert wanted <= seen, sorted(wanted - seen)[:10]
    return taken


def test_a_few_quiet_jobs_are_all_looked_at_in_one_look_however_spread() -> None:
    # 300 jobs, from a minute to 200 days old
    ages = [timedelta(minutes=1) * 1.07**n for n in range(300)]
    ledger = Ledger([START - age for age in ages if age < timedelta(days=200)], {})
    found = looks(ledger, 2, every=0)
    assert set(found[0]) == set(range(len(ledger.touched)))
    assert set(found[1]) == set(found[0])  # (the round ended: the next starts again at the newest)


def test_behind_a_deep_backlog_reads_are_bounded_and_a_look_gathers_its_limit() -> None:
    # 40,000 jobs touched over 80 s, the newest 30 s ago
    start = START - timedelta(seconds=QUIET + 80)
    ledger = Ledger([start + timedelta(seconds=80 * n / 40_000) for n in range(40_000)], {})
    found = looks(ledger, 9)
    # No read walks more than a few times the target (one read of them all walked 40,000)...
    assert max(ledger.walked) <= 4 * TARGET, max(ledger.walked)
    # ...and between two reads the look pauses as long as a read took: others take the lock
    assert ledger.slept and min(ledger.slept) >= READ_SECONDS * 0.999
    # Each look gathers about as many as one read of them all did, the newest first...
    assert all(len(f) >= LIMIT - 4 * TARGET for f in found[:7]), [len(f) for f in found]
    assert max(found[0]) == 39_999
    # ...and a round reaches every job (one read of them all saw the oldest 5,000, always)
    assert set().union(*found[:9]) == set(range(40_000))


def test_a_round_reaches_every_job_whatever_the_clock_does_between_looks() -> None:
    # 14,000 jobs touched within 2 s, the clock moving 30 s between looks
    start = START - timedelta(seconds=QUIET + 5)
    ledger = Ledger([start + timedelta(seconds=2 * n / 14_000) for n in range(14_000)], {})
    assert_rounds_cover(ledger, ledger.slices())


def test_a_job_quiet_since_a_round_began_is_reached_by_the_next_round() -> None:
    start = START - timedelta(seconds=QUIET + 80)
    ledger = Ledger([start + timedelta(seconds=80 * n / 12_000) for n in range(12_000)], {})
    slices = ledger.slices()
    first = slices.look(ledger, QUIET, limit=LIMIT)
    assert len(first) > LIMIT - 4 * TARGET
    # A job lost now: quiet (touched 31 s ago) while the round walks the older ones
    ledger.touched.append(_ms(START - timedelta(seconds=QUIET + 1) + MS))
    seen = [{doc["_id"] for doc in slices.look(ledger, QUIET, limit=LIMIT)} for _ in range(4)]
    assert 12_000 in set().union(*seen)


def test_jobs_touched_in_one_instant_are_read_narrower_and_none_older_is_passed() -> None:
    # bulk publishes: 3,000 jobs in one millisecond, 100 in each of the next 60, older ones
    burst = [START - timedelta(seconds=QUIET + 5)] * 3_000
    burst += [START - timedelta(seconds=QUIET + 4) + n * MS for n in range(60) for _ in range(100)]
    older = [START - timedelta(hours=h) for h in range(1, 100)]
    ledger = Ledger(burst + older, {})
    assert_rounds_cover(ledger, ledger.slices())
    # Past the limit in one millisecond: a look takes the limit of them and goes on
    ledger = Ledger([START - timedelta(seconds=QUIET + 5)] * 12_000 + older, {})
    found = looks(ledger, 3, every=0)
    assert set(range(99)) <= set().union(*map(set, found))  # (the older ones: ids 0..98)


def test_no_job_falls_between_two_slices() -> None:
    # jobs touched a millisecond apart around every slice's edge: each read's bounds are exact
    base = START - timedelta(seconds=QUIET)
    touched = [base - n * MS for n in range(1, 3_000)]
    touched += [base - timedelta(seconds=s) for s in range(1, 2_000)]
    ledger = Ledger(touched, {})
    assert set(looks(ledger, 1)[0]) == set(range(len(touched)))


def test_a_round_that_ends_within_a_look_is_followed_by_the_next_from_the_newest() -> None:
    start = START - timedelta(seconds=QUIET + 70)
    ledger = Ledger([start + timedelta(seconds=70 * n / 7_000) for n in range(7_000)], {})
    first, second = looks(ledger, 2, every=0)
    assert max(first) == 6_999 and min(first) >= 2_000 - 4 * TARGET  # the newest
    # the older rest, then the newest again: each job once, down to where the look began
    assert len(second) == len(set(second))
    assert set(range(min(first))) <= set(second) and 6_999 in second
    assert not set(second) & set(range(min(first), min(first) + 1_000))


def test_due_jobs_are_found_at_every_look_however_long_ago_they_were_touched() -> None:
    # A job delayed 500 days ago, due 40 s ago, and a retry due now; behind a deep backlog
    start = START - timedelta(seconds=QUIET + 80)
    due = {
        "delayed": (START - timedelta(days=500), START - timedelta(seconds=40)),
        "retry": (START - timedelta(minutes=3), START - timedelta(seconds=QUIET + 1)),
        "not yet": (START - timedelta(minutes=3), START - timedelta(seconds=10)),
    }
    ledger = Ledger([start + timedelta(seconds=80 * n / 40_000) for n in range(40_000)], due)
    for found in looks(ledger, 3, every=0):
        assert {"delayed", "retry"} <= set(found) and "not yet" not in found


def test_a_dense_stretch_behind_a_quiet_one_is_read_whole_at_most_once_a_round() -> None:
    # 10 recent jobs, then 8,000 touched within a minute three hours ago
    recent = [START - timedelta(seconds=QUIET + n) for n in range(1, 11)]
    old = START - timedelta(hours=3)
    ledger = Ledger(recent + [old + timedelta(seconds=60 * n / 8_000) for n in range(8_000)], {})
    slices = ledger.slices()
    assert_rounds_cover(ledger, slices, rounds=3)
    # Over three rounds, a read walked the dense stretch whole at most three times
    assert sum(1 for w in ledger.walked if w > 4 * TARGET) <= 3, sorted(ledger.walked)[-10:]
    assert sum(ledger.walked) <= 3 * 2 * 8_000 + 20 * TARGET, sum(ledger.walked)


@settings(max_examples=examples(30), deadline=None)
@given(
    clusters=st.lists(
        st.tuples(
            st.integers(min_value=31, max_value=10**7),  # seconds before the first look
            st.integers(min_value=1, max_value=3_000),  # jobs
            st.integers(min_value=0, max_value=10**5),  # over this many milliseconds
        ),
        min_size=1,
        max_size=5,
    ),
    every=st.sampled_from([0.0, 1.0, QUIET, 600.0]),
)
def test_every_round_reaches_every_job_quiet_when_it_began(
    clusters: list[tuple[int, int, int]], every: float
) -> None:
    touched = [
        START - timedelta(seconds=ago) + timedelta(milliseconds=span * n // jobs)
        for ago, jobs, span in clusters
        for n in range(jobs)
    ]
    ledger = Ledger(touched, {})
    slices = ledger.slices()
    for _ in range(2):
        wanted, seen = ledger.quiet_ids(), set()
        for _ in range(40):
            found = [doc["_id"] for doc in slices.look(ledger, QUIET, limit=LIMIT)]
            assert len(found) == len(set(found))
            seen |= set(found)
            ledger.at += timedelta(seconds=every)
            if slices._waiting._before is None:
                break
        assert wanted <= seen, sorted(wanted - seen)[:10]


def test_many_due_jobs_neither_starve_the_waiting_ones_nor_hold_the_lock_long() -> None:
    # 5,200 retries due over the last 10 minutes (behind a downstream outage), 300 waiting jobs
    due = {
        f"retry-{n}": (
            START - timedelta(seconds=600 - n / 10),
            START - timedelta(seconds=600 - n / 10),
        )
        for n in range(5_200)
    }
    waiting = [START - timedelta(seconds=QUIET + 1 + n) for n in range(300)]
    ledger = Ledger(waiting, due)
    found = looks(ledger, 2, every=0)
    assert set(range(300)) <= set(found[0])  # the waiting ones at the first look
    # ...and every due one within a round of two looks, each read bounded
    assert set(due) <= set(found[0]) | set(found[1])
    assert max(ledger.walked) <= 4 * TARGET, max(ledger.walked)


def test_a_bulk_publish_in_one_instant_is_read_whole_whatever_else_is_due() -> None:
    due = {
        f"retry-{n}": (START - timedelta(minutes=5), START - timedelta(minutes=5))
        for n in range(4_950)
    }
    burst = [START - timedelta(seconds=QUIET + 5)] * 100
    ledger = Ledger(burst, due)
    for found in looks(ledger, 2, every=0):
        assert set(range(100)) <= set(found)


def test_a_dense_stretch_behind_a_gap_is_not_read_whole_twice_when_a_look_stops_in_it() -> None:
    # 4,950 recent jobs, two days of nothing, then 20,000 jobs ending with a bulk of 100 at once
    recent = [START - timedelta(seconds=QUIET + 1) - n * MS for n in range(4_950)]
    far = START - timedelta(days=2)
    dense = [far] * 100 + [far - n * 10 * MS for n in range(1, 20_000)]
    ledger = Ledger(recent + dense, {})
    assert_rounds_cover(ledger, ledger.slices(), rounds=2)
    assert sum(1 for w in ledger.walked if w > 4 * TARGET) <= 1, sorted(ledger.walked)[-5:]


def test_after_days_without_quiet_jobs_a_new_one_is_found_at_the_first_look() -> None:
    ledger = Ledger([], {})
    slices = ledger.slices()
    for _ in range(2 * 24 * 60):  # two days of looks every 30 s, nothing quiet
        assert slices.look(ledger, QUIET, limit=LIMIT) == []
        ledger.at += timedelta(seconds=QUIET)
    reads = len(ledger.walked)
    ledger.touched.append(_ms(ledger.at - timedelta(seconds=QUIET + 1)))
    assert [doc["_id"] for doc in slices.look(ledger, QUIET, limit=LIMIT)] == [0]
    assert len(ledger.walked) - reads <= 2 * 40  # (the empty past crossed in a few reads)


def test_a_watchs_look_reads_only_what_was_touched_since_its_start() -> None:
    # 5,000 retries due over the last hour; the watch looks at those touched in the last 2 min
    due = {f"retry-{n}": (START - timedelta(seconds=3_600 - n * 0.72),) * 2 for n in range(5_000)}
    ledger = Ledger([], due)
    since = START - timedelta(minutes=2)
    found = ledger.slices().look(ledger, 2.0, limit=LIMIT, since=since)
    recent = {
        key for key, (touched, _) in due.items() if since <= touched < START - timedelta(seconds=2)
    }
    assert {doc["_id"] for doc in found} == recent
    assert sum(ledger.walked) <= len(recent) + 4 * TARGET, sum(ledger.walked)


def test_waiting_jobs_read_by_a_look_whose_due_read_fails_come_with_the_next_look() -> None:
    # 12,000 waiting jobs (a round of three looks); the first look's due read fails
    start = START - timedelta(seconds=QUIET + 80)
    ledger = Ledger([start + timedelta(seconds=80 * n / 12_000) for n in range(12_000)], {})
    slices = ledger.slices()
    real = ledger.quiet_due
    failures = iter([True])

    def quiet_due(**bounds: Any) -> list[dict[str, Any]]:
        if next(failures, False):
            raise ConnectionError("ledger away")
        return real(**bounds)

    ledger.quiet_due = quiet_due  # type: ignore[method-assign]
    with contextlib.suppress(ConnectionError):
        slices.look(ledger, QUIET, limit=LIMIT)
    found = {doc["_id"] for doc in slices.look(ledger, QUIET, limit=LIMIT)}
    assert 11_999 in found  # (the newest: read by the failed look, its round gone on)


def test_a_look_ends_within_its_time_and_the_next_goes_on() -> None:
    # 40,000 waiting jobs; a look given the time of about four reads (the sweep's lock is short)
    start = START - timedelta(seconds=QUIET + 80)
    ledger = Ledger([start + timedelta(seconds=80 * n / 40_000) for n in range(40_000)], {})
    slices = ledger.slices()
    reads = len(ledger.walked)
    first = {doc["_id"] for doc in slices.look(ledger, QUIET, limit=LIMIT, seconds=0.2)}
    assert 0 < len(ledger.walked) - reads <= 12  # (both kinds: a few reads each)
    second = {doc["_id"] for doc in slices.look(ledger, QUIET, limit=LIMIT, seconds=0.2)}
    assert second and not first & second and max(second) < min(first)  # (went on, older)


def test_jobs_arriving_one_by_one_and_staying_quiet_keep_a_round_short() -> None:
    # A held tier: a job a minute for two days, none ever claimed; a look every 30 s
    ledger = Ledger([], {})
    slices = ledger.slices()
    for n in range(2 * 24 * 60 * 2):
        if n % 2 == 0:
            bisect.insort(ledger.touched, _ms(ledger.at - timedelta(seconds=QUIET + 1)))
        slices.look(ledger, QUIET, limit=LIMIT)
        ledger.at += timedelta(seconds=QUIET)
    # The marks a round keeps grow with the quiet jobs (about one every TARGET), not the reads
    # that found them a few at a time; so does a round's count of reads
    jobs = len(ledger.touched)
    assert len(slices._waiting._last_marks) <= jobs // TARGET + 2, len(slices._waiting._last_marks)
    reads = len(ledger.walked)
    assert_rounds_cover(ledger, slices, rounds=1)
    assert (len(ledger.walked) - reads) / 2 <= 2 * (jobs // TARGET) + 60, len(ledger.walked) - reads
