"""Tiers and how a task's tier is chosen (call option > settings rule > task option > default)."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from .errors import ConfigurationError
from .policies.backpressure import TierLimit

if TYPE_CHECKING:
    from celery import Task

DEAD_LETTER_QUEUE = "dead_letter"

# Producers wait (up to 5 s) rather than grow a tier's backlog without bound; shed is opt-in.
DEFAULT_TIER_LIMITS = {
    "critical": TierLimit(high_water=10_000, policy="block", block_timeout_seconds=5.0),
    "default": TierLimit(high_water=50_000, policy="block", block_timeout_seconds=5.0),
    "bulk": TierLimit(high_water=100_000, policy="block", block_timeout_seconds=5.0),
}


class Tiers:
    """The tiers of an app (each its own queue) and the glob rules that route tasks to them."""

    def __init__(
        self, names: tuple[str, ...], *, default: str, rules: dict[str, str] | None = None
    ) -> None:
        self.names = names
        self.default = self.check(default, where="default tier")
        self.rules = {
            pattern: self.check(tier, where=f"routing rule {pattern!r}")
            for pattern, tier in (rules or {}).items()
        }

    def check(self, tier: str, *, where: str) -> str:
        if tier not in self.names:
            raise ConfigurationError(
                f"unknown tier {tier!r} in {where}; known tiers: {', '.join(self.names)}"
            )
        return tier

    def resolve(self, task: Task, call_tier: str | None = None) -> str:
        """The tier a publish of ``task`` goes to."""
        if call_tier:
            return self.check(call_tier, where=f"the call of {task.name}")
        for pattern, tier in self.rules.items():
            if fnmatchcase(task.name, pattern):
                return tier
        task_tier = getattr(task, "tier", None)
        if task_tier:
            return self.check(str(task_tier), where=f"task {task.name}")
        return self.default


class TierWorkerDefaults:
    """How a tier's workers run by default (``celery ledger worker --tier``)."""

    def __init__(self, *, concurrency: int, prefetch_multiplier: int) -> None:
        self.concurrency = concurrency
        self.prefetch_multiplier = prefetch_multiplier


# Critical workers never reserve more than they can start at once (prefetch 1); bulk workers
# reserve a few to keep their pool busy.
TIER_WORKER_DEFAULTS = {
    "critical": TierWorkerDefaults(concurrency=2, prefetch_multiplier=1),
    "default": TierWorkerDefaults(concurrency=2, prefetch_multiplier=1),
    "bulk": TierWorkerDefaults(concurrency=2, prefetch_multiplier=4),
}
