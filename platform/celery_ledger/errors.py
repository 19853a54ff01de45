"""The exceptions celery-ledger raises, all rooted at :class:`LedgerError`.

LedgerError
├── ConfigurationError          settings or task options are invalid
├── PublishError                a message could not be published as asked
│   ├── PayloadError            arguments are not JSON-serialisable or exceed the size limit
│   ├── IdentityError           a task id that is not the id of the job's key
│   ├── Backpressure            the tier's queue is above its high-water mark
│   ├── RetryNotPublished       a retry's message could not be published
│   └── NotReplicated           the ledger away, no broker replica confirmed the job in time
├── StoreError                  the ledger store failed (not worth retrying as is)
│   └── LedgerUnavailable       unreachable, or the outcome of a write is unknown (transient)
│       └── NotApplied          unavailable, and the operation surely did not apply
├── TaskError                   raised by (or on behalf of) a task body
│   ├── PermanentError          retrying cannot help: dead-letter at once
│   ├── StepFailed              inside a workflow: one of its steps failed for good
│   └── WorkflowFailed          a workflow ended without its result (failed, compensated, ...)
├── WorkflowError               a workflow cannot go on as written
│   └── NonDeterminism          its code asks for another step than its log recorded there
└── ControlFlow                 not failures: the platform acts on them, Sentry never reports
    ├── LeaseLost               a newer claim owns the record; this holder must stop writing
    ├── CircuitOpen             a circuit breaker refused the call for now (``retry_at``)
    ├── WorkflowCancelled       inside a workflow: it was cancelled (compensations follow)
    └── Interrupted             the worker is shutting down; the job resumes elsewhere
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


class IdentityError(PublishError, ValueError):
    """A task id was given that is not the id of the job ``(task name, idempotency key)``."""


class Backpressure(PublishError):
    """The tier's queue is above its high-water mark: the publish was refused (or timed out)."""

    def __init__(self, tier: str, depth: int, high_water: int) -> None:
        super().__init__(f"backpressure on tier {tier!r}: depth {depth}, high water {high_water}")
        self.tier = tier
        self.depth = depth
        self.high_water = high_water

    def __reduce__(self) -> tuple[type[Backpressure], tuple[str, int, int]]:
        return type(self), (self.tier, self.depth, self.high_water)


class RetryNotPublished(PublishError):
    """The message of a retry could not be published (broker down, backpressure)."""


class NotReplicated(PublishError, ConnectionError):
    """The ledger is away, so the broker alone keeps the job until it is back, and fewer of
    the broker's replicas than ``LEDGER_BROKER_CONFIRM_REPLICAS`` confirmed in time that they
    hold it (a failover under way, replicas behind): its message was not sent. Publish again
    (the key runs the job once). A ``ConnectionError``: like a broker away, a task body's
    publish refused so is retried by default."""


class StoreError(LedgerError):
    """The ledger store failed."""


class LedgerUnavailable(StoreError):
    """The ledger cannot be reached right now, or a write's outcome is unknown (its reply was
    lost, or its write concern was not confirmed); the operation may succeed later."""


class NotApplied(LedgerUnavailable):
    """The ledger did not apply the operation, for now (no server could be selected, so it
    was never sent; or a claim's record kept changing under it): trying again later is safe,
    and a caller that must know whether a write applied may rely on it."""


class CommitLost(StoreError):
    """The ledger no longer holds atomic steps whose transactions it acknowledged to this
    attempt (a server that did not keep a commit across a crash or a failover). The attempt's
    outcome is not written: the job runs again and the steps with it."""

    def __init__(self, record_id: str, steps: tuple[str, ...]) -> None:
        super().__init__(
            f"{record_id}: the ledger lost the acknowledged commit of atomic step(s)"
            f" {', '.join(steps)}; the job runs again"
        )
        self.record_id = record_id
        self.steps = steps

    def __reduce__(self) -> tuple[type[CommitLost], tuple[str, tuple[str, ...]]]:
        return type(self), (self.record_id, self.steps)


class TaskError(LedgerError):
    """Raised by, or on behalf of, a task body."""


class PermanentError(TaskError):
    """A failure that retrying cannot fix; the task is dead-lettered without retries."""


class StepFailed(TaskError):
    """Raised inside a workflow's code where a step (task or child workflow) failed for good.

    The workflow may catch it (a fallback); uncaught, the workflow fails and its registered
    compensations run.
    """

    def __init__(self, step: str, position: int, reason: str) -> None:
        super().__init__(f"step {position} ({step}) failed: {reason}")
        self.step = step
        self.position = position
        self.reason = reason

    def __reduce__(self) -> tuple[type[StepFailed], tuple[str, int, str]]:
        return type(self), (self.step, self.position, self.reason)


class WorkflowFailed(TaskError):
    """A workflow ended without a result: failed, compensated, cancelled or dead (the
    message says which, and why)."""


class WorkflowError(LedgerError):
    """A workflow cannot go on as written (its definition, its log, or an operator's request)."""


class NonDeterminism(WorkflowError):
    """A workflow's code asked, at a position of its log, for another command than the one
    recorded there: resuming it would silently diverge, so it stops (status ``stuck``)."""


class ControlFlow(LedgerError):
    """Tells the caller what to do next; never a failure of the platform or of the task."""


class LeaseLost(ControlFlow):
    """A newer claim (higher fencing token) owns the record; this holder's write was refused."""

    def __init__(self, record_id: str, fence: int) -> None:
        super().__init__(f"lease on {record_id} lost: fencing token {fence} was superseded")
        self.record_id = record_id
        self.fence = fence

    def __reduce__(self) -> tuple[type[LeaseLost], tuple[str, int]]:
        return type(self), (self.record_id, self.fence)


class CircuitOpen(ControlFlow):
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


class DeadlineExceeded(TaskError, TimeoutError):
    """A dependency did not answer before the deadline (``bounded``, ``hedged``): a timeout,
    so a task's retry policy retries it and an optional step is skipped on it."""


class Interrupted(ControlFlow):
    """The worker is shutting down: the job hands its message back and resumes elsewhere."""


class WorkflowCancelled(ControlFlow):
    """Raised inside a workflow's code where it waits when the workflow is cancelled; uncaught,
    its registered compensations run and it ends ``cancelled``."""


# pymongo's server-selection error ends with the topology it saw, every server's state in full
# (a screenful for a replica set); what failed is said before it.
_TOPOLOGY = ", Topology Description: "


def brief(exc: BaseException) -> str:
    """``exc``'s text for a line a person reads (a log line, an error, a health check), less
    pymongo's topology description: the servers' errors and the timeout stay."""
    return str(exc).split(_TOPOLOGY, 1)[0]
