"""One Protocol per caller of the ledger store: what each engine needs of it, and nothing
more. The engines hold their store by these types (a reader sees which part of the
:class:`~celery_ledger.ledger.store.Ledger` each one uses, and mypy checks that the Ledger
provides it); the test fakes provide the same, held to them by ``tests/unit/test_structure.py``,
and to the real store by the contract suite."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, TypeVar

from pymongo import MongoClient, WriteConcern
from pymongo.client_session import ClientSession

from .core import BuryMatch, Claim, EnqueueOutcome, QueuedJob, RecordState
from .dead import DeadJob
from .message import KeptMessage
from .record import ErrorEntry, LedgerRecord, State

T = TypeVar("T")


class ProgressStore(Protocol):
    """What a long job's heartbeat, checkpoints and steps need of the ledger."""

    now: Callable[[], datetime]
    open_text: Callable[[str], str]  # opens a sealed value (the runtime's sealer)

    def add_artefact(self, record_id: str, fence: int, path: str) -> None: ...

    def heartbeat(
        self, record_id: str, fence: int, lease_seconds: float | None = None
    ) -> datetime: ...

    def load_progress(self, record_id: str) -> dict[str, Any]: ...

    def run_transaction(self, callback: Callable[[ClientSession], T]) -> T: ...

    def save_checkpoint(
        self,
        record_id: str,
        fence: int,
        state: dict[str, Any] | str,
        lease_seconds: float | None = None,
    ) -> None: ...

    def save_step(
        self, record_id: str, fence: int, name: str, result_json: str, *, skipped: str = ""
    ) -> None: ...

    def save_step_in(
        self, session: ClientSession, record_id: str, fence: int, name: str, result_json: str
    ) -> bool: ...


class GuardStore(ProgressStore, Protocol):
    """What the guard (claim, body, outcome) needs of the ledger (and the long job it runs)."""

    now: Callable[[], datetime]

    def alias(self, alias: str, *, record_id: str, task: str, key: str) -> None: ...

    def bury(
        self, record_id: str, dead: DeadJob, *, match: BuryMatch, task: str, key: str, tier: str
    ) -> bool: ...

    def claim(
        self,
        record_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        owner: str,
        lease_seconds: float | None = None,
        message: KeptMessage | None = None,
        max_attempts: int | None = None,
        alias: str | None = None,
        slo_at: datetime | None = None,
        slo_seconds: float | None = None,
        new: bool = False,
        handed_back: int = 0,
    ) -> Claim: ...

    def complete(
        self,
        record_id: str,
        fence: int,
        result_json: str,
        *,
        op: str,
        atomic_steps: Sequence[str] = (),
        degraded: Mapping[str, Any] | None = None,
        replace_at: datetime | None = None,
    ) -> None: ...

    def find_raw(self, record_id: str) -> dict[str, Any] | None: ...

    def finish_without_result(
        self,
        record_id: str,
        fence: int,
        *,
        outcome: str,
        note: str,
        op: str,
        replaced_by: str | None = None,
        atomic_steps: Sequence[str] = (),
    ) -> None: ...

    def get_by_id(self, record_id: str) -> LedgerRecord | None: ...

    def keep_degraded(
        self, record_id: str, fence: int, error: ErrorEntry | None, *, op: str, reason: str
    ) -> None: ...

    def load_progress(self, record_id: str) -> dict[str, Any]: ...

    def mark_late(self, record_id: str, *, slo_seconds: float | None = None) -> bool: ...

    def record_deferral(
        self,
        record_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        reason: str,
        until: datetime,
        objective: Mapping[str, Any] | None = None,
    ) -> None: ...

    def record_retry(
        self,
        record_id: str,
        fence: int,
        error: ErrorEntry,
        *,
        retry_at: datetime,
        op: str,
        traceback: str = "",
        retries: int | None = None,
        previous_delay: float | None = None,
    ) -> None: ...

    def release(
        self, record_id: str, fence: int, *, op: str, refund_attempt: bool = False
    ) -> None: ...


class DeadLetterStore(Protocol):
    """What the dead letters (recording, triage, replay, purge) need of the ledger."""

    now: Callable[[], datetime]

    def alias(self, alias: str, *, record_id: str, task: str, key: str) -> None: ...

    def bury(
        self, record_id: str, dead: DeadJob, *, match: BuryMatch, task: str, key: str, tier: str
    ) -> bool: ...

    def copies_pending(self, *, limit: int = 100) -> list[dict[str, Any]]: ...

    def find_dead(
        self,
        *,
        task: str | None = None,
        since: datetime | None = None,
        reason: str | None = None,
        tenant: str | None = None,
        limit: int = 1000,
        include_purged: bool = False,
        after: tuple[datetime | None, str] | None = None,
    ) -> list[dict[str, Any]]: ...

    def find_dead_by_key(self, key: str, *, task: str | None = None) -> dict[str, Any] | None: ...

    def find_raw(self, record_id: str) -> dict[str, Any] | None: ...

    def mark_copy_pending(self, record_id: str, pending: bool) -> None: ...

    def take_copy(self, record_id: str, due: datetime) -> bool: ...

    def mark_copies_due(self, record_ids: Sequence[str]) -> int: ...

    def purge(self, record_ids: Sequence[str], *, actor: str) -> int: ...

    def purge_dead(self, record_ids: Sequence[str], *, actor: str) -> list[str]: ...

    def reopen(self, record_id: str, *, actor: str) -> datetime | None: ...

    def resolve(self, ident: str) -> dict[str, Any] | None: ...

    def undo_reopen(self, record_id: str, reopened_at: datetime) -> None: ...


class BackendStore(Protocol):
    """What Celery's result backend needs of the ledger."""

    now: Callable[[], datetime]

    def bury(
        self, record_id: str, dead: DeadJob, *, match: BuryMatch, task: str, key: str, tier: str
    ) -> bool: ...

    def delete_group(self, group_id: str) -> None: ...

    def forget_result(self, record_id: str) -> None: ...

    def group_members(self, group_id: str) -> list[str] | None: ...

    def resolve(self, ident: str) -> dict[str, Any] | None: ...

    def save_group(self, group_id: str, member_ids: Sequence[str]) -> None: ...

    def store_plain(self, task_id: str, fields: dict[str, Any]) -> None: ...


class ReconcilerStore(Protocol):
    """What the reconciler's sweep needs of the ledger."""

    now: Callable[[], datetime]

    def expired_leases(self, *, grace_seconds: float, limit: int = 500) -> list[dict[str, Any]]: ...

    def leave_unpublished(self, doc: Mapping[str, Any]) -> bool: ...

    def mark_reconciled(self, doc: Mapping[str, Any]) -> bool: ...

    def replacements_due(
        self, *, older_than_seconds: float, limit: int = 500
    ) -> list[dict[str, Any]]: ...

    def quiet_waiting(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        touched_before: datetime | None = None,
    ) -> list[dict[str, Any]]: ...

    def quiet_due(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        due_since: datetime | None = None,
        due_before: datetime | None = None,
    ) -> list[dict[str, Any]]: ...

    def records(self, record_ids: Sequence[str]) -> list[dict[str, Any]]: ...

    def stale(
        self, state: State, *, older_than_seconds: float, limit: int = 500
    ) -> list[dict[str, Any]]: ...

    def states_of(self, record_ids: Sequence[str]) -> dict[str, RecordState]: ...

    def enqueue_many(self, jobs: Sequence[QueuedJob]) -> list[EnqueueOutcome]: ...


class OutboxStore(Protocol):
    """What the outbox (a committer's flush, the relay) needs of the ledger: its client and
    write concern too, for the sessions of the app's transactions."""

    now: Callable[[], datetime]

    @property
    def client(self) -> MongoClient[dict[str, Any]]: ...

    @property
    def write_concern(self) -> WriteConcern: ...

    def bury(
        self, record_id: str, dead: DeadJob, *, match: BuryMatch, task: str, key: str, tier: str
    ) -> bool: ...

    def mark_published(self, record_ids: Sequence[str]) -> int: ...

    def unpublished(
        self,
        *,
        ids: Sequence[str] | None = None,
        older_than_seconds: float = 0.0,
        limit: int = 500,
        skip: Callable[[Mapping[str, Any]], bool] | None = None,
    ) -> list[dict[str, Any]]: ...


class EscalationStore(Protocol):
    """What the escalation of late jobs needs of the ledger."""

    now: Callable[[], datetime]

    def forget_objective(self, record_id: str) -> None: ...

    def get(self, task_name: str, key: str) -> LedgerRecord | None: ...

    def mark_late(self, record_id: str, *, slo_seconds: float | None = None) -> bool: ...

    def overdue(self, *, limit: int = 200) -> list[dict[str, Any]]: ...


class LastGoodStore(Protocol):
    """What fallbacks need of the ledger: the last good results."""

    now: Callable[[], datetime]

    def last_good(self, task: str, cache_key: str) -> tuple[str, datetime] | None: ...

    def remember(self, task: str, cache_key: str, result_json: str) -> None: ...


class PublishStore(Protocol):
    """What the publish side (a task's apply_async) needs of the ledger."""

    now: Callable[[], datetime]

    def bury(
        self, record_id: str, dead: DeadJob, *, match: BuryMatch, task: str, key: str, tier: str
    ) -> bool: ...

    def enqueue(
        self,
        record_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        message: KeptMessage,
        objective: Mapping[str, Any] | None = None,
        session: ClientSession | None = None,
        claimable_at: datetime | None = None,
    ) -> EnqueueOutcome: ...

    def mark_unpublished(self, record_id: str, *, later: bool = False) -> None: ...


PORTS: tuple[type[Any], ...] = (
    GuardStore,
    DeadLetterStore,
    BackendStore,
    ProgressStore,
    ReconcilerStore,
    OutboxStore,
    EscalationStore,
    LastGoodStore,
    PublishStore,
)
