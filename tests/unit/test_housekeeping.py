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


def test_the_stop_hooks_run_from_the_workers_stop_and_a_failing_one_stops_nothing() -> None:
    # Given housekeeping with a lane mid-job and two stop hooks, the first failing
    in_job = threading.Event()
    finish = threading.Event()
    stopped: list[str] = []

    def job() -> None:
        in_job.set()
        finish.wait(10)

    def broken(timeout: float) -> None:
        stopped.append("broken")
        raise RuntimeError("ledger away")

    def hook(timeout: float) -> None:
        stopped.append("hook")
        finish.set()  # a watcher gives its lease up, its tick ends

    keeping = Housekeeping({"triggers": [job]}, interval=0.01, on_stop=(broken, hook))
    keeping.start()
    assert in_job.wait(10) and not stopped  # nothing at start, nor from a signal handler
    # When the worker stops
    keeping.stop(timeout=10)
    # Then every hook ran, in order, and the lanes ended
    assert stopped == ["broken", "hook"]
    assert not any(t.is_alive() for t in keeping._threads)


def test_a_cold_stop_gives_its_hooks_only_what_is_left_of_its_second() -> None:
    # Given a stop hook stuck behind an outage (it uses all the time it is given)
    given: list[float] = []

    def stuck(timeout: float) -> None:
        given.append(timeout)
        threading.Event().wait(timeout)

    keeping = Housekeeping({}, interval=0.01, on_stop=(stuck, stuck))
    # When the worker stops cold
    keeping.terminate()
    # Then the first hook had the cold stop's second, not a warm stop's patience, and the
    # second what was left of it
    assert 0.9 < given[0] <= 1.0
    assert given[1] < 0.1
