"""The chaos soak's accounting: a job the soak itself killed at every delivery is dead as
designed (poison), not a wrong outcome; one with a single attempt the soak did not kill is."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from ops.chaos.plan import PROFILES, Job
from ops.chaos.report import Kill
from ops.chaos.soak import Soak

POISON = "poison: delivered 5 times without an outcome (the worker was lost each time)"
JOB = Job("s1-long-7", "long", 3.0, "bulk")


def soak(attempts: list[dict[str, Any]], kills: list[Kill]) -> Any:
    @contextlib.contextmanager
    def world() -> Iterator[Any]:
        found = SimpleNamespace(find=lambda q: [a for a in attempts if a["key"] == q["key"]])
        yield SimpleNamespace(soak_world=SimpleNamespace(attempts=found))

    return SimpleNamespace(world=world, kills=kills, profile=PROFILES["long"])


def attempt(at: float, pid: int) -> dict[str, Any]:
    return {"system": "ledger", "key": JOB.key, "at": at, "pid": pid}


def test_a_job_killed_by_the_soak_at_every_attempt_is_dead_as_designed() -> None:
    attempts = [attempt(10.0 * i, 100 + i) for i in range(5)]
    kills = [Kill(10.0 * i + 1.5, "ledger", "pool", [100 + i]) for i in range(5)]
    found = Soak.killed_at_every_attempt(soak(attempts, kills), "ledger", JOB, POISON)
    assert found is not None and found.startswith("5 attempts, each killed")


def test_an_attempt_the_soak_did_not_kill_makes_it_a_wrong_outcome() -> None:
    attempts = [attempt(10.0 * i, 100 + i) for i in range(5)]
    kills = [Kill(10.0 * i + 1.5, "ledger", "pool", [100 + i]) for i in range(4)]
    kills.append(Kill(200.0, "ledger", "pool", [104]))  # long after that attempt ended
    assert Soak.killed_at_every_attempt(soak(attempts, kills), "ledger", JOB, POISON) is None


def test_another_death_is_never_put_down_to_the_kills() -> None:
    attempts = [attempt(0.0, 100)]
    kills = [Kill(1.0, "ledger", "pool", [100])]
    reason = "permanent error: PermanentError"
    assert Soak.killed_at_every_attempt(soak(attempts, kills), "ledger", JOB, reason) is None
