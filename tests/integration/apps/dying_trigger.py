"""The trigger app of :mod:`tests.integration.apps.triggers`, with one fault for a test: the
worker whose environment names an order in ``TRIGGER_TEST_DIE_AT_ORDER`` SIGKILLs itself and
its pool processes (a host crash) while its watcher publishes that order's job, after the
job's ``queued`` record is written and before its message reaches the broker.

That is the point of Celery's ``before_task_publish`` signal for a trigger's task: the task's
``apply_async`` writes the record first (``dedupe_on_publish``: ``Ledger.enqueue``), then
Celery builds the message and sends the signal just before kombu's ``producer.publish``.

It dies once: the first process to create ``TRIGGER_TEST_DIE_MARKER`` (a path) dies; a worker
started later with the same environment publishes that order's job normally.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from celery import signals

from tests.integration.apps.triggers import TASK, app, on_order_task

__all__ = ["DIE_AT_ORDER", "DIE_MARKER", "app", "on_order_task"]

DIE_AT_ORDER = "TRIGGER_TEST_DIE_AT_ORDER"
DIE_MARKER = "TRIGGER_TEST_DIE_MARKER"


def die_before_the_message(sender: Any = None, body: Any = None, **_: Any) -> None:
    """``before_task_publish``: the chosen order's job is being published: crash the host."""
    if sender != TASK or not isinstance(body, tuple | list) or not body:
        return
    args = body[0]  # protocol 2: (args, kwargs, embed); the argument is the order as JSON
    if not args or not isinstance(args[0], dict):
        return
    if args[0].get("_id") != os.environ[DIE_AT_ORDER]:
        return
    try:
        fd = os.open(os.environ[DIE_MARKER], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # it died once already
    os.write(fd, f"{os.getpid()} {args[0]['_id']}".encode())
    os.close(fd)
    # The whole worker (its own session: main process and pool), as WorkerProcess.kill does
    os.killpg(os.getpgrp(), signal.SIGKILL)


if os.environ.get(DIE_AT_ORDER) and os.environ.get(DIE_MARKER):
    signals.before_task_publish.connect(die_before_the_message, weak=False)
