"""The test app, plus a task whose first attempt ends, after a pause, in an outcome that writes
to the broker (a retry, a requeue, a dead letter's copy)."""

from __future__ import annotations

import time
from typing import Any

from celery.exceptions import Reject

from celery_ledger import PermanentError
from tasks.effects import effects, record_effect
from tests.integration.ledger_app import app


@app.task(
    bind=True,
    idempotency_key="{token}",
    max_retries=3,
    retry_base_seconds=0.5,
    retry_cap_seconds=1.0,
)
def pause_then(self: Any, token: str, mode: str, seconds: float) -> str:
    """First attempt: sleep, then retry / requeue / die; later attempts succeed."""
    record_effect("attempt", token)
    first = effects().count_documents({"kind": "attempt", "key": token}) == 1
    if first:
        time.sleep(seconds)
        if mode == "retry":
            raise ConnectionError(f"dependency down for {token}")
        if mode == "requeue":
            raise Reject("try again", requeue=True)
        if mode == "dead":
            raise PermanentError(f"bad data for {token}")
    record_effect("done", token)
    return "done"
