"""What a soak runs: its profiles (ci, long), its jobs and (celery-ledger only) its workflows."""

from __future__ import annotations

import dataclasses
import random
import re
import zlib
from dataclasses import dataclass
from typing import Any

TIERS = ("critical", "default", "bulk")

# celery-ledger's tenants (fair dispatch inside each tier, ``LEDGER_TENANTS``): a big one that
# floods its lanes, one of weight 3, one held to a few bodies at once per tier, a small one;
# the rest of the jobs name none (they go to the tier queues directly, as before tenants).
# Shares of the jobs, out of 100, by a hash of the job's number (not the plan's random source:
# a seed plans the same jobs and faults as before tenants).
FLOOD, GOLD, CAPPED, SMALL = "flood", "gold", "capped", "small"
CAPPED_CONCURRENCY = 2
TENANT_SHARES = {FLOOD: 49, GOLD: 15, CAPPED: 6, SMALL: 15}  # the other 15: no tenant
TENANT_POLICIES: dict[str, dict[str, Any]] = {
    GOLD: {"weight": 3},
    CAPPED: {"concurrency": CAPPED_CONCURRENCY},
}
NO_TENANT = "(none)"  # how the report names the jobs that name no tenant
_NUMBER = re.compile(r"-(\d+)(?::[su]\d+)?$")


def tenant_of(key: str) -> str | None:
    """The tenant of a soak job or workflow step by its effect key (``<run>-<kind>-<n>``, or a
    step's ``<run>-flow-<n>:s<i>``: a workflow's steps share its tenant); None: no tenant. The
    soak app's ``tenant=`` option, so a republished job keeps it from its arguments alone."""
    found = _NUMBER.search(key)
    if found is None:
        return None
    bucket = zlib.crc32(found.group(1).encode()) % 100
    for tenant, share in TENANT_SHARES.items():
        if bucket < share:
            return tenant
        bucket -= share
    return None


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
    workflows: int = 0  # celery-ledger only: durable workflows of 3-5 steps, beside the jobs
    workflow_fail_share: float = 0.0  # of those, designed to fail for good at their last step
    # celery-ledger only: when (a share of fault_seconds) half the workers are restarted, one
    # at a time, into a release with a task the first release lacks (``soak.newer``, a tenth
    # of the jobs, published from the start), and when the rest are (the deploy done);
    # workers started after the first half are of that release
    deploy_at: float | None = None
    deploy_done_at: float | None = None
    # The broker restarted without its data (no AOF, a wiped disk, a replica promoted that had
    # none of it): every queue, delayed retry, lane, lock and workflow wake gone at once. Under
    # the default settings celery-ledger loses nothing (every job has its record).
    broker_wipes: int = 0
    # celery-ledger's broker is a Sentinel group (a primary, two replicas, three sentinels),
    # and its faults are failovers: the primary SIGKILLed (a replica promoted, the old primary
    # back as a replica), or stopped past the sentinels' timeout and continued (it takes
    # writes until the sentinels demote it: what it took then is lost). Plain Celery, if run,
    # keeps its own broker. Asynchronous replication loses the last writes: nothing is lost.
    sentinel: bool = False
    broker_failovers: int = 0


PROFILES = {
    # Published faster than the workers run it: a backlog of about a minute, with workflows
    # waiting behind it and the broker killed twice while jobs are taken and retried (the
    # class of the long soak's losses of 2026-11-28: wakes and step copies that multiplied
    # under a backlog until the workflows and retries starved behind them).
    "ci": Profile(
        name="ci",
        tasks=500,
        mix={"quick": 0.70, "flaky": 0.12, "permanent": 0.08, "long": 0.10},
        long_seconds=(1.0, 3.0),
        publish_seconds=12.0,
        waves=6,
        fault_seconds=40.0,
        pool_kill_every=3.0,
        worker_kills=1,
        broker_kills=2,
        ledger_kills=1,
        delays=2,
        resets=3,
        partitions=1,
        partition_seconds=3.0,
        workers=2,
        concurrency=2,
        drain_timeout=150.0,
        lease_seconds=8.0,
        visibility_timeout=30,
        workflows=50,
        workflow_fail_share=0.3,
        deploy_at=0.3,
        deploy_done_at=0.6,
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
        workflows=400,
        workflow_fail_share=0.25,
        deploy_at=0.3,
        deploy_done_at=0.6,
        broker_wipes=1,
    ),
}
# The long profile on a Sentinel group, its broker faults failovers (celery-ledger only)
PROFILES["failover"] = dataclasses.replace(
    PROFILES["long"],
    name="failover",
    broker_kills=0,
    broker_wipes=0,
    sentinel=True,
    broker_failovers=4,
)


@dataclass(frozen=True)
class Job:
    key: str
    kind: str  # quick | flaky | permanent | long
    param: float  # flaky: failures before success; long: seconds
    tier: str

    @property
    def designed(self) -> str:
        return "dead" if self.kind == "permanent" else "succeeded"

    @property
    def outbox(self) -> bool:
        """A quarter of celery-ledger's jobs are enqueued in a MongoDB transaction (the
        outbox: published after the commit, or by the workers' relay) instead of directly.
        From the job's number, so a seed plans the same jobs and faults as before."""
        return int(self.key.rsplit("-", 1)[1]) % 4 == 1

    @property
    def newer(self) -> bool:
        """A tenth of celery-ledger's jobs are of a task only the release deployed during
        the soak has (``Profile.deploy_at``): the first release's workers hand them over."""
        return int(self.key.rsplit("-", 1)[1]) % 10 == 7

    @property
    def ledger_task(self) -> str:
        return "soak.newer" if self.newer else "soak.work"

    @property
    def tenant(self) -> str | None:
        """celery-ledger's tenant of the job (plain Celery has none)."""
        return tenant_of(self.key)

    @property
    def tenant_by_call(self) -> bool:
        """Half of the tenants' jobs published directly name it in the call too
        (``apply_async(tenant=...)``); the task's ``tenant=`` option names it for the rest."""
        return int(self.key.rsplit("-", 1)[1]) % 2 == 0


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


def step_effect_key(flow_key: str, index: int) -> str:
    """The key of a workflow's step ``index`` in the world (its effect, attempts, failure)."""
    return f"{flow_key}:s{index}"


def undo_effect_key(flow_key: str, index: int) -> str:
    """The key of the compensation of a workflow's step ``index`` in the world."""
    return f"{flow_key}:u{index}"


@dataclass(frozen=True)
class WorkflowJob:
    """A workflow of ``soak.flow``: its steps run in order, each registering a compensation;
    a designed failure's last step fails for good, so the earlier steps are compensated."""

    key: str
    steps: tuple[tuple[str, float], ...]  # (kind, param) per step, as for a job
    tier: str  # its steps' tier

    @property
    def designed(self) -> str:
        return "compensated" if self.steps[-1][0] == "permanent" else "completed"

    @property
    def tenant(self) -> str | None:
        return tenant_of(self.key)

    def step_key(self, index: int) -> str:
        return step_effect_key(self.key, index)

    def undo_key(self, index: int) -> str:
        return undo_effect_key(self.key, index)

    def expected_effects(self) -> list[str]:
        """The effect keys the workflow must leave, each exactly once, in the order they
        happen: every step for a completed workflow; for a compensated one every step but the
        failed last, then their compensations newest first."""
        if self.designed == "completed":
            return [self.step_key(i) for i in range(len(self.steps))]
        done = range(len(self.steps) - 1)
        return [self.step_key(i) for i in done] + [self.undo_key(i) for i in reversed(done)]


def plan_workflows(profile: Profile, rng: random.Random, run: str) -> list[WorkflowJob]:
    """The soak's workflows: 3-5 steps, mostly quick, some flaky (retried) or long (a second
    or two)."""
    flows = []
    for i in range(profile.workflows):
        steps: list[tuple[str, float]] = []
        for _ in range(rng.randint(3, 5)):
            # Long steps are the ones a kill most often lands in.
            kind = rng.choices(["quick", "flaky", "long"], weights=[0.55, 0.15, 0.30])[0]
            param = {"flaky": 1.0, "long": round(rng.uniform(0.5, 2.0), 2)}.get(kind, 0.0)
            steps.append((kind, param))
        if rng.random() < profile.workflow_fail_share:
            steps[-1] = ("permanent", 0.0)
        flows.append(WorkflowJob(f"{run}-flow-{i}", tuple(steps), rng.choice(TIERS)))
    return flows
