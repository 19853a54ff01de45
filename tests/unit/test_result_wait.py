"""``AsyncResult.get(timeout=...)`` against the ledger: the timeout holds, whatever the ledger
does (Celery counts only its own sleeps between polls, and retries a read while the ledger is
away with backoffs of up to 10 s: a ``get(timeout=3)`` took 15 s)."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import AsyncResult

import celery_ledger.backend as backend_module
from celery_ledger import LedgerCelery, LedgerUnavailable, Settings, create_app

UNREACHABLE = {"broker_url": "redis://127.0.0.1:1/0", "mongo_uri": "mongodb://127.0.0.1:1/"}


class Clock:
    """Time that passes only when slept through, or when a read takes it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> tuple[LedgerCelery, Clock, list[float]]:
    made = create_app("waits", settings=Settings(**UNREACHABLE), set_as_current=False)
    clock = Clock()
    monkeypatch.setattr(backend_module, "time", clock)
    reads: list[float] = []
    return made, clock, reads


def test_a_get_with_the_ledger_away_ends_at_its_timeout_saying_so(app: Any) -> None:
    made, clock, reads = app
    backend = made.backend

    def away(task_id: str) -> dict[str, Any]:
        reads.append(clock.now)
        clock.now += 0.5  # (a read that waits for the server before it fails)
        raise LedgerUnavailable("ledger unreachable")

    backend._get_task_meta_for = away
    started = clock.now
    with pytest.raises(CeleryTimeout, match="the ledger is away"):
        AsyncResult("job-1", app=made).get(timeout=3)
    # it retried while there was time, and stopped at the deadline (one read's length past it)
    assert len(reads) > 1
    assert 3.0 <= clock.now - started <= 3.5


def test_a_get_of_a_job_that_stays_pending_ends_at_its_timeout_with_slow_reads(app: Any) -> None:
    made, clock, reads = app

    def slow(task_id: str) -> dict[str, Any]:
        reads.append(clock.now)
        clock.now += 0.4  # (Celery did not count this: 3 s of timeout became 3 s of sleeps)
        return {"status": "PENDING", "result": None, "task_id": task_id}

    made.backend._get_task_meta_for = slow
    started = clock.now
    with pytest.raises(CeleryTimeout, match="timed out"):
        AsyncResult("job-2", app=made).get(timeout=3, interval=0.5)
    assert 3.0 <= clock.now - started <= 3.4


def test_without_a_timeout_a_read_is_retried_while_the_ledger_is_away(app: Any) -> None:
    made, clock, reads = app

    def back_after_three(task_id: str) -> dict[str, Any]:
        reads.append(clock.now)
        if len(reads) <= 3:
            raise LedgerUnavailable("ledger unreachable")
        return {"status": "SUCCESS", "result": 7, "task_id": task_id}

    made.backend._get_task_meta_for = back_after_three
    assert AsyncResult("job-3", app=made).get() == 7
    assert len(reads) == 4
