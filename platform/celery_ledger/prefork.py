"""Celery's prefork pool with one repair: a pool process killed while it writes a result to
the worker cannot end the worker.

The worker reads each message of a pool process (a result, a state change) from the process's
pipe in its event loop, as a generator that resumes when more bytes come
(``celery.concurrency.asynpool.ResultHandler._recv_message``). Celery guards the generator's first
step: a pipe at its end there just drops the reader. A message that arrives in more than one
piece is read on by kombu's hub, which calls the generator itself and re-raises what it raises:
a pool process SIGKILLed halfway through writing a message leaves it cut short, the next read
raises ``OSError("End of file during message")`` (or the truncated body's ``EOFError("Ran out of
input")``), and the whole worker ends with "Unrecoverable error", its other processes' jobs with it
(seen in the long chaos soak, where pool processes are killed every few seconds). Here such a
read hands the pipe back to Celery's reader, whose guarded first step finds the pipe's end and
drops it; the killed process's job is Celery's lost worker (``reject_on_worker_lost``), as for any
process killed mid-job.

``create_app`` puts this pool in place of Celery's prefork pool when a worker starts (the
``worker_init`` signal, before Celery builds the pool); another pool is left as it is.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Generator
from typing import Any

from celery.concurrency import asynpool, prefork

logger = logging.getLogger("celery_ledger.prefork")

# What reading a message cut short raises: the pipe's end in the middle of it (OSError), or a
# body that ends too soon to unpickle (EOFError, UnpicklingError).
_CUT_SHORT = (OSError, EOFError, pickle.UnpicklingError)


class ResultHandler(asynpool.ResultHandler):  # type: ignore[misc]
    def _recv_message(
        self, add_reader: Callable[..., Any], fd: int, callback: Callable[..., Any], **kwargs: Any
    ) -> Generator[None, None, None]:
        reading = super()._recv_message(add_reader, fd, callback, **kwargs)
        try:
            next(reading)  # (what the first step raises, Celery's own guard handles)
        except StopIteration:
            return
        while True:
            yield
            try:
                next(reading)
            except StopIteration:
                return
            except _CUT_SHORT as exc:
                logger.warning(
                    "a pool process's message was cut short (the process died writing it): %r",
                    exc,
                )
                add_reader(fd, self.handle_event, fd)
                return


class AsynPool(asynpool.AsynPool):  # type: ignore[misc]
    ResultHandler = ResultHandler


class TaskPool(prefork.TaskPool):  # type: ignore[misc]
    """Celery's prefork pool, whose worker outlives a process killed mid-write."""

    Pool = AsynPool


def prefer_repaired_pool(worker: Any) -> None:
    """At ``worker_init``: a worker about to build Celery's prefork pool builds this one."""
    from celery.concurrency import get_implementation

    try:
        chosen = get_implementation(worker.pool_cls)
    except Exception:  # Celery reports an unknown pool itself, right after
        return
    if chosen is prefork.TaskPool:
        worker.pool_cls = TaskPool
