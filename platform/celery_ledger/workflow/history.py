"""A workflow's state as a fold of its event log (pure: no I/O, no clock).

The event log is the truth; the state is derived from it, one event at a time, by
:meth:`WorkflowState.apply`. The same fold serves three readers: a wake resuming the workflow
(from its latest snapshot), ``history``/``state --as-of`` (from the first event up to a time),
and the console. A ``snapshot`` event holds the whole state as of its position, so a resume reads
at most the events after it.

Positions: every command the workflow's code issues (a step, a child workflow, a timer, a signal
wait, a version marker, a compensation) takes the next position, in the order the code issues
them. Replaying the code against the log must ask for the same command at every recorded
position; that is what makes a resumed workflow continue instead of starting over.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

# The events' schema version is the log's (ledger.workflow_log.EVENT_SCHEMA): a wake refuses a
# log with events newer than it knows before folding it.
TERMINAL = ("completed", "failed", "compensated", "cancelled", "dead")
# Command kinds, and which of them are ledger jobs (their outcome is read from the ledger).
JOB_KINDS = ("step", "child")


@dataclass
class Command:
    """One recorded command at one position of the workflow."""

    pos: int
    kind: str  # step | child | timer | signal | version | compensation
    name: str  # task, workflow, "sleep", signal or version name
    status: str = "scheduled"  # scheduled | done | failed (a compensation: registered)
    job_id: str | None = None  # a step's or a child's ledger record
    args: str | None = None  # JSON [args, kwargs] of a step, child or compensation
    tier: str | None = None
    result: str | None = None  # JSON text of a step's result (sealed if the task is sensitive)
    error: str | None = None
    until: float | None = None  # a timer's, or a signal wait's timeout (unix seconds)
    version: int | None = None
    signal_id: str | None = None
    timed_out: bool = False
    scheduled_at: float = 0.0  # or when its job was last republished
    republished: int = 0  # times its job was republished (each waits twice as long)
    finished_at: float | None = None
    # A compensation's own run (compensations run after a failure, newest first).
    run_job_id: str | None = None
    run_status: str | None = None  # scheduled | done | failed
    run_error: str | None = None

    @property
    def resolved(self) -> bool:
        return self.status in ("done", "failed")


@dataclass
class WorkflowState:
    """Where one workflow stands (see the module docstring)."""

    id: str
    workflow: str = ""
    key: str = ""
    tier: str | None = None
    args: str = "[[], {}]"  # JSON [args, kwargs]
    parent: dict[str, Any] | None = None  # {"id": ..., "pos": ...} of a child workflow
    status: str = "running"
    generation: int = 0  # bumped by an operator's retry: new step jobs from its position on
    commands: dict[int, Command] = field(default_factory=dict)
    consumed_signals: list[str] = field(default_factory=list)
    cancel: dict[str, Any] | None = None  # reason, actor
    cancel_pos: int | None = None  # where the cancellation was raised into the code
    failure: str | None = None  # why the code failed (before its compensations)
    cancelled: bool = False  # the failure is a cancellation
    result: str | None = None  # JSON of the return value
    error: str | None = None  # why it ended without its result, or why it is stuck
    started_at: float | None = None
    finished_at: float | None = None
    seq: int = -1  # the last event applied
    snapshot_seq: int = -1
    since_snapshot: int = 0  # events applied after the latest snapshot

    # -- queries ---------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def pending_jobs(self) -> list[tuple[Command, str]]:
        """Commands whose ledger job has no recorded outcome yet: (command, job id)."""
        pending: list[tuple[Command, str]] = []
        for command in self.commands.values():
            if command.kind in JOB_KINDS and command.status == "scheduled" and command.job_id:
                pending.append((command, command.job_id))
            if command.run_status == "scheduled" and command.run_job_id:
                pending.append((command, command.run_job_id))
        return pending

    def next_position(self) -> int:
        return max(self.commands, default=-1) + 1

    def compensations(self) -> list[Command]:
        """Registered compensations, newest first (the order they run in)."""
        registered = [c for c in self.commands.values() if c.kind == "compensation"]
        return sorted(registered, key=lambda c: c.pos, reverse=True)

    # -- the fold --------------------------------------------------------------------------

    def apply(self, event: Mapping[str, Any]) -> None:
        """Apply one event (a document of the log) to the state."""
        kind = str(event.get("kind"))
        data: Mapping[str, Any] = event.get("data") or {}
        at = _seconds(event.get("at"))
        seq = int(event.get("seq", self.seq + 1))
        if kind == "snapshot":
            restored = WorkflowState.from_dict(data["state"])
            self.__dict__.update(restored.__dict__)
            self.seq = self.snapshot_seq = seq
            self.since_snapshot = 0
            return
        self.seq = seq
        self.since_snapshot += 1
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:  # an unknown kind (a newer schema) changes nothing here
            handler(data, at)

    def _on_started(self, data: Mapping[str, Any], at: float) -> None:
        self.workflow = str(data.get("workflow", ""))
        self.key = str(data.get("key", ""))
        self.tier = data.get("tier")
        self.args = str(data.get("args", "[[], {}]"))
        self.parent = data.get("parent")
        self.started_at = at
        self.status = "running"

    def _on_scheduled(self, data: Mapping[str, Any], at: float) -> None:
        pos = int(data["pos"])
        command = Command(
            pos=pos,
            kind=str(data["kind"]),
            name=str(data["name"]),
            job_id=data.get("job_id"),
            args=data.get("args"),
            tier=data.get("tier"),
            until=data.get("until"),
            version=data.get("version"),
            scheduled_at=at,
        )
        if command.kind == "version":
            command.status = "done"
        elif command.kind == "compensation":
            command.status = "registered"
        self.commands[pos] = command

    def _on_completed(self, data: Mapping[str, Any], at: float) -> None:
        command = self.commands[int(data["pos"])]
        command.status, command.result, command.finished_at = "done", data.get("result"), at

    def _on_republished(self, data: Mapping[str, Any], at: float) -> None:
        command = self.commands[int(data["pos"])]
        command.scheduled_at, command.republished = at, command.republished + 1

    def _on_step_failed(self, data: Mapping[str, Any], at: float) -> None:
        command = self.commands[int(data["pos"])]
        command.status, command.error, command.finished_at = "failed", data.get("error"), at

    def _on_fired(self, data: Mapping[str, Any], at: float) -> None:
        command = self.commands[int(data["pos"])]
        command.status, command.finished_at = "done", at

    def _on_signal(self, data: Mapping[str, Any], at: float) -> None:
        command = self.commands[int(data["pos"])]
        command.status, command.finished_at = "done", at
        command.result, command.signal_id = data.get("payload"), data.get("signal_id")
        if command.signal_id:
            self.consumed_signals.append(str(command.signal_id))

    def _on_timed_out(self, data: Mapping[str, Any], at: float) -> None:
        command = self.commands[int(data["pos"])]
        command.status, command.timed_out, command.finished_at = "done", True, at

    def _on_cancel_requested(self, data: Mapping[str, Any], at: float) -> None:
        self.cancel = {"reason": data.get("reason", ""), "actor": data.get("actor", ""), "at": at}

    def _on_cancel_delivered(self, data: Mapping[str, Any], at: float) -> None:
        self.cancel_pos = int(data["pos"])

    def _on_code_failed(self, data: Mapping[str, Any], at: float) -> None:
        self.failure = str(data.get("error", ""))
        self.cancelled = bool(data.get("cancelled"))
        self.status = "compensating"

    def _on_compensation_scheduled(self, data: Mapping[str, Any], at: float) -> None:
        command = self.commands[int(data["pos"])]
        command.run_job_id, command.run_status = data.get("job_id"), "scheduled"

    def _on_compensation_completed(self, data: Mapping[str, Any], at: float) -> None:
        self.commands[int(data["pos"])].run_status = "done"

    def _on_compensation_failed(self, data: Mapping[str, Any], at: float) -> None:
        command = self.commands[int(data["pos"])]
        command.run_status, command.run_error = "failed", data.get("error")

    def _on_finished(self, data: Mapping[str, Any], at: float) -> None:
        self.status = str(data["status"])
        self.result = data.get("result")
        self.error = data.get("error")
        self.finished_at = at

    def _on_stuck(self, data: Mapping[str, Any], at: float) -> None:
        self.status, self.error = "stuck", data.get("error")

    def _on_retried(self, data: Mapping[str, Any], at: float) -> None:
        """An operator's retry: resume a stuck workflow, or run again from a position."""
        from_pos = data.get("from_pos")
        self.error = None
        self.status = "running"
        if from_pos is None:
            return
        self.generation = int(data.get("generation", self.generation + 1))
        self.commands = {p: c for p, c in self.commands.items() if p < int(from_pos)}
        for command in self.commands.values():
            command.run_job_id = command.run_status = command.run_error = None
        self.failure, self.cancelled, self.result, self.finished_at = None, False, None, None
        self.cancel, self.cancel_pos = None, None

    # -- snapshots -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state["commands"] = [asdict(c) for c in self.commands.values()]
        return state

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkflowState:
        values = dict(data)
        # Fields a newer version added are left out, so a snapshot survives a rollback.
        fields = Command.__dataclass_fields__
        commands = [
            Command(**{k: v for k, v in c.items() if k in fields})
            for c in values.pop("commands", [])
        ]
        state = cls(**{k: v for k, v in values.items() if k in cls.__dataclass_fields__})
        state.commands = {c.pos: c for c in commands}
        return state


def fold(workflow_id: str, events: Iterable[Mapping[str, Any]]) -> WorkflowState:
    """The state after ``events`` (in sequence order, from a snapshot or the first event)."""
    state = WorkflowState(id=workflow_id)
    for event in events:
        state.apply(event)
    return state


def as_of(workflow_id: str, events: Iterable[Mapping[str, Any]], when: datetime) -> WorkflowState:
    """The state at time ``when``: the fold of the events recorded up to it."""
    limit = when.timestamp()
    return fold(workflow_id, (e for e in events if _seconds(e.get("at")) <= limit))


def _seconds(value: Any) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, int | float):
        return float(value)
    return 0.0
