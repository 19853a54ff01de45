"""What a soak runs: its profiles (ci, long) and its jobs."""

from __future__ import annotations

import random
from dataclasses import dataclass

TIERS = ("critical", "default", "bulk")


@dataclass(frozen=True)
class Profile:
    name: str
    tasks: int  # per system
    mix: dict[str, float]  # kind -> share
    long_seconds: tuple[float, float]
    publish_seconds: float  # publishing is spread over this, in waves
    waves: int
    fault_seconds: float  # faults are injected during this
    pool_kill_every: float
    worker_kills: int
    broker_kills: int
    ledger_kills: int
    delays: int
    resets: int
    partitions: int
    partition_seconds: float
    workers: int  # per system
    concurrency: int
    drain_timeout: float
    lease_seconds: float
    visibility_timeout: int


PROFILES = {
    "ci": Profile(
        name="ci",
        tasks=300,
        mix={"quick": 0.70, "flaky": 0.12, "permanent": 0.08, "long": 0.10},
        long_seconds=(1.0, 3.0),
        publish_seconds=24.0,
        waves=8,
        fault_seconds=40.0,
        pool_kill_every=3.0,
        worker_kills=1,
        broker_kills=1,
        ledger_kills=1,
        delays=2,
        resets=3,
        partitions=1,
        partition_seconds=3.0,
        workers=2,
        concurrency=2,
        drain_timeout=90.0,
        lease_seconds=8.0,
        visibility_timeout=30,
    ),
    "long": Profile(
        name="long",
        tasks=5000,
        mix={"quick": 0.82, "flaky": 0.08, "permanent": 0.05, "long": 0.05},
        long_seconds=(1.0, 4.0),
        publish_seconds=240.0,
        waves=60,
        fault_seconds=300.0,
        pool_kill_every=3.0,
        worker_kills=4,
        broker_kills=3,
        ledger_kills=3,
        delays=8,
        resets=12,
        partitions=3,
        partition_seconds=4.0,
        workers=2,
        concurrency=2,
        drain_timeout=300.0,
        lease_seconds=8.0,
        visibility_timeout=30,
    ),
}


@dataclass(frozen=True)
class Job:
    key: str
    kind: str  # quick | flaky | permanent | long
    param: float  # flaky: failures before success; long: seconds
    tier: str

    @property
    def designed(self) -> str:
        return "dead" if self.kind == "permanent" else "succeeded"


def plan_jobs(profile: Profile, rng: random.Random, run: str) -> list[Job]:
    kinds = list(profile.mix)
    jobs = []
    for i in range(profile.tasks):
        kind = rng.choices(kinds, weights=[profile.mix[k] for k in kinds])[0]
        param = {
            "flaky": float(rng.randint(1, 2)),
            "long": round(rng.uniform(*profile.long_seconds), 2),
        }.get(kind, 0.0)
        jobs.append(Job(f"{run}-{kind}-{i}", kind, param, rng.choice(TIERS)))
    return jobs
