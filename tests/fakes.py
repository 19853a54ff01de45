"""In-memory stand-ins for unit tests of the engines (guard, dead letters, reconciler).

:class:`MemoryLedger` keeps the store's protocol (claims with leases and fencing tokens, fenced
outcome writes that recognise their own repeat, the one dead write, the reconciler's views) over
a dict of documents, with a clock the test moves and faults the test injects. The contract suite
(``tests/integration/test_store_contract.py``) runs the same scenarios on it and on the real
store against SecantusDB, so the fake cannot drift from what it stands in for.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from celery_ledger.errors import CommitLost, LeaseLost
from celery_ledger.identity import derive_task_id
from celery_ledger.ledger.dead import DeadJob
from celery_ledger.ledger.message import KeptMessage
from celery_ledger.ledger.record import LedgerRecord, State, tenant_of_document
from celery_ledger.ledger.store import (
    COPY_DUE_SHIFT,
    COPY_GRACE,
    ENDED_AS_WRITTEN,
    ENQUEUE_BATCH,
    EPOCH,
    FOREVER,
    UNPUBLISHED,
    BuryMatch,
    Claim,
    ClaimOutcome,
    EnqueueOutcome,
    Fenced,
    HeldBy,
    QueuedJob,
    RecordState,
    Unchanged,
    Unclaimed,
)


class Clock:
    """A UTC clock that only the test moves."""

    def __init__(self, start: datetime | None = None) -> None:
        self.at = start or datetime(2026, 11, 23, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.at

    def advance(self, seconds: float) -> None:
        self.at += timedelta(seconds=seconds)


def server_clocks(
    ledger_now: Callable[[], datetime], broker_now: Callable[[], float] = time.time
) -> dict[str, Any]:
    """A fake runtime's clocks, as ``Runtime`` gives them: the broker's (``message_time``,
    the wall clock unless given) and a message's time taken over to the ledger's."""

    def on_ledger_clock(message_time: float | None) -> datetime:
        now = ledger_now()
        if message_time is None:
            return now
        return now - timedelta(seconds=broker_now() - message_time)

    return {"message_time": broker_now, "on_ledger_clock": on_ledger_clock}


@dataclass
class Fault:
    """Make the next call of ``method`` raise ``exc``; ``applied``: after the write applied."""

    method: str
    exc: BaseException
    applied: bool = False
    times: int = 1


T = TypeVar("T")
_SESSION = object()  # what a transaction's callback gets from the in-memory store


class MemoryLedger:
    """The store's protocol in memory (see the module docstring)."""

    def __init__(
        self,
        *,
        clock: Callable[[], datetime] | None = None,
        lease_seconds: float = 60.0,
        max_deliveries: int = 5,
        error_history_limit: int = 20,
        dead_retention_seconds: float = 30 * 24 * 3600,
        result_retention_seconds: float = 7 * 24 * 3600,
        fleet: str | None = None,
    ) -> None:
        self.now = clock or Clock()
        self.fleet = fleet
        self.lease_seconds = lease_seconds
        self.max_deliveries = max_deliveries
        self.error_history_limit = error_history_limit
        self.dead_retention = timedelta(seconds=dead_retention_seconds)
        self.result_retention = timedelta(seconds=result_retention_seconds)
        self.docs: dict[str, dict[str, Any]] = {}
        self.faults: list[Fault] = []
        self.calls: list[str] = []
        self.cache: dict[tuple[str, str], tuple[str, datetime]] = {}
        self.groups: dict[str, list[str]] = {}
        self.open_text: Callable[[str], str] = lambda text: text
        self._last_fence = 0

    # -- fault injection -----------------------------------------------------------------------

    def fail(
        self, method: str, exc: BaseException, *, applied: bool = False, times: int = 1
    ) -> None:
        self.faults.append(Fault(method, exc, applied, times))

    def _enter(self, method: str) -> Fault | None:
        """Record the call; raise a fault that strikes before the write, or return one that
        strikes after it."""
        self.calls.append(method)
        for fault in self.faults:
            if fault.method == method and fault.times > 0:
                fault.times -= 1
                if not fault.applied:
                    raise fault.exc
                return fault
        return None

    @staticmethod
    def _leave(fault: Fault | None) -> None:
        if fault is not None:
            raise fault.exc

    # -- reads -----------------------------------------------------------------------------------

    def find_raw(self, record_id: str) -> dict[str, Any] | None:
        self._enter("find_raw")
        doc = self.docs.get(record_id)
        return copy.deepcopy(doc) if doc is not None else None

    def resolve(self, ident: str) -> dict[str, Any] | None:
        doc = self.find_raw(ident)
        if doc is not None and isinstance(doc.get("alias_of"), str) and "state" not in doc:
            return self.find_raw(doc["alias_of"])
        return doc

    def get(self, task_name: str, key: str) -> LedgerRecord | None:
        return self.get_by_id(derive_task_id(task_name, key))

    def get_by_id(self, record_id: str) -> LedgerRecord | None:
        doc = self.resolve(record_id)
        if doc is None:
            return None
        if isinstance(doc.get("result"), str):
            doc["result"] = self.open_text(doc["result"])
        return LedgerRecord.model_validate(doc)

    def load_progress(self, record_id: str) -> dict[str, Any]:
        self._enter("load_progress")
        doc = self.docs.get(record_id) or {}
        return copy.deepcopy(
            {k: doc[k] for k in ("_id", "checkpoint", "steps", "artefacts") if k in doc}
        )

    # -- the claim -----------------------------------------------------------------------------

    def _fence(self, at_least: int = 0) -> int:
        now_ns = int(self.now().timestamp() * 1_000_000) * 1000
        self._last_fence = max(now_ns, self._last_fence + 1, at_least)
        return self._last_fence

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
        new: bool = False,  # the store's choice of write only: the same outcome either way
        handed_back: int = 0,
    ) -> Claim:
        fault = self._enter("claim")
        now = self.now()
        lease = timedelta(seconds=lease_seconds or self.lease_seconds)
        doc = self.docs.get(record_id)
        created = doc is None
        if alias is not None and alias not in self.docs:
            self.docs[alias] = {
                "_id": alias,
                "alias_of": record_id,
                "task": task,
                "key": key,
                "created_at": now,
            }
        if doc is not None and (doc.get("task") != task or doc.get("key") != key):
            self._leave(fault)
            return Claim(ClaimOutcome.CONFLICT)
        if doc is None:
            doc = self.docs[record_id] = {
                "_id": record_id,
                "v": 2,
                "task": task,
                "key": key,
                "attempts": 0,
                "inflight": 0,
                "fence": 0,
                "claimable_at": EPOCH,
                "created_at": now,
            }
            if slo_at is not None:
                doc |= {"slo_at": slo_at, "slo_seconds": slo_seconds}
        state = doc.get("state")
        # A success is claimable again only while a degraded result awaits its replacement.
        pending = (doc.get("degraded") or {}).get("replace_at") is not None
        if state == State.SUCCEEDED and doc["claimable_at"] > now:
            self._leave(fault)
            if pending:  # a degraded result's replacement, early: back when it is due
                return Claim(ClaimOutcome.BUSY, retry_at=doc["claimable_at"])
            doc["duplicates"] = doc.get("duplicates", 0) + 1
            return Claim(ClaimOutcome.DUPLICATE)
        if state == State.DEAD:
            self._leave(fault)
            return Claim(ClaimOutcome.DEAD)
        if doc["claimable_at"] > now:
            self._leave(fault)
            return Claim(ClaimOutcome.BUSY, retry_at=doc["claimable_at"])
        reason = None
        if doc.get("inflight", 0) >= self.max_deliveries + handed_back:
            reason = (
                "poison",
                f"poison: delivered {doc['inflight'] - handed_back} times without an outcome"
                " (the worker was lost each time)",
            )
        elif max_attempts is not None and doc.get("attempts", 0) >= max_attempts:
            reason = ("retired", f"attempts budget exhausted ({doc['attempts']} attempts)")
        if reason is not None:
            dead = DeadJob.of_reason(
                reason[0],  # type: ignore[arg-type]
                reason[1],
                task=task,
                message=KeptMessage.from_document(doc.get("message")),
            )
            self._bury_fields(doc, dead)
            self._leave(fault)
            return Claim(ClaimOutcome.DEAD, killed=True)
        fence = self._fence(doc.get("fence", 0) + 1)
        if self.fleet is not None:
            doc["fleet"] = self.fleet
        doc.update(
            {
                "tier": tier,
                "state": State.RUNNING.value,
                "fence": fence,
                "lease_owner": owner,
                "lease_expires_at": now + lease,
                "claimable_at": now + lease,
                "started_at": now,
                "updated_at": now,
                "attempts": doc.get("attempts", 0) + 1,
                "inflight": doc.get("inflight", 0) + 1,
            }
        )
        doc.pop("unpublished_at", None)
        if message is not None:
            doc["message"] = message.document()
        self._leave(fault)
        return Claim(ClaimOutcome.CLAIMED, fence=fence, created=created)

    # -- outcomes of an attempt ------------------------------------------------------------------

    def _ended(self, now: datetime, claimable_at: datetime) -> dict[str, Any]:
        return {
            "claimable_at": claimable_at,
            "updated_at": now,
            "lease_owner": None,
            "lease_expires_at": None,
            "inflight": 0,
        }

    def _end_attempt(
        self,
        method: str,
        record_id: str,
        fence: int,
        op: str,
        fields: dict[str, Any],
        push: dict[str, Any] | None = None,
        atomic_steps: Sequence[str] = (),
    ) -> None:
        fault = self._enter(method)
        doc = self.docs.get(record_id)
        holds = doc is not None and doc.get("fence") == fence and doc.get("state") == State.RUNNING
        missing = tuple(n for n in atomic_steps if n not in ((doc or {}).get("steps") or {}))
        # As the real store: the write matches, or a repeat recognises itself, or it is refused
        if doc is not None and holds and not missing:
            doc.update(copy.deepcopy(fields))
            doc["ops"] = [*doc.get("ops", []), op][-4:]
            if push is not None:
                errors = doc.setdefault("errors", [])
                errors.append(push)
                del errors[: -self.error_history_limit]
            self._leave(fault)
            return
        if doc is not None and op in doc.get("ops", []):
            self._leave(fault)
            return  # a repeat of a write that applied
        self._leave(fault)
        if holds and missing:
            raise CommitLost(record_id, missing)
        raise LeaseLost(record_id, fence)

    def complete(
        self,
        record_id: str,
        fence: int,
        result_json: str,
        *,
        op: str,
        atomic_steps: Sequence[str] = (),
        degraded: dict[str, Any] | None = None,
        replace_at: datetime | None = None,
    ) -> None:
        now = self.now()
        fields: dict[str, Any] = {
            "state": State.SUCCEEDED.value,
            "result": result_json,
            **self._ended(now, FOREVER),
            "finished_at": now,
            "expires_at": now + self.result_retention,
        }
        if degraded is not None:
            fields["degraded"] = {**degraded, "at": now, "replace_at": replace_at}
            if replace_at is not None:
                fields |= {"claimable_at": replace_at, "attempts": 0, "replace_due": replace_at}
        self._end_attempt("complete", record_id, fence, op, fields, atomic_steps=atomic_steps)
        doc = self.docs[record_id]
        doc.pop("slo_at", None)
        if replace_at is None:
            doc.pop("replace_due", None)
        if degraded is None and "degraded" in doc:
            doc["replaced_degraded"] = doc.pop("degraded")

    def keep_degraded(
        self, record_id: str, fence: int, error: Any | None, *, op: str, reason: str
    ) -> None:
        now = self.now()
        degraded = dict(self.docs.get(record_id, {}).get("degraded") or {})
        degraded |= {"replace_at": None, "replacement_failed": reason}
        self.docs.get(record_id, {}).pop("replace_due", None)
        self._end_attempt(
            "keep_degraded",
            record_id,
            fence,
            op,
            {"state": State.SUCCEEDED.value, **self._ended(now, FOREVER), "degraded": degraded},
            push=None if error is None else error.model_dump(),
        )

    def remember(self, task: str, cache_key: str, result_json: str) -> None:
        self.cache[(task, cache_key)] = (result_json, self.now())

    def last_good(self, task: str, cache_key: str) -> tuple[str, datetime] | None:
        return self.cache.get((task, cache_key))

    def overdue(self, *, limit: int = 200) -> list[dict[str, Any]]:
        now = self.now()
        due = [d for d in self.docs.values() if d.get("slo_at") is not None and d["slo_at"] <= now]
        due.sort(key=lambda d: d["slo_at"])  # as the store reads its objectives: earliest first
        return [copy.deepcopy(d) for d in due[:limit]]

    def mark_late(self, record_id: str, *, slo_seconds: float | None = None) -> bool:
        doc = self.docs.get(record_id)
        if doc is None or "late_at" in doc:
            return False
        doc["late_at"] = self.now()
        if slo_seconds is not None:
            doc["slo_seconds"] = slo_seconds
        doc.pop("slo_at", None)
        return True

    def forget_objective(self, record_id: str) -> None:
        self.docs.get(record_id, {}).pop("slo_at", None)

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
    ) -> None:
        now = self.now()
        fields = {
            "state": State.SUCCEEDED.value,
            "outcome": outcome,
            "note": note,
            **self._ended(now, FOREVER),
            "finished_at": now,
        }
        if replaced_by is not None:
            fields["replaced_by"] = replaced_by
        self._end_attempt(
            "finish_without_result", record_id, fence, op, fields, atomic_steps=atomic_steps
        )

    def record_retry(
        self,
        record_id: str,
        fence: int,
        error: Any,
        *,
        retry_at: datetime,
        op: str,
        traceback: str = "",
        retries: int | None = None,
        previous_delay: float | None = None,
    ) -> None:
        now = self.now()
        doc = self.docs.get(record_id) or {}
        message = copy.deepcopy(doc.get("message") or {})
        headers = message.setdefault("headers", {})
        if retries is not None:
            headers["retries"] = retries
        if previous_delay is not None:
            headers["ledger_previous_delay"] = previous_delay
        self._end_attempt(
            "record_retry",
            record_id,
            fence,
            op,
            {
                "state": State.RETRYING.value,
                **self._ended(now, now),
                "next_attempt_at": retry_at,
                "traceback": traceback,
                "message": message,
            },
            push=error.model_dump(),
        )

    def release(self, record_id: str, fence: int, *, op: str, refund_attempt: bool = False) -> None:
        now = self.now()
        fields: dict[str, Any] = {"state": State.QUEUED.value, **self._ended(now, now)}
        if refund_attempt:
            fields["attempts"] = self.docs.get(record_id, {}).get("attempts", 1) - 1
        self._end_attempt("release", record_id, fence, op, fields)

    def _bury_fields(self, doc: dict[str, Any], dead: DeadJob) -> None:
        now = self.now()
        doc.update(
            {
                "state": State.DEAD.value,
                **self._ended(now, now + COPY_GRACE + COPY_DUE_SHIFT),  # the copy's due time
                "finished_at": now,
                "expires_at": now + self.dead_retention,
                **copy.deepcopy(dead.fields()),
            }
        )
        if dead.error is not None:
            errors = doc.setdefault("errors", [])
            errors.append(dead.error.model_dump())
            del errors[: -self.error_history_limit]

    def bury(
        self, record_id: str, dead: DeadJob, *, match: BuryMatch, task: str, key: str, tier: str
    ) -> bool:
        if isinstance(match, Fenced):
            now = self.now()
            fields = {
                "state": State.DEAD.value,
                **self._ended(now, now + COPY_GRACE + COPY_DUE_SHIFT),  # the copy's due time
                "finished_at": now,
                "expires_at": now + self.dead_retention,
                **dead.fields(),
            }
            self._end_attempt(
                "bury",
                record_id,
                match.fence,
                match.op,
                fields,
                push=dead.error.model_dump() if dead.error is not None else None,
            )
            return True
        fault = self._enter("bury")
        doc = self.docs.get(record_id)
        if isinstance(match, HeldBy | Unchanged):
            applies = doc is not None and (
                (doc.get("state") == State.RUNNING and doc.get("lease_owner") == match.owner)
                if isinstance(match, HeldBy)
                else (
                    doc.get("fence") == match.fence
                    and doc.get("state") == match.state
                    and match.claimable_at in (None, doc.get("claimable_at"))
                )
            )
            if applies:
                assert doc is not None
                self._bury_fields(doc, dead)
            self._leave(fault)
            return applies
        assert isinstance(match, Unclaimed)
        if (
            doc is not None
            and match.kill_waiting
            and doc.get("task") == task
            and doc.get("key") == key
            and doc.get("state") in (State.QUEUED, State.RETRYING)
            and doc.get("degraded") is None
        ):
            self._bury_fields(doc, dead)
            self._leave(fault)
            return True
        if doc is None:
            doc = self.docs[record_id] = {
                "_id": record_id,
                "v": 2,
                "task": task,
                "key": key,
                "tier": tier,
                "attempts": 0,
                "fence": 0,
                "created_at": self.now(),
                "errors": [],
            }
            self._bury_fields(doc, dead)
            self._leave(fault)
            return True
        if doc.get("state") != State.DEAD:
            doc["quarantined"] = doc.get("quarantined", 0) + 1
            doc["last_quarantined"] = {"reason": dead.reason, "at": self.now()}
        self._leave(fault)
        return False

    def alias(self, alias: str, *, record_id: str, task: str, key: str) -> None:
        self._enter("alias")
        self.docs.setdefault(alias, {"_id": alias, "alias_of": record_id, "task": task, "key": key})

    # -- progress ------------------------------------------------------------------------------

    def _fenced(
        self, method: str, record_id: str, fence: int, change: Callable[[dict[str, Any]], None]
    ) -> None:
        fault = self._enter(method)
        doc = self.docs.get(record_id)
        if doc is None or doc.get("fence") != fence or doc.get("state") != State.RUNNING:
            self._leave(fault)
            raise LeaseLost(record_id, fence)
        change(doc)
        self._leave(fault)

    def heartbeat(self, record_id: str, fence: int, lease_seconds: float | None = None) -> datetime:
        until = self.now() + timedelta(seconds=lease_seconds or self.lease_seconds)
        self._fenced(
            "heartbeat",
            record_id,
            fence,
            lambda doc: doc.update(lease_expires_at=until, claimable_at=until),
        )
        return until

    def save_checkpoint(
        self, record_id: str, fence: int, state: dict[str, Any], lease_seconds: float | None = None
    ) -> None:
        until = self.now() + timedelta(seconds=lease_seconds or self.lease_seconds)
        self._fenced(
            "save_checkpoint",
            record_id,
            fence,
            lambda doc: doc.update(
                checkpoint=copy.deepcopy(state), lease_expires_at=until, claimable_at=until
            ),
        )

    def save_step(
        self, record_id: str, fence: int, name: str, result_json: str, *, skipped: str = ""
    ) -> None:
        step: dict[str, Any] = {"result": result_json}
        if skipped:
            step["skipped"] = skipped
        self._fenced(
            "save_step",
            record_id,
            fence,
            lambda doc: doc.setdefault("steps", {}).update({name: step}),
        )

    def run_transaction(self, callback: Callable[[Any], T]) -> T:
        """The callback runs with a stand-in session: the in-memory store has one writer."""
        self._enter("run_transaction")
        return callback(_SESSION)

    def save_step_in(
        self, session: Any, record_id: str, fence: int, name: str, result_json: str
    ) -> bool:
        self._enter("save_step_in")
        doc = self.docs.get(record_id)
        if (
            doc is None
            or doc.get("fence") != fence
            or doc.get("state") != State.RUNNING
            or name in doc.get("steps", {})
        ):
            return False
        doc.setdefault("steps", {})[name] = {"result": result_json, "atomic": True}
        return True

    def add_artefact(self, record_id: str, fence: int, path: str) -> None:
        def add(doc: dict[str, Any]) -> None:
            artefacts = doc.setdefault("artefacts", [])
            if path not in artefacts:
                artefacts.append(path)

        self._fenced("add_artefact", record_id, fence, add)

    # -- publish side ----------------------------------------------------------------------------

    def _queued(self, task: str, key: str, tier: str) -> dict[str, Any]:
        now = self.now()
        return ({} if self.fleet is None else {"fleet": self.fleet}) | {
            "v": 2,
            "task": task,
            "key": key,
            "tier": tier,
            "state": State.QUEUED.value,
            "attempts": 0,
            "inflight": 0,
            "fence": 0,
            "claimable_at": EPOCH,
            "created_at": now,
            "updated_at": now,
        }

    def enqueue(
        self,
        record_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        message: KeptMessage,
        objective: dict[str, Any] | None = None,
        claimable_at: datetime | None = None,
        session: Any = None,
    ) -> EnqueueOutcome:
        fault = self._enter("enqueue")
        doc = self.docs.get(record_id)
        if doc is None:
            self.docs[record_id] = {
                "_id": record_id,
                **self._queued(task, key, tier),
                "message": message.document(),
                **(objective or {}),
            }
            if claimable_at is not None:
                self.docs[record_id]["claimable_at"] = claimable_at
            if session is not None:  # an outbox write: unpublished until its publish
                self.docs[record_id].update(
                    claimable_at=UNPUBLISHED, unpublished_at=self.now(), outbox=True
                )
            self._leave(fault)
            return EnqueueOutcome.NEW
        self._leave(fault)
        if doc.get("state") == State.QUEUED and doc.get("unpublished_at") is not None:
            return EnqueueOutcome.UNPUBLISHED
        return EnqueueOutcome.KNOWN

    def enqueue_many(self, jobs: Sequence[QueuedJob]) -> list[EnqueueOutcome]:
        """The store's one bulk write (and its read back of the unpublished ones): one call."""
        if len(jobs) > ENQUEUE_BATCH:
            raise ValueError(f"{len(jobs)} jobs; a bulk enqueue writes {ENQUEUE_BATCH} at most")
        fault = self._enter("enqueue_many")
        outcomes = [self._enqueue_one(job) for job in jobs]
        self._leave(fault)
        return outcomes

    def _enqueue_one(self, job: QueuedJob) -> EnqueueOutcome:
        doc = self.docs.get(job.record_id)
        if doc is None:
            self.docs[job.record_id] = {
                "_id": job.record_id,
                **self._queued(job.task, job.key, job.tier),
                "message": job.message.document(),
                **(job.objective or {}),
            }
            if job.claimable_at is not None:
                self.docs[job.record_id]["claimable_at"] = job.claimable_at
            return EnqueueOutcome.NEW
        if doc.get("state") == State.QUEUED and doc.get("unpublished_at") is not None:
            return EnqueueOutcome.UNPUBLISHED
        return EnqueueOutcome.KNOWN

    def mark_unpublished_many(self, record_ids: Sequence[str], *, later: bool = False) -> None:
        fault = self._enter("mark_unpublished_many")
        for record_id in record_ids:
            doc = self.docs.get(record_id)
            if doc is not None and doc.get("state") == State.QUEUED and doc.get("fence") == 0:
                doc.update(unpublished_at=self.now(), updated_at=EPOCH)
                if not later:
                    doc.update(claimable_at=UNPUBLISHED)
        self._leave(fault)

    def mark_unpublished(self, record_id: str, *, later: bool = False) -> None:
        self._enter("mark_unpublished")
        doc = self.docs.get(record_id)
        if doc is not None and doc.get("state") == State.QUEUED and doc.get("fence") == 0:
            doc.update(unpublished_at=self.now(), updated_at=EPOCH)
            if not later:
                doc.update(claimable_at=UNPUBLISHED)

    def unpublished(
        self,
        *,
        ids: Sequence[str] | None = None,
        older_than_seconds: float = 0.0,
        limit: int = 500,
        skip: Callable[[Any], bool] | None = None,
    ) -> list[dict[str, Any]]:
        self._enter("unpublished")
        cutoff = self.now() - timedelta(seconds=older_than_seconds)
        waiting = [
            d
            for d in self.docs.values()
            if d.get("state") == State.QUEUED and d.get("claimable_at") == UNPUBLISHED
        ]
        if ids is not None:
            return [copy.deepcopy(d) for d in waiting if d["_id"] in ids]
        found = [
            copy.deepcopy(d)
            for d in waiting
            if d["unpublished_at"] <= cutoff and (skip is None or not skip(d))
        ]
        return found[:limit]

    def mark_published(self, record_ids: Sequence[str]) -> int:
        self._enter("mark_published")
        marked = 0
        for record_id in record_ids:
            doc = self.docs.get(record_id)
            if doc is None or doc.get("state") != State.QUEUED:
                continue
            if doc.get("claimable_at") != UNPUBLISHED:
                continue
            doc.update(claimable_at=EPOCH, updated_at=self.now(), published_at=self.now())
            doc.pop("unpublished_at", None)
            marked += 1
        return marked

    def record_deferral(
        self,
        record_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        reason: str,
        until: datetime,
        objective: dict[str, Any] | None = None,
    ) -> None:
        self._enter("record_deferral")
        doc = self.docs.setdefault(
            record_id, {"_id": record_id, **self._queued(task, key, tier), **(objective or {})}
        )
        doc["deferrals"] = doc.get("deferrals", 0) + 1
        doc["last_deferral"] = {"reason": reason, "until": until, "at": self.now()}

    # -- dead letters ----------------------------------------------------------------------------

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
    ) -> list[dict[str, Any]]:
        def order(doc: dict[str, Any]) -> tuple[bool, datetime, str]:
            # newest first by death time, then id; without a death time last (as MongoDB)
            at = doc.get("finished_at")
            return (at is not None, at or datetime.min, str(doc["_id"]))

        docs = [
            copy.deepcopy(d)
            for d in self.docs.values()
            if d.get("state") == State.DEAD
            and (task is None or d.get("task") == task)
            and (since is None or d["finished_at"] >= since)
            and (not reason or reason.lower() in str(d.get("dead_reason", "")).lower())
            and (not tenant or tenant_of_document(d) == tenant)
            and (include_purged or not d.get("purged_at"))
            and (after is None or order(d) < order({"finished_at": after[0], "_id": after[1]}))
        ]
        return sorted(docs, key=order, reverse=True)[:limit]

    def find_dead_by_key(self, key: str, *, task: str | None = None) -> dict[str, Any] | None:
        for doc in self.docs.values():
            found = doc.get("state") == State.DEAD and doc.get("key") == key
            if found and (task is None or doc.get("task") == task):
                return copy.deepcopy(doc)
        return None

    def mark_copy_pending(self, record_id: str, pending: bool) -> None:
        self._enter("mark_copy_pending")
        doc = self.docs.get(record_id)
        if doc is not None and doc.get("state") == State.DEAD and not doc.get("purged_at"):
            doc["claimable_at"] = self.now() + COPY_DUE_SHIFT if pending else FOREVER
            if not pending:
                doc["copied_at"] = self.now()

    def take_copy(self, record_id: str, due: datetime) -> bool:
        self._enter("take_copy")
        doc = self.docs.get(record_id)
        if doc is None or doc.get("state") != State.DEAD or doc.get("claimable_at") != due:
            return False
        doc["claimable_at"] = self.now() + COPY_GRACE + COPY_DUE_SHIFT
        return True

    def mark_copies_due(self, record_ids: Sequence[str]) -> int:
        self._enter("mark_copies_due")
        marked = 0
        for record_id in record_ids:
            doc = self.docs.get(record_id)
            if (
                doc is not None
                and doc.get("state") == State.DEAD
                and not doc.get("purged_at")
                and doc.get("claimable_at") == FOREVER  # (one due or being made: left)
            ):
                doc["claimable_at"] = self.now() + COPY_DUE_SHIFT
                marked += 1
        return marked

    def copies_pending(self, *, limit: int = 100) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(d)
            for d in self.docs.values()
            if d.get("state") == State.DEAD and d["claimable_at"] <= self.now() + COPY_DUE_SHIFT
        ][:limit]

    def count_dead(self) -> int:
        return sum(
            1
            for d in self.docs.values()
            if d.get("state") == State.DEAD and d.get("workflow_status") not in ENDED_AS_WRITTEN
        )

    def reopen(self, record_id: str, *, actor: str) -> datetime | None:
        self._enter("reopen")
        doc = self.docs.get(record_id)
        if doc is None or doc.get("state") != State.DEAD or doc.get("purged_at"):
            return None
        now = self.now()
        doc.update(
            state=State.QUEUED.value,
            attempts=0,
            inflight=0,
            claimable_at=EPOCH,
            updated_at=now,
            replayed_at=now,
            replays=doc.get("replays", 0) + 1,
        )
        doc.pop("expires_at", None)
        return now

    def undo_reopen(self, record_id: str, reopened_at: datetime) -> None:
        doc = self.docs.get(record_id)
        if (
            doc is not None
            and doc.get("state") == State.QUEUED
            and doc.get("replayed_at") == reopened_at
        ):
            now = self.now()
            doc.update(
                state=State.DEAD.value,
                claimable_at=FOREVER,
                updated_at=now,
                expires_at=now + self.dead_retention,
            )

    def purge(self, record_ids: Sequence[str], *, actor: str) -> int:
        return len(self.purge_dead(record_ids, actor=actor))

    def purge_dead(self, record_ids: Sequence[str], *, actor: str) -> list[str]:
        self._enter("purge")
        purged = []
        for record_id in record_ids:
            doc = self.docs.get(record_id)
            if doc is not None and doc.get("state") == State.DEAD and not doc.get("purged_at"):
                doc.update(purged_at=self.now(), purged_by=actor, claimable_at=FOREVER)
                for name in ("message", "result", "errors", "traceback"):
                    doc.pop(name, None)
                purged.append(record_id)
        return purged

    # -- results outside the ledger protocol, Celery's groups ----------------------------------

    def store_plain(self, task_id: str, fields: dict[str, Any]) -> None:
        self._enter("store_plain")
        doc = self.docs.get(task_id)
        if doc is not None and ("fence" in doc or "alias_of" in doc):
            return  # a ledger record owns this id: its protocol records the outcome
        now = self.now()
        self.docs[task_id] = {
            **(doc or {"_id": task_id}),
            **fields,
            "updated_at": now,
            "expires_at": now + self.result_retention,
        }

    def forget_result(self, record_id: str) -> None:
        self._enter("forget_result")
        doc = self.docs.get(record_id)
        if doc is not None:
            doc.pop("result", None)

    def save_group(self, group_id: str, member_ids: Sequence[str]) -> None:
        self._enter("save_group")
        self.groups[group_id] = [str(member) for member in member_ids]

    def group_members(self, group_id: str) -> list[str] | None:
        self._enter("group_members")
        members = self.groups.get(group_id)
        return None if members is None else list(members)

    def delete_group(self, group_id: str) -> None:
        self._enter("delete_group")
        self.groups.pop(group_id, None)

    # -- the reconciler's view -------------------------------------------------------------------

    def expired_leases(self, *, grace_seconds: float, limit: int = 500) -> list[dict[str, Any]]:
        self._enter("expired_leases")
        cutoff = self.now() - timedelta(seconds=grace_seconds)
        return [
            copy.deepcopy(d)
            for d in self.docs.values()
            if d.get("state") == State.RUNNING and d["claimable_at"] < cutoff
        ][:limit]

    def states_of(self, record_ids: Sequence[str]) -> dict[str, RecordState]:
        self._enter("states_of")
        return {i: RecordState.of(d) for i in record_ids if (d := self.docs.get(i)) is not None}

    QUIET_FIELDS = ("task", "tier", "fleet", "updated_at", "claimable_at")

    def quiet_waiting(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        touched_before: datetime | None = None,
    ) -> list[dict[str, Any]]:
        self._enter("quiet_waiting")
        return self._quiet(
            older_than_seconds,
            limit,
            lambda d: (
                self._waiting(d)
                and (touched_since is None or d["updated_at"] >= touched_since)
                and (touched_before is None or d["updated_at"] < touched_before)
            ),
            by="updated_at",
        )

    def quiet_due(
        self,
        *,
        older_than_seconds: float,
        limit: int,
        touched_since: datetime | None = None,
        due_since: datetime | None = None,
        due_before: datetime | None = None,
    ) -> list[dict[str, Any]]:
        self._enter("quiet_due")
        return self._quiet(
            older_than_seconds,
            limit,
            lambda d: (
                not self._waiting(d)
                and (touched_since is None or d["updated_at"] >= touched_since)
                and (due_since is None or d["claimable_at"] >= due_since)
                and (due_before is None or d["claimable_at"] < due_before)
            ),
            by="claimable_at",
        )

    @staticmethod
    def _waiting(d: dict[str, Any]) -> bool:  # (in a queue: claimable from EPOCH)
        return bool(d.get("state") == State.QUEUED.value and d["claimable_at"] == EPOCH)

    def _quiet(
        self,
        older_than_seconds: float,
        limit: int,
        kept: Callable[[dict[str, Any]], bool],
        *,
        by: str,
    ) -> list[dict[str, Any]]:
        cutoff = self.now() - timedelta(seconds=older_than_seconds)
        found = [
            (i, d)
            for i, d in self.docs.items()
            if d.get("state") in (State.QUEUED.value, State.RETRYING.value)
            and d["claimable_at"] < cutoff
            and d["claimable_at"] != UNPUBLISHED
            and d["updated_at"] < cutoff
            and kept(d)
        ]
        found.sort(key=lambda f: f[1][by])
        found.reverse()
        return [{"_id": i, **{k: d[k] for k in self.QUIET_FIELDS if k in d}} for i, d in found][
            :limit
        ]

    def records(self, record_ids: Sequence[str]) -> list[dict[str, Any]]:
        self._enter("records")
        return [copy.deepcopy(d) for i in record_ids if (d := self.docs.get(i)) is not None]

    def stale(
        self, state: State, *, older_than_seconds: float, limit: int = 500
    ) -> list[dict[str, Any]]:
        self._enter("stale")
        cutoff = self.now() - timedelta(seconds=older_than_seconds)
        return [
            copy.deepcopy(d)
            for d in self.docs.values()
            if d.get("state") == state.value
            and d["claimable_at"] < cutoff
            and d["updated_at"] < cutoff
        ][:limit]

    def replacements_due(
        self, *, older_than_seconds: float, limit: int = 500
    ) -> list[dict[str, Any]]:
        cutoff = self.now() - timedelta(seconds=older_than_seconds)
        due = [
            d
            for d in self.docs.values()
            if d.get("replace_due") is not None
            and d["replace_due"] < cutoff
            and d.get("state") == State.SUCCEEDED
            and d.get("claimable_at", EPOCH) < cutoff
            and d.get("updated_at", EPOCH) < cutoff
        ]
        return [copy.deepcopy(d) for d in due[:limit]]

    def mark_reconciled(self, doc: Mapping[str, Any]) -> bool:
        self._enter("mark_reconciled")
        held = self.docs.get(doc["_id"])
        if (
            held is None
            or held.get("updated_at") != doc.get("updated_at")
            or held.get("claimable_at") != doc.get("claimable_at")
        ):
            return False
        held.update(updated_at=self.now(), reconciled_at=self.now(), claimable_at=self.now())
        held["reconciled"] = held.get("reconciled", 0) + 1
        return True

    def leave_unpublished(self, doc: Mapping[str, Any]) -> bool:
        self._enter("leave_unpublished")
        held = self.docs.get(doc["_id"])
        if (
            held is None
            or held.get("state") != State.QUEUED
            or held.get("claimable_at") != UNPUBLISHED
            or held.get("updated_at") != doc.get("updated_at")
        ):
            return False
        held["updated_at"] = self.now()
        return True


class MemoryRedis:
    """The Redis list and string commands the engines use, in memory."""

    def __init__(self) -> None:
        self.lists: dict[str, list[bytes]] = {}

    def lpush(self, key: str, value: str | bytes) -> None:
        self.lists.setdefault(key, []).insert(
            0, value.encode() if isinstance(value, str) else value
        )

    def ltrim(self, key: str, start: int, end: int) -> None:
        items = self.lists.get(key, [])
        self.lists[key] = items[start : None if end == -1 else end + 1]

    def lindex(self, key: str, index: int) -> bytes | None:
        items = self.lists.get(key, [])
        return items[index] if -len(items) <= index < len(items) else None

    def lrem(self, key: str, count: int, value: bytes) -> int:
        items = self.lists.get(key, [])
        for position in range(len(items) - 1, -1, -1):
            if items[position] == value:
                del items[position]
                return 1
        return 0


@dataclass
class Published:
    """One message a fake publish port sent."""

    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]


@dataclass
class Outbox:
    """The publish ports of the runtime, recording instead of sending."""

    tasks: list[Published] = field(default_factory=list)
    raw: list[tuple[str, dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    broken: BaseException | None = None

    def publish(self, task: str, args: list[Any], kwargs: dict[str, Any], **options: Any) -> None:
        if self.broken is not None:
            raise self.broken
        self.tasks.append(Published(task, list(args), dict(kwargs), options))

    def publish_raw(self, queue: str, payload: dict[str, Any], headers: dict[str, Any]) -> None:
        self.raw.append((queue, payload, headers))
