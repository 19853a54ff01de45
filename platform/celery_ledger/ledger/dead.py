"""A dead job: why it died, how its failures group, and what is kept to run it again.

Every path that ends a job for good builds one :class:`DeadJob` and hands it to the store's one
dead write (:meth:`celery_ledger.ledger.store.Ledger.bury`): a body's permanent failure or
exhausted retries, a retirement (time budget, age, attempts), a poison message (a worker lost
every time, a message that never reached a task), a job shed by backpressure, a revoked or a
rejected one. :class:`DeadLetter` is what is announced of a dead record (the ``dead_letter``
queue's copy, observers).
"""

from __future__ import annotations

import hashlib
import json
import traceback as tb
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from ..crypto import REDACTED
from ..exits import text_of
from ..untrusted import storable, storable_value
from .message import KeptMessage
from .record import ErrorEntry

Death = Literal[
    "failed", "retired", "poison", "shed", "revoked", "rejected", "unknown-task", "bad-arguments"
]


@dataclass(frozen=True)
class DeadJob:
    """Why a job died (``reason``), its group (``fingerprint``), its kept message, the error
    that ended it (appended to the history) and that error's traceback."""

    death: Death
    reason: str
    fingerprint: str
    fingerprint_text: str
    message: KeptMessage | None = None
    error: ErrorEntry | None = None
    traceback: str = ""
    # A poison message whose headers no signature vouches for: why not, and the identity its
    # headers claim (information only: it is filed under its own digest, never under that job).
    unauthenticated: str | None = None
    claimed: Mapping[str, Any] | None = None

    @classmethod
    def of_exception(
        cls,
        exc: BaseException,
        *,
        reason: str,
        error: ErrorEntry,
        message: KeptMessage | None,
        sensitive: bool,
        death: Death = "failed",
    ) -> DeadJob:
        """A job killed by its body's exception, grouped by the exception type and the frame
        that raised it. A sensitive task keeps no exception text and no traceback."""
        digest, text = exception_fingerprint(exc)
        return cls(
            death=death,
            reason=storable(redact_reason(reason) if sensitive else reason),
            fingerprint=digest,
            fingerprint_text=text,
            message=message,
            error=error,
            traceback="" if sensitive else storable(format_traceback(exc))[-8000:],
        )

    @classmethod
    def of_reason(
        cls,
        death: Death,
        reason: str,
        *,
        task: str,
        message: KeptMessage | None = None,
        group: str | None = None,
    ) -> DeadJob:
        """A job ended for a reason of the platform's, grouped by the reason's first clause
        (``"poison: delivered 3 times"`` groups as ``poison``) and the task."""
        head = group or reason.split(":", 1)[0].split(" (", 1)[0]
        text = storable(f"{head} ({task})")
        return cls(
            death=death,
            reason=storable(reason),
            fingerprint=hashlib.sha256(text.encode()).hexdigest()[:12],
            fingerprint_text=text,
            message=message,
        )

    def fields(self) -> dict[str, Any]:
        """The record fields this death sets (with the state fields the store adds)."""
        fields: dict[str, Any] = {
            "death": self.death,
            "dead_reason": self.reason,
            "fingerprint": self.fingerprint,
            "fingerprint_text": self.fingerprint_text,
        }
        if self.message is not None:
            fields["message"] = self.message.document()
        if self.traceback:
            fields["traceback"] = self.traceback
        if self.unauthenticated is not None:
            fields["unauthenticated"] = self.unauthenticated
        if self.claimed is not None:
            fields["claimed"] = dict(self.claimed)
        return fields


@dataclass(frozen=True)
class DeadLetter:
    """The announcement of a dead record: the ``dead_letter`` queue's copy, and what observers
    (metrics, Sentry, logs) get."""

    record_id: str
    task: str | None
    key: str | None
    tier: str | None
    reason: str | None
    death: str | None
    fingerprint: str | None
    fingerprint_text: str | None
    message: Any
    errors: Any
    at: str
    unauthenticated: str | None = None  # why its headers are not trusted (see DeadJob)

    @classmethod
    def of_record(cls, record: Mapping[str, Any], *, now: datetime | None = None) -> DeadLetter:
        """The announcement of a dead record; ``now`` on the ledger's clock (the copy's time,
        which its retention is judged by)."""
        return cls(
            record_id=str(record["_id"]),
            task=record.get("task"),
            key=record.get("key"),
            tier=record.get("tier"),
            reason=record.get("dead_reason"),
            death=record.get("death"),
            fingerprint=record.get("fingerprint"),
            fingerprint_text=record.get("fingerprint_text"),
            message=_jsonable(record.get("message")),
            errors=_jsonable(record.get("errors", [])),
            at=(now or datetime.now(UTC)).isoformat(),
            unauthenticated=record.get("unauthenticated"),
        )

    @classmethod
    def of_job(
        cls,
        record_id: str,
        dead: DeadJob,
        *,
        task: str,
        key: str,
        tier: str,
        now: datetime | None = None,
    ) -> DeadLetter:
        """The announcement of a job just buried with ``dead`` (no read of the record); ``now``
        as for :meth:`of_record`."""
        return cls(
            record_id=record_id,
            task=task,
            key=key,
            tier=tier,
            reason=dead.reason,
            death=dead.death,
            fingerprint=dead.fingerprint,
            fingerprint_text=dead.fingerprint_text,
            message=None if dead.message is None else _jsonable(dead.message.document()),
            errors=[] if dead.error is None else [_jsonable(dead.error.model_dump())],
            at=(now or datetime.now(UTC)).isoformat(),
            unauthenticated=dead.unauthenticated,
        )

    @property
    def poison(self) -> bool:
        """A message that never reached a task body (or whose worker was lost every time)."""
        return self.death in ("poison", "unknown-task")

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def error_entry(
    exc: BaseException,
    *,
    owner: str,
    attempt: int,
    fence: int,
    action: str,
    at: datetime,
    redact: bool = False,
    planned_delay_seconds: float | None = None,
) -> ErrorEntry:
    """One failed attempt for the record's error history."""
    return ErrorEntry(
        action=action,
        planned_delay_seconds=planned_delay_seconds,
        type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=REDACTED if redact else storable(_text(exc)[:2000]),
        traceback_digest=traceback_digest(exc),
        at=at,
        worker=owner,
        attempt=attempt,
        fence=fence,
    )


def exception_fingerprint(exc: BaseException) -> tuple[str, str]:
    """(digest, text) of the exception type and the frame that raised it, to group failures."""
    frames = tb.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].name}" if frames else "?"
    text = storable(f"{type(exc).__module__}.{type(exc).__qualname__} at {where}")
    return hashlib.sha256(text.encode()).hexdigest()[:12], text


def traceback_digest(exc: BaseException) -> str:
    """A short digest of where the exception was raised (frames, not line text or values)."""
    frames = tb.extract_tb(exc.__traceback__)
    where = "|".join(f"{f.filename}:{f.name}:{f.lineno}" for f in frames)
    return hashlib.sha256(f"{type(exc).__qualname__}|{where}".encode()).hexdigest()[:16]


def _text(exc: BaseException) -> str:
    text = text_of(exc)
    return "(its text could not be read)" if text is None else text


def format_traceback(exc: BaseException | None) -> str:
    return "" if exc is None else "".join(tb.format_exception(exc))


def redact_reason(reason: str) -> str:
    """A reason without the exception's text ("kind: Type"), for sensitive tasks."""
    return ": ".join(reason.split(": ")[:2])


def _jsonable(value: Any) -> Any:
    """``value`` as plain JSON types that any BSON encoder and JSON serializer accept."""
    return None if value is None else storable_value(json.loads(json.dumps(value, default=str)))
