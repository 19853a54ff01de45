"""The ``wf`` object a workflow's code receives: its commands, served from the log on replay.

Each wake runs the workflow's code from the top. A command whose position the log already
resolved returns the recorded outcome at once (a step's result, a signal's payload), so the code
fast-forwards through its past without repeating an effect. The first command that is not
resolved either is new (it is recorded, and its effect is started once the record is durable)
or still waits (a step in flight, a timer not due): then the code is suspended by
:class:`Suspend`, and the workflow sleeps until something wakes it.

A command that differs from the one recorded at its position (another kind or name) is
non-determinism: the code was changed under a running workflow. It is never resolved silently:
the workflow stops as ``stuck``. ``wf.version`` lets a change keep old workflows on their path.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..errors import (
    ConfigurationError,
    NonDeterminism,
    PayloadError,
    StepFailed,
    WorkflowCancelled,
)
from ..identity import canonical_json
from .history import JOB_KINDS, Command, WorkflowState


class Suspend(BaseException):
    """The workflow waits. A BaseException, so the code's ``except Exception`` never swallows
    it (workflow code must not catch BaseException)."""


@dataclass(frozen=True)
class Call:
    """What one command asks for: a task (step), a workflow (child) with its arguments."""

    kind: str  # step | child
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tier: str | None = None
    sensitive: bool = False  # a sensitive task: its arguments are sealed in the log


@dataclass(frozen=True)
class Signal:
    """A signal sent to the workflow and not consumed yet."""

    id: str
    name: str
    payload: str | None  # JSON
    sent_at: float


# Turns what the code passed (a task, a signature, a workflow, a workflow call) into a Call.
CallOf = Callable[[Any, tuple[Any, ...], dict[str, Any]], Call]
# Opens a step's recorded result (a sensitive task's is sealed) and decodes its JSON.
Decode = Callable[[str | None], Any]


class WorkflowContext:
    """The ``wf`` argument of a workflow (see the module docstring).

    Public API for workflow code: :meth:`run`, :meth:`gather`, :meth:`compensate`,
    :meth:`sleep`, :meth:`wait_signal`, :meth:`version`, and :attr:`id`, :attr:`key`.
    """

    def __init__(
        self,
        state: WorkflowState,
        *,
        now: float,
        signals: Sequence[Signal],
        call_of: CallOf,
        check_call: Callable[[Call], None] = lambda call: None,
        job_id_of: Callable[[Call, int], str],
        decode: Decode,
        emit: Callable[[str, dict[str, Any]], None],
        seal: Callable[[str], str] | None = None,
        sensitive: bool = False,
    ) -> None:
        self._state = state
        self._sensitive = sensitive  # a sensitive workflow: every step's arguments sealed
        self._now = now
        self._signals = sorted(signals, key=lambda s: (s.sent_at, s.id))
        self._call_of = call_of
        self._check_call = check_call
        self._job_id_of = job_id_of
        self._decode = decode
        self._emit = emit
        self._seal = seal
        self._pos = 0
        # Set once the code was suspended: code that swallowed the Suspend (a bare except)
        # must not issue commands past a wait.
        self.suspended = False
        self.nondeterminism: NonDeterminism | None = None
        self.waiting_until: list[float] = []  # timers and signal timeouts this wake waits for

    @property
    def position(self) -> int:
        """The position of the code's next command (how far this run of the code came)."""
        return self._pos

    @property
    def id(self) -> str:
        """The workflow's id (also its ``AsyncResult`` id)."""
        return self._state.id

    @property
    def key(self) -> str:
        """The workflow's idempotency key: pass it on to receivers of outside effects."""
        return self._state.key

    # -- commands ----------------------------------------------------------------------------

    def run(self, target: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a step and return its result: a ledger task (``payments.charge, 7`` or
        ``payments.charge.s(7)``) or a child workflow (``ship, 7`` or ``ship.s(7)``).

        The step runs once per workflow, whatever crashes: its job is keyed by the workflow and
        the step's position. Raises :class:`StepFailed` if it failed for good.
        """
        command = self._command(self._call_of(target, args, kwargs))
        return self._outcome(command)

    def gather(self, targets: Iterable[Any]) -> list[Any]:
        """Run steps in parallel (signatures, as for :meth:`run`) and return their results in
        order once all have finished. Raises :class:`StepFailed` for the first that failed."""
        commands = [self._command(self._call_of(t, (), {})) for t in targets]
        if any(not c.resolved for c in commands):
            raise self._suspend()
        return [self._outcome(c) for c in commands]

    def compensate(self, target: Any, *args: Any, **kwargs: Any) -> None:
        """Register a compensation (saga): if the workflow fails for good or is cancelled
        later, registered compensations run newest first, each once, each recorded."""
        call = self._call_of(target, args, kwargs)
        self._check_if_new(call, "compensation")
        pos, recorded = self._next("compensation", call.name)
        if recorded is None:
            self._new(pos, "compensation", call.name, args=self._arguments(call), tier=call.tier)

    def sleep(self, seconds: float) -> None:
        """A durable timer: the workflow wakes after ``seconds`` (held in the broker's delayed
        set, not in a worker's memory), across any restart."""
        pos, command = self._next("timer", "sleep")
        self._cancel_point(pos, command)
        if command is None:
            command = self._new(pos, "timer", "sleep", until=self._now + _seconds(seconds))
        if command.resolved:
            return
        assert command.until is not None
        if self._now >= command.until:
            self._emit("fired", {"pos": pos})
            return
        self.waiting_until.append(command.until)
        raise self._suspend()

    def wait_signal(self, name: str, timeout: float | None = None) -> Any:
        """Wait for signal ``name`` and return its payload; ``None`` after ``timeout`` seconds.

        Each signal is delivered once, to one wait; a signal sent before the wait is kept
        until a wait for its name consumes it.
        """
        pos, command = self._next("signal", name)
        self._cancel_point(pos, command)
        if command is None:
            until = None if timeout is None else self._now + _seconds(timeout)
            command = self._new(pos, "signal", name, until=until)
        if command.resolved:
            return None if command.timed_out else self._decode(command.result)
        consumed = set(self._state.consumed_signals)
        for signal in self._signals:
            if signal.name == name and signal.id not in consumed:
                self._emit(
                    "signal", {"pos": pos, "signal_id": signal.id, "payload": signal.payload}
                )
                return self._decode(signal.payload)
        if command.until is not None:
            if self._now >= command.until:
                self._emit("timed_out", {"pos": pos})
                return None
            self.waiting_until.append(command.until)
        raise self._suspend()

    def version(self, name: str, latest: int, *, oldest: int = 1) -> int:
        """Which version of a change this workflow runs: ``latest`` for a workflow that
        reaches this point for the first time, the recorded one on replay, and ``oldest`` for
        a workflow whose log passed this point before the change was deployed.

            if wf.version("ship-with-insurance", 2) == 2:
                wf.run(insure, order_id)
        """
        if self.suspended:
            raise Suspend
        pos = self._pos
        recorded = self._state.commands.get(pos)
        if recorded is not None:
            if recorded.kind == "version" and recorded.name == name:
                self._pos += 1
                return int(recorded.version or oldest)
            return oldest  # recorded before the change: the old path, and no position taken
        self._pos += 1
        self._new(pos, "version", name, version=int(latest))
        return int(latest)

    # -- the machinery -----------------------------------------------------------------------

    def _suspend(self) -> Suspend:
        self.suspended = True
        return Suspend()

    def _next(self, kind: str, name: str) -> tuple[int, Command | None]:
        if self.suspended:
            raise Suspend
        pos = self._pos
        self._pos += 1
        recorded = self._state.commands.get(pos)
        if recorded is not None and (recorded.kind != kind or recorded.name != name):
            self.nondeterminism = NonDeterminism(
                f"workflow {self._state.workflow} ({self._state.id}) position {pos}: the log"
                f" recorded {recorded.kind} {recorded.name!r}, the code now asks for {kind}"
                f" {name!r} (a change under running workflows: gate it with wf.version)"
            )
            raise self.nondeterminism
        return pos, recorded

    def _check_if_new(self, call: Call, kind: str) -> None:
        """Check a call the log has not recorded at the next position (its arguments, its
        target's signature), before the position is taken: a refused call records nothing, and
        is refused again on replay (the position holds what came after it, not this call). A
        call the log recorded there replays its outcome unchecked, whatever a later deploy
        changed in its target's signature or the limits."""
        if self.suspended:
            return
        recorded = self._state.commands.get(self._pos)
        if recorded is None or (recorded.kind, recorded.name) != (kind, call.name):
            self._check_call(call)

    def _command(self, call: Call) -> Command:
        self._check_if_new(call, call.kind)
        pos, command = self._next(call.kind, call.name)
        self._cancel_point(pos, command)
        if command is None:
            command = self._new(
                pos,
                call.kind,
                call.name,
                job_id=self._job_id_of(call, pos),
                args=self._arguments(call),
                tier=call.tier,
            )
        return command

    def _outcome(self, command: Command) -> Any:
        if command.status == "done":
            return self._decode(command.result)
        if command.status == "failed":
            state = self._state
            cancel = state.cancel
            if (
                cancel is not None
                and state.cancel_pos is None
                and (command.finished_at or 0.0) >= float(cancel.get("at") or 0.0)
            ):
                # A step that ended failed after a cancellation was requested (a child
                # workflow the cancellation reached): the cancellation, not the failure, ends
                # the code. One that failed before it is the code's to handle (a fallback).
                self._emit("cancel_delivered", {"pos": command.pos})
                raise WorkflowCancelled(f"cancelled: {cancel.get('reason', '')}")
            raise StepFailed(command.name, command.pos, command.error or "failed")
        raise self._suspend()

    def _new(self, pos: int, kind: str, name: str, **fields: Any) -> Command:
        data = {"pos": pos, "kind": kind, "name": name}
        data.update({k: v for k, v in fields.items() if v is not None})
        self._emit("scheduled", data)
        return self._state.commands[pos]

    def _arguments(self, call: Call) -> str:
        """The call's arguments as the log keeps them (sealed for a sensitive task, and in a
        sensitive workflow).

        Raises:
            ConfigurationError: a sensitive workflow calls a task or workflow that is not
                sensitive (its message, ledger record and result would hold the workflow's
                data in clear).
        """
        if self._sensitive and not call.sensitive:
            raise ConfigurationError(
                f"{call.kind} {call.name} is not sensitive, and workflow {self._state.workflow}"
                " is: its message, record and result would hold the workflow's data in clear"
                " (declare it sensitive=True)"
            )
        try:
            text = canonical_json([list(call.args), call.kwargs])
        except PayloadError as exc:
            raise PayloadError(f"arguments of {call.kind} {call.name}: {exc}") from exc
        if (call.sensitive or self._sensitive) and self._seal is not None:
            return self._seal(text)
        return text

    def _cancel_point(self, pos: int, command: Command | None) -> None:
        """Raise the cancellation where the code waits (recorded, so a replay raises it at the
        same position).

        Not at a step or child workflow in flight: its job runs whatever the workflow does, so
        the code waits for its outcome, registers the compensation that follows it, and meets
        the cancellation at its next new command or wait; cancelling there would leave the
        step's effect without its compensation.
        """
        state = self._state
        if state.cancel_pos is not None:
            # At its position, and at any new command after it: code that caught the
            # cancellation (an ``except Exception`` around a wait) starts nothing more
            if pos == state.cancel_pos or (command is None and pos > state.cancel_pos):
                raise WorkflowCancelled(f"cancelled: {(state.cancel or {}).get('reason', '')}")
            return
        if state.cancel is None or (command is not None and command.resolved):
            return
        if command is not None and command.kind in JOB_KINDS:
            return
        self._emit("cancel_delivered", {"pos": pos})
        raise WorkflowCancelled(f"cancelled: {state.cancel.get('reason', '')}")


def decode_json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def signal_of(doc: Mapping[str, Any]) -> Signal:
    sent = doc.get("sent_at")
    if isinstance(sent, datetime):
        sent = sent.timestamp()
    return Signal(
        id=str(doc.get("signal_id", doc.get("_id"))),
        name=str(doc.get("name", "")),
        payload=doc.get("payload"),
        sent_at=float(sent) if isinstance(sent, int | float) else 0.0,
    )


# The longest a timer or a signal's timeout may be (a century): every due time is kept as a
# date, and one that is no time (NaN, infinite) or past the calendar's end left the workflow
# waiting for ever and its status unreadable.
LONGEST_WAIT_SECONDS = 100 * 366 * 86400.0


def _seconds(value: Any) -> float:
    """``value`` as seconds to wait (0 for a negative one).

    Raises:
        PayloadError: not a number, not finite, or longer than ``LONGEST_WAIT_SECONDS``.
    """
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise PayloadError(f"{value!r} is not a number of seconds") from exc
    if not seconds <= LONGEST_WAIT_SECONDS:  # (NaN and infinity included)
        raise PayloadError(
            f"a wait of {value!r} seconds: at most {LONGEST_WAIT_SECONDS:.0f} (a century)"
        )
    return max(seconds, 0.0)
