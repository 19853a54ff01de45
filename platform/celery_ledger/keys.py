"""The old path of :mod:`celery_ledger.identity` (idempotency keys, task ids, a job's
identity), kept for one release: it was renamed so that "keys" names only the encryption and
signing keys (``ledger keys``). Import from ``celery_ledger.identity``."""

from __future__ import annotations

from .identity import (
    MESSAGE_ID_KEY_PREFIX,
    SCHEDULE_KEY_PREFIX,
    TASK_ID_NAMESPACE,
    Identity,
    KeySpec,
    bind_arguments,
    canonical_json,
    compute_key,
    default_key,
    derive_task_id,
    identity_of,
    slot_key,
    slot_of_key,
    validate_key,
)

__all__ = [
    "MESSAGE_ID_KEY_PREFIX",
    "SCHEDULE_KEY_PREFIX",
    "TASK_ID_NAMESPACE",
    "Identity",
    "KeySpec",
    "bind_arguments",
    "canonical_json",
    "compute_key",
    "default_key",
    "derive_task_id",
    "identity_of",
    "slot_key",
    "slot_of_key",
    "validate_key",
]
