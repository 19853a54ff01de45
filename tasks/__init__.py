"""The reference app: tasks an app team would write on celery-ledger (``celery -A tasks``)."""

from .app import app

__all__ = ["app"]
