"""LedgerTask: the base task class of every celery-ledger app."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ClassVar

import redis
from celery import Task
from celery.result import AsyncResult
from celery.worker.request import Request

from . import headers
from .crypto import REDACTED
from .errors import LedgerUnavailable, PayloadError
from .guard import run_guarded, sealed_if_sensitive
from .keys import KeySpec, canonical_json, compute_key, derive_task_id, validate_key
from .policies.backoff import Jitter
from .policies.retry import RetryPolicy
from .progress import Execution, Step, batches

if TYPE_CHECKING:
    from .app import LedgerCelery

logger = logging.getLogger("celery_ledger.task")

# Options a call may not pass through to the broker: the ledger owns them.
_LEDGER_OWNED_OPTIONS = ("ignore_result",)


class LedgerRequest(Request):  # type: ignore[misc]
    """A LedgerTask message in the worker: its expiry is the guard's to enforce.

    Celery discards an expired message unrecorded and adds its id to the worker's revoked ids,
    which (ids derive from keys) would discard every later delivery of the job, a replay too.
    The guard claims it instead and retires it: dead, with reason ``expired``.
    """

    def maybe_expire(self) -> bool:
        return False


class LedgerTask(Task):  # type: ignore[misc]
    """A Celery task whose effects happen once per idempotency key.

    Task options (``@app.task(...)``):
        idempotency_key: a callable over the task's arguments, or a ``str.format`` template over
            them by name (``"order-{order_id}"``). Default: a hash of the task name and the
            canonical JSON of the arguments.
        tier: ``critical``, ``default`` or ``bulk``: the queue the task is routed to.
        lease_seconds: how long a claim is exclusive (default: the ``lease_seconds`` setting).
        dedupe_on_publish: write a ``queued`` record at publish and skip known keys.
    """

    app: LedgerCelery
    idempotency_key: KeySpec = None
    tier: str | None = None
    lease_seconds: float | None = None
    dedupe_on_publish: bool | None = None
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
    max_attempts: int | None = None  # total claims of one job, whatever their cause
    sensitive: bool = False  # arguments and results encrypted at rest, never logged
    retry_on: tuple[type[BaseException], ...] = ()
    fail_on: tuple[type[BaseException], ...] = ()

    acks_late = True
    reject_on_worker_lost = True
    Request = LedgerRequest

    ledger_options: ClassVar[frozenset[str]] = frozenset(
        {
            "idempotency_key",
            "tier",
            "lease_seconds",
            "dedupe_on_publish",
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
    def checkpoint_state(self) -> dict[str, Any] | None:
        """The last checkpoint of this job (from any earlier attempt), or None."""
        state: dict[str, Any] | None = self.execution.progress.get("checkpoint")
        return state

    def step(self, name: str) -> Step:
        """A sub-step that runs once per job (context manager, decorator or ``.run(func)``)."""
        return self.execution.step(name)

    def batches(self, collection: Any, **options: Any) -> Iterator[list[dict[str, Any]]]:
        """Read a MongoDB collection in checkpointed ``_id`` order (see :func:`batches`)."""
        return batches(self.execution, collection, **options)

    def should_stop(self) -> bool:
        """True once the worker is shutting down: checkpoint and raise :class:`Interrupted`."""
        return self.execution.should_stop()

    def register_artefact(self, path: str) -> None:
        """Name a temporary file the job leaves behind, removed if the job is retired."""
        self.execution.register_artefact(path)

    def on_retire(self, reason: str, artefacts: list[str]) -> None:
        """Cleanup hook when the job is retired (time budget, age): removes its artefacts."""
        for path in artefacts:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Check the task's tier against the app's tiers, however the tier was set."""
        tiers = getattr(app, "tiers", None)
        if cls.tier is not None and tiers is not None:
            tiers.check(cls.tier, where=f"task {cls.name or cls.__name__}")

    def resolved_retry_policy(self, tier: str | None = None) -> RetryPolicy:
        """Task options over the tier's default (settings may override tier defaults)."""
        tier = tier or self.tier or self.app.tiers.default
        return self.app.retry_policy_for(tier).updated(
            max_retries=self.max_retries,
            base_seconds=self.retry_base_seconds,
            cap_seconds=self.retry_cap_seconds,
            jitter=self.retry_jitter,
        )

    def retry(self, *args: Any, max_retries: int | None = None, **options: Any) -> Any:
        """Celery's retry, bounded by the resolved policy when no limit is given."""
        if max_retries is None:
            max_retries = self.resolved_retry_policy().max_retries
        run_tier = getattr(self.request, "ledger_run_tier", None)
        if run_tier is not None:  # the tier the guard validated, not the message's header
            options.setdefault("tier", run_tier)
        return super().retry(*args, max_retries=max_retries, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or request.is_eager:
            return self.run(*args, **kwargs)
        return run_guarded(self, args, kwargs)

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
    ) -> AsyncResult:
        """Publish the task; see :meth:`celery.app.task.Task.apply_async`.

        Extra options: ``idempotency_key`` (this call's key) and ``tier`` (this call's tier).
        The task id is derived from ``(task name, key)`` unless given.

        Raises:
            PayloadError: the arguments are not JSON-serialisable or exceed the size limit.
        """
        args = tuple(args) if args else ()
        kwargs = dict(kwargs) if kwargs else {}
        settings = self.app.settings
        message_headers = dict(options.pop("headers", None) or {})
        explicit_key = options.pop("idempotency_key", None)
        call_tier = options.pop("tier", None)
        for name in _LEDGER_OWNED_OPTIONS:
            options.pop(name, None)

        payload = canonical_json([list(args), kwargs])
        if len(payload) > settings.max_payload_bytes:
            raise PayloadError(
                f"arguments of {self.name} are {len(payload)} bytes of JSON;"
                f" the limit is {settings.max_payload_bytes} (LEDGER_MAX_PAYLOAD_BYTES)"
            )
        if explicit_key is not None:
            key = validate_key(explicit_key, task_name=self.name)
        elif message_headers.get(headers.KEY):
            key = validate_key(message_headers[headers.KEY], task_name=self.name)
        else:
            key = compute_key(
                self.key_spec(), task_name=self.name, run=self.run, args=args, kwargs=kwargs
            )
        tier = self.app.tiers.resolve(self, call_tier or message_headers.get(headers.TIER))
        task_id = task_id or derive_task_id(self.name, key)
        message_headers[headers.KEY] = key
        message_headers[headers.TIER] = tier
        message_headers.setdefault(headers.ENQUEUED_AT, time.time())
        options.setdefault("queue", tier)
        if self.sensitive:  # what monitoring (events, Flower) shows of the arguments
            options["argsrepr"] = options["kwargsrepr"] = REDACTED

        def publish_now() -> AsyncResult:
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

        if self.app.conf.task_always_eager:
            return publish_now()

        due_at = _due_time(options.pop("countdown", None), options.pop("eta", None))
        if due_at is not None and due_at > time.time():
            return self._publish_later(
                args,
                kwargs,
                task_id,
                due_at,
                link=link,
                link_error=link_error,
                shadow=shadow,
                headers=message_headers,
                **options,
            )

        if self._over_high_water(tier, task_id, key, args, kwargs, message_headers):
            return self.AsyncResult(task_id)
        # A retry republishes a job the ledger knows: never deduplicated.
        dedupe = "retries" not in options and (
            settings.dedupe_on_publish if self.dedupe_on_publish is None else self.dedupe_on_publish
        )
        if dedupe:
            try:
                new = self.app.ledger.enqueue(
                    task_id,
                    task=self.name,
                    key=key,
                    tier=tier,
                    message=self._message_of(args, kwargs),
                )
            except LedgerUnavailable as exc:
                # Publishing never needs the ledger: the claim still runs the job once; only the
                # reconciler's republish of a lost message is missing for this one.
                logger.warning(
                    "ledger unreachable; %s published without its queued record: %s", task_id, exc
                )
                dedupe = False
            else:
                if not new:
                    return self.AsyncResult(task_id)
        try:
            return publish_now()
        except Exception:
            if dedupe:
                # If the ledger is down too, the queued record stays and blocks a republish
                # until the reconciler finds it (a queued record whose message never went out).
                with contextlib.suppress(LedgerUnavailable):
                    self.app.ledger.forget_queued(task_id)
            raise

    def _over_high_water(
        self,
        tier: str,
        task_id: str,
        key: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        message_headers: dict[str, Any],
    ) -> bool:
        """Apply the tier's backpressure; True if the job was shed (recorded, not published).

        Raises:
            Backpressure: the tier is above its mark and its policy is reject, or block timed out.
        """
        try:
            decision = self.app.backpressure.check(tier)
        except redis.RedisError as exc:  # the publish itself will say if the broker is down
            logger.warning("backpressure check on %s skipped: %s", tier, exc)
            return False
        if decision == "publish":
            return False
        depth = self.app.queue_depths.depth(tier)
        reason = f"shed: tier {tier} above its high-water mark (depth {depth})"
        self.app.ledger.record_shed(
            task_id,
            task=self.name,
            key=key,
            tier=tier,
            reason=reason,
            args=list(args),
            kwargs=kwargs,
            headers=message_headers,
        )
        return True

    def _message_of(self, args: Any, kwargs: Any) -> dict[str, Any]:
        """The arguments as the ledger keeps them for a republish (sealed if sensitive)."""
        return sealed_if_sensitive(
            self,
            {"args_json": json.dumps(list(args or ())), "kwargs_json": json.dumps(kwargs or {})},
        )

    @classmethod
    def key_spec(cls) -> KeySpec:
        """The ``idempotency_key`` option as given (a function stored on the class unbound)."""
        spec = inspect.getattr_static(cls, "idempotency_key")
        return spec.__func__ if isinstance(spec, staticmethod) else spec

    def _publish_later(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        task_id: str,
        due_at: float,
        **options: Any,
    ) -> AsyncResult:
        options = {name: value for name, value in options.items() if value is not None}
        options.pop("producer", None)
        self.app.delayed.schedule(
            self.name, list(args), kwargs, {"task_id": task_id, **options}, due_at
        )
        return self.AsyncResult(task_id)


def _due_time(countdown: float | None, eta: datetime | str | None) -> float | None:
    if countdown is not None:
        return time.time() + float(countdown)
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if isinstance(eta, datetime):
        # A naive eta is UTC, as Celery reads it (the app's timezone is UTC).
        return (eta if eta.tzinfo else eta.replace(tzinfo=UTC)).timestamp()
    return None
