"""Small helpers the integration tests share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

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


def effect_count(kind: str, key: str) -> int:
    return effects().count_documents({"kind": kind, "key": key})
