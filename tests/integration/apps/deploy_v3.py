"""Version 3 of the "deploys" app: ``deploys.whoami`` removed (the old workers still run it)."""

from __future__ import annotations

from celery_ledger import create_app
from tasks.effects import record_effect

app = create_app("deploys")


@app.task(name="deploys.greet", idempotency_key="{token}")
def greet(token: str, greeting: str = "hello") -> str:
    record_effect("greet", token)
    return greeting


@app.task(name="deploys.new_feature", idempotency_key="{token}")
def new_feature(token: str) -> str:
    record_effect("new_feature", token)
    return "new"
