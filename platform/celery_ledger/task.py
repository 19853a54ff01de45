"""LedgerTask: the base task class of every celery-ledger app (the Celery adapter of the guard).

In the worker, ``__call__`` turns Celery's request into a :class:`~celery_ledger.guard.Delivery`,
lets the guard run it, and turns the guard's verdict into Celery's control flow. On the publish
side, ``apply_async`` gives every job its identity (task name and idempotency key, and the task
id derived from them), its tier and its ledger headers, and applies backpressure and
dedupe-on-publish. :class:`LedgerRequest` is the message in the worker's main process: it leaves
expiry to the guard and retires a job whose body the worker killed at its hard time limit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeAlias

import redis
from celery import Task
from celery.canvas import Signature
from celery.exceptions import Ignore, Reject, Retry
from celery.result import AsyncResult
from celery.worker.request import Request
from kombu.exceptions import EncodeError

from . import bulk_publish, headers
from .admission import ADMITTED, NEVER_SHED, WORKFLOW_STEP
from .conf_check import task_problems
from .crypto import REDACTED, SEALED_SERIALIZER, sealing
from .errors import (
    Backpressure,
    ConfigurationError,
    IdentityError,
    LedgerError,
    LedgerUnavailable,
    PayloadError,
    PermanentError,
    RetryNotPublished,
)
from .exits import readable
from .guard import Delivery, Replaced, TaskPolicy, Verdict
from .identity import (
    Identity,
    KeySpec,
    bind_arguments,
    compute_key,
    derive_task_id,
    identity_of,
    option_as_given,
    slot_of_key,
    validate_key,
    why_unbound,
)
from .ledger.dead import DeadJob
from .ledger.message import KeptMessage
from .ledger.store import EnqueueOutcome, QueuedJob, Unclaimed, objective
from .policies.backoff import Jitter
from .policies.fallback import Fallback
from .policies.retry import RetryPolicy
from .progress import Execution, Step, batches
from .publish_checks import PUBLISH_OUTAGES, check_call_options, due_time, payload_json
from .schedules import BEAT_HEADER, note_foreign_beat
from .tenancy import TenantSpec, tenant_of_call, tenant_slot_of
from .untrusted import (
    expiry_of,
    float_or_none,
    redelivered,
    request_header,
    request_property,
    retries_done,
)

if TYPE_CHECKING:
    from .app import LedgerCelery

logger = logging.getLogger("celery_ledger.task")
# Celery's result handle, by a name the class body's own AsyncResult method does not shadow.
_Result: TypeAlias = AsyncResult

# Options a call may not pass through to the broker: the ledger owns them.
_LEDGER_OWNED_OPTIONS = ("ignore_result", *headers.PROPERTIES)
# Options a job enqueued in a transaction cannot carry: its record keeps the call only.
_NOT_IN_OUTBOX = ("chain", "countdown", "eta", "expires")
# Marks a publish of a delivery's own arguments again (a retry, a deferral): see
# ``signature_from_request``.
_REPUBLISH = "ledger_republish"
# A deferral's count of deliveries handed back alive (see headers.HANDED_BACK): an option only
# the guard's deferral passes, made the copy's message property by the publish.
_HANDED_BACK = "ledger_handed_back_count"
# Options that only Celery sets when it publishes a message it froze itself (chains, groups,
# chords, callbacks, replace, retries and deferrals from a request): its task id was chosen by
# Celery, not by the caller, and the message's key header says which job it is.
_FROZEN_BY_CELERY = (
    "parent_id",
    "root_id",
    "group_id",
    "chord",
    "chain",
    "replaced_task_nesting",
    "retries",
)
_MAX_DEFERRALS = 1_000_000


_EVENT_TEXT_FIELDS = ("result", "exception", "traceback", "args", "kwargs")


def _redacted_event_field(name: str, value: Any) -> Any:
    """An event field of a sensitive task: its text gone, an exception's type kept."""
    if name not in _EVENT_TEXT_FIELDS or value in (None, ""):
        return value
    if name == "exception":  # safe_repr(exc): "TypeName('text', ...)"
        kind = str(value).split("(", 1)[0]
        return f"{kind}({REDACTED!r})" if kind.isidentifier() else REDACTED
    return REDACTED


class LedgerRequest(Request):  # type: ignore[misc]
    """A LedgerTask message in the worker's main process.

    Expiry is the guard's to enforce: Celery discards an expired message unrecorded and adds
    its id to the worker's revoked ids, which would discard every later delivery of the job, a
    replay too. The guard claims it instead and retires it: dead, with reason ``expired``.

    At a hard time limit the worker kills the pool process running the body; the job is then
    retired here, but only while the lease is still held by that process (a takeover by a newer
    claim is never undone by the old holder's limit).

    A sensitive task's events (what Flower and ``celery events`` show) carry no result and no
    exception text or traceback (which hold what the arguments held), only the exception's
    type. Nor does the worker's reply when asked (``inspect active``, ``reserved``,
    ``query_task``: Flower's worker page), a list kept in the broker's append-only file. Its
    arguments are the redaction marker, as is ``argsrepr`` whatever the publisher wrote (one
    that did not know the task as sensitive, ``send_task`` by name, wrote the arguments).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self.task, "sensitive", False):
            self._argsrepr = self._kwargsrepr = REDACTED

    def info(self, safe: bool = False) -> dict[str, Any]:
        described: dict[str, Any] = super().info(safe=safe)
        if getattr(self.task, "sensitive", False):  # (whatever ``safe`` asks)
            described["args"] = described["kwargs"] = REDACTED
        return described

    def send_event(self, type: str, **fields: Any) -> None:
        if getattr(self.task, "sensitive", False):
            fields = {name: _redacted_event_field(name, value) for name, value in fields.items()}
        super().send_event(type, **fields)

    def maybe_expire(self) -> bool:
        return False

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if not soft:
            self._retire_killed_body(timeout)
        super().on_timeout(soft, timeout)

    def _retire_killed_body(self, timeout: float) -> None:
        task = self.task
        if not isinstance(task, LedgerTask) or self.worker_pid is None:
            return
        try:
            identity = task.identity_of_message(self.id, self._request_dict, self.args, self.kwargs)
            task.app.guard.retire_held(
                identity,
                owner=f"{self.hostname}:{self.worker_pid}",
                reason=f"time limit exceeded (hard, {timeout}s)",
                on_retire=task.on_retire,
            )
        except Exception:  # the worker's event loop must go on
            logger.exception("could not retire %s after its hard time limit", self.id)


class LedgerTask(Task):  # type: ignore[misc]
    """A Celery task whose effects happen once per idempotency key.

    Task options (``@app.task(...)``):
        idempotency_key: a callable over the task's arguments, or a ``str.format`` template over
            them by name (``"order-{order_id}"``). Default: a hash of the task name and the
            canonical JSON of the arguments.
        tier: ``critical``, ``default`` or ``bulk``: the queue the task is routed to.
        lease_seconds: how long a claim is exclusive (default: the ``lease_seconds`` setting).
        dedupe_on_publish: write a ``queued`` record at publish and skip known keys.
        tenant: whose job a call is (a callable or template, as ``idempotency_key``): its
            jobs share their tier fairly with other tenants' (celery_ledger.tenancy).
    """

    app: LedgerCelery
    idempotency_key: KeySpec = None
    tier: str | None = None
    lease_seconds: float | None = None
    dedupe_on_publish: bool | None = None
    tenant: TenantSpec = None
    # Retries (None: the tier's default, see policies/retry.py).
    max_retries: int | None = None
    retry_base_seconds: float | None = None
    retry_cap_seconds: float | None = None
    retry_jitter: Jitter | None = None
    breaker: str | None = None  # the circuit breaker guarding this task's dependency
    rate_bucket: str | None = None  # a shared token bucket (LEDGER_RATE_LIMITS) the task draws from
    # Long-lived jobs.
    heartbeat_seconds: float | None = None  # default: a third of the lease; 0 turns it off
    max_age_seconds: float | None = None  # retire (dead, "expired") messages older than this
    # Calls through bounded()/hedged() in the body wait at most this long in all (a deadline
    # over the body: see celery_ledger.policies.deadline).
    deadline_seconds: float | None = None
    # Graceful degradation: what to serve instead of waiting while the dependency is down
    # (LastGood, Alternate, Placeholder: see celery_ledger.policies.fallback), and the latency
    # objective past which an unfinished job is reported late (default: the tier's,
    # LEDGER_SLO_SECONDS).
    fallback: Any = None
    slo_seconds: float | None = None
    max_attempts: int | None = None  # total claims of one job, whatever their cause
    sensitive: bool = False  # arguments and results encrypted at rest, never logged
    retry_on: tuple[type[BaseException], ...] = ()
    fail_on: tuple[type[BaseException], ...] = ()

    acks_late = True
    reject_on_worker_lost = True
    # Set here, not left to Celery's task_* settings: a ledger task's messages are JSON (sealed
    # per publish when sensitive) and its result is always kept (conf_check.py)
    serializer = "json"
    ignore_result = False
    Request = LedgerRequest

    ledger_options: ClassVar[frozenset[str]] = frozenset(
        {
            "idempotency_key",
            "tier",
            "lease_seconds",
            "dedupe_on_publish",
            "tenant",
            "retry_base_seconds",
            "retry_cap_seconds",
            "retry_jitter",
            "retry_on",
            "fail_on",
            "breaker",
            "rate_bucket",
            "heartbeat_seconds",
            "max_age_seconds",
            "max_attempts",
            "sensitive",
            "deadline_seconds",
            "fallback",
            "slo_seconds",
        }
    )

    # -- the API of a running body ------------------------------------------------------------

    @property
    def execution(self) -> Execution:
        execution: Execution | None = getattr(self.request, "ledger_execution", None)
        if execution is None:
            raise RuntimeError("only available while a LedgerTask runs in a worker")
        return execution

    def heartbeat(self) -> None:
        """Extend the lease now (automatic every third of the lease; for long blocking calls)."""
        self.execution.heartbeat.beat()

    def checkpoint(self, state: dict[str, Any]) -> None:
        """Store progress; a later attempt starts with it in :attr:`checkpoint_state`."""
        self.execution.checkpoint(state)

    @property
    def job_key(self) -> str:
        """The running job's idempotency key: pass it on to receivers of outside effects."""
        key: str = self.request.ledger_key
        return key

    @property
    def scheduled_for(self) -> datetime | None:
        """The slot a periodic run is for (its schedule entry's due time, UTC), or None when
        the job was not started by a schedule: work on "the hour it is for", not "now"."""
        return slot_of_key(getattr(self.request, "ledger_key", None))

    @property
    def checkpoint_state(self) -> dict[str, Any] | None:
        """The last checkpoint of this job (from any earlier attempt), or None."""
        state: dict[str, Any] | None = self.execution.progress.get("checkpoint")
        return state

    def step(
        self,
        name: str,
        *,
        optional: bool = False,
        needs_seconds: float = 0.0,
        default: Any = None,
        skip_on: tuple[type[BaseException], ...] = (),
    ) -> Step:
        """A sub-step that runs once per job (context manager, decorator or ``.run(func)``).

        ``optional=True``: when its dependency is down (an open circuit, a connection error, a
        timeout, or one of ``skip_on``) the step is skipped and recorded as skipped, with
        ``default`` as its result, and the job goes on; with ``needs_seconds``, ``.run`` also
        skips it when less than that is left of the attempt's soft time limit. A skipped step
        stays skipped for the job (a later attempt gets ``default`` too).
        """
        return self.execution.step(
            name, optional=optional, needs_seconds=needs_seconds, default=default, skip_on=skip_on
        )

    def batches(self, collection: Any, **options: Any) -> Iterator[list[dict[str, Any]]]:
        """Read a MongoDB collection in checkpointed ``_id`` order (see :func:`batches`)."""
        return batches(self.execution, collection, **options)

    def should_stop(self) -> bool:
        """True once the worker is shutting down: checkpoint and raise ``Interrupted``."""
        return self.execution.should_stop()

    def register_artefact(self, path: str) -> None:
        """Name a temporary file the job leaves behind, removed if the job is retired."""
        self.execution.register_artefact(path)

    def on_retire(self, reason: str, artefacts: list[str]) -> None:
        """Cleanup hook when the job is retired (time budget, age): removes its artefacts."""
        for path in artefacts:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    # -- options ------------------------------------------------------------------------------

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Check the task's tier against the app's tiers, however the tier was set."""
        tiers = getattr(app, "tiers", None)
        if cls.tier is not None and tiers is not None:
            tiers.check(cls.tier, where=f"task {cls.name or cls.__name__}")
        Fallback.of(cls.fallback)  # a wrong fallback= is an error at definition, not at run
        problems = task_problems(cls)
        if problems:
            raise ConfigurationError("; ".join(problems))
        slo = cls.slo_seconds
        if slo is not None and (
            isinstance(slo, bool)
            or not isinstance(slo, int | float)
            or not 0 < slo < 10 * 365 * 86400
        ):
            raise ConfigurationError(f"task {cls.name}: slo_seconds must be seconds > 0")

    def resolved_retry_policy(self, tier: str | None = None) -> RetryPolicy:
        """Task options over the tier's default (settings may override tier defaults)."""
        tier = tier or self.app.tiers.of_task(self.name, self.tier)
        return self.app.runtime.retry_policy_for(tier).updated(
            max_retries=self.max_retries,
            base_seconds=self.retry_base_seconds,
            cap_seconds=self.retry_cap_seconds,
            jitter=self.retry_jitter,
        )

    def policy(self, tier: str) -> TaskPolicy:
        """The options the guard runs this task's deliveries with."""
        request = self.request
        soft = self.soft_time_limit
        if soft is None and isinstance(request.timelimit, list | tuple):
            soft = request.timelimit[1]
        return TaskPolicy(
            name=self.name,
            retry_policy=self.resolved_retry_policy(tier),
            lease_seconds=self.lease_seconds or self.app.settings.lease_seconds,
            heartbeat_seconds=self.heartbeat_seconds,
            sensitive=self.sensitive,
            breaker=self.breaker,
            rate_bucket=self.rate_bucket,
            max_age_seconds=self.max_age_seconds,
            max_attempts=self.max_attempts,
            retry_on=(*(self.retry_on or ()), *PUBLISH_OUTAGES),
            outages=PUBLISH_OUTAGES,
            fail_on=tuple(self.fail_on or ()),
            soft_time_limit=soft,
            deadline_seconds=self.deadline_seconds,
            fallback=Fallback.of(self.fallback),
            slo_seconds=self._slo_seconds(tier),
        )

    def _slo_seconds(self, tier: str) -> float | None:
        """The latency objective: the task's, else its tier's."""
        if self.slo_seconds is not None:
            return float(self.slo_seconds)
        return self.app.settings.slo_seconds.get(tier)

    def _objective(self, tier: str, enqueued_at: float | None, away: bool) -> dict[str, Any]:
        """A new record's latency objective fields: from the message's first enqueue (the
        broker's clock) taken over to the ledger's, or from now (``away``: not read)."""
        slo_seconds = self._slo_seconds(tier)
        if slo_seconds is None:
            return {}
        return objective(slo_seconds, self.app.runtime.on_ledger_clock(enqueued_at, away))

    @classmethod
    def tenant_spec(cls) -> TenantSpec:
        """The ``tenant`` option as given (a function stored on the class unbound)."""
        return option_as_given(cls, "tenant")  # type: ignore[no-any-return]

    @classmethod
    def key_spec(cls) -> KeySpec:
        """The ``idempotency_key`` option as given (a function stored on the class unbound)."""
        return option_as_given(cls, "idempotency_key")  # type: ignore[no-any-return]

    def key_of(self, args: Any, kwargs: Any) -> str:
        """The idempotency key of a call with these arguments (a sensitive task's derived key
        is a keyed HMAC, see :func:`celery_ledger.identity.default_key`)."""
        spec = self.key_spec()
        secret = None
        if self.sensitive and spec is None:
            configured = self.app.settings.key_secret
            if configured is None:
                raise ConfigurationError(KEY_SECRET_NEEDED.format(task=self.name))
            secret = configured.get_secret_value().encode()
        return compute_key(
            spec, task_name=self.name, run=self.run, args=args, kwargs=kwargs, secret=secret
        )

    def identity_of_message(
        self, message_id: str, message_headers: Any, args: Any, kwargs: Any
    ) -> Identity:
        """The job a message of this task names (see :func:`celery_ledger.identity.identity_of`)."""
        found = message_headers if isinstance(message_headers, dict) else {}
        return identity_of(
            self.name,
            message_id,
            key_header=found.get(headers.KEY),
            key_of_arguments=None
            if found.get(BEAT_HEADER) is True
            else lambda: self.key_of(tuple(args or ()), dict(kwargs or {})),
        )

    # -- in the worker ------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or request.is_eager:
            return self.run(*args, **kwargs)
        delivery = self._delivery(args, kwargs)
        request.ledger_key = delivery.identity.key  # LedgerTask.job_key
        request.ledger_run_tier = delivery.tier  # a retry republishes to it (LedgerTask.retry)
        request.ledger_tenant_slot = delivery.tenant_slot  # (its end, task_postrun, reads it)
        policy, body = self.policy(delivery.tier), _Body(self, delivery)
        unbound = self.binding_problem(args, kwargs)
        verdict = self.app.guard.run(delivery, policy, body, unbound=unbound)
        self._wake_workflow(verdict)
        return _follow(verdict)

    def _wake_workflow(self, verdict: Verdict) -> None:
        """A workflow's step: wake the workflow once the step's outcome is recorded (not for a
        retry, a deferral or a requeue: the step is still to run). A lost wake is found by
        the reconciler's check of the workflow."""
        workflow_id = request_header(self.request, headers.WORKFLOW)
        if not isinstance(workflow_id, str) or not 0 < len(workflow_id) <= 200:
            return
        deferred = verdict.kind == "ack" and verdict.reason.startswith(("deferred", "lease lost"))
        if deferred or verdict.kind == "requeue" or isinstance(verdict.value, Retry):
            return
        tier = request_header(self.request, headers.WORKFLOW_TIER)
        if not (isinstance(tier, str) and tier in self.app.tiers.names):
            tier = self.app.settings.default_tier
        self.app.wake_where_step_ended(workflow_id, tier)

    def binding_problem(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Why the arguments do not bind the body's signature, or None."""
        return why_unbound(self.run, args, kwargs)

    def _delivery(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Delivery:
        request = self.request
        # Raw messages may carry anything: what the guard and Celery's retry read must be sound.
        request.retries = retries_done(request.retries)
        custom = request.headers if isinstance(request.headers, dict) else {}
        identity = identity_of(
            self.name,
            str(request.id),
            key_header=request_header(request, headers.KEY),
            # (a periodic run that names no key is its message's own job: see schedules.py)
            key_of_arguments=None
            if request_header(request, BEAT_HEADER) is True
            else lambda: self.key_of(args, kwargs),
        )
        header_tier = request_header(request, headers.TIER)
        if not (isinstance(header_tier, str) and header_tier in self.app.tiers.names):
            header_tier = None
        tier = header_tier or self.app.tiers.of_task(self.name, self.tier)
        deferrals = float_or_none(request_header(request, headers.DEFERRALS)) or 0
        handed_back = float_or_none(request_property(request, headers.HANDED_BACK)) or 0
        return Delivery(
            identity=identity,
            tier=tier,
            owner=f"{request.hostname or 'local'}:{os.getpid()}",
            args=args,
            kwargs=kwargs,
            headers=dict(custom),
            retries=request.retries,
            deferrals=int(min(max(deferrals, 0), _MAX_DEFERRALS)),
            handed_back=int(min(max(handed_back, 0), headers.MAX_HANDED_BACK)),
            previous_delay=float_or_none(request_header(request, headers.PREVIOUS_DELAY)),
            enqueued_at=float_or_none(request_header(request, headers.ENQUEUED_AT)),
            expires=expiry_of(request.expires),
            wants_result=bool(request.callbacks or request.chain),
            new=request_property(request, headers.NEW) is True,
            redelivered=redelivered(request),
            tenant_slot=tenant_slot_of(request),
        )

    def signature_from_request(
        self,
        request: Any = None,
        args: Any = None,
        kwargs: Any = None,
        queue: str | None = None,
        **extra_options: Any,
    ) -> Signature:
        """Celery's signature of a request (for its retries, and the guard's deferrals), marked
        as a republish: the delivery's arguments go out as the worker decoded them, kombu's
        JSON types (bytes, datetimes, decimals, UUIDs) included, so the publish checks them as
        kombu encodes them instead of refusing what the message itself carried."""
        slot = tenant_slot_of(request or self.request)
        if slot is not None:  # (a property: Celery copies the headers only)
            extra_options.setdefault("tenant", slot.tenant)
        signature: Signature = super().signature_from_request(
            request, args, kwargs, queue, **{_REPUBLISH: True}, **extra_options
        )
        return signature

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's retry, bounded by the resolved policy when no limit is given.

        Raises:
            RetryNotPublished: the retry's message could not be published (Celery would drop
                the message; the guard hands it back to the queue instead).
        """
        if max_retries is None:
            max_retries = self.resolved_retry_policy().max_retries
        run_tier = getattr(self.request, "ledger_run_tier", None)
        if run_tier is not None:  # the tier the guard validated, not the message's header
            options.setdefault("tier", run_tier)
        try:
            return super().retry(
                args, kwargs, exc, throw, eta, countdown, max_retries=max_retries, **options
            )
        except Reject as reject:
            # Celery turns a failed publish of the retry into Reject(requeue=False): dropped.
            reason = reject.reason
            if not reject.requeue and isinstance(reason, _NEVER_PUBLISHABLE):
                # (a countdown or eta that is no time, arguments the serializer refuses): put
                # back, the delivery would ask for the same retry for ever
                raise PermanentError(f"retry not publishable: {readable(reason)}") from reject
            if not reject.requeue and isinstance(reason, Exception):
                raise RetryNotPublished(f"retry not published: {readable(reason)}") from reject
            raise

    def on_replace(self, sig: Signature) -> Any:
        """Publish the replacement under its own identity; this job ends ``replaced``."""
        if self.request.is_eager:
            return super().on_replace(sig)
        # Celery froze the replacement with this task's id; a ledger job has its own.
        _unfreeze(sig, self.request.id)
        replacement = sig.freeze()
        sig.delay()
        raise Replaced(replacement.id)

    def _refuse_exposed_canvas(self, link: Any, chain: Any) -> None:
        """Refuse, before anything is published, a canvas in which a sensitive task's result
        reaches a task that is not sensitive: this task's callbacks and the rest of its chain,
        and for each task of the chain, its callbacks and the tasks after it (a chain that
        starts with a plain task would otherwise fail later, inside a worker, half run)."""
        steps = list(reversed(chain)) if isinstance(chain, list | tuple) else []  # next first
        refuse_clear_successors(self.app, [self.name], (link, steps))
        for i, step in enumerate(steps):
            if isinstance(step, dict) and isinstance(step.get("task"), str):
                found = step.get("options")
                callbacks = found.get("link") if isinstance(found, dict) else None
                refuse_clear_successors(self.app, [step["task"]], (callbacks, steps[i + 1 :]))

    def AsyncResult(self, task_id: str, **kwargs: Any) -> _Result:
        """Celery's result handle, naming its task (``ledger_task``): a chord's header is
        frozen into these, and the chord's check of its body reads which tasks they are."""
        result: _Result = super().AsyncResult(task_id, **kwargs)
        result.ledger_task = self.name
        return result

    def map(self, it: Any) -> NoReturn:
        raise _no_direct_runs(self.name, "map")

    def starmap(self, it: Any) -> NoReturn:
        raise _no_direct_runs(self.name, "starmap")

    def chunks(self, it: Any, n: int) -> NoReturn:
        raise _no_direct_runs(self.name, "chunks")

    # -- publishing ---------------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> _Result:
        """Publish the task; see :meth:`celery.app.task.Task.apply_async`.

        Extra options: ``idempotency_key`` (this call's key) and ``tier`` (this call's tier).
        The task id is derived from ``(task name, key)``; a ``task_id`` that is not that id is
        accepted only from Celery's canvas (a chain, group, callback or retry froze it).

        Raises:
            PayloadError: the arguments are not JSON-serialisable or exceed the size limit.
            IdentityError: ``task_id`` is not the id of the job's key.
            Backpressure: the tier is above its high-water mark (reject, or a block timed out).
            NotReplicated: the ledger away, no broker replica confirmed the job (send it again).
            ConfigurationError: a Celery setting changed since create_app breaks a guarantee.
        """
        eager = self.app.conf.task_always_eager  # (read once: a lookup in Celery's ChainMap)
        if not eager:  # (eager runs no worker's guarantees)
            self.app.check_configuration()
        args = tuple(args) if args else ()
        kwargs = dict(kwargs) if kwargs else {}
        settings = self.app.settings
        message_headers = dict(options.pop("headers", None) or {})
        session = options.pop("session", None)
        explicit_key = options.pop("idempotency_key", None)
        call_tier = options.pop("tier", None)
        # (a republish from a kept message carries its tenant with its headers: never sent)
        call_tenant = options.pop("tenant", None) or message_headers.pop(headers.TENANT, None)
        admitted = bool(options.pop(ADMITTED, False))
        step = bool(options.pop(WORKFLOW_STEP, False))
        never_shed = bool(options.pop(NEVER_SHED, False))
        check_call_options(self.name, options, owned=_LEDGER_OWNED_OPTIONS)
        handed_back = options.pop(_HANDED_BACK, None)
        if isinstance(handed_back, int) and handed_back > 0:
            options[headers.HANDED_BACK] = min(handed_back, headers.MAX_HANDED_BACK)

        payload = payload_json(args, kwargs, republish=bool(options.pop(_REPUBLISH, False)))
        if len(payload) > settings.max_payload_bytes:
            raise PayloadError(
                f"arguments of {self.name} are {len(payload)} bytes of JSON;"
                f" the limit is {settings.max_payload_bytes} (LEDGER_MAX_PAYLOAD_BYTES)"
            )
        if explicit_key is not None:
            key = validate_key(explicit_key, task_name=self.name)
        elif message_headers.get(headers.KEY):
            key = validate_key(message_headers[headers.KEY], task_name=self.name)
        elif message_headers.get(BEAT_HEADER) is True:
            # A periodic run from a scheduler that names no slot (celery beat with another
            # scheduler class): each tick is a job of its own, whatever its arguments; the
            # workers stand down from running the schedule meanwhile (schedules.py).
            key = f"beat:{uuid.uuid4().hex}"
            runtime = self.app.runtime
            note_foreign_beat(runtime.redis, runtime.name, socket.gethostname())
        else:
            key = self.key_of(args, kwargs)
        tier = self.app.tiers.resolve(self, call_tier or message_headers.get(headers.TIER))
        record_id = derive_task_id(self.name, key)
        if task_id is not None and task_id != record_id and not _from_canvas(options):
            raise IdentityError(
                f"task_id {task_id!r} is not the id of job ({self.name}, key {key!r}),"
                f" which is {record_id!r}: a ledger task's id comes from its idempotency key"
                " (pass idempotency_key=..., or leave task_id out)"
            )
        task_id = task_id or record_id
        tenant = tenant_of_call(
            self.tenant_spec(), task_name=self.name, run=self.run, args=args, kwargs=kwargs,
            given=call_tenant,
        )  # fmt: skip
        if tenant is not None:
            options[headers.TENANT] = tenant
        message_headers[headers.KEY] = key
        message_headers[headers.TIER] = tier
        # A job published for later is enqueued when it is due: its age (max_age_seconds) and
        # its latency objective count from then, not from the publish (a retry keeps its job's
        # first enqueue, in its headers).
        # Every time on a message is the broker's (a producer's host clock may be off)
        now = self.app.runtime.message_time()
        due_at = due_time(options.get("countdown"), options.get("eta"), now=now)
        message_headers.setdefault(headers.ENQUEUED_AT, max(now, due_at or 0.0))
        options.setdefault("queue", self.app.tiers.queue(tier))
        # The body sealed here, before it leaves the process: a sensitive task's, and any body
        # that carries a sensitive task's signature (a chain's rest, a callback) with its
        # arguments. Monitoring (events, Flower, inspect) shows no repr of sensitive arguments.
        self._refuse_exposed_canvas(link, options.get("chain"))
        seal = self.sensitive or self._carries_sensitive(link, link_error, options)
        if self.sensitive:
            options["argsrepr"] = options["kwargsrepr"] = REDACTED
        if seal:
            if not self.app.runtime.sealer.enabled:
                raise ConfigurationError(
                    f"{self.name}: a sensitive task's message is sealed with"
                    " LEDGER_ENCRYPTION_KEYS, which are not set here"
                )
            options["serializer"] = SEALED_SERIALIZER

        if session is not None:
            return self._enqueue_in(
                session,
                args,
                kwargs,
                record_id=record_id,
                key=key,
                tier=tier,
                message_headers=message_headers,
                tenant=tenant,
                unsupported={
                    "task_id (a canvas's)": task_id != record_id,
                    "link": link,
                    "link_error": link_error,
                    **{name: options.get(name) for name in _NOT_IN_OUTBOX},
                },
            )

        def publish_now(new: bool = False) -> _Result:
            if new:  # a first publish with no record written: its claim may insert the record
                options[headers.NEW] = True
            with sealing(self.app.runtime.sealer):
                return super(LedgerTask, self).apply_async(
                    args,
                    kwargs,
                    task_id=task_id,
                    producer=producer,
                    link=link,
                    link_error=link_error,
                    shadow=shadow,
                    headers=message_headers,
                    **options,
                )

        if eager:
            return publish_now()

        options.pop("countdown", None)
        options.pop("eta", None)
        later = due_at if due_at is not None and due_at > now else None
        # A retry republishes a job already admitted and known to the ledger: no backpressure
        # (a shed retry would be lost) and no dedupe. A job for later is not in a queue yet:
        # no backpressure either.
        is_retry = "retries" in options or admitted
        if (
            not is_retry
            and not step
            and later is None
            and self._shed(
                tier, record_id, key, args, kwargs, message_headers, never=never_shed, tenant=tenant
            )
        ):
            return self.AsyncResult(task_id)
        own = self.dedupe_on_publish
        dedupe = settings.dedupe_on_publish if own is None else own
        dedupe = dedupe and not is_retry
        # Published with the ledger away: its record kept in the broker for the reconciler to
        # write (unrecorded.py), or a message lost before its claim could never come back.
        unrecorded: QueuedJob | None = None
        if dedupe:
            away = self.app.runtime.ledger_absence.away()  # (no ledger read: LEDGER_AWAY_SECONDS)
            job = QueuedJob(
                record_id,
                task=self.name,
                key=key,
                tier=tier,
                message=self._kept(args, kwargs, message_headers, tenant),
                objective=self._objective(
                    tier, float_or_none(message_headers.get(headers.ENQUEUED_AT)), away
                ),
                # A job for later: claimable (and looked after by the reconciler) once due
                claimable_at=None
                if later is None
                else self.app.runtime.on_ledger_clock(later, away),
            )
            # In a bulk publish (bulk_publish.py) its record and message go with the batch's
            bulk = bulk_publish.joining(producer, options) if later is None else None
            if away:
                unrecorded, dedupe = job, False
            elif bulk is not None:
                return bulk.hold(job, publish_now, self.AsyncResult(task_id))
            else:
                try:
                    outcome = self.app.ledger.enqueue(record_id, **job.arguments())
                except LedgerUnavailable as exc:
                    # Publishing never needs the ledger: the claim still runs the job once, and
                    # the reconciler writes its record once the ledger is back
                    logger.warning(
                        "ledger unreachable; publishing %s, its queued record kept in the broker"
                        " until the ledger is back: %s",
                        task_id,
                        exc,
                    )
                    self.app.runtime.ledger_absence.seen_away()
                    unrecorded, dedupe = job, False
                else:
                    if outcome is EnqueueOutcome.KNOWN:
                        return self.AsyncResult(task_id)
        if unrecorded is not None:
            self.app.runtime.unrecorded.keep([unrecorded])
        try:
            if later is not None:
                # With dedupe, a message the delayed set loses (a broker that loses its data)
                # is published again by the reconciler once the record is due and stale: it
                # stays queued, claimable at its due time.
                return self._publish_later(
                    args,
                    kwargs,
                    task_id,
                    later,
                    seal,
                    link=link,
                    link_error=link_error,
                    shadow=shadow,
                    headers=message_headers,
                    **options,
                )
            return publish_now(new=not is_retry and not dedupe)
        except Exception:
            if dedupe:
                # Keep the record: another producer may have skipped its publish because of it.
                # Marked so that a publish tried again goes out (not found known), and the
                # reconciler publishes it on its next sweep (a job for later: once it is due).
                with contextlib.suppress(LedgerError):
                    self.app.ledger.mark_unpublished(record_id, later=later is not None)
            raise

    def _enqueue_in(
        self,
        session: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        record_id: str,
        key: str,
        tier: str,
        message_headers: dict[str, Any],
        tenant: str | None,
        unsupported: dict[str, Any],
    ) -> _Result:
        """``apply_async(..., session=session)``: the job's queued record in the session's
        transaction, published after the commit (outbox.py) from its kept message (and tenant).

        Raises:
            ConfigurationError: no transaction, or options an outbox job cannot carry.
            Backpressure: the tier is above its mark and its policy is ``reject``.
        """
        outbox = self.app.outbox
        outbox.require_transaction(session)
        refused = sorted(name for name, value in unsupported.items() if value)
        if refused:
            raise ConfigurationError(
                f"{self.name}: a job enqueued in a transaction cannot carry"
                f" {', '.join(refused)} (its record keeps the call only): start a workflow in"
                " the transaction to compose steps or wait"
            )
        outbox.admit(tier)
        kept = self._kept(args, kwargs, message_headers, tenant)
        outcome = self.app.ledger.enqueue(
            record_id,
            task=self.name,
            key=key,
            tier=tier,
            message=kept,
            objective=self._objective(tier, None, False),
            session=session,
        )
        if outcome is EnqueueOutcome.NEW:
            outbox.stage_job(session, record_id, task=self.name, key=key, tier=tier, message=kept)
        return self.AsyncResult(record_id)

    def _shed(
        self,
        tier: str,
        record_id: str,
        key: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        message_headers: dict[str, Any],
        *,
        never: bool = False,
        tenant: str | None = None,
    ) -> bool:
        """Apply the tier's backpressure, then the tenant's (``max_waiting``: the tier's
        policy, for that tenant only); True if the job was shed (recorded, not published).

        Raises:
            Backpressure: the tier (or the tenant) is above its mark and its policy is reject,
                or block timed out, or its policy is shed and the caller asked ``never``.
        """
        runtime = self.app.runtime
        try:
            decision = runtime.gate.check(tier)
        except redis.RedisError as exc:  # the publish itself will say if the broker is down
            logger.warning("backpressure check on %s skipped: %s", tier, exc)
            return False
        why = f"tier {tier} above its high-water mark"
        if decision == "publish":
            gate, limit = runtime.tenant_gate, runtime.gate.limits[tier]
            if gate is None or tenant is None:
                return False
            queue = self.app.tiers.queue(tier)
            policy = "reject" if never and limit.policy == "shed" else limit.policy
            block = limit.block_timeout_seconds
            if gate.check(tier, queue, tenant, policy=policy, block_seconds=block):
                return False
            why = f"tenant {tenant} above its max_waiting on tier {tier}"
        depth = runtime.queue_depths.depth(tier)
        if never:
            limit = runtime.gate.limits[tier]
            raise Backpressure(tier, depth, limit.high_water or depth)
        dead = DeadJob.of_reason(
            "shed",
            f"shed: {why} (depth {depth})",
            task=self.name,
            message=self._kept(args, kwargs, message_headers, tenant),
            group="shed",
        )
        self.app.ledger.bury(record_id, dead, match=Unclaimed(), task=self.name, key=key, tier=tier)
        return True

    def _carries_sensitive(self, *canvases: Any) -> bool:
        """Whether a signature of a sensitive task of this app is among ``canvases``."""
        tasks = self.app.tasks
        return any(
            getattr(tasks.get(name), "sensitive", False) for name in _signature_tasks(canvases)
        )

    def _kept(
        self, args: Any, kwargs: Any, message_headers: dict[str, Any], tenant: str | None = None
    ) -> KeptMessage:
        """The message as the ledger keeps it to republish it (sealed if sensitive), with its
        tenant (a property, kept with the headers)."""
        sealer = self.app.runtime.sealer if self.sensitive else None
        if tenant is not None:
            message_headers = {**message_headers, headers.TENANT: tenant}
        return KeptMessage.of_call(args, kwargs, message_headers=message_headers, sealer=sealer)

    def _publish_later(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        task_id: str,
        due_at: float,
        seal: bool,
        **options: Any,
    ) -> _Result:
        options = {name: value for name, value in options.items() if value is not None}
        options.pop("producer", None)
        sealer = self.app.runtime.sealer if seal else None
        self.app.runtime.delayed.schedule(
            self.name, list(args), kwargs, {"task_id": task_id, **options}, due_at, sealer=sealer
        )
        return self.AsyncResult(task_id)


KEY_SECRET_NEEDED = (
    "{task} is sensitive and derives its idempotency key from its arguments: set"
    " LEDGER_KEY_SECRET (32+ random characters; the key becomes a keyed HMAC), or give the"
    " task an idempotency_key of fields that are not secret"
)


def refuse_clear_successors(app: Any, sources: Iterable[str], canvases: Any) -> None:
    """Refuse a canvas that hands a sensitive task's result on in clear.

    ``sources`` are the tasks whose results the ``canvases`` receive (a task's callbacks and
    the rest of its chain; a chord's body). Every task in the canvases that is not sensitive
    would get a sensitive result, or what is derived from it, as an argument in clear (its
    message, its record, Flower). Celery's own canvas tasks only pass it along.

    Raises:
        ConfigurationError: a source is sensitive and the canvases hold such a task.
    """
    tasks = app.tasks
    sensitive = sorted(name for name in sources if getattr(tasks.get(name), "sensitive", False))
    if not sensitive:
        return
    exposed = {
        name
        for name in _signature_tasks(canvases)
        if not name.startswith("celery.") and not getattr(tasks.get(name), "sensitive", False)
    }
    if exposed:
        raise ConfigurationError(
            f"{', '.join(sensitive)} is sensitive, and its result would reach"
            f" {', '.join(sorted(exposed))} as an argument in clear (a chain's next task, a"
            " callback or a chord's body gets it): make them sensitive=True too, or publish"
            " them from the body with what they need"
        )


def _signature_tasks(value: Any, depth: int = 0) -> Iterator[str]:
    """The task names of the signatures nested in ``value`` (a canvas: signatures are dicts
    with a ``task`` key; groups, chords and callbacks nest them in lists and options)."""
    if depth > 32:  # a canvas nests a few levels; this bounds a cyclic or hostile structure
        return
    if isinstance(value, dict):
        name = value.get("task")
        if isinstance(name, str):
            yield name
        for item in value.values():
            yield from _signature_tasks(item, depth + 1)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _signature_tasks(item, depth + 1)


class _Body:
    """The guard's view of a Celery task run (:class:`celery_ledger.guard.Body`)."""

    def __init__(self, task: LedgerTask, delivery: Delivery) -> None:
        self._task = task
        self._delivery = delivery

    def start(self, execution: Execution) -> None:
        request = self._task.request
        request.ledger_execution = execution
        request.ledger_fence = execution.fence

    def run(self) -> Any:
        return self._task.run(*self._delivery.args, **self._delivery.kwargs)

    def defer(
        self,
        delay_seconds: float,
        message_headers: dict[str, Any],
        *,
        fresh: bool = False,
        handed_back: int = 0,
    ) -> None:
        task = self._task
        # A fresh run (a degraded result's replacement): no retries used, and none of the
        # canvas the first run dispatched with its result (it would run twice), no expiry.
        options: dict[str, Any] = (
            {
                "retries": 0,
                "chain": None,
                "link": None,
                "link_error": None,
                "chord": None,
                "group_id": None,
                "group_index": None,
                "expires": None,
            }
            if fresh
            else {_HANDED_BACK: handed_back}
        )
        signature = task.signature_from_request(
            task.request,
            self._delivery.args,
            self._delivery.kwargs,
            countdown=delay_seconds,
            headers=message_headers,
            tier=self._delivery.tier,
            **options,
        )
        signature.apply_async()

    def retry(
        self, exc: BaseException, delay_seconds: float, message_headers: dict[str, Any]
    ) -> BaseException:
        retry: BaseException = self._task.retry(
            exc=exc,
            countdown=delay_seconds,
            max_retries=self._task.request.retries + 1,
            headers=message_headers,
            throw=False,
        )
        return retry

    def on_retire(self, reason: str, artefacts: list[str]) -> None:
        self._task.on_retire(reason, artefacts)

    def named_arguments(self) -> dict[str, Any]:
        return bind_arguments(self._task.run, self._delivery.args, self._delivery.kwargs)


# What a retry's publish raised that publishing again can never mend (a countdown or eta that
# is no time, arguments the serializer refuses).
_NEVER_PUBLISHABLE = (ValueError, TypeError, OverflowError, EncodeError)


def _follow(verdict: Verdict) -> Any:
    """Celery's control flow for the guard's verdict."""
    if verdict.kind == "return":
        return verdict.value
    if verdict.kind == "ack":
        raise Ignore(verdict.reason)
    if verdict.kind == "requeue":
        raise Reject(verdict.reason, requeue=True)
    exc = verdict.value
    if isinstance(exc, MemoryError) or not isinstance(exc, Exception):
        # The outcome is recorded; Celery only learns that the job failed. Its main process
        # re-raises a task's MemoryError, which ends the worker, and a BaseException raised
        # into it ends a solo worker and a prefork pool process.
        raise PermanentError(f"{type(exc).__name__}: {exc}"[:2000]) from None
    raise exc


def _from_canvas(options: dict[str, Any]) -> bool:
    return any(options.get(name) is not None for name in _FROZEN_BY_CELERY)


def _unfreeze(sig: Any, task_id: str) -> None:
    """Drop the ids Celery froze a replacement with (``task_id``), so each member is
    published under its own identity."""
    options = getattr(sig, "options", None)
    if isinstance(options, dict):
        for name in ("task_id", "group_id"):
            if options.get(name) == task_id:
                options.pop(name)
    for member in list(getattr(sig, "tasks", None) or ()):
        _unfreeze(member, task_id)
    body = getattr(sig, "body", None)
    if body is not None and body is not sig:
        _unfreeze(body, task_id)


def _no_direct_runs(task: str, how: str) -> ConfigurationError:
    return ConfigurationError(
        f"{task}.{how}() would run the bodies inside one task without their ledger claims;"
        f" publish one job per item instead: group({task.rsplit('.', 1)[-1]}.s(item) for item"
        " in items)"
    )


__all__ = ["LedgerRequest", "LedgerTask"]
