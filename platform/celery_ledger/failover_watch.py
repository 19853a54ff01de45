"""The watch after a failover: for a while after a sweep notices that the broker may have lost
data, the reconciler looks for missing messages at each sweep, and once more at its end.

A failover's old primary that stalled or was stopped, then runs again, believes itself the
primary and takes writes from clients still connected to it until the sentinels make it a
replica (15 s seen on loopback), which drops them: job messages, whose records bring them back
once the reconciler looks, and workflow wakes, which live only in the broker. The sweep that
notices the failover looks at once, but these writes come later; the ordinary look finds a job
only once it was quiet for ``LEDGER_RECONCILE_MISSING_AFTER_SECONDS``, and a workflow waits for
its own check. So the notice starts a watch, kept in the broker (the sweep lock may move to
another worker meanwhile) and here should the broker refuse it; the reconciler reads where it
stands at each sweep (:meth:`FailoverWatch.now`), and the one sweep that finds it lapsed does a
last look and wakes every workflow again, then says so (:meth:`FailoverWatch.done`): until
then, the next sweep finds it ended still.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from .broker import NOT_WATCHING, BrokerView, Watch, WatchState

logger = logging.getLogger("celery_ledger.reconciler")


class FailoverWatch:
    """The watch (see the module docstring), over the broker's note and this process's own."""

    def __init__(
        self, broker: BrokerView, *, monotonic: Callable[[], float], sweep_every: float
    ) -> None:
        self._broker = broker
        self._monotonic = monotonic
        self._sweep_every = sweep_every
        # This process's own watch, while the broker refuses the note: (until, since)
        self._own: tuple[float, datetime] | None = None

    def start(self, since: datetime, seconds: float) -> None:
        """A failover noticed: watch for ``seconds`` the records touched since ``since``."""
        try:
            self._broker.watch_after_failover(seconds, since)
            self._own = None
        except Exception as exc:  # this process watches still, and notes it again
            logger.warning("reconcile: could not note the watch after a failover: %s", exc)
            until = self._monotonic() + seconds
            if self._own is not None:  # (a watch under way: the wider one)
                until, since = max(until, self._own[0]), min(since, self._own[1])
            self._own = (until, since)

    def now(self) -> WatchState:
        """Where this sweep stands."""
        if self._own is not None:
            return self._own_state()
        try:
            return self._broker.watch()
        except Exception as exc:  # (a read: the broker away, the looks below fail as well)
            logger.debug("reconcile: the watch after a failover could not be read: %s", exc)
            return NOT_WATCHING

    def done(self) -> None:
        """The watch's end was seen to (its last look made, the workflows woken)."""
        if self._own is not None:
            self._own = None
            return
        try:
            self._broker.watch_done()
        except Exception as exc:  # the next sweep sees to it again
            logger.warning("reconcile: could not note the watch's end: %s", exc)

    def _own_state(self) -> WatchState:
        assert self._own is not None
        until, since = self._own
        left = until - self._monotonic()
        if left > 0:
            try:  # the broker takes it now: every sweeper watches
                self._broker.watch_after_failover(left, since)
                self._own = None
            except Exception:  # (still refused: this process's own, as before)
                pass
            return WatchState(Watch.WATCHING, since)
        if -left > 2 * self._sweep_every:  # (lapsed long ago: this process swept no more)
            self._own = None
            return NOT_WATCHING
        return WatchState(Watch.ENDED, since)
