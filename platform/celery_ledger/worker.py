"""Worker bootstep: what every celery-ledger worker runs beside its pool."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from celery import bootsteps

from .delayed import DelayedPublisher
from .errors import LedgerError

logger = logging.getLogger("celery_ledger.worker")


class LedgerWorkerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Ensures the ledger's indexes and publishes delayed deliveries when they fall due.

    The publisher is the step's ``obj``, so Celery's start, stop and terminate reach it.
    """

    requires: ClassVar[set[str]] = {"celery.worker.components:Pool"}

    def create(self, worker: Any) -> DelayedPublisher:
        app = worker.app
        try:
            app.ledger.ensure_indexes()
        except LedgerError as exc:  # the ledger may come up later; claims defer until then
            logger.warning("could not ensure ledger indexes at start-up: %s", exc)
        return DelayedPublisher(
            app.delayed,
            lambda name, args, kwargs, options: app.send_task(name, args, kwargs, **options),
            interval=app.settings.defer_poll_seconds,
        )
