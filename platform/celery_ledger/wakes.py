"""At most one wake of a workflow waits in the broker: later wakes are folded into it.

A wake is idempotent and reads everything it acts on (the log, its jobs' outcomes, its signals)
when it runs, not when it was sent, so a wake that still waits in a queue already does what any
later one would. Wakes come from several places (each step's outcome, each signal, the
reconciler's and the relay's checks of workflows nothing woke), and under a backlog every one of
them waited behind the whole queue: the long chaos soak's default queue held over 3,000 wakes for
400 workflows, a third of what the workers ran was wakes that found nothing to do, and the steps
the workflows waited for starved behind them.

So a wake for now is sent only if it sets its workflow's mark in Redis (``SET NX``); the wake
clears the mark when it starts, before it reads anything. A wake sent after that is sent (what
happened after the read needs a new look); one sent before it is folded (the read that follows
sees what it would have seen). Wakes for later (a timer, a backoff) are never folded: they carry
a time.

The mark is written before the message, so that a wake never waits unmarked while a running
one clears a mark set after it. It ends by itself after :data:`HOLD_SECONDS`, which bounds
what a mark without a wake costs: a sender killed between the mark and the message, a broker
killed in that millisecond, a wake run by a worker of an older release (which does not clear
marks) during a rolling deploy, or a sender that raced one whose publish failed and withdrew
its mark. Events folded meanwhile are seen by the next wake, or by the reconciler's next
check. A wake that waits longer than that behind a backlog lets one more through, so checks
and events cost the fleet at most one wake message per workflow per hold time.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

logger = logging.getLogger("celery_ledger.workflow")

# How long a sent wake holds back later ones (see the module docstring): a minute, so that a
# mark left without its wake (a rolling deploy's older workers leave every mark they meet)
# delays a workflow by about that; behind a longer backlog a still workflow's checks send at
# most one more wake a minute (a workflow waiting for a step in flight is not woken by them).
HOLD_SECONDS = 60.0


class PendingWakes:
    """The marks of the workflows that have a wake waiting in the broker (one Redis key each)."""

    def __init__(
        self, client: redis.Redis, *, namespace: str, hold_seconds: float = HOLD_SECONDS
    ) -> None:
        self._client = client
        self._prefix = f"{namespace}:ledger:wake:" if namespace else "ledger:wake:"
        self._hold_ms = max(int(hold_seconds * 1000), 1)

    def key(self, workflow_id: str) -> str:
        return self._prefix + workflow_id

    def claim(self, workflow_id: str) -> bool:
        """Mark a wake of the workflow as sent; False if one is marked already (fold into it).

        Raises:
            redis.RedisError: the broker is away (its caller sends the wake unmarked: a
                duplicate wake costs a read, a missing one a check time).
        """
        return bool(self._client.set(self.key(workflow_id), b"1", nx=True, px=self._hold_ms))

    def withdraw(self, workflow_id: str) -> None:
        """Clear the mark of a wake that was not sent after all (its publish failed)."""
        try:
            self._client.delete(self.key(workflow_id))
        except redis.RedisError as exc:  # held until its hold time ends: wakes are late, not lost
            logger.warning("wake mark of workflow %s not cleared: %s", workflow_id, exc)

    def started(self, workflow_id: Any) -> None:
        """A wake of the workflow starts: later wakes are sent again.

        Raises:
            redis.RedisError: the mark could not be cleared; the wake must not run (its caller
                sends it back), or every wake after it would be folded into one that has run.
        """
        if isinstance(workflow_id, str):
            self._client.delete(self.key(workflow_id))
