"""The ledger record: one MongoDB document per (task name, idempotency key).

Schema 2 (schema 1 records read the same): ``message`` keeps the ledger headers with the
arguments; a terminal record may name its ``outcome`` (``ignored``, ``replaced``); a dead one its
``death`` (``failed``, ``retired``, ``poison``, ...); an alias document (``alias_of``) maps a
message id that is not a job's record id to that record."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .. import headers
from ..tracecontext import trace_id_of

SCHEMA_VERSION = 2


class State(StrEnum):
    """Where a job stands. ``succeeded`` and ``dead`` are terminal."""

    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    DEAD = "dead"


TERMINAL = frozenset({State.SUCCEEDED, State.DEAD})


def status_of(state: State, *, degraded: bool, late: bool) -> str:
    """What a caller polling a job sees: its state, except ``succeeded`` while a degraded
    result stands (its replacement may be running: the degraded result is served until the
    real one replaces it) and ``late`` for an unfinished job past its latency objective."""
    if degraded and state is not State.DEAD:
        return State.SUCCEEDED.value
    if late and state not in TERMINAL:
        return "late"
    return state.value


class ErrorEntry(BaseModel):
    """One failed attempt, as kept in the record's bounded error history."""

    model_config = ConfigDict(extra="ignore")

    type: str
    message: str
    traceback_digest: str = ""
    at: datetime
    worker: str = ""
    attempt: int = 0
    fence: int = 0
    action: str = ""  # "retry" or "dead"
    planned_delay_seconds: float | None = None


def tenant_of_document(doc: Mapping[str, Any]) -> str | None:
    """A stored record's tenant: its ``tenant`` field, else (a record written without it: a
    claim, a poison message) the tenant its kept message carries with its headers."""
    tenant = doc.get("tenant")
    if tenant is None:
        message = doc.get("message")
        kept = message.get("headers") if isinstance(message, Mapping) else None
        tenant = kept.get(headers.TENANT) if isinstance(kept, Mapping) else None
    return tenant if isinstance(tenant, str) else None


class LedgerRecord(BaseModel):
    """A typed view of a ledger document (what ``app.ledger.get`` returns)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    id: str = Field(alias="_id")
    schema_version: int = Field(SCHEMA_VERSION, alias="v")
    task: str
    key: str
    tier: str = "default"
    tenant: str | None = None  # whose job (celery_ledger.tenancy): its own field or its message's
    state: State
    attempts: int = 0
    fence: int = 0
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    result_json: str | None = Field(None, alias="result")
    errors: list[ErrorEntry] = Field(default_factory=list)
    duplicates: int = 0
    dead_reason: str | None = None
    death: str | None = None  # dead: failed, retired, shed, poison, revoked, rejected, ...
    outcome: str | None = None  # succeeded without a result of its own: ignored, replaced
    replaced_by: str | None = None  # the task id of the replacement (``Task.replace``)
    fingerprint: str | None = None
    fingerprint_text: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    expires_at: datetime | None = None
    # A fallback's result (policies/fallback.py): its trigger, the option that served it, when,
    # and when the real job runs again to replace it (None: it stands).
    degraded: dict[str, Any] | None = None
    replaced_degraded: dict[str, Any] | None = None  # the degraded result the real one replaced
    late_at: datetime | None = None  # reported late: past its latency objective unfinished
    slo_seconds: float | None = None
    # The trace of the job's last claimed attempt (``LEDGER_TRACING``), from the message the
    # ledger keeps for it: where its spans are.
    trace_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _trace_of_kept_message(cls, data: Any) -> Any:
        if isinstance(data, dict) and "trace_id" not in data:
            message = data.get("message")
            kept = message.get("headers") if isinstance(message, dict) else None
            trace_id = trace_id_of(kept)
            if trace_id is not None:
                data = {**data, "trace_id": trace_id}
        if isinstance(data, dict) and "tenant" not in data:
            tenant = tenant_of_document(data)
            if tenant is not None:
                data = {**data, "tenant": tenant}
        return data

    @property
    def result(self) -> Any:
        """The task's return value, decoded from the stored JSON."""
        return None if self.result_json is None else json.loads(self.result_json)

    @property
    def status(self) -> str:
        """What a caller polling the job sees (see :func:`status_of`)."""
        return status_of(
            self.state,
            degraded=self.degraded is not None and self.result_json is not None,
            late=self.late_at is not None,
        )

    @property
    def last_error(self) -> ErrorEntry | None:
        return self.errors[-1] if self.errors else None
