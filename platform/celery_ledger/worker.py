"""Worker bootstep: what every celery-ledger worker runs beside its pool."""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from .delayed import DelayedPublisher
from .errors import LedgerError

logger = logging.getLogger("celery_ledger.worker")


class LedgerWorkerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Ensures the ledger's indexes and publishes delayed deliveries when they fall due."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.publisher: DelayedPublisher | None = None

    def start(self, worker: Any) -> None:
        app = worker.app
        try:
            app.ledger.ensure_indexes()
        except LedgerError as exc:  # the ledger may come up later; claims defer until then
            logger.warning("could not ensure ledger indexes at start-up: %s", exc)
        self.publisher = DelayedPublisher(
            app.delayed,
            lambda name, args, kwargs, options: app.send_task(name, args, kwargs, **options),
            interval=app.settings.defer_poll_seconds,
        )
        self.publisher.start()

    def stop(self, worker: Any) -> None:
        if self.publisher is not None:
            self.publisher.stop()
