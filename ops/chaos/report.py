"""What a soak found: kills it made, per system the outcome of every job, and celery-ledger's
workflows; printed as tables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..bench.common import console, print_table


@dataclass
class Kill:
    at: float
    system: str
    kind: str
    pids: list[int]


@dataclass
class WorkflowReport:
    """celery-ledger's workflows (plain Celery has none): their ends and their steps' effects."""

    workflows: int = 0
    designed_compensated: int = 0
    completed: int = 0
    compensated: int = 0
    lost: list[str] = field(default_factory=list)  # not ended by the end of the drain
    wrong_status: list[str] = field(default_factory=list)  # ended, but not as designed
    step_effects: int = 0  # effects of steps and compensations (every run counted)
    expected_effects: int = 0
    duplicates: int = 0  # effects beyond the first, over all step and compensation keys
    duplicate_causes: dict[str, int] = field(default_factory=dict)
    missing_effects: int = 0  # expected once, never happened
    unexpected_effects: int = 0  # a step or compensation that should not have acted
    out_of_order: list[str] = field(default_factory=list)  # steps or compensations misordered
    step_claims: int = 0  # claims of the steps' and compensations' jobs, over all records
    designed_claims: int = 0  # one per job, one more per designed retry (flaky steps)
    dead_steps: int = 0  # dead records of the steps' task
    dead_steps_match: bool | None = None  # exactly the designed failures' last steps
    terminal_seconds: float | None = None  # after the faults, until every workflow ended
    wakes: int = 0  # wakes the workers ran, over all workflows
    wakes_most: int = 0  # the most wakes one workflow had
    wakes_most_in_a_minute: int = 0  # the most one workflow had within any 60 seconds
    wakes_waiting_most: int = 0  # the most wakes of one workflow waiting in a queue at once
    step_copies_waiting_most: int = 0  # the most copies of one step's message waiting at once
    deepest_backlog: int = 0  # the most messages waiting in the tiers' queues at once
    details: list[str] = field(default_factory=list)

    @property
    def wakes_per_workflow(self) -> float:
        return self.wakes / self.workflows if self.workflows else 0.0

    @property
    def ok(self) -> bool:
        return (
            not self.lost
            and not self.wrong_status
            and self.duplicates == 0
            and self.missing_effects == 0
            and self.unexpected_effects == 0
            and not self.out_of_order
            and bool(self.dead_steps_match)
        )


@dataclass
class TenantReport:
    """One tenant's jobs (``(none)``: the jobs that name no tenant)."""

    tenant: str
    jobs: int = 0
    succeeded: int = 0
    dead: int = 0
    designed_dead: int = 0
    killed_to_dead: int = 0  # dead as poison: the soak killed its process at every delivery
    duplicates: int = 0  # effects beyond the first
    not_ended: list[str] = field(default_factory=list)
    wrong_tenant: list[str] = field(default_factory=list)  # a record not of its planned tenant
    # from publish to its body's first start (under the faults: a figure, not an invariant)
    wait_median_seconds: float | None = None
    wait_p90_seconds: float | None = None


@dataclass
class TenantsReport:
    """celery-ledger's tenants under the faults (ops/chaos/tenants.py)."""

    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    tenants: list[TenantReport] = field(default_factory=list)
    lanes_left: list[str] = field(default_factory=list)  # fair dispatch's leftovers at the end
    capped: str = ""
    capped_limit: int = 0
    capped_bodies: int = 0  # runs of the capped tenant's bodies (every attempt)
    capped_redelivered: int = 0  # of them, copies that reached the queue past the lane
    capped_most_at_once: int = 0
    capped_over_limit_seconds: float = 0.0
    # stretches over the limit begun during or soon after a fault that may lose its entries
    capped_after_outage: list[str] = field(default_factory=list)
    capped_unexplained: list[str] = field(default_factory=list)  # the gate failed
    capped_unended: list[str] = field(default_factory=list)  # a span with no end and no kill
    most_capped_entries: int = 0  # the most live concurrency entries seen at once (sampled)

    def render(self, system: str) -> None:
        def seconds(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f}s"

        print_table(
            f"tenants on {system}: policies {self.policies}",
            ["tenant", "jobs", "succeeded", "dead/designed (+killed)", "duplicates", "not ended",
             "record's tenant wrong", "wait to start: median / p90"],
            [
                [t.tenant, t.jobs, t.succeeded, f"{t.dead}/{t.designed_dead} (+{t.killed_to_dead})",
                 t.duplicates,
                 len(t.not_ended), len(t.wrong_tenant),
                 f"{seconds(t.wait_median_seconds)} / {seconds(t.wait_p90_seconds)}"]
                for t in self.tenants
            ],
        )  # fmt: skip
        console.print(
            f"{system} tenant {self.capped!r} (concurrency {self.capped_limit}):"
            f" {self.capped_bodies} bodies run ({self.capped_redelivered} redelivered copies),"
            f" most at once {self.capped_most_at_once}, over the limit"
            f" {self.capped_over_limit_seconds:.1f}s in all"
            f" ({len(self.capped_after_outage)} stretches after an outage,"
            f" {len(self.capped_unexplained)} unexplained), most live slots seen"
            f" {self.most_capped_entries};"
            f" lanes left at the end: {len(self.lanes_left)}",
            highlight=False,
        )
        for line in (
            self.lanes_left[:5]
            + [f"over the limit, unexplained: {x}" for x in self.capped_unexplained[:8]]
            + [f"over the limit, after an outage: {x}" for x in self.capped_after_outage[:4]]
            + [f"no end and no kill: {x}" for x in self.capped_unended[:5]]
            + [w for t in self.tenants for w in t.wrong_tenant[:3]]
        ):
            console.print(f"  {system} tenants: {line}", highlight=False, soft_wrap=True)

    @property
    def ok(self) -> bool:
        return (
            not self.lanes_left
            and not self.capped_unexplained
            and not self.capped_unended
            and all(not t.not_ended and not t.wrong_tenant for t in self.tenants)
        )


@dataclass
class SystemReport:
    system: str
    tasks: int = 0
    succeeded: int = 0
    dead: int = 0
    designed_dead: int = 0
    lost: list[str] = field(default_factory=list)
    wrong_outcome: list[str] = field(default_factory=list)
    # dead as poison because the soak killed its process at every delivery: as designed
    killed_to_dead: list[str] = field(default_factory=list)
    duplicates: int = 0  # effects beyond the first, over all keys
    duplicate_keys: list[str] = field(default_factory=list)
    duplicate_causes: dict[str, int] = field(default_factory=dict)
    effects_of_failed_jobs: int = 0
    dead_letters_match: bool | None = None
    dead_letter_detail: str = ""
    drain_seconds: float | None = None
    quiet: bool = False
    details: list[str] = field(default_factory=list)
    workflows: WorkflowReport | None = None
    tenants: TenantsReport | None = None  # celery-ledger's
    # celery-ledger's periodic task (every 2 s, the workers' own scheduler): the slots from
    # its first run until a minute before the count, and those of them that did not run once
    schedule_slots: int = 0
    schedule_missing: list[float] = field(default_factory=list)
    schedule_duplicates: int = 0  # runs beyond the first, over all slots

    @property
    def schedule_ok(self) -> bool:
        return not self.schedule_missing and self.schedule_duplicates == 0


@dataclass
class SoakReport:
    profile: str
    seed: int
    faults: dict[str, int]
    repaired: dict[str, int]  # jobs the workers' reconciler brought back, and how often
    systems: dict[str, SystemReport]
    crashes: list[str]  # workers that exited by themselves (restarted by the soak)
    fault_log: list[str]
    fault_seconds: float
    total_seconds: float
    config: dict[str, Any]

    def render(self) -> None:
        print_table(
            f"faults injected ({self.profile} profile, seed {self.seed})",
            ["fault", "count"],
            [[kind, count] for kind, count in sorted(self.faults.items())],
        )
        rows = []
        for name, r in self.systems.items():
            rows.append(
                [
                    name,
                    r.tasks,
                    r.succeeded,
                    f"{r.dead}/{r.designed_dead}",
                    r.duplicates,
                    len(r.lost),
                    len(r.wrong_outcome),
                    "yes"
                    if r.dead_letters_match
                    else ("-" if r.dead_letters_match is None else "NO"),
                    "-" if r.drain_seconds is None else f"{r.drain_seconds:.1f}s",
                ]
            )
        print_table(
            f"chaos soak: {self.fault_seconds:.0f}s of faults, {self.total_seconds:.0f}s in all",
            [
                "system",
                "tasks",
                "succeeded",
                "dead/designed",
                "duplicates",
                "lost",
                "wrong outcome",
                "dead letters = designed",
                "time to drain",
            ],
            rows,
        )
        for name, r in self.systems.items():
            w = r.workflows
            if w is None:
                continue
            ended = "-" if w.terminal_seconds is None else f"{w.terminal_seconds:.1f}s"
            print_table(
                f"workflows on {name} (plain Celery has none)",
                ["figure", "value"],
                [
                    ["workflows (3-5 steps)", w.workflows],
                    ["completed", w.completed],
                    ["compensated / designed to fail", f"{w.compensated}/{w.designed_compensated}"],
                    ["lost (not ended after the drain)", len(w.lost)],
                    ["ended otherwise than designed", len(w.wrong_status)],
                    [
                        "step and compensation effects / expected",
                        f"{w.step_effects}/{w.expected_effects}",
                    ],
                    ["duplicate effects", w.duplicates],
                    ["missing effects", w.missing_effects],
                    ["unexpected effects", w.unexpected_effects],
                    ["effects out of order", len(w.out_of_order)],
                    [
                        "dead steps = designed failures",
                        f"{'yes' if w.dead_steps_match else 'NO'} ({w.dead_steps})",
                    ],
                    [
                        "step claims / designed (more: crashes, outages)",
                        f"{w.step_claims}/{w.designed_claims}",
                    ],
                    ["every workflow ended, after the faults", ended],
                    [
                        "wakes per workflow: mean / most / most in a minute",
                        f"{w.wakes_per_workflow:.1f} / {w.wakes_most} / {w.wakes_most_in_a_minute}",
                    ],
                    [
                        "most waiting at once: wakes of a workflow / copies of a step",
                        f"{w.wakes_waiting_most} / {w.step_copies_waiting_most}",
                    ],
                    ["deepest backlog (messages queued at once)", w.deepest_backlog],
                ],
            )
        for name, r in self.systems.items():
            if r.tenants is not None:
                r.tenants.render(name)
        for name, r in self.systems.items():
            if r.schedule_slots:
                console.print(
                    f"{name} periodic task: {r.schedule_slots} slots, missing"
                    f" {len(r.schedule_missing)}, run twice {r.schedule_duplicates}"
                    + (f" (missing: {r.schedule_missing[:10]})" if r.schedule_missing else ""),
                    highlight=False,
                )
        if self.repaired:
            console.print(
                f"the ledger workers' own reconciler brought back: {self.repaired}",
                highlight=False,
            )
        console.print("fault timeline: " + "; ".join(self.fault_log), highlight=False)
        for crash in self.crashes:
            console.print(f"worker exited by itself (restarted): {crash}", highlight=False)
        for name, r in self.systems.items():
            if r.duplicate_causes:
                console.print(f"{name} duplicate effects by cause: {r.duplicate_causes}")
            for line in r.details[:12]:
                console.print(f"  {name}: {line}", highlight=False, soft_wrap=True)
            if r.workflows is not None:
                if r.workflows.duplicate_causes:
                    console.print(
                        f"{name} duplicate step effects by cause: {r.workflows.duplicate_causes}"
                    )
                for line in r.workflows.details[:12]:
                    console.print(f"  {name} workflows: {line}", highlight=False, soft_wrap=True)
