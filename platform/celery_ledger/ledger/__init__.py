"""The idempotency ledger: the record model, the kept message, the dead job, and the MongoDB
store that owns every read and write of the ledger's collections."""

from .dead import DeadJob, DeadLetter
from .message import KeptMessage
from .record import ErrorEntry, LedgerRecord, State
from .store import Claim, ClaimOutcome, Ledger

__all__ = [
    "Claim",
    "ClaimOutcome",
    "DeadJob",
    "DeadLetter",
    "ErrorEntry",
    "KeptMessage",
    "Ledger",
    "LedgerRecord",
    "State",
]
