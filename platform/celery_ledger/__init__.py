"""celery-ledger: Celery tasks with exactly-once effects, backed by a MongoDB ledger."""

from .app import LedgerCelery, create_app
from .errors import (
    Backpressure,
    CircuitOpen,
    ConfigurationError,
    ControlFlow,
    IdentityError,
    Interrupted,
    LeaseLost,
    LedgerError,
    LedgerUnavailable,
    PayloadError,
    PermanentError,
    PublishError,
    RetryNotPublished,
    StoreError,
    TaskError,
)
from .events import Job, Observer
from .ledger import ErrorEntry, LedgerRecord, State
from .settings import Settings
from .task import LedgerTask

__all__ = [
    "Backpressure",
    "CircuitOpen",
    "ConfigurationError",
    "ControlFlow",
    "ErrorEntry",
    "IdentityError",
    "Interrupted",
    "Job",
    "LeaseLost",
    "LedgerCelery",
    "LedgerError",
    "LedgerRecord",
    "LedgerTask",
    "LedgerUnavailable",
    "Observer",
    "PayloadError",
    "PermanentError",
    "PublishError",
    "RetryNotPublished",
    "Settings",
    "State",
    "StoreError",
    "TaskError",
    "create_app",
]
