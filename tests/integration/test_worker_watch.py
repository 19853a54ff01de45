"""A worker that dies fails the running test at once, with its last log lines; the session's
worker is started again for the tests after it (tests/integration/watchdog.py, conftest.py)."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any

import pytest

from .conftest import SESSION_WORKER, revive_session_worker
from .helpers import wait_for
from .watchdog import WorkerDied


def _kill_later(pid: int, seconds: float = 1.0) -> None:
    """SIGKILL the worker's process group: a death no test asked for."""
    threading.Timer(seconds, lambda: os.killpg(pid, signal.SIGKILL)).start()


def test_a_test_blocked_on_a_result_fails_within_seconds_when_its_worker_dies(
    stack: Any, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import long_sleeper

    # Given a worker of its own queue running a 30 s job, and a test waiting for the result
    queue = f"doomed-{uuid.uuid4().hex[:6]}"
    doomed = stack.start_worker(queue, concurrency=1, name=f"{queue}@127.0.0.1")
    try:
        result = long_sleeper.apply_async((token, 30.0), queue=queue)
        # When the worker dies
        _kill_later(doomed.pid)
        started = time.monotonic()
        with pytest.raises(WorkerDied) as died:
            result.get(timeout=60)
        # Then the wait ends within seconds, with the worker's name and last log lines
        assert time.monotonic() - started < 5
        assert doomed.name in str(died.value)
        assert "killed by signal 9" in str(died.value)
        assert "ready" in str(died.value)  # Celery's start-up line, from the worker's log
    finally:
        doomed.expect_exit()
        stack.workers.remove(doomed)


def test_the_session_worker_is_started_again_after_it_died(
    stack: Any, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import record

    # Given the session's worker dies while a test waits on something
    main = stack.workers[0]
    assert main.name == SESSION_WORKER
    _kill_later(main.pid)
    started = time.monotonic()
    with pytest.raises(WorkerDied, match=SESSION_WORKER):
        wait_for(lambda: False, timeout=60, what="a condition the dead worker would bring")
    assert time.monotonic() - started < 5
    # When the suite moves on to the next test (the fixture after each test does this)
    assert revive_session_worker()
    # Then a new session worker runs tasks
    assert stack.workers[0].name == SESSION_WORKER and stack.workers[0].pid != main.pid
    assert record.delay(token).get(timeout=30)["token"] == token
