"""The worker's prefork pool (celery_ledger.prefork): which exits at a worker's start end it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from celery_ledger.prefork import TaskPool


@pytest.mark.parametrize(
    ("exited", "started_ok"),
    [
        ([], True),
        ([-9], True),  # SIGKILLed as it started (the OOM killer, an operator): replaced
        ([-9, -9], True),
        ([1], False),  # exited by itself: it could not start (the app failing in the child)
        ([0], False),
        ([-11], False),  # another signal: a child that cannot start may die of one (a crash)
        ([15], False),  # (a SIGTERM that early: billiard's child exits with status 15)
        ([-9, 1], False),
        ([None], False),  # never started
    ],
)
def test_only_a_process_that_could_not_start_ends_the_worker(
    exited: list[Any], started_ok: bool
) -> None:
    pool = TaskPool.__new__(TaskPool)  # (no processes: the check alone)
    pool._pool = SimpleNamespace(_join_exited_workers=lambda: list(exited))
    assert pool.did_start_ok() is started_ok
