"""The process's heartbeat thread: every lease is extended when it is due, however the
heartbeats of the process's bodies start and stop around each other."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import pytest

from celery_ledger.errors import LeaseLost, LedgerUnavailable
from celery_ledger.ledger.store import Ledger
from celery_ledger.progress import _TICKER, Heartbeat


class _Beats:
    """Stands in for the ledger: records when each record's lease was extended."""

    def __init__(self) -> None:
        self.at: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def heartbeat(self, record_id: str, fence: int, lease_seconds: float | None = None) -> None:
        with self._lock:
            self.at.setdefault(record_id, []).append(time.monotonic())


def _heartbeat(beats: _Beats, record_id: str, interval: float) -> Heartbeat:
    return Heartbeat(
        cast(Ledger, cast(Any, beats)),
        record_id,
        1,
        lease_seconds=interval * 3,
        interval_seconds=interval,
    )


def test_a_short_interval_started_while_the_thread_waits_on_a_long_one_beats_on_time() -> None:
    beats = _Beats()
    long = _heartbeat(beats, "long", 30.0).start()
    # Start the short one early in the thread's longest wait (a second: the shutdown watch),
    # whatever the machine's load did to the steps before.
    deadline = time.monotonic() + 10
    while _TICKER._wakes_at - time.monotonic() < 0.8 and time.monotonic() < deadline:
        time.sleep(0.005)
    short = _heartbeat(beats, "short", 0.1)
    started = time.monotonic()
    short.start()
    try:
        deadline = started + 5
        while len(beats.at.get("short", [])) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert beats.at.get("short"), "the short heartbeat never beat"
        first = beats.at["short"][0] - started
        # Due 0.1 s after it started, and not left until the thread's wait (0.8 s or more
        # still to go) ends: that wait is cut short for it.
        assert first < 0.6, f"first beat {first:.2f} s after start"
        assert len(beats.at["short"]) >= 3
        assert "long" not in beats.at  # not due: never extended early
    finally:
        short.stop()
        long.stop()


def test_a_stopped_heartbeat_extends_nothing_more_and_the_others_go_on() -> None:
    beats = _Beats()
    first = _heartbeat(beats, "first", 0.05).start()
    second = _heartbeat(beats, "second", 0.05).start()
    try:
        deadline = time.monotonic() + 5
        while len(beats.at.get("first", [])) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        first.stop()
        stopped_with = len(beats.at["first"])
        before = len(beats.at.get("second", []))
        time.sleep(0.5)
        assert len(beats.at["first"]) == stopped_with
        assert len(beats.at["second"]) > before + 2
    finally:
        first.stop()
        second.stop()


class _Ledger:
    """A ledger whose heartbeat raises ``error`` (None: answers)."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def heartbeat(self, record_id: str, fence: int, lease_seconds: float | None = None) -> None:
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize(
    ("error", "kept"),
    [
        (None, True),
        (LedgerUnavailable("down"), True),  # the body runs on through an outage: so does its slot
        (LeaseLost("r", 1), False),  # a newer claim runs the job: the slot is not this one's
    ],
)
def test_a_beat_keeps_the_tenants_slot_unless_the_lease_was_lost(
    error: Exception | None, kept: bool
) -> None:
    slot: list[str] = []
    heartbeat = Heartbeat(
        cast(Ledger, cast(Any, _Ledger(error))),
        "r",
        1,
        lease_seconds=30,
        interval_seconds=10,
        also=lambda: slot.append("kept"),
    )
    heartbeat.tick(time.monotonic() + 11)  # (due: the ticker's call; errors logged, not raised)
    assert slot == (["kept"] if kept else [])
    heartbeat.tick(time.monotonic() + 22)
    assert len(slot) == (2 if kept else 0)
