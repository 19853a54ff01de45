"""The workflow engine: starts workflows and runs their wakes (short, idempotent deliveries).

A wake reads the log's tail (one read, down to the latest snapshot), reads the outcomes of the
jobs the workflow waits on (one read of their ledger records), replays the code to the first
command that is not resolved, and appends what it decided (one ordered insert): the outcomes it
observed and the new commands. Only then does it start their effects (publish a step, hold a
timer's wake in the delayed set, start a child), so an effect is never started for a decision
that is not durable. A step's job is keyed by the workflow and the step's position, so starting
it twice (a wake repeated after a crash) is one job, run once by the ledger's claim.

Wakes need no lease: two wakes of one workflow that read the same log prefix decide the same
commands (the code is deterministic), and the log's unique sequence lets the first append win
while the second stops where it collided and reads again.

Three round trips per sequential step is the minimum here: the decision must be durable before
its effect (one write), the step's outcome lives in the step's own ledger record and must be read
(one read), and any worker may resume the workflow, so its log must be read (one read); each
touches documents the others' writers do not, in different collections.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from celery.exceptions import SoftTimeLimitExceeded
from pymongo.client_session import ClientSession

from ..crypto import Sealer
from ..errors import (
    ConfigurationError,
    NonDeterminism,
    PayloadError,
    StepFailed,
    WorkflowCancelled,
    WorkflowError,
)
from ..events import Observer
from ..exits import described, worker_stopping
from ..identity import KeySpec, canonical_json, compute_key, derive_task_id
from ..ledger.record import State
from ..ledger.workflow_log import (
    ACTIVE,
    CANCEL_REQUEST,
    EVENT_SCHEMA,
    PENDING_SIGNAL,
    WorkflowLog,
    is_event,
)
from ..untrusted import storable
from .context import Call, Suspend, WorkflowContext, signal_of
from .history import WorkflowState, fold

logger = logging.getLogger("celery_ledger.workflow")

MAX_CONFLICTS = 5  # appends lost to a concurrent wake before this wake gives way
NOT_HERE = "not here"  # a wake with ``here_only`` of a workflow another release or app runs
MAX_CHECK_DOUBLINGS = 4  # a still workflow is checked at least every 16 check times
REPUBLISH_AFTER_SECONDS = 30.0  # a step with no ledger record this long after it was scheduled
UNKNOWN_WORKFLOW_RETRY_SECONDS = 30.0  # a wake for a workflow this worker does not define
# A timer's wake found the timer not quite due (the waking host's clock is behind the one that
# published the wake): within this many seconds of it, the wake is published again for then.
EARLY_WAKE_SECONDS = 60.0
MIN_REHELD_WAKE_SECONDS = 1.0


@dataclass(frozen=True)
class Definition:
    """A workflow as the engine runs it (what ``@app.workflow`` declares)."""

    name: str
    fn: Callable[..., Any]
    key_spec: KeySpec = None
    tier: str | None = None
    snapshot_every: int | None = None
    # Its arguments, signals' payloads, result and error text sealed or withheld in the log;
    # a key derived from its arguments is an HMAC under ``key_secret``.
    sensitive: bool = False
    key_secret: bytes | None = None

    def key_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if self.sensitive and self.key_spec is None and self.key_secret is None:
            raise ConfigurationError(
                f"{self.name} is sensitive and derives its idempotency key from its arguments:"
                " set LEDGER_KEY_SECRET, or give it an idempotency_key"
            )
        return compute_key(
            self.key_spec,
            task_name=self.name,
            run=_without_context(self.fn),
            args=args,
            kwargs=kwargs,
            secret=self.key_secret if self.sensitive else None,
        )


class Ports(Protocol):
    """What the engine asks of the app: publishing steps and wakes, resolving calls."""

    def call_of(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call: ...

    def check_arguments(self, call: Call) -> None: ...

    def publish_step(
        self, call: Call, *, job_id: str, key: str, workflow_id: str, workflow_tier: str
    ) -> None: ...

    def publish_wake(self, workflow_id: str, tier: str, *, delay: float = 0.0) -> bool:
        """Send a wake; False if it was folded into one that already waits (the same effect)."""
        ...


def step_key(workflow_id: str, generation: int, pos: int, *, undo: bool = False) -> str:
    """The idempotency key of a workflow's step (or of a compensation's run)."""
    return f"wf:{workflow_id}:{generation}:{pos}" + (":undo" if undo else "")


class WorkflowEngine:
    """Starts workflows and runs their wakes (see the module docstring)."""

    def __init__(
        self,
        log: WorkflowLog,
        definitions: Mapping[str, Definition],
        ports: Ports,
        *,
        default_tier: str,
        snapshot_every: int,
        check_seconds: float,
        max_payload_bytes: int,
        committer_grace_seconds: float = 0.0,
        max_result_bytes: int = 16 * 1024 * 1024,
        open_text: Callable[[str], str] = lambda text: text,
        seal_text: Callable[[str], str] | None = None,
        observers: Observer | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.log = log
        self.definitions = definitions
        self.ports = ports
        self.default_tier = default_tier
        self.snapshot_every = snapshot_every
        self.check_seconds = check_seconds
        # A workflow started in an app's transaction is due for a check once its committer has
        # had this long to wake it (the outbox's grace): only a committer that died leaves it.
        self.committer_grace_seconds = committer_grace_seconds
        self.max_payload_bytes = max_payload_bytes
        self.max_result_bytes = max_result_bytes
        self.open_text = open_text
        self.seal_text = seal_text
        self.observers = observers or Observer()
        self.clock = clock

    @property
    def worker(self) -> str:
        return f"{socket.gethostname()}:{os.getpid()}"

    # -- starting -------------------------------------------------------------------------------

    def start(
        self,
        definition: Definition,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        key: str | None = None,
        parent: dict[str, Any] | None = None,
        session: ClientSession | None = None,
    ) -> tuple[str, bool]:
        """Start the workflow of this key (once per key, ever); returns (its id, whether this
        call started it). The state document is durable before the first wake is published,
        so a lost wake is found by the reconciler.

        ``session``: the state document is written in that session's transaction (the app's
        own) and no wake is published (the caller's outbox publishes it after the commit). It
        is due for a check once ``committer_grace_seconds`` have passed: a committing process
        that dies before that publish leaves it to the outbox relay's next pass.

        Raises:
            PayloadError: the arguments do not fit the workflow's signature, are not JSON, or
                exceed the size limit (refused here, not failed later in a worker).
        """
        try:
            inspect.signature(_without_context(definition.fn)).bind(*args, **kwargs)
        except TypeError as exc:
            raise PayloadError(
                f"workflow {definition.name} cannot take these arguments: {exc}"
            ) from exc
        key = key or definition.key_of(args, kwargs)
        workflow_id = derive_task_id(definition.name, key)
        arguments = canonical_json([list(args), kwargs])
        if len(arguments) > self.max_payload_bytes:
            raise PayloadError(
                f"arguments of workflow {definition.name} are {len(arguments)} bytes of JSON;"
                f" the limit is {self.max_payload_bytes} (LEDGER_MAX_PAYLOAD_BYTES)"
            )
        tier = definition.tier or self.default_tier
        now = self.log.now()
        first_check = self.committer_grace_seconds if session else self.check_seconds
        created = self.log.create(
            {
                "_id": workflow_id,
                "workflow": definition.name,
                "key": key,
                "tier": tier,
                "args": self._sealed(arguments) if definition.sensitive else arguments,
                "parent": parent,
                "check_at": now + timedelta(seconds=first_check),
            },
            session=session,
        )
        if created and session is None:
            try:
                self.ports.publish_wake(workflow_id, tier)
            except Exception as exc:  # durable already: the reconciler wakes it
                logger.warning("workflow %s started; its first wake is late: %s", workflow_id, exc)
        return workflow_id, created

    # -- a wake ---------------------------------------------------------------------------------

    def wake(self, workflow_id: str, *, here_only: bool = False) -> str:
        """Advance the workflow as far as its log and its jobs' outcomes allow; returns what
        it did (``suspended``, ``finished``, ``stuck``, ``unknown``, ...).

        ``here_only``: a wake run where a step ended, not from a wake message: a workflow this
        worker cannot advance (not defined here, or written by a newer release) is left as it
        is (``not here``), for its caller to send a wake message to the workers that can."""
        for _ in range(MAX_CONFLICTS):
            outcome = self._wake_once(workflow_id, here_only=here_only)
            if outcome != "conflict":
                return outcome
        return "conflict"  # another wake keeps winning: it does the work

    def _tail_limit(self) -> int:
        """One read reaches the latest snapshot: the largest snapshot interval in use, plus
        room for the documents beside the events (signals, a cancel request)."""
        declared = [d.snapshot_every for d in self.definitions.values() if d.snapshot_every]
        return max([self.snapshot_every, *declared]) + 64

    def _wake_once(self, workflow_id: str, *, here_only: bool = False) -> str:
        docs = self.log.tail(workflow_id, limit=self._tail_limit())
        newer = max((int(d.get("v") or 1) for d in docs if is_event(d)), default=1)
        if newer > EVENT_SCHEMA and here_only:
            return NOT_HERE
        if newer > EVENT_SCHEMA:
            # Written by a newer release (a rollback is under way): folding past events this
            # one does not know would silently drop what they say. The newer workers run it.
            logger.warning(
                "workflow %s has events of schema %s (this worker knows %s); woken again in %ss",
                workflow_id,
                newer,
                EVENT_SCHEMA,
                UNKNOWN_WORKFLOW_RETRY_SECONDS,
            )
            state_doc = self.log.get_state(workflow_id) or {}
            self.ports.publish_wake(
                workflow_id,
                str(state_doc.get("tier") or self.default_tier),
                delay=UNKNOWN_WORKFLOW_RETRY_SECONDS,
            )
            return "newer schema"
        events = sorted((d for d in docs if is_event(d)), key=lambda d: int(d["seq"]))
        starts = [i for i, e in enumerate(events) if e.get("kind") in ("snapshot", "started")]
        events = events[starts[-1] :] if starts else []
        state = fold(workflow_id, events)
        consumed_before = set(state.consumed_signals)
        base = state.seq
        now = self.clock()
        new: list[dict[str, Any]] = []

        def emit(kind: str, data: dict[str, Any]) -> None:
            event = {"kind": kind, "data": data}
            state.apply({**event, "seq": state.seq + 1, "at": now})
            new.append(event)

        if not events:
            started = self.log.get_state(workflow_id)
            if started is None and here_only:
                return NOT_HERE
            if started is None:
                logger.warning("wake for unknown workflow %s ignored", workflow_id)
                return "unknown"
            emit("started", _started_event(started))
        if state.finished:
            # Its state document is written last: once it says ended, the end is complete
            # (a read, not the end's writes again, for each late wake of an ended workflow).
            ended = self.log.get_state(workflow_id)
            if ended is None or ended.get("status") in ACTIVE:
                self._after_finish(state, docs)
            return "finished"
        if state.status == "stuck":
            return "stuck"  # until an operator's retry
        definition = self.definitions.get(state.workflow)
        if definition is None and here_only:
            return NOT_HERE
        if definition is None:
            logger.warning(
                "workflow %s (%s) is not defined in this worker; woken again in %ss",
                state.workflow,
                workflow_id,
                UNKNOWN_WORKFLOW_RETRY_SECONDS,
            )
            self.ports.publish_wake(
                workflow_id, self._tier(state), delay=UNKNOWN_WORKFLOW_RETRY_SECONDS
            )
            return "unknown workflow"
        republish = self._observe(state, emit, now)
        cancel = next((d for d in docs if d.get("kind") == CANCEL_REQUEST), None)
        if cancel is not None and state.cancel is None:
            emit(
                "cancel_requested",
                {"reason": cancel.get("reason", ""), "actor": cancel.get("actor", "")},
            )
        signals = [signal_of(d) for d in docs if d.get("kind") == PENDING_SIGNAL]
        waiting: list[float] = []
        if state.status == "running":
            waiting = self._run_code(state, definition, signals, emit, now)
        if state.status == "compensating":
            self._compensate(state, emit)
        every = definition.snapshot_every or self.snapshot_every
        if new and state.since_snapshot >= every:
            emit("snapshot", {"state": state.to_dict()})
        landed = self.log.append(workflow_id, base, new, worker=self.worker)
        self._effects(state, new[:landed], docs)
        # A pending signal the log had consumed before this wake (a resend that raced its first
        # delivery): never delivered again, so dropped. Only what this wake read counts: its own
        # consumptions are dropped by their effects, once they landed.
        self.log.drop_signals(
            workflow_id,
            [
                d.get("signal_id")
                for d in docs
                if d.get("kind") == PENDING_SIGNAL and d.get("signal_id") in consumed_before
            ],
        )
        if landed < len(new):
            return "conflict"
        for command in republish:
            self._publish_command(
                state, command.pos, command.kind, command.name, command.args, command.tier
            )
        if waiting:
            self._keep_timer(state, min(waiting), new, now)
        return state.status if state.status != "running" else "suspended"

    def _keep_timer(
        self, state: WorkflowState, until: float, new: list[dict[str, Any]], now: float
    ) -> None:
        """The code waits for a timer (or a signal's timeout) due at ``until``. The wake that
        scheduled it published its wake for then; the state document keeps the time, so the
        reconciler's checks of a still workflow never pass it by (a lost wake costs at most a
        check time). A wake that finds it due soon, not due yet, is most likely that wake,
        early by the clocks' skew: it is published again for then."""
        scheduled = any(
            e["kind"] == "scheduled" and e["data"].get("until") is not None for e in new
        )
        if scheduled or until - now <= EARLY_WAKE_SECONDS:
            self.log.wait_until(
                state.id,
                datetime.fromtimestamp(until, UTC),
                check_by=datetime.fromtimestamp(until + self.check_seconds, UTC),
            )
        if not scheduled and until - now <= EARLY_WAKE_SECONDS:
            # At least a second on: clocks that disagree never make wakes chase each other.
            delay = max(until - now, MIN_REHELD_WAKE_SECONDS) + 0.05
            self.ports.publish_wake(state.id, self._tier(state), delay=delay)

    def _observe(
        self,
        state: WorkflowState,
        emit: Callable[[str, dict[str, Any]], None],
        now: float,
    ) -> list[Any]:
        """Record the outcomes of the jobs the workflow waits on; returns the commands whose
        job has no record long after it was scheduled (their message was lost)."""
        pending = state.pending_jobs()
        if not pending:
            return []
        found = self.log.outcomes([job_id for _, job_id in pending])
        lost = []
        for command, job_id in pending:
            doc = found.get(job_id)
            outcome = _job_outcome(doc, self.log, depth=0)
            if outcome is None:
                # Not at the first sight of no record (a backlog delays a claim, and a copy of
                # every waiting step at every check would grow the backlog it waits in), but
                # long after its publish, and each republish waits twice as long again.
                if doc is None and now - command.scheduled_at > self._republish_after(command):
                    emit("republished", {"pos": command.pos})
                    lost.append(command)
                continue
            done, value = outcome
            if command.run_job_id == job_id:
                if done:
                    emit("compensation_completed", {"pos": command.pos})
                else:
                    emit("compensation_failed", {"pos": command.pos, "error": value})
            elif done:
                emit("completed", {"pos": command.pos, "result": value})
            else:
                emit("step_failed", {"pos": command.pos, "error": value})
        return lost

    def _run_code(
        self,
        state: WorkflowState,
        definition: Definition,
        signals: list[Any],
        emit: Callable[[str, dict[str, Any]], None],
        now: float,
    ) -> list[float]:
        """Run the code as far as it goes; returns the times of the timers and signal timeouts
        it suspended at (empty if it did not suspend at one)."""
        context = WorkflowContext(
            state,
            now=now,
            signals=signals,
            call_of=self._call_of,
            check_call=self._check_call,
            job_id_of=lambda call, pos: self._job_id(state, call, pos),
            decode=self._decode,
            emit=emit,
            seal=self.seal_text,
            sensitive=definition.sensitive,
        )
        args, kwargs = json.loads(self.open_text(state.args))
        failure: str | None = None
        cancelled = False
        result: Any = None
        finished = False
        try:
            result = definition.fn(context, *args, **kwargs)
            finished = True
        except Suspend:
            pass
        except WorkflowCancelled as exc:
            failure, cancelled = str(exc), True
        except SoftTimeLimitExceeded:
            # The time limit of the delivery running this wake (a task_soft_time_limit that
            # reaches wakes, or the step whose end advances its workflow in place), not the
            # code's failure: this wake is interrupted, and the workflow's next wake runs it
            raise
        except Exception as exc:  # the workflow's code failed: compensations follow
            failure = _describe(exc, sensitive=definition.sensitive)
        except BaseException as exc:
            if worker_stopping(exc):
                raise  # the wake goes back with its message, as a killed process's
            # SystemExit, KeyboardInterrupt, GeneratorExit raised by the code: its own failure
            # (unrecorded, the wake failed again at every try, or ended its pool process)
            failure = _describe(exc, sensitive=definition.sensitive)
        if context.suspended and context.nondeterminism is None:
            return context.waiting_until  # it waits, whatever the code did after the suspension
        if state.cancel_pos is not None and not cancelled:
            # The code caught the cancellation (an ``except Exception`` around a wait) and went
            # on to return or fail: it ends cancelled all the same, its compensations run
            finished, cancelled = False, True
            failure = f"cancelled: {(state.cancel or {}).get('reason', '')}"
        recorded_past = state.next_position()
        if context.nondeterminism is None and not cancelled and context.position < recorded_past:
            # The code ended (returned or raised) before commands its log recorded: they were
            # removed or moved under a running workflow. Ending here would leave a recorded
            # step running unawaited, or compensations skipping steps that ran.
            last = state.commands[recorded_past - 1]
            context.nondeterminism = NonDeterminism(
                f"workflow {state.workflow} ({state.id}) position {context.position}: the log"
                f" recorded commands up to {last.kind} {last.name!r} at position {last.pos},"
                " the code now ends before them (a change under running workflows: gate it"
                " with wf.version)"
            )
        if context.nondeterminism is not None:
            # Named by its type (as the README and the error tree promise) in the status, the
            # history and ``workflows show``, which all read this event's text
            error = described(context.nondeterminism)
            emit("stuck", {"error": error})
            logger.error("%s", error)
            return []
        if finished:
            try:
                encoded = canonical_json(result)
            except PayloadError as exc:
                failure = f"the workflow's result is not JSON: {exc}"
            else:
                if len(encoded) <= self.max_result_bytes:
                    if definition.sensitive:
                        encoded = self._sealed(encoded)
                    emit("finished", {"status": "completed", "result": encoded})
                    return []
                failure = (
                    f"the workflow's result is {len(encoded)} bytes of JSON; the limit is"
                    f" {self.max_result_bytes} (LEDGER_MAX_RESULT_BYTES)"
                )
        if failure is not None:
            emit("code_failed", {"error": storable(failure)[:4000], "cancelled": cancelled})
        return []

    def _compensate(
        self, state: WorkflowState, emit: Callable[[str, dict[str, Any]], None]
    ) -> None:
        """Run the registered compensations newest first, one at a time."""
        compensations = state.compensations()
        for command in compensations:
            if command.run_status == "done":
                continue
            if command.run_status == "failed":
                error = (
                    f"{state.failure}; then compensation {command.name} (position {command.pos})"
                    f" failed: {command.run_error}"
                )
                emit("finished", {"status": "dead", "error": error})
                return
            if command.run_status == "scheduled":
                return
            job_id = derive_task_id(
                command.name, step_key(state.id, state.generation, command.pos, undo=True)
            )
            emit("compensation_scheduled", {"pos": command.pos, "job_id": job_id})
            return
        status = "compensated" if compensations else "failed"
        if state.cancelled:
            status = "cancelled"
        emit("finished", {"status": status, "error": state.failure or status})

    # -- effects of the appended events ---------------------------------------------------------

    def _effects(
        self, state: WorkflowState, landed: list[dict[str, Any]], docs: list[dict[str, Any]]
    ) -> None:
        for event in landed:
            kind, data = event["kind"], event["data"]
            if kind in ("completed", "step_failed"):
                command = state.commands[int(data["pos"])]
                waited = self.clock() - command.scheduled_at
                self.observers.workflow_step(
                    state.workflow, command.name, waited, kind == "completed"
                )
            if kind == "scheduled" and data["kind"] in ("step", "child"):
                self._publish_command(
                    state,
                    data["pos"],
                    data["kind"],
                    data["name"],
                    data.get("args"),
                    data.get("tier"),
                )
            elif kind == "scheduled" and data.get("until") is not None:
                delay = max(float(data["until"]) - self.clock(), 0.0)
                self.ports.publish_wake(state.id, self._tier(state), delay=delay + 0.05)
            elif kind == "compensation_scheduled":
                command = state.commands[int(data["pos"])]
                self._publish_command(
                    state, command.pos, "compensation", command.name, command.args, command.tier
                )
            elif kind == "signal":
                self.log.drop_signals(state.id, [data.get("signal_id")])
            elif kind == "cancel_requested":
                # At once: the code waits for its children to end before it meets the
                # cancellation (WorkflowContext._cancel_point), and a child may wait forever.
                self._cancel_children(state)
            elif kind == "code_failed":
                self.log.set_status(state.id, "compensating", error=data.get("error"))
                if data.get("cancelled"):
                    self._cancel_children(state)
            elif kind == "stuck":
                self.log.set_status(state.id, "stuck", error=data.get("error"))
            elif kind == "retried":
                self.log.set_status(state.id, "running", error=None)
        if any(e["kind"] == "finished" for e in landed):
            self._after_finish(state, docs)

    def _cancel_children(self, state: WorkflowState) -> None:
        """A cancelled workflow cancels the child workflows it still waits on."""
        for command in state.commands.values():
            if command.kind != "child" or command.status != "scheduled" or not command.job_id:
                continue
            # A child that already ended says so (its end wakes the parent, which ignores it).
            with contextlib.suppress(WorkflowError):
                self.cancel(command.job_id, reason=f"parent {state.id} cancelled", actor=state.id)

    def _publish_command(
        self,
        state: WorkflowState,
        pos: int,
        kind: str,
        name: str,
        args: str | None,
        tier: str | None,
    ) -> None:
        call_args, call_kwargs = json.loads(self.open_text(args or "[[], {}]"))
        if kind == "child":
            definition = self.definitions.get(name)
            if definition is None:
                raise WorkflowError(f"child workflow {name} is not defined in this worker")
            self.start(
                definition,
                tuple(call_args),
                dict(call_kwargs),
                key=_child_key(state, pos),
                parent={"id": state.id, "pos": pos, "tier": self._tier(state)},
            )
            return
        undo = kind == "compensation"
        key = step_key(state.id, state.generation, pos, undo=undo)
        call = Call("step", name, tuple(call_args), dict(call_kwargs), tier)
        self.ports.publish_step(
            call,
            job_id=derive_task_id(name, key),
            key=key,
            workflow_id=state.id,
            workflow_tier=self._tier(state),
        )

    def _after_finish(self, state: WorkflowState, docs: list[dict[str, Any]]) -> None:
        """What follows the end (idempotent: a repeated wake of an ended workflow redoes it):
        its ledger record (``AsyncResult``), its parent's wake, the leftover signals, and last
        its state document (until that says ended, the reconciler keeps waking it), and the
        observers' count of ends."""
        self.log.finish_record(
            state.id,
            task=state.workflow,
            key=state.key,
            tier=self._tier(state),
            result=state.result if state.status == "completed" else None,
            error=None if state.status == "completed" else f"{state.status}: {state.error}",
            status=state.status,
        )
        if state.parent:
            self.ports.publish_wake(
                str(state.parent["id"]), str(state.parent.get("tier") or self._tier(state))
            )
        self.log.drop_signals(
            state.id, [d.get("signal_id") for d in docs if d.get("kind") == PENDING_SIGNAL]
        )
        self.log.delete([str(d["_id"]) for d in docs if d.get("kind") == CANCEL_REQUEST])
        self.log.set_status(
            state.id,
            state.status,
            error=state.error,
            finished_at=datetime.fromtimestamp(state.finished_at or self.clock(), UTC),
        )
        # Counted with the state document's end, so a wake that died before that write counts
        # the end when the next wake completes it, and no end counts twice.
        self.observers.workflow_ended(state.workflow, state.status)

    # -- operator actions ---------------------------------------------------------------------

    def signal(
        self, workflow_id: str, name: str, payload: Any, *, signal_id: str, actor: str, limit: int
    ) -> bool:
        """Keep a signal for the workflow and wake it; False if this signal id was sent before."""
        state = self._active_state(workflow_id, "signal")
        payload_json = canonical_json(payload)
        if len(payload_json) > self.max_payload_bytes:
            raise PayloadError(
                f"signal payload is {len(payload_json)} bytes;"
                f" the limit is {self.max_payload_bytes}"
            )
        if signal_id in self._consumed_signals(workflow_id):
            return False  # delivered already: its document is gone, its id is in the log
        if Sealer.is_sealed(str(state.get("args") or "")):  # a sensitive workflow's
            payload_json = self._sealed(payload_json)
        added = self.log.add_signal(
            workflow_id,
            signal_id,
            {"name": name, "payload": payload_json, "sent_at": self.log.now(), "actor": actor},
            limit=limit,  # refused beyond it, with the reason
        )
        self._nudge(workflow_id, state)
        return added

    def _consumed_signals(self, workflow_id: str) -> set[str]:
        docs = self.log.tail(workflow_id, limit=self._tail_limit())
        events = sorted((d for d in docs if is_event(d)), key=lambda d: int(d["seq"]))
        starts = [i for i, e in enumerate(events) if e.get("kind") in ("snapshot", "started")]
        return set(fold(workflow_id, events[starts[-1] :] if starts else []).consumed_signals)

    def cancel(self, workflow_id: str, *, reason: str, actor: str) -> None:
        state = self._active_state(workflow_id, "cancel")
        if state.get("status") == "stuck":
            # A cancellation is met by the code, which runs to undo its steps; a stuck
            # workflow's code does not run until an operator's retry
            raise WorkflowError(
                f"cannot cancel workflow {workflow_id}: it is stuck ({state.get('error')});"
                " retry it once its code is fixed (ledger workflows retry), then cancel it"
            )
        self.log.request_cancel(
            workflow_id, {"reason": reason, "actor": actor, "at": self.log.now()}
        )
        self._nudge(workflow_id, state)

    def retry(self, workflow_id: str, *, from_step: int | None, actor: str) -> dict[str, Any]:
        """Resume a stuck workflow, or run an ended one again from a position (new step jobs
        from there on; earlier steps keep their results). Returns the appended event."""
        for _ in range(MAX_CONFLICTS):
            docs = self.log.all_events(workflow_id)
            if not docs:
                raise WorkflowError(f"no workflow {workflow_id}")
            state = fold(workflow_id, docs)
            if state.status in ("running", "compensating"):
                raise WorkflowError(f"workflow {workflow_id} is {state.status}: cancel it first")
            ran_compensations = any(c.run_status for c in state.commands.values())
            if from_step is None:
                failed = [c.pos for c in state.commands.values() if c.status == "failed"]
                if state.status != "stuck":
                    if not failed:
                        raise WorkflowError(
                            f"workflow {workflow_id} is {state.status}: name --from-step"
                        )
                    from_step = min(failed)
            if from_step is not None and ran_compensations and from_step != 0:
                raise WorkflowError(
                    f"workflow {workflow_id} ran its compensations: only a retry from step 0 can"
                    " run it again (earlier steps were undone)"
                )
            event = {
                "kind": "retried",
                "data": {"from_pos": from_step, "generation": state.generation + 1, "actor": actor},
            }
            if from_step is None:
                event["data"] = {"from_pos": None, "actor": actor}
            if self.log.append(workflow_id, state.seq, [event], worker=self.worker) == 1:
                break
        else:
            raise WorkflowError(f"workflow {workflow_id} changed during the retry; try again")
        if state.status != "stuck":
            self.log.reopen_record(workflow_id)
        self.log.set_status(
            workflow_id,
            "running",
            error=None,
            check_at=self.log.now() + timedelta(seconds=self.check_seconds),
        )
        self.ports.publish_wake(workflow_id, self._tier(state))
        return event

    def _active_state(self, workflow_id: str, action: str) -> dict[str, Any]:
        doc = self.log.get_state(workflow_id)
        if doc is None:
            raise WorkflowError(f"no workflow {workflow_id}")
        if doc.get("status") not in ACTIVE:
            raise WorkflowError(
                f"cannot {action} workflow {workflow_id}: it is {doc.get('status')}"
            )
        return doc

    def _nudge(self, workflow_id: str, doc: Mapping[str, Any]) -> None:
        """Wake the workflow now; should that wake be lost, the reconciler's check is due soon."""
        self.log.check_by(
            workflow_id, self.log.now() + timedelta(seconds=self.check_seconds), earlier_only=True
        )
        try:
            self.ports.publish_wake(workflow_id, str(doc.get("tier") or self.default_tier))
        except Exception as exc:
            logger.warning(
                "wake of workflow %s not published (the reconciler will): %s", workflow_id, exc
            )

    def mark_stuck(self, workflow_id: str, error: str) -> None:
        """Record that the workflow cannot advance (every wake failed): an operator's retry
        resumes it. Best effort: if even this fails, the reconciler keeps waking it."""
        try:
            events = self.log.all_events(workflow_id)
            state = fold(workflow_id, events)
            if not events or state.finished or state.status == "stuck":
                return
            stuck = {"kind": "stuck", "data": {"error": storable(error)[:4000]}}
            if self.log.append(workflow_id, state.seq, [stuck], worker=self.worker) == 1:
                self.log.set_status(workflow_id, "stuck", error=error[:4000])
        except Exception:
            logger.exception("could not mark workflow %s stuck", workflow_id)

    # -- the reconciler's part ------------------------------------------------------------------

    def wake_overdue(self, *, limit: int = 200, held: Iterable[str] = ()) -> int:
        """Wake active workflows nothing woke within the check time (their wake-up was lost,
        or a step's message was): each wake republishes what is missing. One whose log grew
        within the check time is not woken (it advances: its wakes are not lost), and one
        that stays still through its checks (a long timer, a signal, a step behind a backlog)
        is checked half as often each time, down to one check in MAX_CHECK_DOUBLINGS
        doublings: checks are reads and a wake of every waiting workflow at every check would
        take the workers' time from the steps they wait for. Workflows of the ``held`` tiers
        (above their backpressure mark) are left due: a wake would add to the queue that is
        too deep, and checks them once it drains."""
        woken = 0
        now = self.log.now()
        for doc in self.log.due_for_check(limit=limit, skip_tiers=held):
            workflow_id = str(doc["_id"])
            last, started_job = self.log.last_event(workflow_id)
            if last is not None and (now - last).total_seconds() < self.check_seconds:
                self.log.check_by(
                    workflow_id,
                    self._capped(doc, last + timedelta(seconds=self.check_seconds)),
                    checks=0,
                )
                continue
            checks = int(doc.get("checks") or 0)
            wait = self.check_seconds * 2 ** min(checks, MAX_CHECK_DOUBLINGS)
            self.log.check_by(
                workflow_id, self._capped(doc, now + timedelta(seconds=wait)), checks=checks + 1
            )
            if started_job is not None and self.log.in_flight(started_job):
                # It waits for the job its newest event started, which has not ended (behind a
                # backlog, or retrying): that job's end wakes it, and a wake now would only find
                # it waiting (under the long soak's backlog a third of the wakes were these). A
                # job whose message is lost is the reconciler's to bring back; one that ended
                # without waking it is seen at the next check.
                continue
            woken += self.ports.publish_wake(workflow_id, str(doc.get("tier") or self.default_tier))
        return woken

    def _capped(self, doc: Mapping[str, Any], check_at: datetime) -> datetime:
        """``check_at``, or a check time after the timer the workflow waits for, if earlier."""
        timer = doc.get("timer_at")
        if isinstance(timer, datetime):
            timer = timer if timer.tzinfo else timer.replace(tzinfo=UTC)
            if timer >= self.log.now():
                return min(check_at, timer + timedelta(seconds=self.check_seconds))
        return check_at

    # -- helpers --------------------------------------------------------------------------------

    def _call_of(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        call = self.ports.call_of(target, args, kwargs)
        if call.kind == "child" and call.name not in self.definitions:
            raise ConfigurationError(f"{call.name} is not a workflow of this app")
        return call

    def _check_call(self, call: Call) -> None:
        """Refuse a new command's arguments (size, the target's signature): raised into the
        code before the command is recorded. Only for new commands: a recorded one replays
        its outcome whatever a later deploy changed in its target's signature or the limits."""
        size = len(canonical_json([list(call.args), call.kwargs]))
        if size > self.max_payload_bytes:
            raise PayloadError(
                f"arguments of step {call.name} are {size} bytes of JSON; the limit is"
                f" {self.max_payload_bytes} (LEDGER_MAX_PAYLOAD_BYTES)"
            )
        definition = self.definitions.get(call.name) if call.kind == "child" else None
        if definition is not None:
            try:  # here, into the parent's code, not later where its start would fail forever
                inspect.signature(_without_context(definition.fn)).bind(*call.args, **call.kwargs)
            except TypeError as exc:
                raise PayloadError(
                    f"child workflow {call.name} cannot take these arguments: {exc}"
                ) from exc
        self.ports.check_arguments(call)

    def _republish_after(self, command: Any) -> float:
        """How long a step's job may have no record before its message counts as lost: three
        checks (at most REPUBLISH_AFTER_SECONDS), doubled at each republish, up to an hour."""
        base = min(max(3 * self.check_seconds, 5.0), REPUBLISH_AFTER_SECONDS)
        return float(min(base * 2 ** min(int(command.republished), 10), 3600.0))

    def _job_id(self, state: WorkflowState, call: Call, pos: int) -> str:
        if call.kind == "child":
            return derive_task_id(call.name, _child_key(state, pos))
        return derive_task_id(call.name, step_key(state.id, state.generation, pos))

    def _decode(self, text: str | None) -> Any:
        return None if text is None else json.loads(self.open_text(text))

    def _sealed(self, text: str) -> str:
        if self.seal_text is None:
            raise ConfigurationError("a sensitive workflow needs LEDGER_ENCRYPTION_KEYS")
        return self.seal_text(text)

    def _tier(self, state: WorkflowState) -> str:
        return state.tier or self.default_tier


def _child_key(state: WorkflowState, pos: int) -> str:
    return f"{state.id}:{state.generation}:{pos}"


def _started_event(doc: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "workflow": doc.get("workflow"),
        "key": doc.get("key"),
        "tier": doc.get("tier"),
        "args": doc.get("args", "[[], {}]"),
        "parent": doc.get("parent"),
    }


def _job_outcome(
    doc: Mapping[str, Any] | None, log: WorkflowLog, *, depth: int
) -> tuple[bool, str] | None:
    """(True, result JSON) for a succeeded job, (False, reason) for a dead one, else None."""
    if doc is None:
        return None
    state = doc.get("state")
    if state == State.SUCCEEDED.value:
        if doc.get("outcome") == "replaced" and doc.get("replaced_by") and depth < 10:
            replacement = log.outcomes([str(doc["replaced_by"])]).get(str(doc["replaced_by"]))
            return _job_outcome(replacement, log, depth=depth + 1)
        result = doc.get("result")
        return True, result if isinstance(result, str) else "null"
    if state == State.DEAD.value:
        return False, str(doc.get("dead_reason") or "dead")
    return None


def _describe(exc: BaseException, *, sensitive: bool = False) -> str:
    if isinstance(exc, StepFailed):
        return str(exc)  # the step's dead reason (a sensitive task's holds no text)
    if sensitive:  # an exception's text may hold the workflow's data: its type only
        return f"{type(exc).__name__} (message withheld: sensitive workflow)"
    return described(exc)


def _without_context(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The workflow function's signature without its first parameter (``wf``), for keys."""
    import functools

    signature = inspect.signature(fn)
    params = list(signature.parameters.values())[1:]

    @functools.wraps(fn)
    def bound(*args: Any, **kwargs: Any) -> Any:  # pragma: no cover - only its signature is used
        raise TypeError("not callable")

    bound.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return bound


__all__ = ["Definition", "Ports", "WorkflowEngine", "step_key"]
