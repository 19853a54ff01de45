"""The Redis transport's poller for a worker without an event loop (the gevent and eventlet
pools): its wait on the sockets bounded while a channel has no credit (see ``transport.py``,
whose :class:`~celery_ledger.transport.Transport` uses it)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from kombu.transport import redis as kombu_redis

# While a consuming channel has no credit (its QoS's every message is taken and not yet
# acknowledged), kombu stops polling that channel's BRPOP socket and waits on the others for
# the whole drain timeout. A worker with an event loop (prefork, threads, solo) checks credit
# again at the loop's next tick. Celery's loop without one (``synloop``: the gevent and eventlet
# pools) drains with a 2-second timeout, and an acknowledgement made meanwhile by a task's
# greenlet returns credit but wakes nobody: the worker sits out the rest of the 2 seconds with
# free slots. With acks_late and a prefetch of one per slot (create_app's settings) credit runs
# out whenever every slot is busy, so a loaded gevent worker stalled again and again (6 tiny
# tasks a second here, plain Celery 10 to 54). kombu's poller cannot be woken from another
# greenlet or thread, so the wait is bounded instead: re-checked every 5 ms, only while a
# channel lacks credit (every slot busy). Measured: about 0.08 ms of CPU a check, under 2% of a
# core while every slot is busy, against a free slot left idle for up to 2 seconds.
CREDIT_RECHECK_SECONDS = 0.005


def poll_timeout(channels: Iterable[Any], timeout: float | None) -> float | None:
    """How long a drain may wait on the sockets: ``timeout``, or at most
    :data:`CREDIT_RECHECK_SECONDS` while a channel that consumes has no credit."""
    if any(channel.active_queues and not channel.qos.can_consume() for channel in channels):
        return CREDIT_RECHECK_SECONDS if timeout is None else min(timeout, CREDIT_RECHECK_SECONDS)
    return timeout


# kombu sweeps for messages left unacknowledged past the visibility timeout on every tenth call
# of ``maybe_restore_messages``, which its poller makes at each wait that ends with no reply at
# all: while credit is out, once per 2-second drain. The rechecks above end such a wait every
# 5 ms, so those calls are spaced by time here, as often as the drains came.
# (An event loop calls it from its own timer, ``unacked_restore_interval``: left as it is.)
RESTORE_CALL_SECONDS = 2.0


class MultiChannelPoller(kombu_redis.MultiChannelPoller):
    """kombu's poller, whose wait is bounded while credit is out (see :func:`poll_timeout`).
    Only a drain without an event loop comes here; an event loop polls through its hub."""

    _restore_called_at = float("-inf")

    def get(self, callback: Any, timeout: float | None = None) -> Any:
        return super().get(callback, poll_timeout(self._channels, timeout))

    def maybe_restore_messages(self) -> Any:
        if self._in_protected_read:  # from a drain's wait (``get``), not an event loop's timer
            now = time.monotonic()
            if now - self._restore_called_at < RESTORE_CALL_SECONDS:
                return None
            self._restore_called_at = now
        return super().maybe_restore_messages()
