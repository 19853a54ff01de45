"""Long-lived jobs: heartbeats, checkpoints, steps and checkpointed batch reads.

While a body runs, a heartbeat thread extends its lease every third of the lease, so a long
job keeps its claim and a dead worker's lease ends within one lease. The same thread watches
for the worker's warm shutdown (a flag file its parent writes on SIGTERM), so the body can
checkpoint and hand its message back (:meth:`Execution.should_stop`, :class:`Interrupted`).

Every write is fenced: a worker whose lease was taken over cannot write a checkpoint or a
step, and learns it (:class:`~celery_ledger.errors.LeaseLost`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from bson import json_util
from pymongo.client_session import ClientSession

from . import tracecontext
from .crypto import Sealer
from .errors import CircuitOpen, ConfigurationError, Interrupted, LeaseLost, LedgerError
from .ledger.ports import ProgressStore
from .locks import ForkSafeLock, process_generation
from .policies.retry import RETRYABLE_BY_DEFAULT

logger = logging.getLogger("celery_ledger.progress")

T = TypeVar("T")
_STEP_NAME = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


class _StepNotRecorded(Exception):
    """Aborts an atomic step's transaction whose step record did not match."""


@functools.lru_cache(maxsize=8)
def shutdown_flag(parent_pid: int) -> Path:
    """The file a worker's main process creates when a warm shutdown begins. Kept per pid:
    every task's heartbeat asks for it, and building the path cost a pool process about 2% of
    its CPU."""
    return Path(tempfile.gettempdir()) / f"celery-ledger-shutdown-{parent_pid}"


# The worker's main process, recorded there at its start (its prefork children inherit it). A
# body runs in that process on a threads, gevent, eventlet or solo pool, in a child of it on
# prefork: its parent's pid names the right flag only in the second case.
_main_pid: int | None = None


def serve_shutdown_flag() -> Path:
    """In a worker's main process at its start: the flag its warm shutdown will create."""
    global _main_pid
    _main_pid = os.getpid()
    return shutdown_flag(_main_pid)


def watched_shutdown_flag() -> Path:
    """The flag a running body watches: its worker's main process's (the parent's pid, where
    no worker recorded one: a pool process made otherwise)."""
    return shutdown_flag(_main_pid if _main_pid is not None else os.getppid())


class Heartbeat:
    """Extends one lease while the body runs, from the process's heartbeat thread.

    One daemon thread per process serves every running body (:class:`_Ticker`): starting a
    thread per task would cost more than a millisecond of every task's time.
    """

    def __init__(
        self,
        ledger: ProgressStore,
        record_id: str,
        fence: int,
        *,
        lease_seconds: float,
        interval_seconds: float,
        also: Callable[[], None] | None = None,
    ) -> None:
        self._also = also  # beats with the lease (a tenant's slot): must not raise
        self._ledger = ledger
        self._record_id = record_id
        self._fence = fence
        self._lease_seconds = lease_seconds
        self.interval = interval_seconds
        self.due = 0.0
        self._flag = watched_shutdown_flag()
        self._lock = ForkSafeLock()  # a tick in progress finishes before stop() returns
        self._stopped = False
        self.lost = False
        self.shutdown_requested = False

    def start(self) -> Heartbeat:
        self.due = time.monotonic() + self.interval
        _TICKER.add(self)
        return self

    def stop(self) -> None:
        _TICKER.remove(self)
        with self._lock:
            self._stopped = True

    def beat(self) -> None:
        try:
            self._ledger.heartbeat(self._record_id, self._fence, self._lease_seconds)
        except LeaseLost:
            self.lost = True
            raise
        finally:
            # After the lease (it must never wait behind this), and whether or not the ledger
            # answered: the body runs on through a ledger outage, and keeps its tenant's slot
            if self._also is not None and not self.lost:
                self._also()

    def tick(self, now: float) -> None:
        """Called by the ticker at least every second: watch for shutdown, beat when due."""
        with self._lock:
            if self._stopped:
                return
            if not self.shutdown_requested and self._flag.exists():
                self.shutdown_requested = True
                logger.warning(
                    "worker shutting down: %s should checkpoint and stop", self._record_id
                )
            if now < self.due:
                return
            self.due = now + self.interval
            if self.lost:
                return
            try:
                self.beat()
            except LeaseLost:
                logger.warning("lease on %s lost: a newer claim took over", self._record_id)
            except LedgerError as exc:  # ledger down: try again next beat, the lease may hold
                logger.warning("heartbeat of %s failed: %s", self._record_id, exc)


class _Ticker:
    """The process's heartbeat thread: ticks every started :class:`Heartbeat` when due, and
    each at least once a second (the shutdown flag). Started on first use in each process."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        self._beats: set[Heartbeat] = set()
        self._wake = threading.Event()
        self._generation = -1
        # When the thread's current wait ends: a heartbeat due later needs no wake-up. Waking
        # it for every new attempt cost each task a thread switch (measured in the pool).
        self._wakes_at = 0.0

    def add(self, heartbeat: Heartbeat) -> None:
        with self._lock:
            generation = process_generation()
            if self._generation != generation:  # none yet, or a forked child
                self._generation = generation
                self._beats = set()
                self._wake = threading.Event()
                thread = threading.Thread(target=self._run, name="ledger-heartbeat", daemon=True)
                self._wakes_at = 0.0
                thread.start()
            self._beats.add(heartbeat)
            # Compared under the lock the thread sets it under: either the thread's next
            # reading of the beats includes this one, or its wait is known here.
            early = heartbeat.due < self._wakes_at
        if early:  # a short interval, due before the current wait ends
            self._wake.set()

    def remove(self, heartbeat: Heartbeat) -> None:
        with self._lock:
            self._beats.discard(heartbeat)

    def _run(self) -> None:
        while True:
            try:
                self._tick_due()
            except Exception:  # one bad tick must never stop every heartbeat of the process
                logger.exception("heartbeat thread: a tick failed; going on")
                time.sleep(1.0)

    def _tick_due(self) -> None:
        with self._lock:
            beats = list(self._beats)
            now = time.monotonic()
            wait = min([1.0, *(b.due - now for b in beats)])
            self._wakes_at = now + max(wait, 0.0)
        if wait > 0 and self._wake.wait(wait):
            self._wake.clear()
            return
        now = time.monotonic()
        for heartbeat in beats:
            heartbeat.tick(now)


_TICKER = _Ticker()


class Execution:
    """What a running LedgerTask body can reach through ``self`` (one per attempt)."""

    def __init__(
        self,
        ledger: ProgressStore,
        record_id: str,
        fence: int,
        heartbeat: Heartbeat,
        lease_seconds: float,
        *,
        sealer: Sealer | None = None,
        time_limit: float | None = None,
        on_skip: Callable[[str, str], None] | None = None,
        outages: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.ledger = ledger
        # The platform's own outages (the broker refusing a publish, a full tier): passing, and
        # no sign of a step's dependency, so they never skip an optional step (a skip is for
        # good: the step's effect would be lost); the job is retried instead.
        self.outages = outages
        self.record_id = record_id
        self.fence = fence
        self.heartbeat = heartbeat
        self.lease_seconds = lease_seconds
        # The attempt's time budget (its soft time limit), for optional steps that need more
        # than is left of it.
        self.deadline = None if time_limit is None else time.monotonic() + time_limit
        self.on_skip = on_skip  # (step, reason): the guard tells the observers
        # A sensitive task's checkpoint and step results are stored sealed (they hold what its
        # arguments hold); they are opened here, in the worker's memory, only.
        self.sealer = sealer
        self._progress: dict[str, Any] | None = None
        # The atomic steps whose result this attempt used: its success is written only while
        # the record still has them (see Ledger.complete).
        self.atomic_steps: list[str] = []

    @property
    def progress(self) -> dict[str, Any]:
        """Checkpoint, steps and artefacts stored by earlier attempts (read once, lazily)."""
        if self._progress is None:
            self._progress = self.opened(self.ledger.load_progress(self.record_id))
        return self._progress

    def opened(self, progress: dict[str, Any]) -> dict[str, Any]:
        """``progress`` as stored, with sealed values opened (plain ones pass through)."""
        open_text = self.ledger.open_text
        checkpoint = progress.get("checkpoint")
        if isinstance(checkpoint, str):
            progress["checkpoint"] = json_util.loads(open_text(checkpoint))
        for saved in (progress.get("steps") or {}).values():
            if isinstance(saved.get("result"), str):
                saved["result"] = open_text(saved["result"])
        return progress

    def stored(self, text: str) -> str:
        """``text`` as this attempt stores it: sealed for a sensitive task."""
        return self.sealer.seal(text) if self.sealer is not None else text

    def checkpoint(self, state: Mapping[str, Any]) -> None:
        state = dict(state)  # BSON values (ObjectId cursors, datetimes) are fine here
        kept: dict[str, Any] | str = state
        if self.sealer is not None:  # extended JSON keeps those BSON types across the seal
            kept = self.stored(
                json_util.dumps(state, json_options=json_util.CANONICAL_JSON_OPTIONS)
            )
        self._fenced(
            lambda: self.ledger.save_checkpoint(
                self.record_id, self.fence, kept, self.lease_seconds
            )
        )
        self.progress["checkpoint"] = state

    def used_atomic(self, name: str) -> None:
        """The attempt's result now relies on atomic step ``name`` (recorded, by this attempt
        or an earlier one); a step whose transaction failed is not one of them."""
        if name not in self.atomic_steps:
            self.atomic_steps.append(name)

    def remaining_seconds(self) -> float | None:
        """What is left of the attempt's time budget (``None``: no soft time limit)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def step(
        self,
        name: str,
        *,
        optional: bool = False,
        needs_seconds: float = 0.0,
        default: Any = None,
        skip_on: tuple[type[BaseException], ...] = (),
    ) -> Step:
        if not _STEP_NAME.match(name):
            raise ConfigurationError(f"step name {name!r}: use letters, digits, '_' or '-'")
        if (needs_seconds or skip_on) and not optional:
            raise ConfigurationError(
                f"step {name!r}: needs_seconds and skip_on are for optional steps"
            )
        return Step(
            self,
            name,
            optional=optional,
            needs_seconds=needs_seconds,
            default=default,
            skip_on=skip_on,
        )

    def should_stop(self) -> bool:
        return self.heartbeat.shutdown_requested

    def register_artefact(self, path: str) -> None:
        self._fenced(lambda: self.ledger.add_artefact(self.record_id, self.fence, path))
        self.progress.setdefault("artefacts", []).append(path)

    def _fenced(self, write: Callable[[], None]) -> None:
        try:
            write()
        except LeaseLost:
            self.heartbeat.lost = True
            raise


class Step:
    """A sub-step that runs once per job: ``with self.step("x") as s`` or ``@self.step("x")``.

    A completed step's result is kept in the record; a later attempt (after a crash, a retry or
    a replay) skips the step and gets the same result.
    """

    def __init__(
        self,
        execution: Execution,
        name: str,
        *,
        optional: bool = False,
        needs_seconds: float = 0.0,
        default: Any = None,
        skip_on: tuple[type[BaseException], ...] = (),
    ) -> None:
        self._execution = execution
        self.name = name
        self.optional = optional
        self.skip_on = skip_on
        self.needs_seconds = needs_seconds
        self.default = default
        saved = execution.progress.get("steps", {}).get(name)
        self.done = saved is not None
        self.result: Any = json.loads(saved["result"]) if saved is not None else None
        # Why an optional step was skipped (by this attempt or an earlier one), else "".
        self.skipped: str = str(saved.get("skipped") or "") if saved is not None else ""
        self._span = contextlib.ExitStack()  # the span of a with block, while it runs

    def __enter__(self) -> Step:
        if self.needs_seconds:
            # A with block cannot be skipped before it runs: the time budget needs .run(func).
            raise ConfigurationError(
                f"step {self.name!r}: needs_seconds works with .run(func) or the decorator,"
                " not a with block"
            )
        # The block is the step's span, as .run(func) is (closed by __exit__).
        self._span = contextlib.ExitStack()
        self._span.enter_context(tracecontext.span(f"step {self.name}", **self._attributes()))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        handled = False
        try:
            if exc_type is None:
                if not self.done:
                    self.complete(self.result)
            elif self.optional and not self.done and exc is not None and self._down(exc):
                self.skip(_why(exc))
                handled = True  # an optional step's dependency being down does not fail the job
        finally:
            span, self._span = self._span, contextlib.ExitStack()
            if handled:
                span.close()
            else:
                span.__exit__(exc_type, exc, tb)
        return handled

    def _down(self, exc: BaseException) -> bool:
        if isinstance(exc, self._execution.outages) and not isinstance(exc, self.skip_on):
            return False
        return _dependency_down(exc, self.skip_on)

    def _short_of_time(self) -> str:
        left = self._execution.remaining_seconds()
        if self.needs_seconds and left is not None and left < self.needs_seconds:
            return f"time budget: {max(left, 0.0):.1f}s left, the step needs {self.needs_seconds}s"
        return ""

    def skip(self, reason: str) -> None:
        """Record this optional step as skipped (``reason``), its result the step's default."""
        execution = self._execution
        result_json = json.dumps(self.default)
        execution._fenced(
            lambda: execution.ledger.save_step(
                execution.record_id,
                execution.fence,
                self.name,
                execution.stored(result_json),
                skipped=reason,
            )
        )
        execution.progress.setdefault("steps", {})[self.name] = {
            "result": result_json,
            "skipped": reason,
        }
        self.done, self.result, self.skipped = True, self.default, reason
        logger.info("%s: optional step %s skipped: %s", execution.record_id, self.name, reason)
        if execution.on_skip is not None:
            execution.on_skip(self.name, reason)

    def complete(self, result: Any = None) -> None:
        """Record the step as done with ``result`` (JSON)."""
        result_json = json.dumps(result)
        execution = self._execution
        execution._fenced(
            lambda: execution.ledger.save_step(
                execution.record_id, execution.fence, self.name, execution.stored(result_json)
            )
        )
        execution.progress.setdefault("steps", {})[self.name] = {"result": result_json}
        self.done, self.result = True, result

    def run(self, func: Callable[[], T]) -> T:
        """Run ``func`` unless the step is done; either way return its (recorded) result."""
        with tracecontext.span(f"step {self.name}", **self._attributes()):
            if not self.done and self.optional:
                short = self._short_of_time()
                if short:
                    self.skip(short)
                else:
                    try:
                        self.complete(func())
                    except Exception as exc:
                        if not self._down(exc):
                            raise
                        self.skip(_why(exc))
            elif not self.done:
                self.complete(func())
            return self.result  # type: ignore[no-any-return]

    def _attributes(self) -> dict[str, Any]:
        return {
            "ledger.step": self.name,
            "ledger.step.recorded_before": self.done,
            "ledger.step.optional": self.optional,
        }

    def atomic(self, func: Callable[[ClientSession], T]) -> T:
        """Run ``func(session)`` and record the step in one MongoDB transaction: exactly once.

        ``func`` makes its writes with ``session=session`` on collections of the ledger's
        deployment (``session.client[db][collection]``). They commit together with the step
        record, under this attempt's fence: a worker that dies before the commit leaves no
        trace, and a later attempt skips the step and gets the same result. ``func`` may run
        more than once within one attempt when a transient error aborts the transaction
        (every run but the committed one is rolled back), so it must not act outside it.
        """
        with tracecontext.span(f"step {self.name}", atomic=True, **self._attributes()):
            return self._atomic(func)

    def _atomic(self, func: Callable[[ClientSession], T]) -> T:
        execution = self._execution
        if self.done:
            execution.used_atomic(self.name)
            return self.result  # type: ignore[no-any-return]

        def in_transaction(session: ClientSession) -> T:
            result = func(session)
            recorded = execution.ledger.save_step_in(
                session,
                execution.record_id,
                execution.fence,
                self.name,
                execution.stored(json.dumps(result)),
            )
            if not recorded:
                raise _StepNotRecorded  # aborts: nothing of this run is kept
            return result

        try:
            result = execution.ledger.run_transaction(in_transaction)
        except _StepNotRecorded:
            # Recorded by a commit of ours whose reply was lost, or the lease was taken over.
            progress = execution.opened(execution.ledger.load_progress(execution.record_id))
            saved = progress.get("steps", {})
            if self.name not in saved:
                execution.heartbeat.lost = True
                raise LeaseLost(execution.record_id, execution.fence) from None
            self.done, self.result = True, json.loads(saved[self.name]["result"])
            execution.used_atomic(self.name)
            return self.result  # type: ignore[no-any-return]
        execution.progress.setdefault("steps", {})[self.name] = {"result": json.dumps(result)}
        self.done, self.result = True, result
        execution.used_atomic(self.name)
        return result

    def __call__(self, func: Callable[[], T]) -> Callable[[], T]:
        """Decorator form: the decorated function runs at most once per job."""
        return lambda: self.run(func)


# What says a dependency is down (the errors a task retries by default, an open circuit, a
# deadline passed: DeadlineExceeded is a TimeoutError).
DEPENDENCY_DOWN: tuple[type[BaseException], ...] = (CircuitOpen, *RETRYABLE_BY_DEFAULT)


def _dependency_down(exc: BaseException, also: tuple[type[BaseException], ...] = ()) -> bool:
    """Whether an optional step's failure means its dependency is unavailable (skip it), not
    that the step is wrong (fail as any step would): an open circuit, a connection refused or
    lost, a timeout, or one of the step's own ``skip_on`` errors."""
    return isinstance(exc, DEPENDENCY_DOWN + also)


def _why(exc: BaseException) -> str:
    # The error's type, never its text (it may quote a sensitive task's arguments).
    if isinstance(exc, CircuitOpen):
        return f"dependency down: circuit {exc.name!r} open"
    return f"dependency down: {type(exc).__name__}"


def batches(
    execution: Execution,
    collection: Any,
    *,
    name: str = "backfill",
    batch_size: int = 500,
    query: Mapping[str, Any] | None = None,
    projection: Mapping[str, Any] | None = None,
) -> Iterator[list[dict[str, Any]]]:
    """Read ``collection`` in ``_id`` order, ``batch_size`` documents per query, resuming
    after the last batch this job finished (its ``_id`` is checkpointed under ``name``).

    A batch counts as finished when the caller asks for the next one; on a warm shutdown the
    generator raises :class:`Interrupted` after checkpointing.
    """
    if batch_size < 1:
        raise ConfigurationError("batch_size must be at least 1")
    cursors = dict((execution.progress.get("checkpoint") or {}).get("cursors", {}))
    last_id = cursors.get(name)
    while True:
        flt = dict(query or {})
        if last_id is not None:
            flt["_id"] = {"$gt": last_id}
        batch = list(collection.find(flt, projection).sort("_id", 1).limit(batch_size))
        if not batch:
            return
        yield batch
        last_id = batch[-1]["_id"]
        cursors[name] = last_id
        state = dict(execution.progress.get("checkpoint") or {})
        state["cursors"] = cursors
        execution.checkpoint(state)
        if execution.should_stop():
            raise Interrupted(f"shutdown: {name} stopped after _id {last_id!r}")
