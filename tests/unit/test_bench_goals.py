"""The throughput benchmark's CPU goals: what celery-ledger adds to a task's CPU, by process,
against Celery with its MongoDB backend in the same run."""

from __future__ import annotations

from ops.bench.throughput import cpu_ratios, cpu_reported


def test_the_cpu_goals_compare_the_same_processes_of_the_same_run() -> None:
    profile = {
        "ledger": {"worker": 0.8, "pool": 0.9, "producer": 1.0, "ledger server": 2.0},
        "ledger-no-dedupe": {"worker": 0.8, "pool": 0.9, "producer": 0.6, "ledger server": 1.5},
        "plain-mongo": {"worker": 0.7, "pool": 0.3, "producer": 0.5, "ledger server": 0.8},
    }
    found = {label: (round(ratio, 2), goal) for label, ratio, goal in cpu_ratios(profile)}
    assert found == {
        "worker + pool CPU a task: ledger / plain-mongo": (1.7, 1.2),
        # The producer's goal is a publish that writes no record; dedupe's cost is reported
        "producer CPU a task: ledger-no-dedupe / plain-mongo": (1.2, 1.2),
    }
    reported = {label: round(ratio, 2) for label, ratio in cpu_reported(profile)}
    assert reported == {
        "producer CPU a task, dedupe on publish (default): ledger / plain-mongo": 2.0,
        "dedupe on publish's producer cost: ledger / ledger-no-dedupe": 1.67,
    }
    # A run without the baseline (--only ledger) reports no CPU goal
    assert cpu_ratios({"ledger": profile["ledger"]}) == []
    assert cpu_reported({"ledger": profile["ledger"]}) == []
