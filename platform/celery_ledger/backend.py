"""The ledger as Celery's result backend: ``AsyncResult.get()``, ``.state``, ``.result``.

Records written by the claim protocol are read from here; the guard writes their outcomes
itself (fenced), so every write Celery's worker asks of a backend for a ledger task is skipped:
``STARTED`` (``task_track_started``) is what the claim records, and success, retry and failure
are the guard's. A revoked ledger job is recorded dead (reason ``revoked``) if nobody runs it.
Tasks outside the protocol (Celery's own, or a ``base=celery.Task`` task) get plain records.

A message id that is not a job's record id (a canvas member's) is read through its alias, and a
replaced job's result is its replacement's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from celery import states
from celery.backends.base import BaseBackend
from celery.exceptions import TimeoutError
from celery.result import GroupResult
from pymongo.errors import ConnectionFailure

from .errors import LedgerUnavailable
from .ledger.dead import DeadJob
from .ledger.message import KeptMessage
from .ledger.ports import BackendStore
from .ledger.record import State, status_of
from .ledger.store import Unclaimed
from .task import LedgerTask, refuse_clear_successors

logger = logging.getLogger("celery_ledger.backend")

CELERY_STATE = {
    State.QUEUED: states.PENDING,
    State.RUNNING: states.STARTED,
    State.RETRYING: states.RETRY,
    State.SUCCEEDED: states.SUCCESS,
    State.DEAD: states.FAILURE,
}
LEDGER_STATE = {
    states.PENDING: State.QUEUED,
    states.RECEIVED: State.QUEUED,
    states.STARTED: State.RUNNING,
    states.RETRY: State.RETRYING,
    states.SUCCESS: State.SUCCEEDED,
    states.FAILURE: State.DEAD,
}
# A custom Celery state (not ready: ``get()`` goes on waiting): the job is past its latency
# objective and unfinished.
LATE = "LATE"
_MAX_REPLACEMENTS = 10  # replaced_by pointers followed when reading a result
# The deadline of the wait in progress in this context (``AsyncResult.get(timeout=...)``):
# Celery's retry of a read asks the backend whether to retry, and sleeps through it.
_deadline: ContextVar[float | None] = ContextVar("celery_ledger_result_deadline", default=None)


class LedgerBackend(BaseBackend):  # type: ignore[misc]
    """Celery result backend over the app's :class:`~celery_ledger.ledger.Ledger`."""

    persistent = True
    supports_native_join = False

    @property
    def ledger(self) -> BackendStore:
        ledger: BackendStore = self.app.ledger
        return ledger

    def apply_chord(self, header_result_args: Any, body: Any, **kwargs: Any) -> Any:
        """Celery's chord (its unlock task polls the header's results), refused first, before
        anything is published, if a sensitive task of the header would hand its result to a
        body that is not sensitive."""
        _group_id, results = header_result_args
        refuse_clear_successors(self.app, _task_names(results), body)
        return super().apply_chord(header_result_args, body, **kwargs)

    def exception_safe_to_retry(self, exc: Exception) -> bool:
        if not isinstance(exc, ConnectionFailure | LedgerUnavailable):
            return False
        deadline = _deadline.get()
        return deadline is None or time.monotonic() < deadline  # (no retry past a get's timeout)

    def _sleep(self, amount: float) -> None:
        deadline = _deadline.get()  # (a retry's backoff, up to 10 s, never past it either)
        time.sleep(
            amount if deadline is None else max(0.0, min(amount, deadline - time.monotonic()))
        )

    def wait_for(
        self,
        task_id: str,
        timeout: float | None = None,
        interval: float = 0.5,
        no_ack: bool = True,
        on_interval: Callable[[], Any] | None = None,
    ) -> dict[str, Any]:
        """Celery's wait (``AsyncResult.get``), its timeout kept on the clock: Celery counts only
        its own sleeps, so polls the ledger held up (retried while it was away) ran past it (a
        ``get(timeout=3)`` took 15 s). A ledger still away at the deadline is a ``TimeoutError``
        that says so."""
        self._ensure_not_eager()
        outer = _deadline.get()  # (a wait inside another's: the nearer deadline holds)
        deadline = None if timeout is None else time.monotonic() + timeout
        if outer is not None:
            deadline = outer if deadline is None else min(outer, deadline)
        token = _deadline.set(deadline)
        try:
            while True:
                try:
                    meta: dict[str, Any] = self.get_task_meta(task_id)
                except (ConnectionFailure, LedgerUnavailable) as exc:
                    if deadline is None or time.monotonic() < deadline:
                        raise
                    raise TimeoutError(
                        f"The operation timed out: the ledger is away ({exc})"
                    ) from exc
                if meta["status"] in states.READY_STATES:
                    return meta
                if on_interval:
                    on_interval()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("The operation timed out.")
                time.sleep(interval if left is None else min(interval, left))
        finally:
            _deadline.reset(token)

    # -- writes ------------------------------------------------------------------------------

    def _store_result(
        self,
        task_id: str,
        result: Any,
        state: str,
        traceback: str | None = None,
        request: Any = None,
        **kwargs: Any,
    ) -> Any:
        if request is None and state == states.REVOKED:
            # A worker's revoke command, before any message of the job arrived: the task is
            # unknown here. Kill a ledger job that waits; the message, when it arrives, is
            # recorded with its task by the worker that drops it (as Celery did before 5.7).
            self._record_revocation(task_id, lambda: self._revoked_by_id(task_id))
            return result
        task = self.app.tasks.get(getattr(request, "task", None) or "")
        if isinstance(task, LedgerTask):
            if state == states.REVOKED:
                self._record_revocation(task_id, lambda: self._revoked(task, task_id, request))
            return result  # the guard records every outcome of a ledger job, fenced
        fields: dict[str, Any] = {
            "state": LEDGER_STATE.get(state, State.QUEUED).value,
            "celery_state": state,
            "result": json.dumps(result, default=str),
            "traceback": (traceback or "")[-8000:],
        }
        if request is not None and getattr(request, "task", None):
            fields["task"] = request.task
        self.ledger.store_plain(task_id, fields)
        return result

    @staticmethod
    def _record_revocation(task_id: str, record: Callable[[], None]) -> None:
        """Record a revocation without ever raising: this runs in the worker's main process
        (Celery's strategy marks a revoked message before acknowledging it), where an exception
        ends the worker, and Celery's backend retries would sleep in its event loop. A job whose
        revocation could not be recorded stays revoked in the workers' memory; a copy the
        reconciler brings back later is revoked (and recorded) again."""
        try:
            record()
        except Exception as exc:
            logger.error("could not record the revocation of %s: %s", task_id, exc)

    def _revoked_by_id(self, task_id: str) -> None:
        doc = self.ledger.resolve(task_id)
        task = self.app.tasks.get(str((doc or {}).get("task")))
        if doc is None or not isinstance(task, LedgerTask) or "key" not in doc:
            return
        dead = DeadJob.of_reason(
            "revoked",
            "revoked",
            task=task.name,
            message=KeptMessage.from_document(doc.get("message")),
        )
        if self.ledger.bury(
            doc["_id"],
            dead,
            match=Unclaimed(kill_waiting=True),
            task=task.name,
            key=str(doc["key"]),
            tier=str(doc.get("tier") or self.app.tiers.default),
        ):
            self.app.dead_letters.announce_record(doc["_id"])

    def _revoked(self, task: LedgerTask, task_id: str, request: Any) -> None:
        """A revoked ledger job nobody runs yet is dead (replayable), so nothing waits on it."""
        identity = task.identity_of_message(
            task_id,
            getattr(request, "headers", None) or {},
            getattr(request, "args", None),
            getattr(request, "kwargs", None),
        )
        tier = self.app.tiers.of_task(task.name, task.tier)
        sealer = self.app.sealer if task.sensitive else None
        message = KeptMessage.of_call(
            getattr(request, "args", None) or (),
            getattr(request, "kwargs", None) or {},
            message_headers=getattr(request, "headers", None) or {},
            sealer=sealer,
        )
        dead = DeadJob.of_reason("revoked", "revoked", task=task.name, message=message)
        if self.ledger.bury(
            identity.record_id,
            dead,
            match=Unclaimed(kill_waiting=True),
            task=identity.task,
            key=identity.key,
            tier=tier,
        ):
            self.app.dead_letters.announce_record(identity.record_id)

    def _forget(self, task_id: str) -> None:
        # The record is what keeps the job from running twice: drop only the stored result.
        self.ledger.forget_result(task_id)

    # -- reads -------------------------------------------------------------------------------

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        doc = self.ledger.resolve(task_id)
        for _ in range(_MAX_REPLACEMENTS):  # a replaced job's result is its replacement's
            if doc is None or doc.get("outcome") != "replaced":
                break
            doc = self.ledger.resolve(str(doc.get("replaced_by")))
        if doc is None:
            return {"status": states.PENDING, "result": None, "task_id": task_id}
        status = doc.get("celery_state") or _celery_status(doc)
        result: Any = None
        if doc.get("result") is not None:
            result = json.loads(self.app.runtime.sealer.open(doc["result"]))
        if status in (states.FAILURE, states.RETRY) and "celery_state" not in doc:
            result = _exception_payload(doc)
        elif status == LATE:  # not ready: what a poller can show while it waits
            result = {
                "state": doc.get("state"),
                "late_at": doc.get("late_at"),
                "slo_seconds": doc.get("slo_seconds"),
            }
        meta: dict[str, Any] = self.meta_from_decoded(
            {
                "task_id": task_id,
                "status": status,
                "result": result,
                "date_done": doc.get("finished_at"),
                "traceback": doc.get("traceback"),
                "children": [],
            }
        )
        return meta

    def task_result_exists(self, task_id: str) -> bool:
        return self.ledger.resolve(task_id) is not None

    # -- groups (so that group().get() works) -------------------------------------------------

    def _save_group(self, group_id: str, result: Any) -> Any:
        self.ledger.save_group(group_id, [r.id for r in result.results])
        return result

    def _restore_group(self, group_id: str) -> dict[str, Any] | None:
        members = self.ledger.group_members(group_id)
        if members is None:
            return None
        return {
            "task_id": group_id,
            "result": GroupResult(
                group_id, [self.app.AsyncResult(i) for i in members], app=self.app
            ),
        }

    def _delete_group(self, group_id: str) -> None:
        self.ledger.delete_group(group_id)


def _celery_status(doc: dict[str, Any]) -> str:
    """A ledger record's state as Celery's (see ``status_of``: degraded, late)."""
    state = State(doc["state"])
    status = status_of(
        state,
        degraded=doc.get("degraded") is not None and doc.get("result") is not None,
        late=doc.get("late_at") is not None,
    )
    return LATE if status == "late" else CELERY_STATE[State(status)]


def _exception_payload(doc: dict[str, Any]) -> dict[str, Any]:
    """The last recorded error in the shape Celery's ``exception_to_python`` reads."""
    errors = doc.get("errors") or []
    last = (
        errors[-1]
        if errors
        else {"type": "celery_ledger.errors.TaskError", "message": doc.get("dead_reason", "failed")}
    )
    module, _, name = str(last["type"]).rpartition(".")
    return {
        "exc_type": name,
        "exc_message": [last.get("message", "")],
        "exc_module": module or "builtins",
    }


def _task_names(results: Any, depth: int = 0) -> list[str]:
    """The tasks of a chord header's frozen results (a nested group holds more of them)."""
    if depth > 32:
        return []
    names: list[str] = []
    for result in results or ():
        name = getattr(result, "ledger_task", None)
        if isinstance(name, str):
            names.append(name)
        names += _task_names(getattr(result, "results", None), depth + 1)
    return names
