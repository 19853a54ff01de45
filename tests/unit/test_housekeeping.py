"""The workers' housekeeping: a slow or stuck job never holds back another lane's jobs."""

from __future__ import annotations

import threading

from celery_ledger.worker import Housekeeping


def test_a_stuck_upkeep_job_does_not_hold_back_due_deliveries() -> None:
    # Given an upkeep job stuck in a call (a ledger outage waits out its server selection)
    release = threading.Event()
    stuck = threading.Event()

    def ledger_upkeep() -> None:
        stuck.set()
        release.wait(30)

    published = threading.Semaphore(0)
    keeping = Housekeeping(
        {"deliveries": [published.release], "upkeep": [ledger_upkeep], "empty": []},
        interval=0.01,
    )
    keeping.start()
    try:
        assert stuck.wait(10)
        # Then due deliveries are still published, tick after tick, while it is stuck
        for _ in range(5):
            assert published.acquire(timeout=10)
    finally:
        release.set()
        keeping.stop()
    assert not any(t.is_alive() for t in keeping._threads)


def test_a_failing_job_does_not_stop_its_lane() -> None:
    calls: list[str] = []
    ran_after = threading.Event()

    def broken() -> None:
        calls.append("broken")
        raise RuntimeError("broker away")

    def after() -> None:
        calls.append("after")
        if calls.count("after") >= 3:
            ran_after.set()

    keeping = Housekeeping({"upkeep": [broken, after]}, interval=0.01)
    keeping.start()
    try:
        assert ran_after.wait(10)
    finally:
        keeping.stop()
    assert calls.count("broken") >= 3
