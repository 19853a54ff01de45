"""Tasks the integration tests run in real workers; each records its effect to be counted."""

from __future__ import annotations

import os
import time
from typing import Any

from celery_ledger import create_app
from tasks.effects import effects, record_effect

app = create_app("ledger_tests")


class FlakyError(ConnectionError):
    """Fails the first attempts of ``flaky``."""


@app.task(idempotency_key="{token}")
def record(token: str, sleep_seconds: float = 0.0) -> dict[str, Any]:
    """Sleep, then record one effect."""
    time.sleep(sleep_seconds)
    record_effect("record", token)
    return {"token": token, "pid": os.getpid()}


@app.task(
    bind=True,
    idempotency_key="{token}",
    autoretry_for=(FlakyError,),
    default_retry_delay=0.3,
    max_retries=5,
    retry_backoff=False,
)
def flaky(self: Any, token: str, failures: int) -> str:
    """Fail ``failures`` times (counted as attempt effects), then record one effect."""
    record_effect("attempt", token)
    if effects().count_documents({"kind": "attempt", "key": token}) <= failures:
        raise FlakyError(f"flaky failure for {token}")
    record_effect("flaky", token)
    return f"ok after {failures} failures"


@app.task(idempotency_key="{token}")
def boom(token: str) -> None:
    raise ValueError(f"boom {token}")


@app.task(idempotency_key="{token}")
def returns_a_set(token: str) -> Any:
    return {1, 2, 3}


@app.task(idempotency_key="{token}", dedupe_on_publish=True)
def record_deduped(token: str) -> str:
    record_effect("deduped", token)
    return token


@app.task
def add(x: int, y: int) -> int:
    record_effect("add", f"{x}+{y}")
    return x + y


@app.task(
    bind=True,
    idempotency_key="{token}",
    autoretry_for=(FlakyError,),
    default_retry_delay=3,
    max_retries=1,
    retry_backoff=False,
)
def slow_retry(self: Any, token: str) -> str:
    """Fails once, then is retried after 3 seconds."""
    record_effect("attempt", token)
    if effects().count_documents({"kind": "attempt", "key": token}) == 1:
        raise FlakyError("first attempt")
    return "retried"
