"""The platform's one extension point for observers: metrics, Sentry, logs (tracing later).

Subclass :class:`Observer` and override the events you need; every method does nothing by
default. The app's :class:`Observers` calls each observer in order and logs and swallows an
observer's exception: observing can never fail a task. Events:

    claimed(job, fence)                   a delivery took the lease and runs the body
    duplicate(job)                        a delivery of a finished job, not run
    deferred(job, reason, delay_seconds)  put off without an attempt (lease held, breaker open,
                                          ledger down, rate limited, unknown task)
    retried(job, delay_seconds, error)    a failed attempt will be retried
    succeeded(job, seconds)               the outcome is recorded
    dead(job, letter)                     the job is dead-lettered (a DeadLetter)
    lease_lost(job, fence)                a newer claim took over; this holder stopped
    ledger_unavailable(job, where)        a ledger call failed for now; the job is kept
    commit_lost(job, steps)               the ledger lost atomic steps it had acknowledged;
                                          the job runs again (a server losing commits)
    breaker(name, old, new)               a circuit breaker changed state
    shed(tier)                            a publish was shed by backpressure
    tenant_refused(tier, tenant, policy)  a tenant's publish past its max_waiting was refused
                                          by its tier's policy (shed, reject, block timed out)
    throttle(queue, engaged, reason)      bulk consumption paused or resumed
    step_skipped(job, step, reason)       an optional step was skipped (the job goes on)
    degraded(job, reason, fallback)       a fallback's answer was recorded instead of waiting
    late(job, age_seconds, slo_seconds)   a job is past its latency objective (once per job)
    workflow_step(workflow, step, seconds, ok)
                                          a workflow recorded a step's outcome, ``seconds``
                                          after it scheduled the step
    workflow_ended(workflow, status)      a workflow ended (completed, failed, compensated, ...)
    clock_read(reading)                   a server's clock was read (its offset from this host's)
    scheduled(schedule, task, slot, lag)  a periodic run was sent for its slot
    schedule_skipped(schedule, task, slot, reason)
                                          a slot passed without a run (its entry paused)
    trigger_change(trigger)               a change-stream trigger turned a change into a job
    trigger_waited(trigger, tier)         a trigger stopped reading: its tier is above its mark
    trigger_problem(trigger, namespace, problem, detail)
                                          a trigger stopped (its stream invalidated, its
                                          history lost, ...) until an operator resets it
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .clock import Reading
    from .ledger.dead import DeadLetter

logger = logging.getLogger("celery_ledger.events")


@dataclass(frozen=True, slots=True)
class Job:
    """Which job an event is about."""

    task: str
    tier: str | None
    record_id: str
    key: str | None = None


class Observer:
    """Base class of observers: every event method does nothing unless overridden."""

    def claimed(self, job: Job, fence: int) -> None:
        """A delivery took the lease (fencing token ``fence``) and runs the body."""

    def duplicate(self, job: Job) -> None:
        """A delivery of a job that already finished was acknowledged without running."""

    def deferred(self, job: Job, reason: str, delay_seconds: float) -> None:
        """A delivery was put off for ``delay_seconds`` without using an attempt."""

    def retried(self, job: Job, delay_seconds: float, error: BaseException | None) -> None:
        """A failed attempt is retried after ``delay_seconds``."""

    def succeeded(self, job: Job, seconds: float) -> None:
        """The body's outcome is recorded, ``seconds`` after the claim."""

    def dead(self, job: Job, letter: DeadLetter) -> None:
        """The job is dead-lettered."""

    def lease_lost(self, job: Job, fence: int) -> None:
        """A newer claim took over while this holder (``fence``) ran."""

    def ledger_unavailable(self, job: Job, where: str) -> None:
        """A ledger call (``where``) failed for now; the job is deferred or requeued."""

    def commit_lost(self, job: Job, steps: tuple[str, ...]) -> None:
        """The ledger no longer has atomic ``steps`` whose commit it acknowledged to this
        attempt: the success was not recorded and the job runs again."""

    def breaker(self, name: str, old: str, new: str) -> None:
        """Circuit breaker ``name`` went from ``old`` to ``new``."""

    def shed(self, tier: str) -> None:
        """A publish to ``tier`` was shed by backpressure (kept as a replayable dead letter)."""

    def tenant_refused(self, tier: str, tenant: str, policy: str) -> None:
        """A publish of ``tenant``'s job to ``tier`` found the tenant past its ``max_waiting``
        and was refused by the tier's ``policy``: ``shed`` (kept as a replayable dead letter),
        ``reject`` or ``block`` (its wait timed out: :class:`Backpressure` raised)."""

    def throttle(self, queue: str, engaged: bool, reason: str | None) -> None:
        """This worker paused (``engaged``) or resumed consuming ``queue``."""

    def step_skipped(self, job: Job, step: str, reason: str) -> None:
        """An optional step of ``job`` was skipped (its dependency down, or short of time):
        the job goes on degraded. ``reason`` names the error's type, never its text."""

    def degraded(self, job: Job, reason: str, fallback: str) -> None:
        """``job`` succeeded with its fallback's answer (``fallback``: the option that served)
        instead of waiting: ``reason`` is the trigger (circuit-open, timeout,
        retries-exhausted)."""

    def late(self, job: Job, age_seconds: float, slo_seconds: float) -> None:
        """``job`` is past its latency objective (reported once per job)."""

    def workflow_step(self, workflow: str, step: str, seconds: float, ok: bool) -> None:
        """Workflow ``workflow`` recorded the outcome of its step ``step`` (a task or a child
        workflow), ``seconds`` after it scheduled it; ``ok``: succeeded."""

    def workflow_ended(self, workflow: str, status: str) -> None:
        """A workflow ended with ``status``."""

    def outbox_published(self, tier: str, by: str, count: int) -> None:
        """``count`` jobs enqueued in an app's transaction were published to ``tier``, ``by``
        the process that committed them (``committer``) or the outbox relay (``relay``)."""

    def clock_read(self, reading: Reading) -> None:
        """A server's clock was read (:class:`celery_ledger.clock.Reading`: its offset from
        this host's clock, within its error)."""

    def scheduled(self, schedule: str, task: str, slot: float, lag_seconds: float) -> None:
        """A run of the schedule entry ``schedule`` (of ``task``) for ``slot`` (unix time) was
        sent, ``lag_seconds`` after its slot (celery beat's, or the fleet's scheduler)."""

    def schedule_skipped(self, schedule: str, task: str, slot: float, reason: str) -> None:
        """The slot ``slot`` of the schedule entry ``schedule`` passed without a run
        (``reason``: ``paused``, an operator paused the entry)."""

    def trigger_change(self, trigger: str) -> None:
        """The change-stream trigger ``trigger`` turned a change into a job."""

    def trigger_waited(self, trigger: str, tier: str) -> None:
        """The trigger ``trigger`` stopped reading: its ``tier`` is above its mark (it reads
        on once there is room; reported once per wait)."""

    def trigger_problem(self, trigger: str, namespace: str, problem: str, detail: str) -> None:
        """The trigger ``trigger`` (on ``namespace``) stopped: ``problem`` is ``invalidated``,
        ``history_lost``, ``invalid_token`` or ``stuck``; its changes are no longer turned
        into jobs until it is reset (reported once, by the watcher that found it)."""


EVENTS: tuple[str, ...] = tuple(
    name for name, value in vars(Observer).items() if callable(value) and not name.startswith("_")
)


class Observers(Observer):
    """Calls every registered observer in order; an observer's failure is logged and dropped."""

    def __init__(self, *observers: Observer) -> None:
        self._observers: list[Observer] = list(observers)

    def add(self, observer: Observer) -> Observer:
        self._observers.append(observer)
        return observer

    def __iter__(self) -> Any:
        return iter(self._observers)

    def _dispatch(self, event: str, *args: Any) -> None:
        for observer in self._observers:
            try:
                getattr(observer, event)(*args)
            except Exception:
                logger.warning("observer %r failed on %s", observer, event, exc_info=True)

    def claimed(self, job: Job, fence: int) -> None:
        self._dispatch("claimed", job, fence)

    def duplicate(self, job: Job) -> None:
        self._dispatch("duplicate", job)

    def deferred(self, job: Job, reason: str, delay_seconds: float) -> None:
        self._dispatch("deferred", job, reason, delay_seconds)

    def retried(self, job: Job, delay_seconds: float, error: BaseException | None) -> None:
        self._dispatch("retried", job, delay_seconds, error)

    def succeeded(self, job: Job, seconds: float) -> None:
        self._dispatch("succeeded", job, seconds)

    def dead(self, job: Job, letter: DeadLetter) -> None:
        self._dispatch("dead", job, letter)

    def lease_lost(self, job: Job, fence: int) -> None:
        self._dispatch("lease_lost", job, fence)

    def ledger_unavailable(self, job: Job, where: str) -> None:
        self._dispatch("ledger_unavailable", job, where)

    def commit_lost(self, job: Job, steps: tuple[str, ...]) -> None:
        self._dispatch("commit_lost", job, steps)

    def breaker(self, name: str, old: str, new: str) -> None:
        self._dispatch("breaker", name, old, new)

    def shed(self, tier: str) -> None:
        self._dispatch("shed", tier)

    def tenant_refused(self, tier: str, tenant: str, policy: str) -> None:
        self._dispatch("tenant_refused", tier, tenant, policy)

    def throttle(self, queue: str, engaged: bool, reason: str | None) -> None:
        self._dispatch("throttle", queue, engaged, reason)

    def step_skipped(self, job: Job, step: str, reason: str) -> None:
        self._dispatch("step_skipped", job, step, reason)

    def degraded(self, job: Job, reason: str, fallback: str) -> None:
        self._dispatch("degraded", job, reason, fallback)

    def late(self, job: Job, age_seconds: float, slo_seconds: float) -> None:
        self._dispatch("late", job, age_seconds, slo_seconds)

    def workflow_step(self, workflow: str, step: str, seconds: float, ok: bool) -> None:
        self._dispatch("workflow_step", workflow, step, seconds, ok)

    def workflow_ended(self, workflow: str, status: str) -> None:
        self._dispatch("workflow_ended", workflow, status)

    def outbox_published(self, tier: str, by: str, count: int) -> None:
        self._dispatch("outbox_published", tier, by, count)

    def clock_read(self, reading: Reading) -> None:
        self._dispatch("clock_read", reading)

    def scheduled(self, schedule: str, task: str, slot: float, lag_seconds: float) -> None:
        self._dispatch("scheduled", schedule, task, slot, lag_seconds)

    def schedule_skipped(self, schedule: str, task: str, slot: float, reason: str) -> None:
        self._dispatch("schedule_skipped", schedule, task, slot, reason)

    def trigger_change(self, trigger: str) -> None:
        self._dispatch("trigger_change", trigger)

    def trigger_waited(self, trigger: str, tier: str) -> None:
        self._dispatch("trigger_waited", trigger, tier)

    def trigger_problem(self, trigger: str, namespace: str, problem: str, detail: str) -> None:
        self._dispatch("trigger_problem", trigger, namespace, problem, detail)
