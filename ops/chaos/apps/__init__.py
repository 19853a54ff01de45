"""The soak's worker apps: the same task body on celery-ledger and on plain Celery."""
