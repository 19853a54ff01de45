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
# Periodic tasks: declared beside the task with @app.periodic (tasks/reports.py), or in
# Celery's own beat_schedule. The workers run them (one scheduler at a time across the fleet),
# and so does `celery -A tasks beat` if you run it; each slot runs once either way.
