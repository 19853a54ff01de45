"""The execution guard: claim the ledger record, run the body once, record the outcome.

A small state machine over one :class:`Delivery` (which job, which message, what it carries).
Before the claim: the task's breaker and rate bucket may put the delivery off (no attempt used).
The claim then decides:

    duplicate   the job already succeeded          acknowledge (or return its result to
                                                   a chain or callbacks)
    dead        the job is dead-lettered           acknowledge; replay is the way back
    busy        another delivery holds the lease   put off until the lease ends
    unavailable the ledger cannot be reached       put off with backoff
    claimed     this delivery holds the lease      run the body under an :class:`Attempt`

An attempt ends in exactly one outcome, each one method of :class:`Attempt`, each written under
the attempt's fencing token: ``succeeded``, ``retry``, ``failed`` (dead), ``retired`` (out of
budget), ``interrupted`` (warm shutdown), ``circuit_open``, ``lease_lost``,
``ledger_unavailable``, ``ignored``, ``rejected``, ``replaced``. The guard returns a
:class:`Verdict` that the Celery adapter (:mod:`celery_ledger.task`) turns into Celery's control
flow: return a value, acknowledge, requeue, or raise. Nothing is dropped: a delivery that is not
run is acknowledged only once another message or the ledger's record will bring the job back.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol, TypeVar

import redis
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded

from . import headers, tracecontext, wire
from .crypto import REDACTED, Sealer
from .deadletter import DeadLetters
from .errors import (
    CircuitOpen,
    CommitLost,
    Interrupted,
    LeaseLost,
    LedgerError,
    LedgerUnavailable,
    NotApplied,
    PayloadError,
    PermanentError,
    RetryNotPublished,
    StoreError,
)
from .events import Job
from .exits import readable, text_of, worker_stopping
from .fallback_serving import Fallbacks
from .identity import Identity
from .ledger.dead import DeadJob, DeadLetter, error_entry, format_traceback
from .ledger.message import KeptMessage
from .ledger.ports import GuardStore
from .ledger.record import ErrorEntry
from .ledger.store import ClaimOutcome, Fenced, HeldBy, Unclaimed, new_op, objective
from .policies.backoff import backoff_seconds
from .policies.breaker import Admission, CircuitBreaker
from .policies.deadline import deadline
from .policies.fallback import Call, Cause, Fallback, cause_of
from .policies.rate_limit import first_wait
from .policies.retry import RetryPolicy, classify, decide
from .policies.tenants import TenantSlot, leave_slot, slot_admitted, slot_keeper
from .policies.unrunnable import unrunnable_delay
from .progress import Execution, Heartbeat
from .runtime import Runtime
from .untrusted import storable

logger = logging.getLogger("celery_ledger.guard")
_STRICT_JSON = json.JSONEncoder(allow_nan=False)  # json.dumps(allow_nan=False)'s, made once


class Replaced(Ignore):  # type: ignore[misc]
    """Raised by a task replaced by another (``Task.replace``): ``task_id`` runs instead."""

    def __init__(self, task_id: str) -> None:
        super().__init__(f"replaced by {task_id}")
        self.task_id = task_id


@dataclass(frozen=True)
class TaskPolicy:
    """What the guard needs to know of the task (its options, resolved)."""

    name: str
    retry_policy: RetryPolicy
    lease_seconds: float
    heartbeat_seconds: float | None = None  # None: a third of the lease; 0: off
    sensitive: bool = False
    breaker: str | None = None
    rate_bucket: str | None = None
    max_age_seconds: float | None = None
    max_attempts: int | None = None
    retry_on: tuple[type[BaseException], ...] = ()
    fail_on: tuple[type[BaseException], ...] = ()
    outages: tuple[type[BaseException], ...] = ()  # the platform's own: retried, no fallback
    soft_time_limit: float | None = None
    deadline_seconds: float | None = None  # bounds the body's bounded()/hedged() calls
    fallback: Fallback | None = None  # what to serve instead of waiting (policies/fallback.py)
    slo_seconds: float | None = None  # the latency objective: older unfinished jobs are late


@dataclass(frozen=True)
class Delivery:
    """One delivery of a message: the job it names and what the message carries."""

    identity: Identity
    tier: str
    owner: str  # "<worker hostname>:<pid>": who holds the lease while the body runs
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    headers: Mapping[str, Any] = field(default_factory=dict)  # the message's (untrusted)
    retries: int = 0
    deferrals: int = 0
    # Deliveries before this one handed back alive without the ledger learning it (the
    # message's ``ledger_handed_back`` property): not lost workers to the poison check.
    handed_back: int = 0
    previous_delay: float | None = None
    enqueued_at: float | None = None
    expires: datetime | None = None
    wants_result: bool = False  # a chain or callbacks follow: a duplicate returns the result
    new: bool = False  # the message's ``ledger_new`` property (see headers.NEW)
    redelivered: bool = False  # a copy kombu restored (its worker died, or it was handed back)
    tenant_slot: TenantSlot | None = None  # whose job: the ``ledger_tenant`` property

    @property
    def record_id(self) -> str:
        return self.identity.record_id

    @property
    def job(self) -> Job:
        return Job(self.identity.task, self.tier, self.identity.record_id, self.identity.key)

    @property
    def first_publish(self) -> bool:
        """Whether the message says it is its job's first publish and no record was written
        for it (then the claim tries an insert). A hint: a wrong one costs at most two writes,
        never a wrong claim."""
        return self.new and not self.redelivered and self.retries == 0 and self.deferrals == 0

    def republish_headers(self, **changes: Any) -> dict[str, Any]:
        """The message's headers for a copy of it, with the validated key and tier."""
        updated = dict(self.headers)
        updated.update({headers.KEY: self.identity.key, headers.TIER: self.tier, **changes})
        for name in tracecontext.HEADERS:  # only valid ones travel on
            updated.pop(name, None)
        updated.update(tracecontext.carried(self.headers))
        tracecontext.stamp(updated)  # made inside an attempt: the copy is its child
        return updated

    def kept(self, sealer: Any) -> KeptMessage:
        """The message as the ledger keeps it (sealed with ``sealer`` when given)."""
        carried = self.republish_headers(retries=self.retries)  # (the tenant's a property)
        carried |= {"expires": self.expires.isoformat()} if self.expires is not None else {}
        carried |= {headers.TENANT: self.tenant_slot.tenant} if self.tenant_slot else {}
        return KeptMessage.of_call(self.args, self.kwargs, message_headers=carried, sealer=sealer)


class Body(Protocol):
    """What the Celery adapter does for the guard."""

    def start(self, execution: Execution) -> None:
        """The attempt begins: the body's API (checkpoints, steps) reaches ``execution``."""

    def run(self) -> Any:
        """Run the task's body with the delivery's arguments."""

    def defer(
        self,
        delay_seconds: float,
        message_headers: dict[str, Any],
        *,
        fresh: bool = False,
        handed_back: int = 0,
    ) -> None:
        """Publish the message again to arrive after ``delay_seconds`` (raises on failure);
        ``fresh``: as a new run (no retries used; no chain, callbacks, group or expiry);
        ``handed_back``: the copy's count of deliveries handed back alive (headers.HANDED_BACK)."""

    def retry(
        self, exc: BaseException, delay_seconds: float, message_headers: dict[str, Any]
    ) -> BaseException:
        """Celery's retry (publishes the retry; returns its ``Retry`` to raise).

        Raises:
            RetryNotPublished: the retry's message could not be published.
        """

    def on_retire(self, reason: str, artefacts: list[str]) -> None:
        """The task's cleanup hook for a retired job."""

    def named_arguments(self) -> dict[str, Any]:
        """The delivery's arguments by parameter name (for a fallback's cache key template)."""


@dataclass(frozen=True)
class Verdict:
    """How the delivery ends, for the Celery adapter."""

    kind: Literal["return", "ack", "requeue", "raise"]
    value: Any = None
    reason: str = ""

    @classmethod
    def ack(cls, reason: str) -> Verdict:
        return cls("ack", reason=reason)

    @classmethod
    def requeue(cls, reason: str) -> Verdict:
        return cls("requeue", reason=reason)

    @classmethod
    def returns(cls, value: Any) -> Verdict:
        return cls("return", value=value)

    @classmethod
    def raises(cls, exc: BaseException) -> Verdict:
        return cls("raise", value=exc)


class _Settled(Exception):
    """Carries a verdict out of a persistence failure (lease lost, ledger gone too long)."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.reason)
        self.verdict = verdict


class Guard:
    """Runs deliveries of ledger tasks (see the module docstring)."""

    def __init__(
        self,
        runtime: Runtime,
        dead_letters: DeadLetters,
        *,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtime = runtime
        self.ledger: GuardStore = runtime.ledger
        self.dead_letters = dead_letters
        self.settings = runtime.settings
        self.observers = runtime.observers
        self.sleep = sleep
        self.monotonic = monotonic
        self.fallbacks = Fallbacks(runtime)

    def run(
        self, delivery: Delivery, policy: TaskPolicy, body: Body, *, unbound: str | None = None
    ) -> Verdict:
        """Run one delivery; ``unbound`` says why its arguments do not bind the body's
        signature (then it waits for a worker with a matching version: :meth:`unrunnable`)."""
        problem = self.oversized(delivery)
        if problem is not None:
            return self._dead_before_claim(delivery, body, problem, "oversized", policy.sensitive)
        if unbound is not None:
            return self.unrunnable(delivery, policy, body, unbound)
        context = {"task_id": delivery.identity.message_id, "key": delivery.identity.key}
        breaker = self.runtime.breakers[policy.breaker] if policy.breaker else None
        admission = self._admit(breaker)
        instead: tuple[Cause, float | None] | None = None
        if admission is not None and not admission.allowed:
            fallback = policy.fallback
            if (
                fallback is None
                or not fallback.applies("circuit-open")
                or self._degraded_already(delivery)
            ):
                return self._circuit_open_before_claim(delivery, policy, body, breaker, admission)
            # Claimed to serve the fallback instead of waiting (the dependency is not called).
            instead, breaker, admission = ("circuit-open", admission.retry_at), None, None
        slot, runtime = delivery.tenant_slot, self.runtime
        if slot and not slot_admitted(runtime, slot, policy.lease_seconds):  # (before tokens)
            reason = f"tenant at its concurrency limit ({slot.tenant})"
            wait = self.settings.busy_recheck_seconds * random.uniform(0.5, 1.0)
            return self._defer(delivery, body, wait, reason)
        wait, bucket = first_wait(  # the tenant's shared bucket, then the task's
            runtime.tenant_rates.bucket(slot.tenant) if slot else None,
            runtime.rate_limits[policy.rate_bucket] if policy.rate_bucket else None,
        )
        if wait > 0:
            reason = f"rate limited ({bucket})"
            return self._defer(delivery, body, wait + random.uniform(0.0, wait * 0.2), reason)
        try:
            claim = self.ledger.claim(
                delivery.record_id,
                task=delivery.identity.task,
                key=delivery.identity.key,
                tier=delivery.tier,
                owner=delivery.owner,
                lease_seconds=policy.lease_seconds,
                message=delivery.kept(self.runtime.sealer if policy.sensitive else None),
                max_attempts=policy.max_attempts,
                alias=delivery.identity.alias,
                new=delivery.first_publish,
                handed_back=delivery.handed_back,
                **self._objective(delivery, policy),
            )
        except LedgerUnavailable as exc:
            # A claim sent whose reply was lost may have applied (and then holds its lease
            # until it ends): counted as handed back; one that never left did not.
            released = None if isinstance(exc, NotApplied) else False
            return self._ledger_unavailable_at_claim(delivery, body, exc, released=released)
        except StoreError as exc:
            reason = storable(f"the ledger refused the claim: {exc}")[:2000]
            return self._dead_before_claim(delivery, body, reason, "unstorable", policy.sensitive)
        if claim.outcome is ClaimOutcome.DUPLICATE:
            return self._duplicate(delivery)
        if claim.outcome is ClaimOutcome.DEAD:
            if claim.killed:
                self.dead_letters.announce_record(delivery.record_id, job=delivery.job)
            logger.warning(
                "delivery of dead job %s dropped; replay it to run again",
                delivery.record_id,
                extra=context,
            )
            return Verdict.ack("delivery of a dead job")
        if claim.outcome is ClaimOutcome.BUSY:
            assert claim.retry_at is not None
            leave_slot(slot)  # (the running delivery's, if it is a copy of this message)
            # Back when the lease ends, or sooner to see whether the holder finished (then this
            # delivery is a suppressed duplicate); a holder that died is taken over at lease end.
            wait = max((claim.retry_at - self.ledger.now()).total_seconds(), 0.0)
            wait = min(wait, self.settings.busy_recheck_seconds)
            delay = wait + random.uniform(0.05, 0.25 + wait * 0.1)
            return self._defer(delivery, body, delay, "leased by another delivery")
        if claim.outcome is ClaimOutcome.CONFLICT:
            return self._conflict(delivery, policy)
        replacing = False
        if policy.fallback is not None and not claim.created:
            try:
                replacing = self._replacing(delivery.record_id, claim.fence)
            except LedgerError as exc:  # not knowing, it must not run: back when it answers
                released = self._release_claim(delivery.record_id, claim.fence)
                if isinstance(exc, LedgerUnavailable):
                    return self._ledger_unavailable_at_claim(delivery, body, exc, released=released)
                return self._defer(
                    delivery,
                    body,
                    self.unavailable_delay(delivery),
                    f"could not read the claimed record: {exc}",
                    released=released,
                )
        attempt = Attempt(
            self, delivery, policy, body, claim.fence, breaker, admission, replacing=replacing
        )
        return attempt.run(instead=instead)

    def _objective(self, delivery: Delivery, policy: TaskPolicy) -> dict[str, Any]:
        """When the job is late (its objective from its first enqueue), for a new record."""
        if policy.slo_seconds is None:
            return {}  # (no clock to read)
        return objective(policy.slo_seconds, self.runtime.on_ledger_clock(delivery.enqueued_at))

    def _degraded_already(self, delivery: Delivery) -> bool:
        """Whether the job's record holds a degraded result (read only while the breaker is
        open, for a task with a fallback): then this delivery, its replacement, waits for the
        breaker instead of serving the fallback again (unknown: it waits, as without one)."""
        try:
            doc = self.ledger.find_raw(delivery.record_id)
        except LedgerError:
            return True
        return doc is not None and doc.get("degraded") is not None

    def _replacing(self, record_id: str, fence: int) -> bool:
        """Whether this claim took over a degraded result (then the attempt is its replacement:
        it never serves the fallback again, and a failure keeps the degraded result). Read from
        the record itself, once per claim of a task with a fallback."""
        doc = self.ledger.find_raw(record_id)
        return doc is not None and doc.get("fence") == fence and doc.get("degraded") is not None

    def _release_claim(self, record_id: str, fence: int) -> bool:
        """Give back a claim whose body did not run; whether the ledger recorded it."""
        try:
            self.ledger.release(record_id, fence, op=new_op(), refund_attempt=True)
        except LedgerError as exc:
            logger.info("could not release %s now (%s); its lease will end", record_id, exc)
            return False
        return True

    def oversized(self, delivery: Delivery) -> str | None:
        """Why the message's arguments are over the limit (published around our API), or None."""
        limit = self.settings.max_payload_bytes
        size = len(wire.dumps([list(delivery.args), delivery.kwargs]))
        if size > limit:
            return f"oversized message: arguments are {size} bytes, the limit is {limit}"
        return None

    def retire_held(
        self,
        identity: Identity,
        *,
        owner: str,
        reason: str,
        on_retire: Callable[[str, list[str]], None],
    ) -> bool:
        """Retire a job whose body the worker killed (hard time limit), if the killed process
        (``owner``) still holds its lease: a newer holder's job is never touched."""
        try:
            artefacts = list(self.ledger.load_progress(identity.record_id).get("artefacts", []))
        except LedgerError:
            artefacts = []
        dead = DeadJob.of_reason("retired", reason, task=identity.task)
        buried = self.ledger.bury(
            identity.record_id,
            dead,
            match=HeldBy(owner),
            task=identity.task,
            key=identity.key,
            tier="",
        )
        if not buried:
            logger.warning(
                "%s: not retired, its lease is no longer %s's", identity.record_id, owner
            )
            return False
        logger.error("%s retired: %s", identity.record_id, reason)
        try:
            on_retire(reason, artefacts)
        except Exception:
            logger.warning("cleanup of retired %s failed", identity.record_id, exc_info=True)
        self.dead_letters.announce_record(identity.record_id)
        return True

    def unrunnable(
        self, delivery: Delivery, policy: TaskPolicy, body: Body, problem: str
    ) -> Verdict:
        """The message's arguments do not bind the task's signature (another version of the
        task published it): put it off for a worker that can run it, within the window, then
        dead-letter it (replayable once the code and the message agree)."""
        later = unrunnable_delay(
            dict(delivery.headers),
            window_seconds=self.settings.unrunnable_window_seconds,
            now=self.runtime.message_time(),
        )
        if later is not None:
            delay, held = later
            held.update({headers.KEY: delivery.identity.key, headers.TIER: delivery.tier})
            return self._defer_with(
                delivery, body, delay, f"arguments do not bind: {problem}", held
            )
        sealer = self.runtime.sealer if policy.sensitive else None
        reason = f"arguments do not match the task's signature: {problem}"
        dead = DeadJob.of_reason(
            "bad-arguments", reason, task=policy.name, message=delivery.kept(sealer)
        )
        identity = delivery.identity
        try:
            buried = self.ledger.bury(
                identity.record_id,
                dead,
                match=Unclaimed(kill_waiting=True),
                task=identity.task,
                key=identity.key,
                tier=delivery.tier,
            )
        except LedgerError as exc:
            return Verdict.requeue(f"ledger unavailable recording a dead job: {exc}")
        if buried:
            self.dead_letters.announce_record(identity.record_id, job=delivery.job)
        return Verdict.ack(reason)

    # -- before a claim ------------------------------------------------------------------------

    def _admit(self, breaker: CircuitBreaker | None) -> Admission | None:
        if breaker is None:
            return None
        try:
            return breaker.admit()
        except redis.RedisError as exc:  # the breaker's store is down: fail open
            logger.warning("breaker %s unavailable (%s); calling through", breaker.name, exc)
            return None

    def _circuit_open_before_claim(
        self,
        delivery: Delivery,
        policy: TaskPolicy,
        body: Body,
        breaker: CircuitBreaker | None,
        admission: Admission,
    ) -> Verdict:
        """While the task's breaker is open, put the delivery off without claiming."""
        assert breaker is not None
        return self.wait_for_breaker(
            delivery, body, breaker.name, admission.retry_at, policy.slo_seconds
        )

    def wait_for_breaker(
        self,
        delivery: Delivery,
        body: Body,
        name: str,
        retry_at: float | None,
        slo_seconds: float | None = None,
        *,
        released: bool | None = None,
    ) -> Verdict:
        """Put the delivery off until breaker ``name`` lets calls through (noted on the
        record, so that its readers see why it waits). ``released``: see :meth:`_defer`."""
        # (a breaker's times are the broker's: its scripts read Redis's TIME)
        now = self.runtime.message_time()
        retry_at = retry_at or now + self.settings.busy_recheck_seconds
        try:
            self.ledger.record_deferral(
                delivery.record_id,
                task=delivery.identity.task,
                key=delivery.identity.key,
                tier=delivery.tier,
                reason=f"circuit {name!r} open",
                until=self.runtime.on_ledger_clock(retry_at),
                objective=objective(slo_seconds, self.runtime.on_ledger_clock(delivery.enqueued_at))
                if slo_seconds is not None
                else {},
            )
        except LedgerError as exc:
            logger.warning("could not record the deferral of %s: %s", delivery.record_id, exc)
        delay = max(retry_at - now, 0.0) + random.uniform(0.05, 0.5)
        return self._defer(delivery, body, delay, "circuit open", released=released)

    def _dead_before_claim(
        self, delivery: Delivery, body: Body, problem: str, group: str, sensitive: bool
    ) -> Verdict:
        """A message that must not (arguments over the limit, published around our API) or
        cannot (the ledger refused its claim for good) be claimed is dead, unclaimed. (A claim
        keeps the message on the record, which may be more than a document holds.) The message
        is kept with the dead record when the ledger takes it, else left out."""
        logger.error("%s: %s", delivery.record_id, problem)
        sealer = self.runtime.sealer if sensitive else None
        identity = delivery.identity
        if identity.alias is not None:  # the message's own id finds the job (AsyncResult)
            try:
                self.ledger.alias(
                    identity.alias,
                    record_id=identity.record_id,
                    task=identity.task,
                    key=identity.key,
                )
            except LedgerUnavailable as exc:
                return self._ledger_unavailable_at_claim(delivery, body, exc)
            except StoreError:
                logger.warning("no alias %s for %s", identity.alias, identity.record_id)
        for message in (delivery.kept(sealer), None):
            dead = DeadJob.of_reason(
                "failed", problem, task=identity.task, message=message, group=group
            )
            try:
                buried = self.ledger.bury(
                    delivery.record_id,
                    dead,
                    match=Unclaimed(),  # a live or finished job is only noted
                    task=identity.task,
                    key=identity.key,
                    tier=delivery.tier,
                )
            except StoreError:
                continue  # too large to keep: without it
            except LedgerUnavailable as exc:
                return self._ledger_unavailable_at_claim(delivery, body, exc)
            if buried:
                self.dead_letters.announce_record(delivery.record_id, job=delivery.job)
            return Verdict.raises(PermanentError(problem))
        return Verdict.requeue(f"could not record {problem}")

    def _ledger_unavailable_at_claim(
        self,
        delivery: Delivery,
        body: Body,
        exc: LedgerUnavailable,
        *,
        released: bool | None = None,
    ) -> Verdict:
        self.observers.ledger_unavailable(delivery.job, "claim")
        logger.warning("ledger unavailable at the claim of %s: %s", delivery.record_id, exc)
        delay = self.unavailable_delay(delivery)
        return self._defer(delivery, body, delay, "ledger unavailable", released=released)

    def unavailable_delay(self, delivery: Delivery) -> float:
        base, cap = (
            self.settings.unavailable_backoff_base_seconds,
            self.settings.unavailable_backoff_cap_seconds,
        )
        return max(backoff_seconds(delivery.deferrals, base_seconds=base, cap_seconds=cap), 0.2)

    def _duplicate(self, delivery: Delivery) -> Verdict:
        self.observers.duplicate(delivery.job)
        logger.info("duplicate suppressed: %s already succeeded", delivery.record_id)
        if delivery.wants_result:
            # The original run may have died before dispatching its chain or callbacks: return
            # the stored result so Celery dispatches them (their own records dedupe them).
            try:
                record = self.ledger.get_by_id(delivery.record_id)
            except LedgerUnavailable:
                return Verdict.requeue("ledger unavailable reading a duplicate's result")
            return Verdict.returns(None if record is None else record.result)
        return Verdict.ack("duplicate delivery of a succeeded job")

    def _conflict(self, delivery: Delivery, policy: TaskPolicy) -> Verdict:
        """The record id names another job (a record written by an older version)."""
        identity = delivery.identity
        reason = (
            f"identity conflict: record {identity.record_id} belongs to another job than"
            f" ({identity.task}, {identity.key})"
        )
        logger.error("%s; the message is kept as a dead letter", reason)
        sealer = self.runtime.sealer if policy.sensitive else None
        dead = DeadJob.of_reason(
            "poison", reason, task=identity.task, message=delivery.kept(sealer), group="conflict"
        )
        conflict_id = f"conflict-{identity.message_id}"
        try:
            self.ledger.bury(
                conflict_id,
                dead,
                match=Unclaimed(),
                task=identity.task,
                key=identity.key,
                tier=delivery.tier,
            )
        except LedgerError:
            return Verdict.requeue("ledger unavailable recording an identity conflict")
        self.dead_letters.announce_record(conflict_id, job=delivery.job)
        return Verdict.ack(reason)

    def _defer(
        self,
        delivery: Delivery,
        body: Body,
        delay: float,
        reason: str,
        *,
        released: bool | None = None,
    ) -> Verdict:
        """Publish the message again for ``delay`` seconds from now, then acknowledge this
        delivery. A deferral is not an attempt. If it cannot be published, requeue instead.

        ``released``: this delivery claimed the job, and the ledger recorded giving the claim
        back (True: that clears the record's count of deliveries without an outcome, so the
        copy's count of those handed back alive starts again from 0) or could not (False: the
        copy counts this one too, see headers.HANDED_BACK, so that the claim's poison check
        does not take it for a lost worker). None: no claim of this delivery is left."""
        message_headers = delivery.republish_headers(**{headers.DEFERRALS: delivery.deferrals + 1})
        count = {None: delivery.handed_back, True: 0, False: delivery.handed_back + 1}[released]
        return self._defer_with(delivery, body, delay, reason, message_headers, handed_back=count)

    def _defer_with(
        self,
        delivery: Delivery,
        body: Body,
        delay: float,
        reason: str,
        message_headers: dict[str, Any],
        *,
        handed_back: int | None = None,
    ) -> Verdict:
        count = delivery.handed_back if handed_back is None else handed_back
        try:
            body.defer(delay, message_headers, handed_back=count)
        except PayloadError as exc:
            # It can never be published again as it is: requeued, it would come straight back
            # for ever. Kept dead with its reason instead (sealed when the app can seal).
            problem = storable(f"cannot be put off ({reason}): {exc}")[:2000]
            sensitive = self.runtime.sealer.enabled
            return self._dead_before_claim(delivery, body, problem, "unpublishable", sensitive)
        except Exception as exc:
            # (The original goes back with the count it came with: a delivery handed back
            # alive that cannot publish its copy either counts as a lost worker.)
            # A requeue comes straight back: held here first (this pool process, not the
            # consumer), so a deferral that keeps failing cannot spin the broker and the ledger.
            hold = 0.5 + backoff_seconds(delivery.deferrals, base_seconds=0.5, cap_seconds=4.5)
            logger.error(
                "could not defer %s (%s); requeueing it in %.1fs", delivery.record_id, exc, hold
            )
            self.sleep(hold)
            return Verdict.requeue(f"could not defer: {exc}")
        logger.info("%s deferred by %.1fs: %s", delivery.record_id, delay, reason)
        self.observers.deferred(delivery.job, reason, delay)
        return Verdict.ack(f"deferred by {delay:.1f}s: {reason}")


class Attempt:
    """A claimed attempt: the body runs under ``fence``, and every outcome is written with it."""

    def __init__(
        self,
        guard: Guard,
        delivery: Delivery,
        policy: TaskPolicy,
        body: Body,
        fence: int,
        breaker: CircuitBreaker | None,
        admission: Admission | None,
        *,
        replacing: bool = False,
    ) -> None:
        self.guard = guard
        # The claim took over a degraded result: this attempt is its replacement.
        self.replacing = replacing
        self.ledger = guard.ledger
        self.delivery = delivery
        self.policy = policy
        self.body = body
        self.fence = fence
        self.breaker = breaker
        self.admission = admission
        self.started = guard.monotonic()
        self.context = {"task_id": delivery.identity.message_id, "fence": fence}
        self.execution: Execution | None = None

    @property
    def record_id(self) -> str:
        return self.delivery.record_id

    def run(self, *, instead: tuple[Cause, float | None] | None = None) -> Verdict:
        """Run the body; or with ``instead`` (a fallback's trigger that happened before the
        claim, and when the dependency may be called again) serve the fallback."""
        self.guard.observers.claimed(self.delivery.job, self.fence)
        # A replacement's age is its degraded result's: it runs whatever the first publish's age.
        expired = None if self.replacing else self._expiry_reason()
        if expired is not None:
            return self._settle(lambda: self.retired(expired, Verdict.ack("expired")))
        lease = self.policy.lease_seconds
        interval = (
            lease / 3 if self.policy.heartbeat_seconds is None else self.policy.heartbeat_seconds
        )
        keep_slot = slot_keeper(self.guard.runtime, self.delivery, lease)  # (a tenant's)
        heartbeat = Heartbeat(
            self.ledger,
            self.record_id,
            self.fence,
            lease_seconds=lease,
            interval_seconds=interval or lease,
            also=keep_slot,
        )
        if interval:
            heartbeat.start()
        execution = Execution(
            self.ledger,
            self.record_id,
            self.fence,
            heartbeat,
            lease,
            sealer=self.guard.runtime.sealer if self.policy.sensitive else None,
            time_limit=self.policy.soft_time_limit,
            on_skip=lambda step, reason: self.guard.observers.step_skipped(
                self.delivery.job, step, reason
            ),
            outages=self.policy.outages,
        )
        self.execution = execution
        try:
            self.body.start(execution)
            if instead is not None:
                return self._settle(lambda: self._serve_instead(*instead))
            return self._settle(self._run_body)
        finally:
            heartbeat.stop()

    def _serve_instead(self, trigger: Cause, retry_at: float | None) -> Verdict:
        """The task's breaker was open at the claim: serve its fallback, or (no option could
        serve) give the claim back and come back when the breaker lets calls through."""
        served = self.degrade(trigger, None, retry_at)
        if served is not None:
            return served
        # No option could serve: the claim is given back as if never taken (waiting for the
        # breaker costs no attempt, as it does not for a task without a fallback).
        released = self._release_quietly(refund_attempt=True)
        name = self.policy.breaker or "?"
        return self.guard.wait_for_breaker(
            self.delivery, self.body, name, retry_at, self.policy.slo_seconds, released=released
        )

    def _settle(self, outcome: Callable[[], Verdict]) -> Verdict:
        try:
            return outcome()
        except _Settled as settled:
            return settled.verdict

    def _run_body(self) -> Verdict:
        try:
            with (
                tracecontext.span("body", **{"ledger.fence": self.fence}),
                deadline(self.policy.deadline_seconds),
            ):
                retval = self.body.run()
        except Interrupted:
            return self.interrupted()
        except SoftTimeLimitExceeded as exc:
            limit = self.policy.soft_time_limit
            reason = (
                f"time limit exceeded (soft, {limit}s)"
                if limit is not None
                else "time limit exceeded (soft: SoftTimeLimitExceeded raised by the body)"
            )
            return self.retired(reason, Verdict.raises(exc))
        except CircuitOpen as exc:
            return self.circuit_open(exc)
        except RetryNotPublished as exc:
            return self.retry_not_published(exc)
        except Retry as exc:
            return self.retry(exc)
        except Replaced as exc:
            return self.replaced(exc)
        except Ignore as exc:
            return self.ignored(exc)
        except Reject as exc:
            return self.rejected(exc)
        except LeaseLost as exc:
            return self.lease_lost(exc)
        except LedgerUnavailable as exc:
            return self.ledger_unavailable(exc)
        except Exception as exc:
            return self.failed(_readable(exc))
        except BaseException as exc:
            if worker_stopping(exc):
                raise  # the pool ends this greenlet (a cold stop): as a killed process
            return self.not_an_exception(_readable(exc))
        return self.succeeded(retval)

    # -- outcomes -----------------------------------------------------------------------------

    def succeeded(
        self,
        retval: Any,
        *,
        degraded: Mapping[str, Any] | None = None,
        replace_at: datetime | None = None,
    ) -> Verdict:
        """Record the result (``degraded``: a fallback's, replaced at ``replace_at``)."""
        try:
            result_json = _STRICT_JSON.encode(retval)
        except (TypeError, ValueError, RecursionError) as exc:  # (nested past the stack)
            return self.dead(
                PermanentError(f"{self.policy.name} returned a value JSON cannot hold: {exc}"),
                reason=f"result not JSON: {exc}",
                verdict=Verdict.raises(PermanentError(f"result not JSON: {exc}")),
            )
        limit = self.guard.settings.max_result_bytes
        if len(result_json) > limit:
            reason = (
                f"result too large: {len(result_json)} bytes of JSON, the limit is {limit}"
                " (LEDGER_MAX_RESULT_BYTES)"
            )
            return self.dead(PermanentError(reason), reason=reason, verdict=None)
        if degraded is None:
            self._report_to_breaker(None)
        stored = (
            self.guard.runtime.sealer.seal(result_json) if self.policy.sensitive else result_json
        )
        late = self._late()
        op = new_op()
        steps = self._atomic_steps()
        self._persist(
            lambda: self.ledger.complete(
                self.record_id,
                self.fence,
                stored,
                op=op,
                atomic_steps=steps,
                degraded=degraded,
                replace_at=replace_at,
            ),
            "completion",
        )
        fallback = self.policy.fallback
        if degraded is None and fallback is not None and fallback.remembers:
            self.guard.fallbacks.remember(
                fallback,
                task=self.policy.name,
                key=self.delivery.identity.key,
                call=self._call(),
                stored=stored,
                sensitive=self.policy.sensitive,
            )
        self.guard.observers.succeeded(self.delivery.job, self.guard.monotonic() - self.started)
        if late is not None:
            self._report_late(late)
        return Verdict.returns(retval)

    def _late(self) -> float | None:
        """The job's age if it finishes past its latency objective (else None)."""
        slo, since = self.policy.slo_seconds, self.delivery.enqueued_at
        if slo is None or since is None or self.replacing:
            return None
        age = self.guard.runtime.message_time() - since  # (stamped on the broker's clock)
        return age if age > slo else None

    def _report_late(self, age: float) -> None:
        """Escalate a job that finished late, unless a sweep reported it already (once)."""
        slo = self.policy.slo_seconds
        try:
            marked = self.ledger.mark_late(self.record_id, slo_seconds=slo)
        except LedgerError as exc:  # the sweep sees it no more (finished): logged instead
            logger.warning(
                "%s finished late (%.0fs) and was not marked: %s", self.record_id, age, exc
            )
            return
        if marked:
            self.guard.observers.late(self.delivery.job, age, slo or 0.0)

    # -- fallbacks (policies/fallback.py) --------------------------------------------------------

    def degrade(
        self, trigger: Cause | None, cause: BaseException | None, retry_at: float | None
    ) -> Verdict | None:
        """Serve the task's fallback instead of waiting: ``succeeded``, marked degraded (and the
        real job scheduled to replace it). None when the task has no fallback for ``trigger``,
        this attempt is itself a replacement (it keeps the degraded result it replaces), or no
        option could serve."""
        fallback = self.policy.fallback
        if fallback is None or not fallback.applies(trigger) or self.replacing:
            return None
        assert trigger is not None
        identity = self.delivery.identity
        served = self.guard.fallbacks.serve(
            fallback,
            task=identity.task,
            key=identity.key,
            call=self._call(),
            sensitive=self.policy.sensitive,
        )
        if served is None:
            return None
        delay: float | None = None
        replace_at: datetime | None = None
        if fallback.replace:
            # When the breaker lets calls through again (a half-open probe), else after a while.
            delay = (
                max(retry_at - self.guard.runtime.message_time(), 0.0)
                if retry_at is not None
                else fallback.replace_after_seconds
            ) + random.uniform(0.05, 0.5)
            replace_at = self.ledger.now() + timedelta(seconds=delay)
        degraded = {"reason": trigger, "fallback": served.option}
        if cause is not None:
            degraded["error"] = type(cause).__name__
        verdict = self.succeeded(served.value, degraded=degraded, replace_at=replace_at)
        if verdict.kind != "return":
            return verdict  # the fallback's value could not be recorded: that outcome stands
        logger.warning(
            "%s degraded (%s): served %s%s",
            self.record_id,
            trigger,
            served.option,
            "" if delay is None else f"; the real job runs again in {delay:.0f}s",
            extra=self.context,
        )
        self.guard.observers.degraded(self.delivery.job, trigger, served.option)
        if delay is not None:
            self._schedule_replacement(delay)
        return verdict

    def _call(self) -> Call:
        try:
            named = self.body.named_arguments()
        except Exception:  # arguments that do not bind (a template over them fails instead)
            named = {}
        return Call(self.delivery.args, self.delivery.kwargs, named)

    def _schedule_replacement(self, delay: float) -> None:
        """Publish the job again, as the replacement of its degraded result: a fresh run (no
        retries used, no chain or callbacks: those ran with the degraded result, once). A lost
        publish is not a lost replacement: the record is claimable from its ``replace_at``, and
        the reconciler republishes it from its kept message once it has waited its stale time;
        whichever delivery claims it is the replacement (the record says so)."""
        message_headers = self.delivery.republish_headers(**{headers.DEFERRALS: 0})
        message_headers.pop(headers.PREVIOUS_DELAY, None)
        try:
            self.body.defer(delay, message_headers, fresh=True)
        except Exception as exc:
            logger.warning("replacement of degraded %s not published now: %s", self.record_id, exc)

    def _keep_degraded(self, reason: str, error: ErrorEntry | None) -> None:
        """The replacement of a degraded result ends without a result of its own (it failed
        for good, ran out of time, was rejected...): the degraded result stands, and the
        failure is kept in the error history. Not a dead letter: the job has its answer."""
        op = new_op()
        self._persist(
            lambda: self.ledger.keep_degraded(
                self.record_id, self.fence, error, op=op, reason=reason
            ),
            "degraded record",
        )
        logger.error(
            "replacement of degraded %s failed (%s); the degraded result stands",
            self.record_id,
            reason,
            extra=self.context,
        )

    def retry(self, retry: Retry) -> Verdict:
        """The body (or Celery's autoretry) asked for a retry, already published by Celery."""
        if retry.sig is None:
            # Raised by hand (``raise Retry()``), not by ``self.retry()``: nothing was
            # published, and a record left retrying would wait for the stale sweep.
            reason = (
                "the body raised celery.exceptions.Retry itself, which publishes nothing:"
                " call self.retry(...) (or raise a retryable error) to retry"
            )
            return self.dead(retry, reason=reason, verdict=Verdict.raises(PermanentError(reason)))
        self._report_to_breaker(retry.exc)
        delay = _seconds_until(retry.when, self.ledger.now())
        self._record_retry(retry.exc or retry, delay)
        return Verdict.raises(retry)

    def failed(self, exc: Exception) -> Verdict:
        """The body raised: retry with backoff if the error is retryable and budget is left."""
        self._report_to_breaker(exc)
        policy = self.policy
        decision = decide(
            exc,
            policy=policy.retry_policy,
            retries_done=self.delivery.retries,
            previous_delay=self.delivery.previous_delay,
            retry_on=policy.retry_on,
            fail_on=policy.fail_on,
        )
        # (a body's publish refused by the platform's own servers, out of retries, is kept
        # dead to be replayed: a fallback served then would hide the work it could not start)
        ours = isinstance(exc, policy.outages)
        retryable = not ours and classify(exc, retry_on=policy.retry_on, fail_on=policy.fail_on)
        trigger = cause_of(exc, retryable=retryable, retry_left=decision.retry)
        served = self.degrade(trigger, exc, None)
        if served is not None:
            return served
        if not decision.retry:
            return self.dead(exc, reason=decision.reason, verdict=Verdict.raises(exc))
        message_headers = self.delivery.republish_headers(
            **{headers.PREVIOUS_DELAY: decision.delay_seconds}
        )
        try:
            retry = self.body.retry(exc, decision.delay_seconds, message_headers)
        except RetryNotPublished as not_published:
            return self.retry_not_published(not_published)
        except PermanentError as unpublishable:  # (a retry that can never be published)
            reason = str(unpublishable)
            return self.dead(exc, reason=reason, verdict=Verdict.raises(unpublishable))
        self._record_retry(exc, decision.delay_seconds)
        return Verdict.raises(retry)

    def not_an_exception(self, exc: BaseException) -> Verdict:
        """The body raised a ``BaseException`` that is not an ``Exception`` (``sys.exit()``,
        ``KeyboardInterrupt``, ``GeneratorExit``...): a bug of the body, never retried. Celery
        is told of a ``PermanentError`` instead: one of these raised into it ends a solo
        worker, and a prefork pool process."""
        reason = (
            f"the body raised {type(exc).__module__}.{type(exc).__qualname__}, which is not"
            " an Exception: not retried"
        )
        return self.dead(exc, reason=reason, verdict=Verdict.raises(PermanentError(reason)))

    def _record_retry(self, exc: BaseException, delay: float) -> None:
        error = self._error(exc, "retry", planned_delay_seconds=delay)
        traceback = "" if self.policy.sensitive else storable(format_traceback(exc))
        op = new_op()
        self._persist(
            lambda: self.ledger.record_retry(
                self.record_id,
                self.fence,
                error,
                retry_at=self.ledger.now() + timedelta(seconds=delay),
                op=op,
                traceback=traceback,
                retries=self.delivery.retries + 1,
                previous_delay=delay,
            ),
            "retry record",
        )
        self.guard.observers.retried(self.delivery.job, delay, exc)

    def retry_not_published(self, exc: RetryNotPublished) -> Verdict:
        """The retry's message could not be published: give the claim back and requeue this
        delivery, which then runs as the retry."""
        logger.error("retry of %s not published (%s); requeueing it", self.record_id, exc)
        return self._release(f"retry not published: {exc}")

    def dead(self, exc: BaseException, *, reason: str, verdict: Verdict | None) -> Verdict:
        """Record the job dead with its reason and its kept message, then announce it."""
        job = DeadJob.of_exception(
            exc,
            reason=reason,
            error=self._error(exc, "dead"),
            message=self.delivery.kept(self._sealer()),
            sensitive=self.policy.sensitive,
        )
        self._bury(job)
        if self.replacing:  # the job has its (degraded) answer: not a failure to Celery
            return Verdict.ack(f"replacement failed, degraded result kept: {reason}")
        return verdict or Verdict.raises(exc)

    def retired(self, reason: str, verdict: Verdict) -> Verdict:
        """The job ran out of budget (time, age): dead, then its cleanup hook runs."""
        try:
            artefacts = list(self.ledger.load_progress(self.record_id).get("artefacts", []))
        except LedgerError:
            artefacts = []
        kept = self.delivery.kept(self._sealer())
        job = DeadJob.of_reason("retired", reason, task=self.policy.name, message=kept)
        self._bury(job)
        logger.error("%s retired: %s", self.record_id, reason)
        try:
            self.body.on_retire(reason, artefacts)
        except Exception:
            logger.warning("cleanup of retired %s failed", self.record_id, exc_info=True)
        if self.replacing:
            return Verdict.ack(f"replacement retired, degraded result kept: {reason}")
        return verdict

    def _bury(self, job: DeadJob) -> None:
        if self.replacing:  # every way a replacement can die keeps the degraded result
            self._keep_degraded(job.reason, job.error)
            return
        op = new_op()
        self._persist(
            lambda: self.ledger.bury(
                self.record_id,
                job,
                match=Fenced(self.fence, op),
                task=self.delivery.identity.task,
                key=self.delivery.identity.key,
                tier=self.delivery.tier,
            ),
            "dead record",
        )
        identity = self.delivery.identity
        letter = DeadLetter.of_job(
            self.record_id,
            job,
            task=identity.task,
            key=identity.key,
            tier=self.delivery.tier,
            now=self.ledger.now(),
        )
        self.guard.dead_letters.announce(letter, job=self.delivery.job)

    def interrupted(self) -> Verdict:
        """Warm shutdown: progress is checkpointed; the message goes back to the queue."""
        logger.warning(
            "%s interrupted by shutdown; requeued to resume from its checkpoint", self.record_id
        )
        return self._release("worker shutting down")

    def circuit_open(self, exc: CircuitOpen) -> Verdict:
        """A breaker used inside the body is open: serve the fallback, or give the claim back
        and come back later."""
        served = self.degrade("circuit-open", exc, exc.retry_at)
        if served is not None:
            return served
        released = self._release_quietly()
        now = self.guard.runtime.message_time()  # (a breaker's times are the broker's)
        delay = max((exc.retry_at or now) - now, 0.0) + random.uniform(0.05, 0.5)
        return self.guard._defer(
            self.delivery, self.body, delay, "circuit open (inside the body)", released=released
        )

    def lease_lost(self, exc: LeaseLost) -> Verdict:
        """A newer claim took over while the body ran: this delivery stops here."""
        logger.warning("%s: a newer claim took over; this holder stops", self.record_id)
        self.guard.observers.lease_lost(self.delivery.job, self.fence)
        return Verdict.ack("lease lost")

    def commit_lost(self, exc: CommitLost) -> Verdict:
        """The ledger lost atomic steps it had acknowledged (a server that did not keep a commit
        across a crash): the result must not be recorded without them. Give the claim back and
        run the job again soon; its steps run again with it."""
        logger.error("%s", exc)
        self.guard.observers.commit_lost(self.delivery.job, exc.steps)
        released = self._release_quietly()
        delay = self.guard.unavailable_delay(self.delivery)
        return self.guard._defer(
            self.delivery, self.body, delay, "ledger lost a commit", released=released
        )

    def ledger_unavailable(self, exc: LedgerUnavailable) -> Verdict:
        """A ledger call of the body's (checkpoint, step, heartbeat) failed for now: never a
        failure of the job. Give the claim back if the ledger lets us, and come back later."""
        logger.warning(
            "%s: ledger unavailable inside the body (%s); deferring", self.record_id, exc
        )
        self.guard.observers.ledger_unavailable(self.delivery.job, "body")
        released = self._release_quietly()
        delay = self.guard.unavailable_delay(self.delivery)
        return self.guard._defer(
            self.delivery,
            self.body,
            delay,
            "ledger unavailable (in the body)",
            released=released,
        )

    def ignored(self, exc: Ignore) -> Verdict:
        """The body raised ``Ignore``: the job ends here, terminal, with its reason."""
        op, steps, told = new_op(), self._atomic_steps(), self._told(exc)
        self._persist(
            lambda: self.ledger.finish_without_result(
                self.record_id,
                self.fence,
                outcome="ignored",
                note=storable(told),
                op=op,
                atomic_steps=steps,
            ),
            "finish",
        )
        return Verdict.ack(f"ignored by the task: {told}")

    def replaced(self, exc: Replaced) -> Verdict:
        """The body replaced itself (``Task.replace``): the job ends, naming its replacement."""
        op, steps = new_op(), self._atomic_steps()
        self._persist(
            lambda: self.ledger.finish_without_result(
                self.record_id,
                self.fence,
                outcome="replaced",
                note=f"replaced by {exc.task_id}",
                replaced_by=exc.task_id,
                op=op,
                atomic_steps=steps,
            ),
            "finish",
        )
        return Verdict.ack(f"replaced by {exc.task_id}")

    def rejected(self, exc: Reject) -> Verdict:
        """``Reject(requeue=True)`` hands the message back; ``Reject(requeue=False)`` ends the
        job dead (replayable) with the task's reason."""
        if exc.requeue:
            return self._release(f"rejected by the task (requeue): {self._told(exc.reason)}")
        reason = f"rejected by the task: {self._told(exc.reason)}"
        kept = self.delivery.kept(self._sealer())
        self._bury(DeadJob.of_reason("rejected", reason, task=self.policy.name, message=kept))
        return Verdict.ack(reason)

    def _told(self, text: object) -> str:
        """An ``Ignore``'s or ``Reject``'s text as kept and logged (a sensitive task's: none)."""
        return REDACTED if self.policy.sensitive else readable(text)

    def _sealer(self) -> Sealer | None:
        return self.guard.runtime.sealer if self.policy.sensitive else None

    # -- persistence ---------------------------------------------------------------------------

    def _release(self, reason: str) -> Verdict:
        op = new_op()
        self._persist(lambda: self.ledger.release(self.record_id, self.fence, op=op), "release")
        return Verdict.requeue(reason)

    def _atomic_steps(self) -> tuple[str, ...]:
        """The atomic steps this attempt's outcome relies on (a success needs them kept)."""
        return tuple(self.execution.atomic_steps) if self.execution is not None else ()

    def _release_quietly(self, *, refund_attempt: bool = False) -> bool:
        """Give the claim back now if the ledger answers; else its lease ends by itself.
        Whether the ledger recorded it."""
        try:
            self.ledger.release(
                self.record_id, self.fence, op=new_op(), refund_attempt=refund_attempt
            )
        except LedgerError as exc:
            logger.info("could not release %s now (%s); its lease will end", self.record_id, exc)
            return False
        return True

    def _hand_back(self, reason: str) -> Verdict:
        """The attempt's outcome could not be recorded (the ledger is unreachable): the message
        goes back, put off while the ledger recovers, counting this delivery as handed back
        alive (its claim stays on the record until its lease ends)."""
        delay = self.guard.unavailable_delay(self.delivery)
        return self.guard._defer(self.delivery, self.body, delay, reason, released=False)

    def _persist(self, write: Callable[[], Any], what: str) -> None:
        """Run a fenced write, retrying while the ledger is unreachable until most of the lease
        is spent (past that, another delivery may take over anyway; no pause outlasts it).

        Raises:
            _Settled: the lease was lost (acknowledge), or the write could not be made
                (requeue: the ledger decides again on redelivery).
        """
        deadline = self.guard.monotonic() + self.policy.lease_seconds * 0.8
        attempt, spent = 0, False
        while True:
            try:
                write()
                return
            except LeaseLost as lost:
                logger.warning("%s of %s refused: a newer claim took over", what, self.record_id)
                raise _Settled(self.lease_lost(lost)) from None
            except CommitLost as exc:
                raise _Settled(self.commit_lost(exc)) from None
            except SoftTimeLimitExceeded:
                # The soft limit struck while the outcome was being written (it strikes once):
                # the write is repeated with its operation id, so it recognises itself if it
                # applied. Left to escape, the job would stay running and its body run again.
                logger.warning(
                    "%s of %s interrupted by the soft time limit; repeating it",
                    what,
                    self.record_id,
                )
                continue
            except LedgerUnavailable as exc:
                left = deadline - self.guard.monotonic()
                if spent or left <= 0:
                    logger.error(
                        "%s of %s failed, ledger unreachable; handing the message back",
                        what,
                        self.record_id,
                    )
                    raise _Settled(self._hand_back(f"{what} failed: {exc}")) from exc
                pause = backoff_seconds(attempt, base_seconds=0.2, cap_seconds=5.0) + 0.05
                attempt, spent = attempt + 1, pause >= left  # (spent: no more pauses after it)
                self.guard.sleep(min(pause, left))
            except StoreError as exc:
                raise _Settled(self._unstorable(what, exc)) from exc

    def _unstorable(self, what: str, exc: StoreError) -> Verdict:
        """The ledger refused an outcome write for good (too large, invalid): record the job
        dead with that reason in a minimal write, so the body never runs again for it."""
        reason = storable(f"the ledger refused the {what}: {exc}")[:2000]
        logger.error("%s: %s", self.record_id, reason)
        if self.replacing and what != "degraded record":
            try:
                self._keep_degraded(reason, None)
            except _Settled as settled:
                return settled.verdict
            return Verdict.raises(PermanentError(reason))
        dead = DeadJob.of_reason("failed", reason, task=self.policy.name, group="unstorable")
        op = new_op()
        try:
            self.ledger.bury(
                self.record_id,
                dead,
                match=Fenced(self.fence, op),
                task=self.delivery.identity.task,
                key=self.delivery.identity.key,
                tier=self.delivery.tier,
            )
        except LeaseLost as lost:
            return self.lease_lost(lost)
        except LedgerError as again:
            logger.error(
                "could not record %s dead either (%s); handing it back", self.record_id, again
            )
            return self._hand_back(reason)
        self.guard.dead_letters.announce_record(self.record_id, job=self.delivery.job)
        return Verdict.raises(PermanentError(reason))

    # -- helpers -------------------------------------------------------------------------------

    def _error(self, exc: BaseException, action: str, **extra: Any) -> Any:
        return error_entry(
            exc,
            owner=self.delivery.owner,
            attempt=self.delivery.retries + 1,
            fence=self.fence,
            action=action,
            at=self.ledger.now(),
            redact=self.policy.sensitive,
            **extra,
        )

    def _expiry_reason(self) -> str | None:
        """Why the job must not run any more (its ``max_age_seconds``, or Celery's ``expires``
        enforced here: see ``LedgerRequest``), or None."""
        age_limit = self.policy.max_age_seconds
        sent_at = self.delivery.enqueued_at
        now = self.guard.runtime.message_time()  # a message's times are the broker's
        if age_limit is not None and sent_at is not None and now - sent_at > age_limit:
            return f"expired: enqueued {now - sent_at:.0f}s ago (max age {age_limit:.0f}s)"
        expires = self.delivery.expires
        if expires is not None and expires <= datetime.fromtimestamp(now, UTC):
            return f"expired: the message expired at {expires.isoformat()} before it ran"
        return None

    def _report_to_breaker(self, exc: BaseException | None) -> None:
        """Count the call's outcome: retryable errors are the dependency's failures."""
        if self.breaker is None or self.admission is None or isinstance(exc, self.policy.outages):
            return  # (nor the platform's own outages: not the dependency's failure or success)
        failed = exc is not None and classify(
            exc, retry_on=self.policy.retry_on, fail_on=self.policy.fail_on
        )
        try:
            if failed:
                self.breaker.record_failure(probe=self.admission.probe)
            else:
                self.breaker.record_success(probe=self.admission.probe)
        except redis.RedisError as error:
            logger.warning("could not report to breaker %s: %s", self.breaker.name, error)


def _seconds_until(when: Any, now: datetime) -> float:
    """Seconds until a retry is due, from ``Retry.when`` (an eta datetime or a countdown)."""
    if isinstance(when, datetime):
        aware = when if when.tzinfo else when.replace(tzinfo=UTC)
        return max((aware - now).total_seconds(), 0.0)
    if isinstance(when, int | float) and not isinstance(when, bool):
        return max(float(when), 0.0)
    return 0.0


_E = TypeVar("_E", bound=BaseException)


def _readable(exc: _E) -> _E | PermanentError:
    """``exc``, or a :class:`PermanentError` naming its type when its text cannot be read (its
    ``__str__`` or ``__repr__`` raises): every record of a failure writes the text, and a raise
    there would leave the job running without an outcome until its lease ended, again at every
    delivery. Such an error is the body's bug: not retried."""
    if text_of(exc) is None:
        return PermanentError(
            f"{type(exc).__module__}.{type(exc).__qualname__} raised; its text could not be"
            " read (its __str__ or __repr__ raised)"
        )
    return exc
