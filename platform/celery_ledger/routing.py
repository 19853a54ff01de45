"""Tiers, their queues, and how a task's tier is chosen.

A tier (``critical``, ``default``, ``bulk``) is a name the app's code uses; each has a queue of
its own in the broker, named by :class:`Tiers` (``queue(tier)``): ``<namespace>.<tier>``, the
namespace being the app's name unless ``LEDGER_QUEUE_NAMESPACE`` says otherwise, so that two
apps on one broker never take each other's messages. An empty namespace gives the bare tier
names (what celery-ledger used before namespaces: share them only on purpose).

A task's tier comes from, in order: the call's ``tier=`` option, the first matching routing
rule, the task's ``tier`` option, the default tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from .errors import ConfigurationError

if TYPE_CHECKING:
    from celery import Task

TIERS: tuple[str, ...] = ("critical", "default", "bulk")
DEAD_LETTER = "dead_letter"  # the logical name of the dead letters' queue


def queue_name(namespace: str, name: str) -> str:
    """The broker queue of tier (or ``dead_letter``) ``name`` in ``namespace``."""
    return f"{namespace}.{name}" if namespace else name


class Tiers:
    """The tiers of an app, their queue names, and the glob rules that route tasks to them.

    Each tier (and ``dead_letter``) has the queue ``<namespace>.<name>`` (bare names without a
    namespace).
    """

    def __init__(
        self,
        names: tuple[str, ...] = TIERS,
        *,
        default: str,
        rules: dict[str, str] | None = None,
        namespace: str = "",
    ) -> None:
        self.namespace = namespace
        self.names = names
        self.default = self.check(default, where="default tier")
        self.rules = {
            pattern: self.check(tier, where=f"routing rule {pattern!r}")
            for pattern, tier in (rules or {}).items()
        }
        self._queues = {name: queue_name(namespace, name) for name in (*names, DEAD_LETTER)}
        self._tiers_of_queue = {queue: tier for tier, queue in self._queues.items()}

    def check(self, tier: str, *, where: str) -> str:
        if tier not in self.names:
            raise ConfigurationError(
                f"unknown tier {tier!r} in {where}; known tiers: {', '.join(self.names)}"
            )
        return tier

    def queue(self, tier: str) -> str:
        """The broker queue of ``tier`` (or of ``dead_letter``)."""
        return self._queues[tier]

    @property
    def queues(self) -> tuple[str, ...]:
        """The tiers' queues, in tier order."""
        return tuple(self._queues[tier] for tier in self.names)

    @property
    def dead_letter_queue(self) -> str:
        return self._queues[DEAD_LETTER]

    def of_record(self, recorded: object, task_tier: str) -> str:
        """The tier a job's record says it was enqueued to (a call's choice) if this app has
        it, else its task's (``task_tier``)."""
        return recorded if isinstance(recorded, str) and recorded in self.names else task_tier

    def for_record(self, record: Mapping[str, Any], task_tier: str | None) -> str | None:
        """The tier this app's sweeps (the reconciler, the outbox relay) republish a job's
        ``record`` to, or None if they leave it; ``task_tier``: its task's tier here, None if
        this release does not have the task. A task of this release goes to the tier its
        record names (a call's choice) or its own; a task it lacks goes to its record's tier
        if the record is this fleet's (written by a worker or producer of this queue
        namespace: a newer release's task during a rolling deploy, or a task this release
        removed; the handoff brings it to a worker that has it). Another app's record sharing
        the ledger, or one written before records named their fleet, is left to that app."""
        if task_tier is not None:
            return self.of_record(record.get("tier"), task_tier)
        recorded = record.get("tier")
        if record.get("fleet") == self.namespace and isinstance(recorded, str):
            return recorded if recorded in self.names else None
        return None

    def tier_of_queue(self, queue: str) -> str | None:
        """The tier whose queue this is (``dead_letter`` for the dead letters'), or None."""
        return self._tiers_of_queue.get(queue)

    def resolve(self, task: Task, call_tier: str | None = None) -> str:
        """The tier a publish of ``task`` goes to."""
        if call_tier:
            return self.check(call_tier, where=f"the call of {task.name}")
        return self.of_task(task.name, getattr(task, "tier", None))

    def of_task(self, task_name: str, task_tier: str | None) -> str:
        """The tier of a task by its name and ``tier`` option (routing rules first)."""
        for pattern, tier in self.rules.items():
            if fnmatchcase(task_name, pattern):
                return tier
        if task_tier:
            return self.check(str(task_tier), where=f"task {task_name}")
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


def unacked_keys(namespace: str) -> dict[str, str]:
    """kombu's keys for delivered, unacknowledged messages, in the app's namespace (so one
    app's reconciler and restore sweep only ever see its own messages)."""
    if not namespace:
        return {}
    return {
        "unacked_key": f"{namespace}.unacked",
        "unacked_index_key": f"{namespace}.unacked_index",
        "unacked_mutex_key": f"{namespace}.unacked_mutex",
    }
