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

With fair dispatch on (``LEDGER_FAIR_QUEUE_DEPTH``), the pool also keeps
``LEDGER_FAIR_EXPRESS_SLOTS`` processes beyond the worker's concurrency, for the tenants' jobs
that go ahead of a backlog (:mod:`celery_ledger.express` takes them); Celery sizes its prefetch
by the concurrency alone (:attr:`TaskPool.num_processes`), so with a prefetch multiplier of 1
(the default of every tier but bulk) its own takes never fill them. (With a larger one, the jobs
a worker reserved may fill them, as any free process, and a newcomer waits behind those.)

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


def express_slots(app: Any) -> int:
    """The pool processes kept for the express lists by ``app``'s settings (0: fair dispatch
    off, or none asked for)."""
    settings = getattr(getattr(app, "runtime", None), "settings", None)
    if settings is None or not getattr(settings, "fair_queue_depth", 0):
        return 0
    return int(getattr(settings, "fair_express_slots", 0))


class TaskPool(prefork.TaskPool):  # type: ignore[misc]
    """Celery's prefork pool; see the module docstring."""

    def __init__(self, limit: int | None = None, *args: Any, **kwargs: Any) -> None:
        self.express_slots = express_slots(kwargs.get("app")) if limit else 0
        semaphore = kwargs.get("semaphore")  # (the worker's count of free processes, shared)
        if self.express_slots and semaphore is not None:
            semaphore.grow(self.express_slots)
        super().__init__((limit + self.express_slots) if limit else limit, *args, **kwargs)

    @property
    def num_processes(self) -> int:
        """The processes Celery's own takes may fill (its prefetch is this many times the
        multiplier, after a reconnection too): the express ones are not counted."""
        return max(int(super().num_processes) - self.express_slots, 0)

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
