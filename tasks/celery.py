"""The app object. Settings come from LEDGER_* environment variables."""

from celery_ledger import create_app

from .observers import SlowJobs

# Its tier queues are named after it: reference.critical, reference.default, reference.bulk.
app = create_app(
    "reference",
    include=[
        "tasks.payments",
        "tasks.notifications",
        "tasks.reports",
        "tasks.backfills",
        "tasks.fulfilment",
        "tasks.triggers",
        "tasks.checkout",
    ],
)
app.observers.add(SlowJobs(budget_seconds=10.0))
