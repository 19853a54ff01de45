"""The exceptions celery-ledger raises, all rooted at :class:`LedgerError`.

    LedgerError
    ├── ConfigurationError          settings or task options are invalid
    ├── PublishError                a message could not be published as asked
    │   ├── PayloadError            arguments are not JSON-serialisable or exceed the size limit
    │   └── Backpressure            the tier's queue is above its high-water mark
    ├── StoreError                  the ledger store failed
    │   └── LedgerUnavailable       the ledger cannot be reached right now (transient)
    └── TaskError                   raised by (or on behalf of) a task body
        └── PermanentError          retrying cannot help: dead-letter at once

Control flow stays apart from errors: :class:`LeaseLost` tells the caller that a newer claim
owns the record, and is not a failure of the platform; :class:`CircuitOpen` tells the caller that
a circuit breaker refused the call for now (``retry_at`` says when to come back).
"""

from __future__ import annotations

from datetime import UTC, datetime


class LedgerError(Exception):
    """Root of every exception celery-ledger raises."""


class ConfigurationError(LedgerError, ValueError):
    """Settings or task options are invalid."""


class PublishError(LedgerError):
    """A message could not be published as asked."""


class PayloadError(PublishError, TypeError):
    """Task arguments are not JSON-serialisable or exceed the size limit."""


class Backpressure(PublishError):
    """The tier's queue is above its high-water mark: the publish was refused (or timed out)."""

    def __init__(self, tier: str, depth: int, high_water: int) -> None:
        super().__init__(f"backpressure on tier {tier!r}: depth {depth}, high water {high_water}")
        self.tier = tier
        self.depth = depth
        self.high_water = high_water

    def __reduce__(self) -> tuple[type[Backpressure], tuple[str, int, int]]:
        return type(self), (self.tier, self.depth, self.high_water)


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


class CircuitOpen(LedgerError):
    """A circuit breaker is open (or its half-open probes are taken): the call was not made."""

    def __init__(self, name: str, retry_at: float | None) -> None:
        message = f"circuit {name!r} is open"
        if retry_at is not None:
            at = datetime.fromtimestamp(retry_at, UTC).isoformat(timespec="milliseconds")
            message += f"; retry after {at}"
        super().__init__(message)
        self.name = name
        self.retry_at = retry_at

    def __reduce__(self) -> tuple[type[CircuitOpen], tuple[str, float | None]]:
        return type(self), (self.name, self.retry_at)
