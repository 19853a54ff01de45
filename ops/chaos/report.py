"""What a soak found: kills it made, and per system the outcome of every job; printed as tables."""

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
class SystemReport:
    system: str
    tasks: int = 0
    succeeded: int = 0
    dead: int = 0
    designed_dead: int = 0
    lost: list[str] = field(default_factory=list)
    wrong_outcome: list[str] = field(default_factory=list)
    duplicates: int = 0  # effects beyond the first, over all keys
    duplicate_keys: list[str] = field(default_factory=list)
    duplicate_causes: dict[str, int] = field(default_factory=dict)
    effects_of_failed_jobs: int = 0
    dead_letters_match: bool | None = None
    dead_letter_detail: str = ""
    drain_seconds: float | None = None
    quiet: bool = False
    details: list[str] = field(default_factory=list)


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
