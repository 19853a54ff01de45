"""The public face of workflows: ``@app.workflow``, ``.start()``, and the handle.

@app.workflow(idempotency_key="fulfil-{order_id}", tier="critical")
def fulfil_order(wf, order_id: int, items: list[str]) -> dict: ...

handle = fulfil_order.start(7, ["a", "b"])   # once per key, ever: the same key, the same one
handle.signal("approved", True); handle.status(); handle.history(); handle.result(timeout=60)
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .. import audit
from ..errors import WorkflowError
from .engine import Definition
from .history import WorkflowState, as_of, fold

if TYPE_CHECKING:
    from pymongo.client_session import ClientSession

    from ..app import LedgerCelery


@dataclass(frozen=True)
class WorkflowCall:
    """A workflow with its arguments (``ship.s(order_id)``), for ``wf.run`` and ``wf.gather``."""

    workflow: Workflow
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class Workflow:
    """A declared workflow (what ``@app.workflow`` returns)."""

    def __init__(self, app: LedgerCelery, definition: Definition) -> None:
        self.app = app
        self.definition = definition
        self.__doc__ = definition.fn.__doc__

    @property
    def name(self) -> str:
        return self.definition.name

    def start(self, *args: Any, **kwargs: Any) -> WorkflowHandle:
        """Start the workflow of these arguments' key, or find the one that key started.

        Raises:
            PayloadError: the arguments are not JSON or exceed the size limit.
            Backpressure: the workflow's tier is above its high-water mark.
        """
        return self.start_with(args, kwargs)

    def start_with(
        self,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        key: str | None = None,
        session: ClientSession | None = None,
    ) -> WorkflowHandle:
        """:meth:`start` with an explicit idempotency ``key`` (instead of the declared one).

        ``session``: started in that session's transaction (the app's own): it exists, and
        runs, only if the transaction commits (see outbox.py).

        Raises:
            ConfigurationError: ``session`` is not in a transaction.
        """
        engine = self.app.workflow_engine
        tier = self.definition.tier or self.app.settings.default_tier
        if session is not None:
            outbox = self.app.outbox
            outbox.require_transaction(session)
            outbox.admit(tier)
            workflow_id, created = engine.start(
                self.definition, tuple(args), dict(kwargs or {}), key=key, session=session
            )
            if created:
                outbox.stage_workflow(session, workflow_id, tier)
            return WorkflowHandle(self.app, workflow_id)
        self.app.admit(tier)
        workflow_id, _ = engine.start(self.definition, tuple(args), dict(kwargs or {}), key=key)
        return WorkflowHandle(self.app, workflow_id)

    def s(self, *args: Any, **kwargs: Any) -> WorkflowCall:
        """This workflow as a child step: ``wf.run(ship.s(order_id))``."""
        return WorkflowCall(self, args, kwargs)

    def handle(self, workflow_id: str) -> WorkflowHandle:
        return WorkflowHandle(self.app, workflow_id)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise WorkflowError(
            f"{self.name} is a workflow: start it with .start(...), or run it as a child step"
            " with wf.run(...)"
        )

    def __repr__(self) -> str:
        return f"<workflow {self.name}>"


@dataclass(frozen=True)
class WorkflowStatus:
    """Where a workflow stands (``handle.status()``)."""

    id: str
    workflow: str
    key: str
    status: (
        str  # running | compensating | stuck | completed | failed | compensated | cancelled | dead
    )
    result: Any
    error: str | None
    steps_done: int
    steps_pending: list[str]
    waiting: list[str]  # timers and signal waits not resolved
    events: int
    started_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True)
class WorkflowEvent:
    """One event of a workflow's log (``handle.history()``)."""

    seq: int
    at: datetime
    kind: str
    worker: str
    fence: int
    data: dict[str, Any]


class WorkflowHandle:
    """A started workflow, by id (``AsyncResult(handle.id)`` works as for any job)."""

    def __init__(self, app: LedgerCelery, workflow_id: str) -> None:
        self.app = app
        self.id = workflow_id

    def __repr__(self) -> str:
        return f"<WorkflowHandle {self.id}>"

    def signal(
        self,
        name: str,
        payload: Any = None,
        *,
        signal_id: str | None = None,
        actor: str | None = None,
    ) -> bool:
        """Send signal ``name``: delivered once, to the first wait for it (kept until then).
        ``signal_id`` makes the send idempotent; returns False if that id was sent before.
        Audited (``actor``: who sends it; default ``$LEDGER_ACTOR``, else user@host)."""
        signal_id = (
            signal_id or f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%f')}-{uuid.uuid4().hex[:8]}"
        )
        who = audit.current_actor(actor)
        with audit.action(
            self.app.ledger, "workflow signal", self.id, actor=who, signal=name, signal_id=signal_id
        ) as entry:
            added = self.app.workflow_engine.signal(
                self.id,
                name,
                payload,
                signal_id=signal_id,
                actor=who,
                limit=self.app.settings.workflow_max_pending_signals,
            )
            entry.note(added=added)
        return added

    def cancel(self, reason: str = "", *, actor: str | None = None) -> None:
        """Cancel: raised into the code at its next wait or new step, once the steps in flight
        have ended (so each step that ran has its compensation registered); child workflows
        are cancelled at once. Its compensations run, and it ends ``cancelled``. Audited, as
        :meth:`signal`."""
        who = audit.current_actor(actor)
        with audit.action(self.app.ledger, "workflow cancel", self.id, actor=who, reason=reason):
            self.app.workflow_engine.cancel(self.id, reason=reason, actor=who)

    def retry(self, from_step: int | None = None, *, actor: str | None = None) -> dict[str, Any]:
        """Resume a stuck workflow, or run an ended one again from position ``from_step``
        (default: its first failed step). Audited, as :meth:`signal`. Returns the event the
        log recorded (``data.from_pos``: where it runs again from; None: resumed)."""
        who = audit.current_actor(actor)
        with audit.action(
            self.app.ledger, "workflow retry", self.id, actor=who, from_step=from_step
        ):
            return self.app.workflow_engine.retry(self.id, from_step=from_step, actor=who)

    def result(self, timeout: float | None = None, *, propagate: bool = True) -> Any:
        """Wait for the end; its result, or :class:`WorkflowFailed` (with ``propagate``)."""
        return self.app.AsyncResult(self.id).get(timeout=timeout, propagate=propagate, interval=0.2)

    def history(self) -> list[WorkflowEvent]:
        """Every event of the log, oldest first, with its time, worker and fence."""
        return [
            WorkflowEvent(
                seq=int(e["seq"]),
                at=e["at"],
                kind=str(e["kind"]),
                worker=str(e.get("worker", "")),
                fence=int(e.get("fence", -1)),
                data=dict(e.get("data") or {}),
            )
            for e in self.app.workflow_engine.log.all_events(self.id)
            if e.get("kind") != "snapshot"
        ]

    def state(self, as_of_time: datetime | None = None) -> WorkflowState:
        """The state rebuilt from the log: now, or as it was at ``as_of_time``."""
        events = self.app.workflow_engine.log.all_events(self.id)
        if not events:
            raise WorkflowError(f"no events for workflow {self.id} (not started, or expired)")
        return fold(self.id, events) if as_of_time is None else as_of(self.id, events, as_of_time)

    def status(self) -> WorkflowStatus:
        doc = self.app.workflow_engine.log.get_state(self.id)
        if doc is None:
            raise WorkflowError(f"no workflow {self.id}")
        events = self.app.workflow_engine.log.all_events(self.id)
        state = fold(self.id, events)
        return status_of(doc, state, len(events), open_text=self.app.sealer.open)


def status_of(
    doc: dict[str, Any],
    state: WorkflowState,
    events: int,
    *,
    open_text: Callable[[str], str] = lambda text: text,
) -> WorkflowStatus:
    """What ``handle.status()`` shows; ``open_text`` opens a sensitive workflow's result."""
    import json

    commands = list(state.commands.values())
    waiting = [
        f"{c.kind} {c.name}"
        + (
            f" until {datetime.fromtimestamp(c.until, UTC).isoformat(timespec='seconds')}"
            if c.until
            else ""
        )
        for c in commands
        if c.kind in ("timer", "signal") and c.status == "scheduled"
    ]
    finished = doc.get("finished_at")
    return WorkflowStatus(
        id=str(doc["_id"]),
        workflow=str(doc.get("workflow", "")),
        key=str(doc.get("key", "")),
        status=state.status if events else str(doc.get("status")),
        result=json.loads(open_text(state.result)) if state.result is not None else None,
        error=state.error or doc.get("error"),
        steps_done=sum(1 for c in commands if c.kind in ("step", "child") and c.status == "done"),
        steps_pending=[
            f"{c.pos}:{c.name}"
            for c in commands
            if c.kind in ("step", "child") and c.status == "scheduled"
        ],
        waiting=waiting,
        events=events,
        started_at=doc.get("created_at"),
        finished_at=finished if isinstance(finished, datetime) else None,
    )
