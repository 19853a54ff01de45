"""The exceptions celery-ledger raises, all rooted at :class:`LedgerError`.

    LedgerError
    ├── ConfigurationError          settings or task options are invalid
    ├── PublishError                a message could not be published as asked
    │   └── PayloadError            arguments are not JSON-serialisable or exceed the size limit
    ├── StoreError                  the ledger store failed
    │   └── LedgerUnavailable       the ledger cannot be reached right now (transient)
    └── TaskError                   raised by (or on behalf of) a task body
        └── PermanentError          retrying cannot help: dead-letter at once

Control flow stays apart from errors: :class:`LeaseLost` tells the caller that a newer claim
owns the record, and is not a failure of the platform.
"""

from __future__ import annotations


class LedgerError(Exception):
    """Root of every exception celery-ledger raises."""


class ConfigurationError(LedgerError, ValueError):
    """Settings or task options are invalid."""


class PublishError(LedgerError):
    """A message could not be published as asked."""


class PayloadError(PublishError, TypeError):
    """Task arguments are not JSON-serialisable or exceed the size limit."""


class StoreError(LedgerError):
    """The ledger store failed."""


class LedgerUnavailable(StoreError):
    """The ledger cannot be reached right now; the operation may succeed later."""


class TaskError(LedgerError):
    """Raised by, or on behalf of, a task body."""


class PermanentError(TaskError):
    """A failure that retrying cannot fix; the task is dead-lettered without retries."""


class LeaseLost(LedgerError):
    """A newer claim (higher fencing token) owns the record; this holder's write was refused."""

    def __init__(self, record_id: str, fence: int) -> None:
        super().__init__(f"lease on {record_id} lost: fencing token {fence} was superseded")
        self.record_id = record_id
        self.fence = fence
