"""create_app: a Celery app whose tasks are LedgerTasks and whose result backend is the ledger."""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import replace
from functools import cached_property
from typing import Any

import redis
from celery import Celery, Task
from kombu.entity import Queue
from pydantic import ValidationError
from pydantic_settings import SettingsError

from .crypto import RedactSensitive, Sealer
from .deadletter import DeadLetters
from .delayed import DelayedDeliveries
from .errors import ConfigurationError
from .hooks import Hooks
from .ledger.store import Ledger
from .observability import install as install_observability
from .observability import ledger_listeners
from .policies.backpressure import Backpressure, QueueDepths
from .policies.breaker import BreakerConfig, Breakers
from .policies.rate_limit import RateLimits
from .policies.retry import TIER_RETRY_DEFAULTS, RetryPolicy
from .pressure import Pressure, Throttle, ThrottleRule
from .reconciler import reconcile
from .routing import DEAD_LETTER_QUEUE, DEFAULT_TIER_LIMITS, Tiers
from .settings import TIERS, Settings
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


class LedgerCelery(Celery):  # type: ignore[misc]
    """A :class:`celery.Celery` with the ledger attached (``app.ledger``)."""

    settings: Settings
    ledger: Ledger
    tiers: Tiers

    @cached_property
    def sealer(self) -> Sealer:
        """Encryption at rest for sensitive tasks (``LEDGER_ENCRYPTION_KEYS``)."""
        return Sealer(self.settings.encryption_keys)

    def is_sensitive(self, task_name: Any) -> bool:
        task = self.tasks.get(task_name) if isinstance(task_name, str) else None
        return bool(getattr(task, "sensitive", False))

    @cached_property
    def hooks(self) -> Hooks:
        """Platform events (see :mod:`celery_ledger.hooks`)."""
        return Hooks()

    @cached_property
    def breakers(self) -> Breakers:
        """Circuit breakers shared through Redis by every worker: ``app.breakers["payments"]``."""
        try:
            configs = {
                name: BreakerConfig(**values)  # type: ignore[arg-type]
                for name, values in self.settings.breakers.items()
            }
        except TypeError as exc:
            raise ConfigurationError(f"LEDGER_BREAKERS: {exc}") from exc
        return Breakers(
            self.settings.broker_url,
            configs=configs,
            on_transition=lambda name, old, new: self.hooks.emit(
                "breaker", name=name, old=old, new=new
            ),
        )

    @cached_property
    def redis(self) -> redis.Redis:
        """A client of the broker's Redis, for the platform's shared state."""
        return redis.Redis.from_url(
            self.settings.broker_url, socket_timeout=5, socket_connect_timeout=5
        )

    @cached_property
    def queue_depths(self) -> QueueDepths:
        return QueueDepths(self.redis, (*self.tiers.names, DEAD_LETTER_QUEUE), ttl_seconds=1.0)

    @cached_property
    def backpressure(self) -> Backpressure:
        limits = dict(DEFAULT_TIER_LIMITS)
        for tier, values in self.settings.tier_limits.items():
            self.tiers.check(tier, where="LEDGER_TIER_LIMITS")
            try:
                limits[tier] = replace(limits[tier], **values)  # type: ignore[arg-type]
            except TypeError as exc:
                raise ConfigurationError(f"LEDGER_TIER_LIMITS[{tier!r}]: {exc}") from exc
        return Backpressure(
            self.queue_depths, limits, on_shed=lambda tier: self.hooks.emit("shed", tier=tier)
        )

    @cached_property
    def rate_limits(self) -> RateLimits:
        try:
            limits = {
                name: (float(v["rate_per_second"]), int(v["burst"]))
                for name, v in self.settings.rate_limits.items()
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"LEDGER_RATE_LIMITS needs rate_per_second and burst: {exc}"
            ) from exc
        return RateLimits(self.redis, limits)

    @cached_property
    def throttle(self) -> Throttle:
        settings = self.settings
        rule = ThrottleRule(
            latency_threshold_ms=settings.throttle_latency_ms,
            critical_backlog=settings.throttle_critical_backlog,
            resume_ratio=settings.throttle_resume_ratio,
        )
        pressure = Pressure(self.redis, window_seconds=settings.pressure_window_seconds)
        return Throttle(
            pressure, self.queue_depths, rule, interval_seconds=settings.throttle_check_seconds
        )

    @cached_property
    def dead_letters(self) -> DeadLetters:
        return DeadLetters(self, self.ledger, self.settings.broker_url)

    def retry_policy_for(self, tier: str) -> RetryPolicy:
        """The tier's retry default: built-in, updated by ``LEDGER_RETRY_POLICIES``."""
        base = TIER_RETRY_DEFAULTS.get(tier, RetryPolicy())
        override = self.settings.retry_policies.get(tier)
        if not override:
            return base
        try:
            return base.updated(**override)
        except TypeError as exc:
            raise ConfigurationError(f"LEDGER_RETRY_POLICIES[{tier!r}]: {exc}") from exc

    @cached_property
    def delayed(self) -> DelayedDeliveries:
        return DelayedDeliveries(self.settings.broker_url, key=f"{self.main}:ledger:delayed")

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


def create_app(name: str, settings: Settings | None = None, **celery_options: Any) -> LedgerCelery:
    """Build a Celery app wired to the ledger; settings from ``LEDGER_*`` unless given.

    Raises:
        ConfigurationError: the settings are invalid (the message names the setting).
    """
    if settings is None:
        settings = settings_from_environment()
    tiers = Tiers(TIERS, default=settings.default_tier, rules=settings.routing_rules)
    app = LedgerCelery(
        name,
        broker=settings.broker_url,
        backend="celery_ledger.ledger.backend:LedgerBackend",
        task_cls=LedgerTask,
        set_as_current=celery_options.pop("set_as_current", True),
        **celery_options,
    )
    app.settings = settings
    app.tiers = tiers
    app.ledger = Ledger(
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
        event_listeners=ledger_listeners(settings),  # metrics: ledger latency
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
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_seconds},
        broker_connection_retry_on_startup=True,
        result_backend_always_retry=True,
        result_backend_max_retries=10,
        task_default_queue=settings.default_tier,
        task_queues=[Queue(tier) for tier in tiers.names] + [Queue(DEAD_LETTER_QUEUE)],
        task_create_missing_queues=True,
        enable_utc=True,
        timezone="UTC",
    )
    app.ledger.open_text = lambda text: app.sealer.open(text)
    app.steps["worker"].add(LedgerWorkerStep)
    logging.getLogger("celery.app.trace").addFilter(RedactSensitive(app.is_sensitive))
    install_observability(app)  # metrics, Sentry, JSON logs: as the settings say

    @app.task(name="celery_ledger.reconcile", base=Task, shared=False)  # type: ignore[untyped-decorator]
    def reconcile_task() -> dict[str, Any]:
        """The reconciler, for celery beat (see :mod:`celery_ledger.reconciler`)."""
        return reconcile(app).as_dict()

    app.conf.beat_schedule = {
        "celery-ledger-reconcile": {
            "task": "celery_ledger.reconcile",
            "schedule": settings.reconcile_every_seconds,
            "options": {"queue": settings.default_tier},
        },
        **(app.conf.beat_schedule or {}),
    }
    return app


__all__ = ["LedgerCelery", "create_app"]
