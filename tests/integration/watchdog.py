"""Fail fast when a worker dies: the test that is running fails at once, with the worker's last
log lines, instead of every later test waiting out its timeouts.

A thread polls the workers of the stacks the suite started (:class:`WatchedStack`). A worker
that exits without a test or fixture having stopped it (``stop()``, ``kill()``, or
``expect_exit()`` before sending it a signal) is a death. While a test runs (:meth:`armed`),
the thread sends the main thread a signal whose handler raises :class:`WorkerDied`: that
interrupts whatever the test waits on (``result.get``, ``wait_for``, a sleep, a socket read). A
death outside a running test is reported by the fixture after it (see ``conftest.py``).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from types import FrameType
from typing import Any

from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess

TAIL_LINES = 40


class WorkerDied(BaseException):
    """A worker of the suite died during this test.

    A BaseException (as KeyboardInterrupt is), so that neither the test's ``except Exception``
    nor hypothesis (which would go on to shrink, each example then waiting on a dead worker)
    catches it; pytest reports it as the test's failure.
    """


class WatchedWorker(WorkerProcess):
    """A worker that knows whether its exit was asked for."""

    exit_expected = False

    def expect_exit(self) -> None:
        """Say that this worker is about to exit on purpose (before signalling it directly)."""
        self.exit_expected = True

    def stop(self, timeout: float | None = None) -> None:
        self.expect_exit()
        super().stop(timeout)

    def kill(self) -> None:
        self.expect_exit()
        super().kill()


class WatchedStack(EmbeddedStack):
    """An embedded stack whose workers are :class:`WatchedWorker` s."""

    def start_worker(self, queues: str, *, wait: bool = True, **options: Any) -> WorkerProcess:
        started = super().start_worker(queues, wait=False, **options)
        worker = WatchedWorker(**{f.name: getattr(started, f.name) for f in fields(started)})
        self.workers[self.workers.index(started)] = worker
        if wait:
            self.wait_ready(worker)
        return worker

    def stop(self) -> None:
        """End everything as :class:`EmbeddedStack` does, but the workers and the ledger with
        SIGKILL: nothing reads a test stack's workers or data afterwards, a worker's warm
        shutdown takes about 2.5 s (a test stack's teardown once waited out hundreds of them),
        and SecantusDB takes 2-3 s to exit on SIGTERM. A test that stops a worker or its ledger
        on purpose (a warm shutdown's promises: test_worker_stops.py) calls ``stop()`` on it
        itself."""
        for worker in self.workers:
            if isinstance(worker, WatchedWorker):
                worker.expect_exit()
        for worker in self.workers:
            if worker.alive():  # (one a test killed is reaped: its pid may be another's now)
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    worker.kill()  # (its process group: the pool with it)
        self.workers.clear()
        ledger, self.ledger = self.ledger, None
        try:
            super().stop()
        finally:
            if ledger is not None and ledger.alive():
                ledger.kill()
            self.ledger = ledger


@dataclass(frozen=True)
class Death:
    name: str
    pid: int
    returncode: int | None
    log_tail: str

    def describe(self) -> str:
        code = self.returncode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return (
            f"worker {self.name} (pid {self.pid}) died ({how}); its last log lines:\n"
            f"{self.log_tail}"
        )


class WorkerWatch:
    """The watchdog thread, and the signal handler that fails the running test."""

    SIGNAL = signal.SIGUSR2

    def __init__(self, interval_seconds: float = 0.2) -> None:
        self._interval = interval_seconds
        self._stacks: list[EmbeddedStack] = []
        self._lock = threading.Lock()
        self._seen: set[int] = set()  # pids of workers found dead (reported once)
        self._pending: list[Death] = []  # unexpected deaths not yet reported to a test
        self._armed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, stack: EmbeddedStack) -> None:
        with self._lock:
            if stack not in self._stacks:
                self._stacks.append(stack)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="worker-watch", daemon=True)
            self._thread.start()

    def unwatch(self, stack: EmbeddedStack) -> None:
        with self._lock:
            if stack in self._stacks:
                self._stacks.remove(stack)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)

    def take_pending(self) -> list[Death]:
        """The deaths no test was told about (they happened outside a test, or were caught)."""
        self.poll()
        with self._lock:
            pending, self._pending = self._pending, []
        return pending

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """While the block runs (in the main thread), a worker's death raises WorkerDied in it."""
        previous = signal.signal(self.SIGNAL, self._on_signal)
        self._armed = True
        try:
            self.poll()
            self._raise_pending()  # a death noticed before the test started
            yield
        finally:
            self._armed = False
            signal.signal(self.SIGNAL, previous)

    def poll(self) -> list[Death]:
        """Look at every watched worker now; the new unexpected deaths."""
        found: list[Death] = []
        with self._lock:
            workers = [worker for stack in self._stacks for worker in list(stack.workers)]
            for worker in workers:
                if worker.pid in self._seen or worker.alive():
                    continue
                self._seen.add(worker.pid)
                if getattr(worker, "exit_expected", False):
                    continue
                death = Death(
                    worker.name, worker.pid, worker.process.returncode, _tail(worker.log_path)
                )
                self._pending.append(death)
                found.append(death)
        return found

    def _run(self) -> None:
        main = threading.main_thread().ident
        while not self._stop.wait(self._interval):
            if self.poll() and self._armed and main is not None:
                signal.pthread_kill(main, self.SIGNAL)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        __tracebackhide__ = True  # the test's traceback ends where it was waiting
        if self._armed:
            self._raise_pending()

    def _raise_pending(self) -> None:
        __tracebackhide__ = True
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            raise WorkerDied("\n\n".join(death.describe() for death in pending))


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


WATCH = WorkerWatch()
