"""The reconciler's look for missing messages reads the quiet jobs a slice of time at a time.

A quiet job is a published one waiting for a claim and untouched for a while: the reconciler
looks for its message in the broker. All of them at once are one range of the sweepers' index,
and the embedded SecantusDB reads a range whole, under its global lock, before a limit applies:
behind a backlog of 14,000 quiet jobs one look held every client of the ledger for 350 ms (up
to 900 ms in the fairness benchmark), every 30 seconds. Here a look reads a range of their last
touch instead (a slice), sized from what the previous slice held to hold about
:data:`TARGET` jobs, and the looks walk from the newest quiet jobs back to the oldest, then start
again from the newest (a round). Every quiet job is looked at once a round. While they are fewer
than ``TARGET`` a round is one look, as before the slices; behind a deep backlog it is a few
minutes of looks, where the jobs wait longer than that for a worker anyway, and the stale sweep
(``reconcile_stale_after_seconds``) brings back any job untouched for that long whatever the
look has reached.

Pure logic over the ledger's ``quiet`` view, so that its rules are tested with the fake ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Protocol


class QuietReader(Protocol):
    """What a look needs of the ledger (its ``quiet`` view and clock)."""

    now: Callable[[], datetime]

    def quiet(
        self, *, older_than_seconds: float, limit: int, touched_since: datetime | None = None
    ) -> list[dict[str, Any]]: ...


# Quiet jobs a look aims to read: about 25 ms of the embedded server's lock.
TARGET = 1_000
# A round's first slice; each next one is sized from what the last held (at most 4 times as
# long: a sparse stretch above a dense one costs one read of a few times the target, not all).
FIRST_SPAN = timedelta(seconds=1)
GROWTH = 4.0
# A round ends at slices this old (no waiting job is): the next look starts at the newest.
LOOK_BACK = timedelta(days=400)
# Reads a look makes at most: an empty slice costs an index probe and its successor is four times
# as long, so a look crosses a quiet gap of months in one go.
READS_PER_LOOK = 24


class QuietSlices:
    """Where the next look reads (see the module docstring). One per reconciler."""

    def __init__(self) -> None:
        self._before: datetime | None = None  # the next slice ends here (None: the newest)
        self._span = FIRST_SPAN

    def look(
        self, ledger: QuietReader, quiet_seconds: float, *, limit: int
    ) -> list[dict[str, Any]]:
        """The quiet jobs (untouched for ``quiet_seconds``) of this look: slices read with
        ``ledger.quiet`` (at most ``limit`` jobs each) until about :data:`TARGET` jobs are
        found, or the round ends."""
        now = ledger.now()
        newest = now - timedelta(seconds=quiet_seconds)
        before = self._before if self._before is not None and self._before <= newest else newest
        found: list[dict[str, Any]] = []
        for _ in range(READS_PER_LOOK):
            since = before - self._span
            before_age = (now - before).total_seconds()
            batch = ledger.quiet(older_than_seconds=before_age, limit=limit, touched_since=since)
            found += batch
            if len(batch) >= limit and self._span > FIRST_SPAN:
                # cut short: the slice is read again, narrower, at the next look
                self._span = max(self._span / 4, FIRST_SPAN)
                break
            before = since
            grow = GROWTH if not batch else min(GROWTH, TARGET / len(batch))
            self._span = max(self._span * grow, FIRST_SPAN)
            if since < now - LOOK_BACK:  # past the oldest a job can be: the round ends
                self._before, self._span = None, FIRST_SPAN
                return found
            if len(found) >= TARGET:
                break
        self._before = before
        return found
