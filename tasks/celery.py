"""The app object. Settings come from LEDGER_* environment variables."""

from celery_ledger import create_app

app = create_app(
    "reference",
    include=["tasks.payments", "tasks.notifications", "tasks.reports", "tasks.backfills"],
)
