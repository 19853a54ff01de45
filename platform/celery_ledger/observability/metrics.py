"""Prometheus metrics of celery-ledger workers (extra ``metrics``: ``prometheus-client``).

An observer of the platform's events (:class:`MetricsObserver`), Celery's ``task_prerun`` signal
and a pymongo command listener update the metrics below in the process where the event happens
(mostly the pool processes). Under a
worker they are in prometheus-client's multiprocess mode, merged and served by the worker's
main process (:mod:`.exporter`); gauges sampled from Redis and the ledger are computed on
scrape there too. Elsewhere (:func:`enable` in a web app) they live in a registry in memory.

Nothing here can fail a task: every handler catches and logs (at most once a minute).
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any, ParamSpec

from celery import signals
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pymongo import monitoring

from .. import headers
from ..clock import last_known_time
from ..events import Job, Observer
from ..locks import ForkSafeLock
from ..policies.breaker import BreakerState
from ..policies.fallback import CAUSES
from ..routing import TIERS
from ..untrusted import float_or_none
from ..workflow.history import TERMINAL

if TYPE_CHECKING:
    from ..clock import Reading
    from ..ledger.dead import DeadLetter

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
        self.steps_skipped = counter(
            "celery_ledger_steps_skipped_total",
            "Optional steps skipped (the job went on degraded), by step and reason.",
            (*TASK_LABELS, "step", "reason"),
        )
        self.degraded = counter(
            "celery_ledger_degraded_total",
            "Jobs that succeeded with a fallback's answer instead of waiting, by trigger and"
            " the option that served.",
            (*TASK_LABELS, "reason", "fallback"),
        )
        self.late = counter(
            "celery_ledger_late_total",
            "Jobs past their latency objective (each counted once).",
            TASK_LABELS,
        )
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
        self.commits_lost = counter(
            "celery_ledger_commits_lost_total",
            "Successes refused because the ledger lost atomic steps it had acknowledged.",
        )
        self.poison = counter(
            "celery_ledger_poison_messages_total", "Undecodable or unknown messages.", ("queue",)
        )
        self.shed = counter("celery_ledger_publishes_shed_total", "Publishes shed.", ("tier",))
        self.tenant_refused = counter(
            "celery_ledger_tenant_refusals_total",
            "Publishes of a tenant past its max_waiting refused by its tier's policy (shed,"
            " reject, block timed out), by tenant: those LEDGER_TENANTS names, the rest 'other'.",
            ("tier", "tenant", "policy"),
        )
        self.breaker_transitions = counter(
            "celery_ledger_breaker_transitions_total", "Breaker state changes.", ("breaker", "to")
        )
        self.ledger_unavailable = counter(
            "celery_ledger_ledger_unavailable_total",
            "Deliveries put off or requeued because the ledger could not be reached.",
            ("where",),
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
        self.workflow_steps = Histogram(
            "celery_ledger_workflow_step_seconds",
            "From a workflow's scheduling of a step to its recorded outcome.",
            ("workflow", "outcome"),
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.outbox_published = counter(
            "celery_ledger_outbox_published_total",
            "Jobs enqueued in an app's transaction, published after its commit, by the"
            " committing process (committer) or the outbox relay (relay: it died first).",
            ("tier", "by"),
        )
        self.workflows_ended = counter(
            "celery_ledger_workflows_ended_total", "Workflows ended.", ("workflow", "status")
        )
        self.schedule_lag = Histogram(
            "celery_ledger_schedule_lag_seconds",
            "From a schedule entry's slot to the send of its run (the scheduler's lag).",
            ("schedule",),
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.schedule_skipped = counter(
            "celery_ledger_schedule_slots_skipped_total",
            "Slots of a schedule entry that passed without a run (reason: paused).",
            ("schedule", "reason"),
        )
        self.clock_offset = Gauge(
            "celery_ledger_clock_offset_seconds",
            "A server's clock minus this host's, at its last reading (decisions use the"
            " server's; past a second the host needs time sync).",
            ("server",),
            multiprocess_mode="livemostrecent",  # (a host's processes share its clock)
            registry=registry,
        )
        self.clock_error = Gauge(
            "celery_ledger_clock_error_seconds",
            "How far the last reading of a server's clock can be off (half its round trip).",
            ("server",),
            multiprocess_mode="livemostrecent",
            registry=registry,
        )
        self.throttle = Gauge(
            "celery_ledger_throttle_engaged",
            "1 while a worker holds back a queue for foreground pressure.",
            ("queue",),
            multiprocess_mode="livemax",
            registry=registry,
        )
        # Change-stream triggers (celery_ledger.triggers): labels from the app's declarations.
        self.trigger_changes = counter(
            "celery_ledger_trigger_changes_total",
            "Changes of a watched collection turned into jobs (published, or known already).",
            ("trigger",),
        )
        self.trigger_waits = counter(
            "celery_ledger_trigger_waits_total",
            "Times a trigger's watcher stopped reading because its tier was above its mark.",
            ("trigger", "tier"),
        )
        self.trigger_problems = counter(
            "celery_ledger_trigger_problems_total",
            "Change streams that could not go on (invalidated, history_lost, invalid_token):"
            " the trigger stops until it is reset.",
            ("trigger", "problem"),
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
    """A tier label from the known set: a message's header is not trusted to name one."""
    return tier if tier in TIERS else "unknown"


# A reason is text for people, and may quote a message ("arguments do not bind: got an
# unexpected keyword argument 'x'" names a keyword the message chose): as a label it would put
# message content in the metrics and make a series of each new text. Labels from reasons and
# other event strings are categories from fixed sets instead; anything else is "other".
OTHER = "other"
DEFERRAL_REASONS = frozenset(
    {
        "leased by another delivery",
        "circuit open",
        "circuit open (inside the body)",
        "ledger unavailable",
        "ledger unavailable (in the body)",
        "ledger lost a commit",
        "rate limited",
        "tenant at its concurrency limit",
        "arguments do not bind",
    }
)
UNAVAILABLE_WHERE = frozenset({"claim", "body"})
SKIP_REASONS = frozenset({"dependency down", "time budget"})
FALLBACK_TRIGGERS = frozenset(CAUSES)
BREAKER_STATES = frozenset(state.value for state in BreakerState)
WORKFLOW_ENDS = frozenset(TERMINAL)
CLOCK_SERVERS = frozenset({"ledger", "broker"})


def category(text: Any, known: Container[str]) -> str:
    """``text`` if it is one of ``known``; else its head (before the first ``:`` or `` (``,
    where a reason's details start) if that is; else ``other``."""
    given = str(text or "")
    if given in known:
        return given
    head = re.split(r":| \(", given, maxsplit=1)[0].strip()
    return head if head in known else OTHER


class _Starts:
    """When each running body started (per process, bounded), for the duration histogram."""

    def __init__(self, limit: int = 10_000) -> None:
        self._limit = limit
        self._lock = ForkSafeLock()
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


class MetricsObserver(Observer):
    """Counts the platform's events (recorded once :func:`enable` ran in the process).

    Labels come from the app, never from a message: a task label is the name of a task the
    app registers (else ``unregistered``: a poison message may name anything, and each name
    would be a series of its own), a tier label one of the tiers (else ``unknown``), and a
    reason, a place or a state one of a fixed set of categories (else ``other``): see
    :func:`category`.
    """

    def __init__(
        self,
        known_tasks: Callable[[], Container[str]] = tuple,
        named_tenants: Container[str] = (),
    ) -> None:
        self._starts = _Starts()
        self._known_tasks = known_tasks
        # A tenant label names a tenant the app's LEDGER_TENANTS names (a bounded set of the
        # operator's choosing; a counter cannot rank tenants as the scraped gauges do).
        self._named_tenants = named_tenants

    def _task(self, name: str) -> str:
        return name if name in self._known_tasks() else "unregistered"

    def _ended(self, job: Job, outcome: str) -> None:
        seconds = self._starts.seconds(job.record_id)
        if seconds is not None:
            _m().duration.labels(self._task(job.task), _tier(job.tier), outcome).observe(seconds)

    @_safe
    def claimed(self, job: Job, fence: int) -> None:
        self._starts.start(job.record_id)
        _m().started.labels(self._task(job.task), _tier(job.tier)).inc()

    @_safe
    def succeeded(self, job: Job, seconds: float) -> None:
        self._starts.seconds(job.record_id)
        _m().succeeded.labels(self._task(job.task), _tier(job.tier)).inc()
        _m().duration.labels(self._task(job.task), _tier(job.tier), "succeeded").observe(seconds)

    @_safe
    def retried(self, job: Job, delay_seconds: float, error: BaseException | None) -> None:
        _m().retried.labels(self._task(job.task), _tier(job.tier)).inc()
        self._ended(job, "retried")

    @_safe
    def dead(self, job: Job, letter: DeadLetter) -> None:
        if letter.poison:  # never reached a body (or its worker was lost every time)
            _m().poison.labels(_tier(letter.tier)).inc()
        _m().dead.labels(self._task(job.task), _tier(job.tier)).inc()
        self._ended(job, "dead")

    @_safe
    def lease_lost(self, job: Job, fence: int) -> None:
        _m().lease_lost.labels(self._task(job.task), _tier(job.tier)).inc()
        self._ended(job, "lease_lost")

    @_safe
    def commit_lost(self, job: Job, steps: tuple[str, ...]) -> None:
        _m().commits_lost.labels(self._task(job.task), _tier(job.tier)).inc()

    @_safe
    def deferred(self, job: Job, reason: str, delay_seconds: float) -> None:
        label = category(reason, DEFERRAL_REASONS)
        _m().deferred.labels(self._task(job.task), _tier(job.tier), label).inc()
        self._ended(job, "deferred")

    @_safe
    def duplicate(self, job: Job) -> None:
        _m().duplicates.labels(self._task(job.task), _tier(job.tier)).inc()

    @_safe
    def ledger_unavailable(self, job: Job, where: str) -> None:
        _m().ledger_unavailable.labels(category(where, UNAVAILABLE_WHERE)).inc()

    @_safe
    def breaker(self, name: str, old: str, new: str) -> None:
        _m().breaker_transitions.labels(name, category(new, BREAKER_STATES)).inc()

    @_safe
    def shed(self, tier: str) -> None:
        _m().shed.labels(_tier(tier)).inc()

    @_safe
    def tenant_refused(self, tier: str, tenant: str, policy: str) -> None:
        label = tenant if tenant in self._named_tenants and tenant != OTHER else OTHER
        _m().tenant_refused.labels(_tier(tier), label, category(policy, REFUSALS)).inc()

    @_safe
    def throttle(self, queue: str, engaged: bool, reason: str | None) -> None:
        _m().throttle.labels(queue).set(1 if engaged else 0)

    @_safe
    def step_skipped(self, job: Job, step: str, reason: str) -> None:
        # A step's name is the app's code (a bounded set); the reason a fixed category.
        reason_label = category(reason, SKIP_REASONS)
        _m().steps_skipped.labels(
            self._task(job.task), _tier(job.tier), step[:64], reason_label
        ).inc()

    @_safe
    def degraded(self, job: Job, reason: str, fallback: str) -> None:
        # The option's label is the app's code (a bounded set); the reason a fixed category.
        _m().degraded.labels(
            self._task(job.task),
            _tier(job.tier),
            category(reason, FALLBACK_TRIGGERS),
            fallback[:64],
        ).inc()

    @_safe
    def late(self, job: Job, age_seconds: float, slo_seconds: float) -> None:
        _m().late.labels(self._task(job.task), _tier(job.tier)).inc()

    @_safe
    def workflow_step(self, workflow: str, step: str, seconds: float, ok: bool) -> None:
        outcome = "succeeded" if ok else "failed"
        _m().workflow_steps.labels(workflow, outcome).observe(max(seconds, 0.0))

    @_safe
    def workflow_ended(self, workflow: str, status: str) -> None:
        _m().workflows_ended.labels(workflow, category(status, WORKFLOW_ENDS)).inc()

    @_safe
    def outbox_published(self, tier: str, by: str, count: int) -> None:
        source = by if by in ("committer", "relay") else OTHER
        _m().outbox_published.labels(_tier(tier), source).inc(count)

    @_safe
    def scheduled(self, schedule: str, task: str, slot: float, lag_seconds: float) -> None:
        _m().schedule_lag.labels(schedule).observe(max(lag_seconds, 0.0))

    @_safe
    def schedule_skipped(self, schedule: str, task: str, slot: float, reason: str) -> None:
        _m().schedule_skipped.labels(schedule, reason).inc()

    @_safe
    def clock_read(self, reading: Reading) -> None:
        server = reading.server if reading.server in CLOCK_SERVERS else OTHER
        _m().clock_offset.labels(server).set(reading.offset_seconds)
        _m().clock_error.labels(server).set(reading.error_seconds)

    # (triggers are the app's declarations, a bounded set: their names are the labels)
    @_safe
    def trigger_change(self, trigger: str) -> None:
        _m().trigger_changes.labels(trigger).inc()

    @_safe
    def trigger_waited(self, trigger: str, tier: str) -> None:
        _m().trigger_waits.labels(trigger, _tier(tier)).inc()

    @_safe
    def trigger_problem(self, trigger: str, namespace: str, problem: str, detail: str) -> None:
        _m().trigger_problems.labels(trigger, category(problem, TRIGGER_PROBLEMS)).inc()


TRIGGER_PROBLEMS = frozenset({"invalidated", "history_lost", "invalid_token", "stuck"})
REFUSALS = frozenset({"shed", "reject", "block"})


def instrument(
    observers: Any,
    known_tasks: Callable[[], Container[str]] = tuple,
    named_tenants: Container[str] = (),
) -> MetricsObserver:
    """Add the metrics observer and the queue-wait signal handler (recorded once enabled);
    ``known_tasks`` gives the names of the app's tasks (its registry), ``named_tenants`` the
    tenants its ``LEDGER_TENANTS`` names."""
    observer = MetricsObserver(known_tasks, named_tenants)
    observers.add(observer)
    signals.task_prerun.connect(observe_queue_wait, weak=False, dispatch_uid="ledger-metrics")
    return observer


@_safe
def observe_queue_wait(sender: Any = None, **_: Any) -> None:
    """``task_prerun``: now minus the message's ``ledger_sent_at`` (clamped at 0)."""
    request = getattr(sender, "request", None)
    if request is None:
        return
    sent_at = float_or_none(_header(request, headers.SENT_AT))
    if sent_at is None:
        return
    tier = _header(request, headers.TIER) or getattr(sender, "tier", None)
    runtime = getattr(getattr(sender, "app", None), "runtime", None)
    # (the broker's clock, as the header was stamped)
    now = runtime.message_time() if runtime is not None else last_known_time("broker")
    wait = max(now - sent_at, 0.0)
    _m().queue_wait.labels(str(sender.name), _tier(tier)).observe(wait)


def _header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None and isinstance(request.headers, dict):
        value = request.headers.get(name)
    return value


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
        "celery_ledger_commits_lost_total",
        "celery_ledger_poison_messages_total",
        "celery_ledger_publishes_shed_total",
        "celery_ledger_tenant_refusals_total",
        "celery_ledger_breaker_transitions_total",
        "celery_ledger_ledger_command_failures_total",
        "celery_ledger_ledger_unavailable_total",
        "celery_ledger_workflows_ended_total",
        "celery_ledger_steps_skipped_total",
        "celery_ledger_degraded_total",
        "celery_ledger_late_total",
        "celery_ledger_outbox_published_total",
        "celery_ledger_schedule_slots_skipped_total",
        *(
            f"{name}_{suffix}"
            for name in (
                "celery_ledger_task_duration_seconds",
                "celery_ledger_queue_wait_seconds",
                "celery_ledger_ledger_command_seconds",
                "celery_ledger_workflow_step_seconds",
                "celery_ledger_schedule_lag_seconds",
            )
            for suffix in ("bucket", "sum", "count")
        ),
        "celery_ledger_throttle_engaged",
        "celery_ledger_clock_offset_seconds",
        "celery_ledger_clock_error_seconds",
        # change-stream triggers
        "celery_ledger_trigger_changes_total",
        "celery_ledger_trigger_waits_total",
        "celery_ledger_trigger_problems_total",
        # sampled on scrape by the worker's exporter
        "celery_ledger_queue_depth",
        "celery_ledger_dead_letters",
        "celery_ledger_delayed_deliveries",
        "celery_ledger_unrecorded_jobs",
        "celery_ledger_parked_messages",
        "celery_ledger_parked_oldest_seconds",
        "celery_ledger_breaker_state",
        "celery_ledger_dependency_up",
        "celery_ledger_worker_consuming",
        "celery_ledger_workflows",
        "celery_ledger_tenant_waiting",
        "celery_ledger_tenant_running",
    }
)
