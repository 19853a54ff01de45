"""The reconciler's ordinary look for missing messages reads the quiet jobs a slice at a time.

A quiet job is a published one waiting for a claim and untouched for a while: the reconciler
looks for its message in the broker. Read at once, they are one range of the sweepers' index, and
the embedded SecantusDB reads a range whole, under its global lock, before a limit applies:
behind a backlog of 14,000 quiet jobs one look held every client of the ledger for 350 ms (up to
900 ms in the fairness benchmark), every 30 seconds, and a small tenant's job waited for it.

Here one look reads ranges of their last touch instead (slices), each sized from what the
previous one held to hold about :data:`TARGET` jobs, from the newest quiet jobs back to the
oldest, and pauses between two reads as long as the read took, so that other clients take the
lock in between. A look still gathers as many jobs as the single read did (its ``limit``) and
finds a job lost a moment ago first; when the quiet jobs are more than that, the next look goes on
from where this one stopped (a round), where the single read looked at the same oldest jobs every
time. Only the lock's hold changes, never which jobs a look reaches sooner or later: a look that
read less than the single read did found lost periodic jobs too late in the long chaos soak.

Pure logic over the ledger's ``quiet`` view, so that its rules are tested with a fake ledger.
"""

from __future__ import annotations

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
    ) -> list[dict[str, Any]]: ...


# Quiet jobs a read aims at: about 15 ms of the embedded server's lock (0.12-0.16 ms a job read,
# 5 ms an empty read, measured at 6,000 queued records).
TARGET = 100
# A round's first slice; each next one is sized from what the last held (at most 4 times as
# long: a sparse stretch above a dense one costs one read of a few times the target, not all).
# Never narrower than the first: jobs touched in the same instant (a bulk publish) are one read.
FIRST_SPAN = timedelta(seconds=0.25)
GROWTH = 4.0
# A round ends at slices this old (no waiting job is): the next look starts at the newest.
LOOK_BACK = timedelta(days=400)
# Reads a look makes at most, besides two per ``TARGET`` jobs of its limit (an empty slice costs
# an index probe and the next is four times as long: a gap of months is crossed in a few); the
# next look goes on from there.
SPARE_READS = 48
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

    def look(
        self, ledger: QuietReader, quiet_seconds: float, *, limit: int
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` quiet jobs (untouched for ``quiet_seconds``), read a slice at a
        time, from where the last look stopped (or the newest, when a round has ended). A
        round that ends within a look is followed by the next one, from the newest down to
        where the look began."""
        now = ledger.now()
        newest = now - timedelta(seconds=quiet_seconds)
        oldest = now - LOOK_BACK
        before = self._before if self._before is not None and self._before <= newest else newest
        began, end = before, oldest  # this walk reads down to ``end``
        wrapped = began == newest  # (a look from the newest has no round to begin after it)
        found: list[dict[str, Any]] = []
        for reads in range(2 * -(-limit // TARGET) + SPARE_READS):
            if reads:
                self._sleep(self._pause)
            since = max(before - self._span, end)
            started = self._monotonic()
            wanted = limit - len(found)
            batch = ledger.quiet(
                older_than_seconds=quiet_seconds,
                limit=wanted,
                touched_since=since,
                touched_before=before,
            )
            self._pause = max(self._monotonic() - started, MIN_PAUSE_SECONDS)
            if len(batch) >= wanted and self._span > FIRST_SPAN:
                # The slice may hold more than is read: read its newest part alone instead
                self._span = FIRST_SPAN
                continue
            # (Full at the narrowest, jobs touched in one instant: the rest wait for a round)
            found += batch
            before = since
            grow = GROWTH if not batch else min(GROWTH, TARGET / len(batch))
            self._span = max(self._span * grow, FIRST_SPAN)
            if before <= end:
                if end == oldest and (wrapped or len(found) >= limit):
                    self._before, self._span = None, FIRST_SPAN  # the round ended
                    return found
                if end == oldest:  # the round ended: the next begins at the newest
                    wrapped, before, end, self._span = True, newest, began, FIRST_SPAN
                    continue
                self._before = before  # down to where this look began: the next goes on
                return found
            if len(found) >= limit:
                break
        self._before = before
        return found
