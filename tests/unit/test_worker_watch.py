"""tests/integration/watchdog.py: a worker that dies interrupts the running test at once.

The workers here are ``sleep`` processes: no servers needed.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.integration.watchdog import WorkerDied, WorkerWatch


class FakeWorker(SimpleNamespace):
    def alive(self) -> bool:
        return bool(self.process.poll() is None)


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[FakeWorker]:
    log = tmp_path / "worker.log"
    log.write_text("[INFO] worker ready\n[CRITICAL] Unrecoverable error: OverflowError\n")
    process = subprocess.Popen(["sleep", "60"])
    yield FakeWorker(name="doomed@127.0.0.1", pid=process.pid, process=process, log_path=log)
    process.kill()
    process.wait()


@pytest.fixture
def watch() -> Iterator[WorkerWatch]:
    running = WorkerWatch(interval_seconds=0.05)
    yield running
    running.close()


BLOCKING_CALLS: dict[str, Callable[[], Any]] = {
    "sleep": lambda: time.sleep(30),
    "event wait": lambda: threading.Event().wait(30),
    "queue get": lambda: queue.Queue().get(timeout=30),
    "subprocess wait": lambda: subprocess.run(["sleep", "30"], check=False),
}


@pytest.mark.parametrize("block", BLOCKING_CALLS.values(), ids=BLOCKING_CALLS.keys())
def test_a_death_interrupts_the_blocked_test_at_once_with_the_log(
    watch: WorkerWatch, worker: FakeWorker, block: Callable[[], Any]
) -> None:
    # Given a watched worker, and a test blocked for 30 s
    watch.watch(SimpleNamespace(workers=[worker]))  # type: ignore[arg-type]
    threading.Timer(0.5, worker.process.kill).start()  # When the worker dies after 0.5 s
    started = time.monotonic()
    with pytest.raises(WorkerDied) as died, watch.armed():
        block()
    # Then the test fails within a second or so, with the worker's name and last log lines
    assert time.monotonic() - started < 3
    assert "doomed@127.0.0.1" in str(died.value)
    assert "killed by signal 9" in str(died.value)
    assert "Unrecoverable error: OverflowError" in str(died.value)


def test_a_worker_stopped_on_purpose_is_no_death(watch: WorkerWatch, worker: FakeWorker) -> None:
    watch.watch(SimpleNamespace(workers=[worker]))  # type: ignore[arg-type]
    worker.exit_expected = True  # WatchedWorker.stop(), kill() and expect_exit() set this
    worker.process.kill()
    worker.process.wait()
    with watch.armed():
        time.sleep(0.3)
    assert watch.take_pending() == []


def test_a_death_outside_a_test_is_kept_for_the_fixture(
    watch: WorkerWatch, worker: FakeWorker
) -> None:
    watch.watch(SimpleNamespace(workers=[worker]))  # type: ignore[arg-type]
    worker.process.kill()
    worker.process.wait()
    time.sleep(0.3)  # not armed: nothing is raised
    pending = watch.take_pending()
    assert [death.name for death in pending] == ["doomed@127.0.0.1"]
    assert watch.take_pending() == []  # reported once
