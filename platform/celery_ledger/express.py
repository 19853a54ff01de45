"""The express process: a worker's take of the tenants' jobs that went ahead of a backlog.

Fair dispatch (:mod:`celery_ledger.fairness`) lets a tenant with nothing waiting go ahead of
another tenant's backlog, but a job starts only where a running one ended: behind a flood that
fills every pool process, the newcomer still waited for the first of them to end (most of a
flood job's time, measured by ``ops/bench/fairness.py``). A process held back from the flood
would cost it a share of its throughput (half of it at ``-c 2``). Instead the pool keeps
``LEDGER_FAIR_EXPRESS_SLOTS`` processes beyond the worker's concurrency
(:class:`celery_ledger.prefork.TaskPool`), and this consumer fills them from the express lists
alone: a second channel on the worker's connection, with a prefetch of that many, whose take
reads only those lists of the queues the task consumer serves now (a throttle or an operator
may cancel one; see ``Channel._brpop_start``). The task consumer's own take reads the express
lists first too, so a message there is taken by whichever process frees first.

Nothing else changes: a message taken here is booked, acknowledged late, put back by the
visibility sweep or the reconciler, guarded and run as any other (Celery's task handler, the
worker's :class:`~celery_ledger.worker.LedgerConsumer`). The worker marks the queues it serves
this way (the feeder's express mark), and only while a worker marks a queue does a newcomer go
to its express list: workers of an earlier release, and a pool that keeps no express process
(another pool, or ``LEDGER_FAIR_EXPRESS_SLOTS=0``), see the front of the queue as before.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from celery import bootsteps

logger = logging.getLogger("celery_ledger.express")


def express_queues(consumer: Any) -> frozenset[str]:
    """The queues whose express lists ``consumer`` (Celery's) takes from with a process of
    their own now: none unless its express consumer runs."""
    return frozenset(getattr(consumer, "ledger_express_queues", None) or ())


class ExpressStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """The express consumer, started after Celery's task consumer (module docstring)."""

    requires: ClassVar[tuple[str, ...]] = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.consumer: Any = None
        c.ledger_express_queues = frozenset()
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        slots = int(getattr(c.pool, "express_slots", 0) or 0)
        tasks = c.task_consumer
        if not slots or tasks is None:
            return
        channel = c.connection.channel()
        channel.ledger_express_for = tasks.channel
        consumer = c.app.amqp.TaskConsumer(
            channel, queues=list(tasks.queues), on_decode_error=c.on_decode_error
        )
        consumer.on_message = c.create_task_handler()
        consumer.qos(prefetch_count=slots)
        consumer.consume()
        self.consumer = consumer
        c.ledger_express_queues = frozenset(queue.name for queue in tasks.queues)
        logger.info("express process(es): %d, for %s", slots, sorted(c.ledger_express_queues))

    def stop(self, c: Any) -> None:
        """Stops taking; what it took runs on and is acknowledged on its channel, which closes
        with the connection (as Celery's task consumer's)."""
        c.ledger_express_queues = frozenset()
        if self.consumer is not None:
            try:
                self.consumer.cancel()
            except Exception as exc:  # a connection already lost: nothing more to cancel
                logger.debug("express consumer not cancelled: %s", exc)
            self.consumer = None

    def shutdown(self, c: Any) -> None:
        self.stop(c)


__all__ = ["ExpressStep", "express_queues"]
