"""The reconciler's ordinary look for missing messages reads the quiet jobs a slice at a time.

A quiet job is a published one waiting for a claim and untouched for a while: the reconciler
looks for its message in the broker. The jobs waiting in a queue are one range of the sweepers'
index by their last touch, and the embedded SecantusDB reads a range whole, under its global
lock, before a limit applies (a read of 100 from a range of 10,000 costs as much as reading all
10,000: about 35 microseconds a job): behind a backlog of 14,000 quiet jobs one read of them held
every client of the ledger for 350 ms (up to 900 ms in the fairness benchmark), every 30 seconds,
and a small tenant's job waited for it. Nothing cheaper tells how many a range holds (a count or
an index-only read walks the jobs too), so the look learns it from the slices it reads.

A look reads the delayed and retrying jobs that are due (read by their due time: few) at once,
then ranges of the waiting jobs' last touch (slices), newest first, each sized from what the
previous one held to hold about :data:`TARGET` jobs, and pauses between two reads as long as the
read took, so that other clients take the lock in between. It gathers up to ``limit`` jobs;
the next look goes on from where this one stopped (a round), and after the oldest from the newest
again, down to where it began. A slice found to hold more than the look can still take is read
again narrower, or left whole to the next look; no job is passed over, except the jobs past the
limit touched within one millisecond (a bulk publish writes a batch of 100 at one instant; more
than 5,000 in one millisecond is out of reach of a fleet), which the stale sweep covers. A job
waiting in a queue does not move back in time (its touch only moves it to the newest end), so a
round reaches every job that was quiet when it began. What a slice costs is the jobs it holds,
except where a stretch without any is followed by a dense one: the read that finds the dense one
holds it whole, once a round.

Pure logic over the ledger's ``quiet`` view, so that its rules are tested with a fake ledger.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Protocol


class QuietReader(Protocol):
    """What a look needs of the ledger (its ``quiet`` view and clock)."""

    now: Callable[[], datetime]

    def quiet(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        touched_before: datetime | None = None,
        published: bool = True,
        due: bool = True,
        newest_first: bool = False,
    ) -> list[dict[str, Any]]: ...


# Quiet jobs a read aims at: about 15 ms of the embedded server's lock (0.12-0.16 ms a job read,
# 5 ms an empty read, measured at 6,000 queued records).
TARGET = 100
# A round's first slice; each next one is sized from what the last held (at most 4 times as
# long or as short). Never narrower than the ledger's clock (it keeps milliseconds).
FIRST_SPAN = timedelta(seconds=0.25)
LEAST_SPAN = timedelta(milliseconds=1)
GROWTH = 4.0
# A round ends at slices this old (no job waits in a queue that long untouched: the stale sweep
# publishes it again, which touches it): the next look starts at the newest.
LOOK_BACK = timedelta(days=400)
# Reads a look makes at most, besides two per ``TARGET`` jobs of its limit (an empty slice costs
# an index probe and the next is four times as long: a gap of months is crossed in a few); the
# next look goes on from there.
SPARE_READS = 48
# Read bounds a round keeps for the next (about one per ``TARGET`` quiet jobs).
MAX_MARKS = 10_000
# The least pause between two reads of a look (the pause is as long as the read took, or this).
MIN_PAUSE_SECONDS = 0.005


class QuietSlices:
    """Where the next look reads, and how (see the module docstring). One per reconciler."""

    def __init__(self, *, sleep: Callable[[float], None], monotonic: Callable[[], float]) -> None:
        self._sleep = sleep
        self._monotonic = monotonic
        self._before: datetime | None = None  # the next slice ends here (None: at the newest)
        self._span = FIRST_SPAN
        self._pause = MIN_PAUSE_SECONDS  # as long as the last read took
        # Where this round's reads began (their lower bounds), and the last round's, ascending:
        # a read of the next round ends at the next of these below it. A job waiting in a queue
        # never moves back in time, so such a range holds at most what it held then (a stretch
        # without jobs followed by a dense one is read whole only once, in the first round).
        self._marks: list[datetime] = []
        self._last_marks: list[datetime] = []

    def _read(self, ledger: QuietReader, quiet_seconds: float, **bounds: Any) -> list[Any]:
        started = self._monotonic()
        found = ledger.quiet(older_than_seconds=quiet_seconds, **bounds)
        self._pause = max(self._monotonic() - started, MIN_PAUSE_SECONDS)
        return found

    def look(
        self, ledger: QuietReader, quiet_seconds: float, *, limit: int
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` quiet jobs (untouched for ``quiet_seconds``): the due ones, then
        the waiting ones a slice at a time from where the last look stopped (or the newest,
        when a round has ended), each job once."""
        found = self._read(ledger, quiet_seconds, limit=limit, published=False)
        now = ledger.now()
        newest = now - timedelta(seconds=quiet_seconds)
        oldest = now - LOOK_BACK
        before = self._before if self._before is not None and self._before <= newest else newest
        began, end, span_began = before, oldest, self._span  # this walk reads down to ``end``
        wrapped = began == newest  # (a look from the newest has no round to begin after it)
        sliced = 0
        for _ in range(2 * -(-limit // TARGET) + SPARE_READS):
            wanted = limit - len(found)
            if wanted <= 0:
                break
            self._sleep(self._pause)
            since = max(before - self._span, end)
            mark = bisect.bisect_left(self._last_marks, before) - 1
            if mark >= 0:
                since = max(since, self._last_marks[mark])
            batch = self._read(
                ledger,
                quiet_seconds,
                limit=wanted,
                touched_since=since,
                touched_before=before,
                due=False,
                newest_first=True,
            )
            if len(batch) >= wanted:
                # The slice may hold more: take those touched after the last one read (their
                # instant whole), and read on from its instant, at the density seen
                last = batch[-1]["updated_at"]
                taken = [doc for doc in batch if doc["updated_at"] > last]
                if taken:
                    found += self._taken(taken)
                    sliced += len(taken)
                    before = last + LEAST_SPAN
                    self._mark(before)
                    spread = taken[0]["updated_at"] - last
                    self._span = max(spread * (TARGET / len(taken)), LEAST_SPAN)
                    continue
                if sliced:
                    break  # more in one instant than the look can still take: the next one
                # (more than the limit in one millisecond: see the module docstring)
                since = last
            found += self._taken(batch)
            sliced += len(batch)
            before = since
            self._mark(before)
            grow = GROWTH if not batch else min(max(TARGET / len(batch), 1 / GROWTH), GROWTH)
            self._span = min(max(self._span * grow, LEAST_SPAN), LOOK_BACK)
            if before <= end:
                if end == oldest:  # the round ended
                    self._last_marks, self._marks = sorted(self._marks), []
                    if wrapped or len(found) >= limit:
                        self._before, self._span = None, FIRST_SPAN
                        return found
                    # the next round begins at the newest
                    wrapped, before, end, self._span = True, newest, began, FIRST_SPAN
                    continue
                # Down to where this look began: the next goes on at the density seen there
                self._before, self._span = before, span_began
                return found
        self._before = before
        return found

    def _taken(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A read's jobs (newest first), marked every ``TARGET`` of them for the next round."""
        for doc in batch[TARGET::TARGET]:
            self._mark(doc["updated_at"] + LEAST_SPAN)
        return batch

    def _mark(self, at: datetime) -> None:
        if len(self._marks) < MAX_MARKS:
            self._marks.append(at)
