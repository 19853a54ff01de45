"""celery-ledger: Celery tasks with exactly-once effects, backed by a MongoDB ledger."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

from .app import LedgerCelery, create_app
from .errors import (
    Backpressure,
    CircuitOpen,
    CommitLost,
    ConfigurationError,
    ControlFlow,
    DeadlineExceeded,
    IdentityError,
    Interrupted,
    LeaseLost,
    LedgerError,
    LedgerUnavailable,
    NonDeterminism,
    NotReplicated,
    PayloadError,
    PermanentError,
    PublishError,
    RetryNotPublished,
    StepFailed,
    StoreError,
    TaskError,
    WorkflowCancelled,
    WorkflowError,
    WorkflowFailed,
)
from .events import Job, Observer
from .ledger import ErrorEntry, LedgerRecord, State
from .policies.deadline import bounded, deadline, hedged, remaining
from .policies.fallback import Alternate, Fallback, LastGood, Placeholder
from .policies.schedule import CatchUp, Overlap, SchedulePolicy
from .settings import Settings
from .task import LedgerTask
from .workflow.api import Workflow, WorkflowEvent, WorkflowHandle, WorkflowStatus
from .workflow.context import WorkflowContext

try:
    __version__: str = _distribution_version("celery-ledger")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Alternate",
    "Backpressure",
    "CatchUp",
    "CircuitOpen",
    "CommitLost",
    "ConfigurationError",
    "ControlFlow",
    "DeadlineExceeded",
    "ErrorEntry",
    "Fallback",
    "IdentityError",
    "Interrupted",
    "Job",
    "LastGood",
    "LeaseLost",
    "LedgerCelery",
    "LedgerError",
    "LedgerRecord",
    "LedgerTask",
    "LedgerUnavailable",
    "NonDeterminism",
    "NotReplicated",
    "Observer",
    "Overlap",
    "PayloadError",
    "PermanentError",
    "Placeholder",
    "PublishError",
    "RetryNotPublished",
    "SchedulePolicy",
    "Settings",
    "State",
    "StepFailed",
    "StoreError",
    "TaskError",
    "Workflow",
    "WorkflowCancelled",
    "WorkflowContext",
    "WorkflowError",
    "WorkflowEvent",
    "WorkflowFailed",
    "WorkflowHandle",
    "WorkflowStatus",
    "bounded",
    "create_app",
    "deadline",
    "hedged",
    "remaining",
]
