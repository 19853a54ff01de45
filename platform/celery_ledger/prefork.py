"""The prefork pool of a celery-ledger worker: Celery's, except that a pool process killed by a
signal while the worker starts does not end the worker.

The first time a Celery worker's event loop starts, it ends ("Unrecoverable error:
WorkerLostError('Could not start worker processes')") if any pool process has exited by then,
whatever ended it: billiard's ``did_start_ok`` asks only whether one exited. That is meant for
processes that cannot start (the app's module failing in the child), but it also ends a worker
whose pool process was killed in its first second (the OOM killer, an operator's ``kill``, a
deploy tool's ``kill -9``; seen in the chaos soak). A process SIGKILLed had started: the pool
replaces it (at its next upkeep, within seconds), as any process that dies later, and the worker
goes on. Any other exit (a failed start: a status of 0 or more; another signal, which a child
that cannot start may die of, a crash in an extension) still ends the worker, as in Celery. (A
SIGTERM that early is not told from a failed start: billiard's child exits with status 15.)

The module is named ``prefork`` as Celery's: Celery's Django fix-up looks for that name to
close the database connections a child inherits.

Set as ``worker_pool`` by ``create_app``: Celery's worker command takes it for ``-P prefork``
(and by default); another pool named on the command line (threads, solo) is used as given.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from celery.concurrency import prefork

logger = logging.getLogger("celery_ledger.prefork")


class TaskPool(prefork.TaskPool):  # type: ignore[misc]
    """Celery's prefork pool; see the module docstring."""

    def did_start_ok(self) -> bool:
        pool: Any = self._pool
        # (what billiard's own check does: the processes that exited, joined and forgotten; the
        # pool starts their replacements at its next upkeep)
        exited = pool._join_exited_workers()
        failed = [status for status in exited if status != -signal.SIGKILL]
        if exited and not failed:
            logger.warning(
                "%d pool process(es) killed (SIGKILL) as the worker started: replaced", len(exited)
            )
        return not failed
