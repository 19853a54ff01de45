"""celery-ledger: Celery tasks with exactly-once effects, backed by a MongoDB ledger."""

from .app import LedgerCelery, create_app
from .errors import (
    Backpressure,
    CircuitOpen,
    ConfigurationError,
    LeaseLost,
    LedgerError,
    LedgerUnavailable,
    PayloadError,
    PermanentError,
    PublishError,
    StoreError,
    TaskError,
)
from .ledger import ErrorEntry, LedgerRecord, State
from .settings import Settings
from .task import LedgerTask

__all__ = [
    "Backpressure",
    "CircuitOpen",
    "ConfigurationError",
    "ErrorEntry",
    "LeaseLost",
    "LedgerCelery",
    "LedgerError",
    "LedgerRecord",
    "LedgerTask",
    "LedgerUnavailable",
    "PayloadError",
    "PermanentError",
    "PublishError",
    "Settings",
    "State",
    "StoreError",
    "TaskError",
    "create_app",
]
