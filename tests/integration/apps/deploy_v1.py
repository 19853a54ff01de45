"""Version 1 of an app ("deploys"), as the workers not yet upgraded run it."""

from __future__ import annotations

from celery_ledger import create_app
from tasks.effects import record_effect

app = create_app("deploys")


@app.task(name="deploys.whoami", idempotency_key="{token}")
def whoami(token: str) -> str:
    record_effect("whoami-deploys", token)
    return "deploys"


@app.task(name="deploys.greet", idempotency_key="{token}")
def greet(token: str) -> str:
    record_effect("greet", token)
    return "hello"
