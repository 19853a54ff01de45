"""create_app: the one place that wires the platform to Celery.

It builds the settings, the tiers, the ledger store and the :class:`~celery_ledger.runtime.
Runtime`, and gives the engines (guard, dead letters, reconciler, observability) the services
they use; the app is a :class:`celery.Celery` whose tasks are LedgerTasks, whose result backend
is the ledger, whose transport and consumer quarantine bad messages, and whose workers run the
platform's housekeeping.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from celery import Celery, Task
from kombu.entity import Queue
from pydantic import ValidationError
from pydantic_settings import SettingsError
from pymongo.monitoring import CommandListener

from .broker import RedisBroker, SweepLock
from .crypto import REDACTED, RedactSensitive, Sealer
from .deadletter import DeadLetters, poison_key
from .errors import ConfigurationError
from .events import Observers
from .guard import Guard
from .ledger.store import Ledger
from .observability import install as install_observability
from .observability import ledger_listeners
from .policies.breaker import Breakers
from .reconciler import Reconciler
from .routing import DEAD_LETTER, TIERS, Tiers
from .runtime import Runtime
from .settings import Settings
from .task import LedgerTask
from .worker import LedgerWorkerStep

# Options of @app.task that Celery reads but that are not attributes of Task.
_DECORATOR_OPTIONS = frozenset(
    {
        "base",
        "bind",
        "name",
        "shared",
        "lazy",
        "filter",
        "autoretry_for",
        "dont_autoretry_for",
        "retry_kwargs",
        "retry_backoff",
        "retry_backoff_max",
        "retry_jitter",
        "pydantic",
        "pydantic_strict",
        "pydantic_context",
        "pydantic_dump_kwargs",
    }
)
# kombu sweeps unacknowledged messages back under a lock; a worker killed while sweeping holds
# it until it expires (300 s by default), stalling every other worker's sweep that long.
_UNACKED_MUTEX_EXPIRE_SECONDS = 60


class LedgerCelery(Celery):  # type: ignore[misc]
    """A :class:`celery.Celery` with the ledger attached (``app.ledger``)."""

    settings: Settings
    tiers: Tiers
    runtime: Runtime

    @property
    def ledger(self) -> Ledger:
        """The ledger store: ``app.ledger.get(task_name, key)`` reads a job's record."""
        return self.runtime.ledger

    @property
    def sealer(self) -> Sealer:
        """Encryption at rest for sensitive tasks (``LEDGER_ENCRYPTION_KEYS``)."""
        return self.runtime.sealer

    @property
    def breakers(self) -> Breakers:
        """Circuit breakers shared through Redis by every worker: ``app.breakers["payments"]``."""
        return self.runtime.breakers

    @property
    def observers(self) -> Observers:
        """The platform's observers: ``app.observers.add(MyObserver())``."""
        return self.runtime.observers

    @cached_property
    def dead_letters(self) -> DeadLetters:
        return DeadLetters(self.runtime, self._publish_raw)

    @cached_property
    def guard(self) -> Guard:
        return Guard(self.runtime, self.dead_letters)

    @cached_property
    def reconciler(self) -> Reconciler:
        runtime = self.runtime
        keys = unacked_keys(self.tiers.namespace)
        broker = RedisBroker(
            runtime.redis,
            queues=self.tiers.queues,
            delayed_key=runtime.delayed.key,
            unacked_key=keys.get("unacked_key", "unacked"),
            unacked_index_key=keys.get("unacked_index_key", "unacked_index"),
        )
        ttl = runtime.settings.reconcile_every_seconds * 2.5
        lock = SweepLock(runtime.redis, f"{runtime.name}:ledger:reconciler", ttl_seconds=ttl)
        return Reconciler(runtime, broker, lock)

    def is_sensitive(self, task_name: Any) -> bool:
        task = self.tasks.get(task_name) if isinstance(task_name, str) else None
        return bool(getattr(task, "sensitive", False))

    def tier_of(self, task_name: str) -> str | None:
        """The tier a task is routed to, or None if no such task is registered here."""
        task = self.tasks.get(task_name)
        if task is None:
            return None
        return self.tiers.of_task(task_name, getattr(task, "tier", None))

    def task(self, *args: Any, **options: Any) -> Any:
        """Declare a task (a :class:`LedgerTask` unless ``base=`` says otherwise).

        Unknown options are refused, so a misspelt option never passes silently.
        """
        if str(options.get("name", "")).startswith("celery."):
            # Celery's own tasks (chord_unlock, backend_cleanup, ...) stay plain tasks.
            options.setdefault("base", Task)
        base = options.get("base") or self.Task
        known = _DECORATOR_OPTIONS | set(dir(base))
        unknown = sorted(set(options) - known)
        if unknown:
            hints = [difflib.get_close_matches(name, known, n=1) for name in unknown]
            hint = "; ".join(
                f"{name!r} (did you mean {h[0]!r}?)" if h else repr(name)
                for name, h in zip(unknown, hints, strict=True)
            )
            raise ConfigurationError(f"unknown task option {hint}")
        bucket = options.get("rate_bucket")
        if bucket is not None and bucket not in self.settings.rate_limits:
            configured = ", ".join(self.settings.rate_limits) or "none configured"
            raise ConfigurationError(
                f"rate_bucket {bucket!r} is not in LEDGER_RATE_LIMITS (known: {configured})"
            )
        if options.get("tier") is not None:
            self.tiers.check(options["tier"], where="a task declaration")
        if options.get("sensitive") and not self.sealer.enabled:
            raise ConfigurationError(
                "sensitive=True needs LEDGER_ENCRYPTION_KEYS (a JSON list of Fernet keys)"
            )
        return super().task(*args, **options)

    # -- the ports the engines publish through ---------------------------------------------------

    def _publish(
        self,
        task: str,
        args: list[Any],
        kwargs: dict[str, Any],
        *,
        task_id: str,
        tier: str,
        headers: dict[str, Any],
        retries: int = 0,
        expires: str | None = None,
        redacted: bool = False,
    ) -> None:
        """A task message to a tier's queue, bypassing the publish-side checks (a republish)."""
        options: dict[str, Any] = {}
        if redacted:
            options["argsrepr"] = options["kwargsrepr"] = REDACTED
        self.send_task(
            task,
            args,
            kwargs,
            task_id=task_id,
            queue=self.tiers.queue(tier),
            headers=headers,
            retries=retries,
            expires=expires,
            **options,
        )

    def _publish_raw(self, queue: str, payload: dict[str, Any], headers: dict[str, Any]) -> None:
        """A plain JSON message (a dead letter's copy) to ``queue``."""
        with self.producer_or_acquire() as producer:
            producer.publish(
                payload,
                exchange="",
                routing_key=queue,
                serializer="json",
                declare=[Queue(queue)],
                retry=True,
                headers=headers,
            )


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


def settings_from_environment() -> Settings:
    """``Settings()`` from ``LEDGER_*``; a bad value or an unknown ``LEDGER_*`` name is refused.

    Raises:
        ConfigurationError: naming the variable (and the closest known one for a misspelling).
    """
    known = {f"LEDGER_{name.upper()}" for name in Settings.model_fields}
    unknown = sorted(
        name for name in os.environ if name.startswith("LEDGER_") and name not in known
    )
    if unknown:
        hints = [difflib.get_close_matches(name, known, n=1) for name in unknown]
        raise ConfigurationError(
            "unknown setting "
            + "; ".join(
                f"{name} (did you mean {hint[0]}?)" if hint else name
                for name, hint in zip(unknown, hints, strict=True)
            )
        )
    try:
        return Settings()
    except (ValidationError, SettingsError) as exc:
        raise ConfigurationError(f"invalid LEDGER_* settings: {exc}") from exc


def create_app(
    name: str,
    settings: Settings | None = None,
    *,
    command_listeners: Sequence[CommandListener] = (),
    **celery_options: Any,
) -> LedgerCelery:
    """Build a Celery app wired to the ledger; settings from ``LEDGER_*`` unless given.

    ``command_listeners`` are pymongo command listeners for the ledger's client (to count or
    time its round trips); ``celery_options`` go to :class:`celery.Celery`.

    Raises:
        ConfigurationError: the settings are invalid (the message names the setting).
    """
    if settings is None:
        settings = settings_from_environment()
    namespace = name if settings.queue_namespace is None else settings.queue_namespace
    tiers = Tiers(
        TIERS, default=settings.default_tier, rules=settings.routing_rules, namespace=namespace
    )
    app = LedgerCelery(
        name,
        broker=settings.broker_url,
        backend="celery_ledger.backend:LedgerBackend",
        task_cls=LedgerTask,
        set_as_current=celery_options.pop("set_as_current", True),
        **celery_options,
    )
    app.settings = settings
    app.tiers = tiers
    ledger = Ledger(
        uri=settings.mongo_uri,
        database=settings.mongo_db,
        collection=settings.ledger_collection,
        write_concern=settings.mongo_write_concern,
        timeout_ms=settings.mongo_timeout_ms,
        lease_seconds=settings.lease_seconds,
        result_retention_seconds=settings.result_retention_seconds,
        dead_retention_seconds=settings.dead_retention_seconds,
        error_history_limit=settings.error_history_limit,
        max_deliveries=settings.max_deliveries,
        ttl_index=settings.ttl_index,
        event_listeners=[*ledger_listeners(settings), *command_listeners],
    )
    app.runtime = Runtime(
        settings,
        name=name,
        tiers=tiers,
        ledger=ledger,
        publish=app._publish,
        tier_of=app.tier_of,
    )
    app.conf.update(
        # JSON only: pickle is refused on both sides.
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        # A message is acknowledged only after its outcome is recorded; a lost worker requeues.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=settings.worker_prefetch_multiplier,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_transport="celery_ledger.transport:Transport",
        worker_consumer="celery_ledger.worker:LedgerConsumer",
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_seconds,
            "unacked_mutex_expire": _UNACKED_MUTEX_EXPIRE_SECONDS,
            **unacked_keys(namespace),
            "ledger_poison_key": poison_key(name),
        },
        broker_connection_retry_on_startup=True,
        result_backend_always_retry=True,
        result_backend_max_retries=10,
        task_default_queue=tiers.queue(settings.default_tier),
        task_queues=[Queue(queue) for queue in (*tiers.queues, tiers.queue(DEAD_LETTER))],
        task_create_missing_queues=True,
        enable_utc=True,
        timezone="UTC",
    )
    app.steps["worker"].add(LedgerWorkerStep)
    logging.getLogger("celery.app.trace").addFilter(RedactSensitive(app.is_sensitive))
    install_observability(app, app.runtime)  # metrics, Sentry, JSON logs: as the settings say

    @app.task(name="celery_ledger.reconcile", base=Task, shared=False)  # type: ignore[untyped-decorator]
    def reconcile_task() -> dict[str, Any]:
        """The reconciler, for celery beat (one sweeper at a time with the workers' own)."""
        report = app.reconciler.sweep_if_leader()
        return {"swept": False} if report is None else report.as_dict()

    app.conf.beat_schedule = {
        "celery-ledger-reconcile": {
            "task": "celery_ledger.reconcile",
            "schedule": settings.reconcile_every_seconds,
            "options": {"queue": tiers.queue(settings.default_tier)},
        },
        **(app.conf.beat_schedule or {}),
    }
    return app


__all__ = ["LedgerCelery", "create_app"]
