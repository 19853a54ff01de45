"""The idempotency ledger: record model, MongoDB store and Celery result backend."""

from .record import ErrorEntry, LedgerRecord, State
from .store import Claim, ClaimOutcome, Ledger

__all__ = ["Claim", "ClaimOutcome", "ErrorEntry", "Ledger", "LedgerRecord", "State"]
