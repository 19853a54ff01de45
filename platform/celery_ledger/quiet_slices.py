"""The reconciler's ordinary look for missing messages reads the quiet jobs a slice at a time.

A quiet job is a published one waiting for a claim and untouched for a while: the reconciler
looks for its message in the broker. The jobs waiting in a queue are one range of the sweepers'
index by their last touch, and the embedded SecantusDB reads a range whole, under its global
lock, before a limit applies (a read of 100 from a range of 10,000 costs as much as reading all
10,000: about 35 microseconds a job): behind a backlog of 14,000 quiet jobs one read of them held
every client of the ledger for 350 ms (up to 900 ms in the fairness benchmark), every 30 seconds,
and a small tenant's job waited for it. Nothing cheaper tells how many a range holds (a count or
an index-only read walks the jobs too), so the look learns it from the slices it reads.

A look reads two kinds of quiet jobs, each in slices of its own axis: the jobs waiting in a
queue by their last touch, and the delayed and retrying ones that are due by their due time (a
retry is due at once: behind an outage of a downstream service they are many). Each slice is
sized from what the previous one held to hold about :data:`TARGET` jobs, read newest first,
with a pause between two reads as long as the read took, so that other clients take the lock
in between. A look gathers up to ``limit`` jobs of each kind; the next look goes on from where
this one stopped (a round), and after the oldest from the newest again, down to where it began.
A slice found to hold more than the look can still take is read on from the instant of the last
job read (the ledger's sort gives the newest first); no job is passed over, except the jobs past
the limit touched within one millisecond (a bulk publish writes a batch of 100 at one instant;
more than 5,000 in one millisecond is out of reach of a fleet), which the stale sweep covers. A
quiet job does not move back in time (a touch or a new due time moves it to the newest end), so
a round reaches every job that was quiet when it began, and marks a round puts every ``TARGET``
jobs bound the next round's reads: a stretch without jobs followed by a dense one, which a read
finds whole, is read so only in the first round.

The looks after the broker may have lost data, and within the watch after a failover (those
touched since a moment), read the same way, in rounds of their own.

Pure logic over the ledger's views of quiet jobs, so that its rules are tested with a fake ledger.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Protocol


class QuietReader(Protocol):
    """What a look needs of the ledger (its views of quiet jobs, and its clock)."""

    now: Callable[[], datetime]

    def quiet_waiting(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        touched_before: datetime | None = None,
    ) -> list[dict[str, Any]]: ...

    def quiet_due(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        due_since: datetime | None = None,
        due_before: datetime | None = None,
    ) -> list[dict[str, Any]]: ...


# Quiet jobs a read aims at: about 15 ms of the embedded server's lock (0.12-0.16 ms a job read,
# 5 ms an empty read, measured at 6,000 queued records).
TARGET = 100
# A round's first slice; each next one is sized from what the last held (at most 4 times as
# long or as short). Never narrower than the ledger's clock (it keeps milliseconds).
FIRST_SPAN = timedelta(seconds=0.25)
LEAST_SPAN = timedelta(milliseconds=1)
GROWTH = 4.0
# A round ends at slices this old (older than any record's times but the ledger's EPOCH marks):
# the next look starts at the newest.
LOOK_BACK = timedelta(days=365 * 50)
# Reads a look makes at most, besides two per ``TARGET`` jobs of its limit (an empty slice costs
# an index probe and the next is four times as long: a gap of months is crossed in a few); the
# next look goes on from there.
SPARE_READS = 48
# Read bounds a round keeps for the next (about one per ``TARGET`` quiet jobs).
MAX_MARKS = 10_000
# The least pause between two reads of a look (the pause is as long as the read took, or this).
MIN_PAUSE_SECONDS = 0.005


class QuietSlices:
    """Where the next look at one kind of quiet jobs reads, and how (see the module
    docstring): the waiting ones by their last touch, or the due ones by their due time."""

    def __init__(
        self, *, sleep: Callable[[float], None], monotonic: Callable[[], float], due: bool
    ) -> None:
        self._sleep = sleep
        self._monotonic = monotonic
        self._due = due
        self._axis = "claimable_at" if due else "updated_at"
        self._before: datetime | None = None  # the next slice ends here (None: at the newest)
        self._span = FIRST_SPAN
        self._pause = MIN_PAUSE_SECONDS  # as long as the last read took
        # Marks this round put every TARGET jobs it read (see _taken), and the last round's,
        # ascending: a read of the next round ends at the next of these below it. A quiet job
        # never moves back in time, so such a range holds at most what it held then (a stretch
        # without jobs followed by a dense one is read whole only once, in the first round).
        self._marks: list[datetime] = []
        self._last_marks: list[datetime] = []
        self._unmarked = 0  # jobs this round read since its last mark

    def _read(
        self,
        ledger: QuietReader,
        quiet_seconds: float,
        *,
        limit: int,
        low: datetime,
        high: datetime,
        since: datetime | None,
    ) -> list[dict[str, Any]]:
        """The jobs of the slice [low, high) of this kind, newest first, up to ``limit``."""
        started = self._monotonic()
        if self._due:
            found = ledger.quiet_due(
                older_than_seconds=quiet_seconds,
                limit=limit,
                touched_since=since,
                due_since=low,
                due_before=high,
            )
        else:
            found = ledger.quiet_waiting(
                older_than_seconds=quiet_seconds,
                limit=limit,
                touched_since=low,
                touched_before=high,
            )
        # (an empty read is an index probe: the next follows at once)
        self._pause = max(self._monotonic() - started, MIN_PAUSE_SECONDS) if found else 0.0
        return found

    def look(
        self,
        ledger: QuietReader,
        quiet_seconds: float,
        *,
        limit: int,
        since: datetime | None = None,
        seconds: float = float("inf"),
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` quiet jobs of this kind (untouched for ``quiet_seconds``, and
        touched ``since`` then, if given), a slice at a time from where the last look stopped
        (or the newest, when a round has ended), each job once; for about ``seconds`` at most
        (the next look goes on: the sweep must end within its lock's time)."""
        deadline = self._monotonic() + seconds
        now = ledger.now()
        newest = now - timedelta(seconds=quiet_seconds)
        # (a due job was touched before its due time: one touched since then is due since then)
        oldest = now - LOOK_BACK if since is None else max(now - LOOK_BACK, since)
        resume = self._before is not None and oldest < self._before <= newest
        before = self._before if resume and self._before is not None else newest
        began, end, span_began = before, oldest, self._span  # this walk reads down to ``end``
        wrapped = began == newest  # (a look from the newest has no round to begin after it)
        found: list[dict[str, Any]] = []
        for reads in range(2 * -(-limit // TARGET) + SPARE_READS):
            wanted = limit - len(found)
            if wanted <= 0:
                break
            if reads and self._monotonic() >= deadline:
                break
            if reads and self._pause:
                self._sleep(self._pause)
            low = max(before - self._span, end)
            mark = bisect.bisect_left(self._last_marks, before) - 1
            if mark >= 0:
                low = max(low, self._last_marks[mark])
            batch = self._read(
                ledger, quiet_seconds, limit=wanted, low=low, high=before, since=since
            )
            if len(batch) >= wanted:
                # The slice may hold more: take those after the last one read's instant, and
                # read on from that instant, at the density seen
                last = batch[-1][self._axis]
                taken = [doc for doc in batch if doc[self._axis] > last]
                before = last + LEAST_SPAN  # (nothing between it and the slice's end is unread)
                if taken:
                    found += self._taken(taken)
                    spread = taken[0][self._axis] - last
                    self._span = max(spread * (TARGET / len(taken)), LEAST_SPAN)
                    continue
                if found:  # more in one instant than the look can still take: the next one
                    self._span = LEAST_SPAN
                    break
                # (more than the limit in one millisecond: see the module docstring)
                low = last
            found += self._taken(batch)
            before = low
            grow = min(max(TARGET / len(batch), 1 / GROWTH), GROWTH) if batch else GROWTH
            self._span = min(max(self._span * grow, LEAST_SPAN), LOOK_BACK)
            if before <= end:
                if end == oldest:  # the round ended
                    self._last_marks, self._marks, self._unmarked = sorted(self._marks), [], 0
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
        """A read's jobs (newest first), a mark put above the next job after every ``TARGET``
        of them, counted across the round's reads: the next round's reads end at the marks,
        so that none reads more than about ``TARGET`` jobs (a stretch without jobs followed by
        a dense one included). Counted, not put where each read ended: jobs arriving a few at
        a time would leave a mark at every read that found one, and each mark stays one (the
        next round's reads end at it, and find a job below it), so a round would read as
        often as jobs ever arrived."""
        for doc in batch:
            if self._unmarked >= TARGET:
                if len(self._marks) < MAX_MARKS:
                    self._marks.append(doc[self._axis] + LEAST_SPAN)
                self._unmarked = 0
            self._unmarked += 1
        return batch


class QuietLook:
    """The reconciler's looks at the quiet jobs of one kind of look (the ordinary ones, or
    those after a loss and within a watch): the waiting ones and the due ones, each kind in
    rounds of its own, up to ``limit`` of each."""

    def __init__(self, *, sleep: Callable[[float], None], monotonic: Callable[[], float]) -> None:
        self._waiting = QuietSlices(sleep=sleep, monotonic=monotonic, due=False)
        self._due = QuietSlices(sleep=sleep, monotonic=monotonic, due=True)
        self._sleep = sleep
        self._kept: list[dict[str, Any]] = []  # waiting ones read by a look that then failed

    def look(
        self,
        ledger: QuietReader,
        quiet_seconds: float,
        *,
        limit: int,
        since: datetime | None = None,
        seconds: float = float("inf"),
    ) -> list[dict[str, Any]]:
        """The quiet jobs of this look (see :meth:`QuietSlices.look`), in ``seconds``."""
        half = seconds / 2
        # The waiting ones read are kept until the due ones are too: their round has gone on
        read = self._waiting.look(ledger, quiet_seconds, limit=limit, since=since, seconds=half)
        waiting = self._kept = (self._kept + read)[: 2 * limit]
        self._sleep(self._waiting._pause)
        due = self._due.look(ledger, quiet_seconds, limit=limit, since=since, seconds=half)
        self._kept = []
        return waiting + due
