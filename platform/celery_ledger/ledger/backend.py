"""The ledger as Celery's result backend: ``AsyncResult.get()``, ``.state``, ``.result``.

Records written by the claim protocol are read from here; :class:`LedgerTask` writes their
outcomes itself (fenced), so the writes Celery's tracer asks of a backend are skipped for them.
Tasks outside the protocol (Celery's own, or a ``base=celery.Task`` task) get plain records.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from celery import states
from celery.backends.base import BaseBackend
from pymongo.errors import ConnectionFailure

from ..deadletter import entry_of
from ..errors import LedgerUnavailable
from .record import State
from .store import Ledger

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


class LedgerBackend(BaseBackend):  # type: ignore[misc]
    """Celery result backend over the app's :class:`~celery_ledger.ledger.Ledger`."""

    persistent = True
    supports_native_join = False

    def __init__(self, app: Any = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._groups_collection = f"{app.settings.ledger_collection}_groups"

    @property
    def ledger(self) -> Ledger:
        ledger: Ledger = self.app.ledger
        return ledger

    def exception_safe_to_retry(self, exc: Exception) -> bool:
        return isinstance(exc, ConnectionFailure | LedgerUnavailable)

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
        if request is not None and getattr(request, "ledger_settled", False):
            return result  # LedgerTask recorded this outcome under its fencing token
        if (
            state == states.FAILURE
            and isinstance(result, dict)
            and result.get("exc_type") == "TimeLimitExceeded"
        ):
            self._retire_after_hard_limit(task_id, request)
        fields: dict[str, Any] = {
            "state": LEDGER_STATE.get(state, State.QUEUED).value,
            "celery_state": state,
            "result": json.dumps(result),
            "traceback": (traceback or "")[-8000:],
        }
        if request is not None and getattr(request, "task", None):
            fields["task"] = request.task
        self.ledger.store_plain(task_id, fields)
        return result

    def _retire_after_hard_limit(self, task_id: str, request: Any) -> None:
        """The worker killed a body at its hard time limit: retire the job (dead), clean up."""
        reason = "time limit exceeded (hard)"
        artefacts = list(self.ledger.load_progress(task_id).get("artefacts", []))
        if not self.ledger.retire(task_id, None, reason):
            return
        task = self.app.tasks.get(getattr(request, "task", None) or "")
        on_retire = getattr(task, "on_retire", None)
        if on_retire is not None:
            try:
                on_retire(reason, artefacts)
            except Exception:  # cleanup must not hide the retirement
                logging.getLogger("celery_ledger.backend").warning(
                    "cleanup of %s failed", task_id, exc_info=True
                )
        doc = self.ledger.find_raw(task_id)
        if doc is not None:
            self.app.dead_letters.announce(entry_of(doc))

    def _forget(self, task_id: str) -> None:
        # The record is what keeps the job from running twice: drop only the stored result.
        self.ledger.collection.update_one({"_id": task_id}, {"$unset": {"result": ""}})

    # -- reads -------------------------------------------------------------------------------

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        doc = self.ledger.find_raw(task_id)
        if doc is None:
            return {"status": states.PENDING, "result": None, "task_id": task_id}
        status = doc.get("celery_state") or CELERY_STATE[State(doc["state"])]
        result: Any = None
        if doc.get("result") is not None:
            result = json.loads(self.app.sealer.open(doc["result"]))
        if status in (states.FAILURE, states.RETRY) and "celery_state" not in doc:
            result = _exception_payload(doc)
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
        return self.ledger.find_raw(task_id) is not None

    # -- groups (so that group().get() works) -------------------------------------------------

    @property
    def _groups(self) -> Any:
        return self.ledger.collection.database.get_collection(self._groups_collection)

    def _save_group(self, group_id: str, result: Any) -> Any:
        payload = json.dumps([r.id for r in result.results])
        self._groups.replace_one(
            {"_id": group_id}, {"_id": group_id, "results": payload}, upsert=True
        )
        return result

    def _restore_group(self, group_id: str) -> dict[str, Any] | None:
        doc = self._groups.find_one({"_id": group_id})
        if doc is None:
            return None
        from celery.result import GroupResult

        ids = json.loads(doc["results"])
        return {
            "task_id": group_id,
            "result": GroupResult(group_id, [self.app.AsyncResult(i) for i in ids], app=self.app),
        }

    def _delete_group(self, group_id: str) -> None:
        self._groups.delete_one({"_id": group_id})


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
