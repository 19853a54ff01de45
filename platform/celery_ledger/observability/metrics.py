"""Prometheus metrics of celery-ledger workers (extra ``metrics``: ``prometheus-client``).

Platform hooks, Celery's ``task_prerun`` signal and a pymongo command listener update the
metrics below in the process where the event happens (mostly the pool processes). Under a
worker they are in prometheus-client's multiprocess mode, merged and served by the worker's
main process (:mod:`.exporter`); gauges sampled from Redis and the ledger are computed on
scrape there too. Elsewhere (:func:`enable` in a web app) they live in a registry in memory.

Nothing here can fail a task: every handler catches and logs (at most once a minute).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec

from celery import signals
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pymongo import monitoring

from . import SENT_AT_HEADER

if TYPE_CHECKING:
    from ..app import LedgerCelery

logger = logging.getLogger("celery_ledger.metrics")

P = ParamSpec("P")

TASK_LABELS = ("task", "tier")
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 1800, 3600)
LEDGER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class LedgerMetrics:
    """The metrics a process updates (a registry of ``None``: multiprocess files only)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = TASK_LABELS) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.started = counter("celery_ledger_tasks_started_total", "Claims that ran the body.")
        self.succeeded = counter("celery_ledger_tasks_succeeded_total", "Completions recorded.")
        self.retried = counter("celery_ledger_tasks_retried_total", "Failed attempts retried.")
        self.dead = counter("celery_ledger_tasks_dead_total", "Jobs dead-lettered.")
        self.duplicates = counter(
            "celery_ledger_duplicates_suppressed_total", "Deliveries of succeeded jobs, not run."
        )
        self.deferred = counter(
            "celery_ledger_tasks_deferred_total",
            "Deliveries republished for later (lease held, breaker open, ledger down...).",
            (*TASK_LABELS, "reason"),
        )
        self.lease_lost = counter(
            "celery_ledger_lease_lost_total", "Writes refused because a newer claim took over."
        )
        self.poison = counter(
            "celery_ledger_poison_messages_total", "Undecodable or unknown messages.", ("queue",)
        )
        self.shed = counter("celery_ledger_publishes_shed_total", "Publishes shed.", ("tier",))
        self.breaker_transitions = counter(
            "celery_ledger_breaker_transitions_total", "Breaker state changes.", ("breaker", "to")
        )
        self.ledger_failures = counter(
            "celery_ledger_ledger_command_failures_total", "Ledger commands failed.", ("command",)
        )
        self.duration = Histogram(
            "celery_ledger_task_duration_seconds",
            "Body run time, from the claim to the recorded outcome.",
            (*TASK_LABELS, "outcome"),
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "celery_ledger_queue_wait_seconds",
            "From publish (ledger_sent_at header) to the start of the delivery.",
            TASK_LABELS,
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.ledger_latency = Histogram(
            "celery_ledger_ledger_command_seconds",
            "Round-trip time of ledger (MongoDB) commands.",
            ("command",),
            buckets=LEDGER_BUCKETS,
            registry=registry,
        )
        self.throttle = Gauge(
            "celery_ledger_throttle_engaged",
            "1 while a worker holds back a queue for foreground pressure.",
            ("queue",),
            multiprocess_mode="livemax",
            registry=registry,
        )


_active: LedgerMetrics | None = None
_last_warning = 0.0


def enable(registry: CollectorRegistry | None = None) -> LedgerMetrics:
    """Start recording into new metric objects (a worker: after multiprocess set-up)."""
    global _active
    _active = LedgerMetrics(registry)
    return _active


def disable() -> None:
    global _active
    _active = None


def active() -> LedgerMetrics | None:
    return _active


def _safe(func: Callable[P, None]) -> Callable[P, None]:
    """Run only while metrics are enabled; log (once a minute) and swallow any failure."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        global _last_warning
        if _active is None:
            return
        try:
            func(*args, **kwargs)
        except Exception:
            now = time.monotonic()
            if now - _last_warning >= 60.0:
                _last_warning = now
                logger.warning("metrics: %s failed", func.__name__, exc_info=True)

    return wrapper


def _m() -> LedgerMetrics:
    assert _active is not None
    return _active


def _tier(tier: Any) -> str:
    return str(tier) if tier else "unknown"


class _Starts:
    """When each running body started (per process, bounded), for the duration histogram."""

    def __init__(self, limit: int = 10_000) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._at: OrderedDict[str, float] = OrderedDict()

    def start(self, record_id: str) -> None:
        with self._lock:
            self._at[record_id] = time.monotonic()
            while len(self._at) > self._limit:  # bodies that ended without an event
                self._at.popitem(last=False)

    def seconds(self, record_id: str) -> float | None:
        with self._lock:
            started = self._at.pop(record_id, None)
        return None if started is None else time.monotonic() - started


def instrument(app: LedgerCelery) -> None:
    """Subscribe the metrics to the app's hooks and Celery's signals (recorded once enabled)."""
    starts = _Starts()
    hooks = app.hooks

    @_safe
    def claimed(*, task: str, tier: str, record_id: str, **_: Any) -> None:
        starts.start(record_id)
        _m().started.labels(task, _tier(tier)).inc()

    @_safe
    def succeeded(*, task: str, tier: str, record_id: str, seconds: float, **_: Any) -> None:
        starts.seconds(record_id)
        _m().succeeded.labels(task, _tier(tier)).inc()
        _m().duration.labels(task, _tier(tier), "succeeded").observe(seconds)

    def ended(outcome: str, counter: Callable[[], Counter] | None) -> Callable[..., None]:
        @_safe
        def handler(*, task: str, tier: str, record_id: str, **fields: Any) -> None:
            if counter is not None:
                counter().labels(task, _tier(tier)).inc()
            if outcome == "deferred":
                reason = str(fields.get("reason") or "unknown")
                _m().deferred.labels(task, _tier(tier), reason).inc()
            seconds = starts.seconds(record_id)
            if seconds is not None:
                _m().duration.labels(task, _tier(tier), outcome).observe(seconds)

        handler.__name__ = outcome
        return handler

    @_safe
    def duplicate(*, task: str, tier: str, **_: Any) -> None:
        _m().duplicates.labels(task, _tier(tier)).inc()

    @_safe
    def breaker(*, name: str, new: Any, **_: Any) -> None:
        _m().breaker_transitions.labels(name, str(getattr(new, "value", new))).inc()

    @_safe
    def shed(*, tier: str, **_: Any) -> None:
        _m().shed.labels(_tier(tier)).inc()

    @_safe
    def throttle(*, queue: str, engaged: bool, **_: Any) -> None:
        record_throttle(queue, engaged)

    hooks.on("claimed", claimed)
    hooks.on("succeeded", succeeded)
    hooks.on("retried", ended("retried", lambda: _m().retried))
    hooks.on("dead", ended("dead", lambda: _m().dead))
    hooks.on("lease_lost", ended("lease_lost", lambda: _m().lease_lost))
    hooks.on("deferred", ended("deferred", None))
    hooks.on("duplicate", duplicate)
    hooks.on("breaker", breaker)
    hooks.on("shed", shed)
    hooks.on("throttle", throttle)
    app.dead_letters.hooks.append(_poison)
    signals.task_prerun.connect(observe_queue_wait, weak=False, dispatch_uid="ledger-metrics")


@_safe
def _poison(entry: dict[str, Any]) -> None:
    """Dead letters that never reached a body (the guard's own are counted by ``dead``)."""
    if str(entry.get("record_id", "")).startswith("poison-"):
        _m().poison.labels(str(entry.get("tier") or "unknown")).inc()


@_safe
def observe_queue_wait(sender: Any = None, **_: Any) -> None:
    """``task_prerun``: now minus the message's ``ledger_sent_at`` (clamped at 0)."""
    request = getattr(sender, "request", None)
    if request is None:
        return
    sent_at = _header(request, SENT_AT_HEADER)
    if sent_at is None:
        return
    tier = _header(request, "ledger_tier") or getattr(sender, "tier", None)
    wait = max(time.time() - float(sent_at), 0.0)
    _m().queue_wait.labels(str(sender.name), _tier(tier)).observe(wait)


def _header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None and isinstance(request.headers, dict):
        value = request.headers.get(name)
    return value


@_safe
def record_throttle(queue: str, engaged: bool) -> None:
    """Set the throttle gauge of ``queue`` (the throttle code may call this directly)."""
    _m().throttle.labels(queue).set(1 if engaged else 0)


class LedgerCommandListener(monitoring.CommandListener):
    """Times every ledger command (pymongo's own ``duration_micros``) by command name."""

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    @_safe
    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        _m().ledger_latency.labels(event.command_name).observe(event.duration_micros / 1e6)

    @_safe
    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        _m().ledger_latency.labels(event.command_name).observe(event.duration_micros / 1e6)
        _m().ledger_failures.labels(event.command_name).inc()


LEDGER_COMMANDS = LedgerCommandListener()

# Every series name this package exports (the ops/ alerts and dashboard are checked against it).
METRIC_NAMES = frozenset(
    {
        "celery_ledger_tasks_started_total",
        "celery_ledger_tasks_succeeded_total",
        "celery_ledger_tasks_retried_total",
        "celery_ledger_tasks_dead_total",
        "celery_ledger_duplicates_suppressed_total",
        "celery_ledger_tasks_deferred_total",
        "celery_ledger_lease_lost_total",
        "celery_ledger_poison_messages_total",
        "celery_ledger_publishes_shed_total",
        "celery_ledger_breaker_transitions_total",
        "celery_ledger_ledger_command_failures_total",
        *(
            f"{name}_{suffix}"
            for name in (
                "celery_ledger_task_duration_seconds",
                "celery_ledger_queue_wait_seconds",
                "celery_ledger_ledger_command_seconds",
            )
            for suffix in ("bucket", "sum", "count")
        ),
        "celery_ledger_throttle_engaged",
        # sampled on scrape by the worker's exporter
        "celery_ledger_queue_depth",
        "celery_ledger_dead_letters",
        "celery_ledger_delayed_deliveries",
        "celery_ledger_breaker_state",
        "celery_ledger_dependency_up",
        "celery_ledger_worker_consuming",
    }
)
