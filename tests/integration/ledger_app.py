"""Tasks the integration tests run in real workers; each records its effect to be counted."""

from __future__ import annotations

import os
import time
from typing import Any

from celery_ledger import PermanentError, create_app
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


@app.task(idempotency_key="{token}")
def fails_until_fixed(token: str) -> str:
    """Permanently fails until a 'fixed' effect exists for the token (an operator's fix)."""
    if effects().count_documents({"kind": "fixed", "key": token}) == 0:
        raise PermanentError(f"bad data for {token}")
    record_effect("fixed_run", token)
    return "fixed"


@app.task(idempotency_key="{token}", max_retries=2, retry_base_seconds=0.1, retry_cap_seconds=0.3)
def always_down(token: str) -> None:
    """A dependency that never comes back: retried twice, then dead."""
    record_effect("attempt", token)
    raise ConnectionError(f"dependency down for {token}")


class RateLimited(Exception):
    """A 429 with a Retry-After hint."""

    retry_after = 1.5


@app.task(
    idempotency_key="{token}",
    retry_on=(RateLimited,),
    retry_base_seconds=0.01,
    retry_cap_seconds=0.02,
)
def rate_limited_once(token: str) -> str:
    record_effect("attempt", token)
    if effects().count_documents({"kind": "attempt", "key": token}) == 1:
        raise RateLimited("429 Too Many Requests")
    return "through"


@app.task(idempotency_key="{token}")
def kills_its_worker(token: str) -> None:
    """Dies with SIGKILL every time (a poison message for plain Celery's requeue loop)."""
    record_effect("attempt", token)
    os.kill(os.getpid(), 9)


@app.task(
    idempotency_key="{token}",
    breaker="payments",
    max_retries=10,
    retry_base_seconds=0.2,
    retry_cap_seconds=0.4,
)
def call_payments(token: str) -> str:
    """Calls the payments dependency (recorded), which fails while an outage is recorded."""
    record_effect("payment_call", token)
    if effects().count_documents({"kind": "outage", "key": "payments"}):
        raise ConnectionError("payments gateway unreachable")
    return "paid"


@app.task(idempotency_key="{token}", rate_bucket="limited")
def rate_limited(token: str) -> str:
    """Draws from the shared 'limited' bucket (4/s, burst 2) across all worker processes."""
    record_effect("limited", token)
    return token


@app.task(idempotency_key="{token}", tier="bulk")
def bulk_item(token: str) -> str:
    time.sleep(0.02)
    record_effect("bulk", token)
    return token
