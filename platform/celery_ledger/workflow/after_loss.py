"""Waking every active workflow again after the broker may have lost data (a failover whose new
primary lacks the last writes, a restart without its data, a wipe): the reconciler's part for
workflows when it notices one (:func:`celery_ledger.broker.data_lost`).

A workflow's wakes live only in the broker: a timer's wake in the delayed set, the wake of a
step's end or of a signal in a queue. The jobs the broker lost come back from their ledger
records, but a lost wake did not: the workflow waited for the reconciler's check,
``workflow_check_seconds`` past its timer (two minutes by default; one that stayed still through
its checks, up to 16 check times). A wake that runs early finds its timer not due and sends no
wake for it, so each workflow is woken at the timer it waits for (now if none). A wake that
survived makes these extra ones find nothing to do: a wake reads everything when it runs. Each
is sent for later, if only by a moment, because a wake for now would be folded into one whose
mark outlived its lost message (:mod:`celery_ledger.wakes`).

Found by the failover matrix (``tests/integration/test_sentinel_failover_matrix.py``): a
failover that lost the timers of workflows waiting four seconds left them waiting two minutes.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from .engine import WorkflowEngine

# The wakes' own delay: for later, never folded into a wake whose message may be lost.
NOT_FOLDED_SECONDS = 0.05


def wake_all_again(engine: WorkflowEngine, held: Iterable[str] = (), *, limit: int = 5_000) -> int:
    """Wake every active workflow of ``engine``'s log (at most ``limit``) at the timer it waits
    for, now if none; those of the ``held`` tiers (above their backpressure mark) are left to
    their checks, as the reconciler's checks leave them. Returns the wakes sent."""
    woken = 0
    now = engine.log.now()
    for doc in engine.log.wakeable(limit=limit, skip_tiers=held):
        delay = 0.0
        timer = doc.get("timer_at")
        if isinstance(timer, datetime):
            timer = timer if timer.tzinfo else timer.replace(tzinfo=UTC)
            delay = max((timer - now).total_seconds(), 0.0)
        tier = str(doc.get("tier") or engine.default_tier)
        woken += engine.ports.publish_wake(str(doc["_id"]), tier, delay=delay + NOT_FOLDED_SECONDS)
    return woken
