"""Another team's app on the same broker, with a task of the same name and tier."""

from __future__ import annotations

from celery_ledger import Settings, create_app
from tasks.effects import record_effect

# Its own ledger collection: two apps never share records, whatever their task names
app = create_app("other_tests", settings=Settings(ledger_collection="other_ledger"))


@app.task(name="deploys.whoami", idempotency_key="{token}")
def whoami(token: str) -> str:
    record_effect("whoami-other", token)
    return "other_tests"
