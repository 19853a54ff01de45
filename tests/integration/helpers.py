"""Small helpers the integration tests share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from tasks.effects import effects

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    *,
    timeout: float = 30.0,
    interval: float = 0.1,
    what: str = "condition",
) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def shared_task(app: Any, name: str) -> Any:
    """The test app's task ``name`` as bound to another app.

    The test app's tasks are Celery *shared* tasks: every app of this process gets them when it
    finalizes (with its own settings). Declaring a same-named task would collide with them.
    """
    import tests.integration.ledger_app  # noqa: F401 - registers the shared tasks

    return app.tasks[name]


def effect_count(kind: str, key: str) -> int:
    return effects().count_documents({"kind": kind, "key": key})
