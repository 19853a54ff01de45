"""Typed settings, read from ``LEDGER_*`` environment variables when the app is built."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

TIERS: tuple[str, ...] = ("critical", "default", "bulk")


class Settings(BaseSettings):
    """Everything ``create_app`` needs; every default is safe for production.

    Read from the environment with the ``LEDGER_`` prefix, for example ``LEDGER_BROKER_URL``.
    """

    model_config = SettingsConfigDict(env_prefix="LEDGER_", extra="forbid")

    broker_url: str = Field("redis://127.0.0.1:6379/0", description="Celery broker URL (Redis).")
    mongo_uri: str = Field("mongodb://127.0.0.1:27017/", description="MongoDB URI of the ledger.")
    mongo_db: str = Field("celery_ledger", description="Database that holds the ledger.")
    ledger_collection: str = Field("ledger", description="Collection of ledger records.")
    mongo_write_concern: Literal["majority", "1"] = Field(
        "majority", description="Write concern of ledger writes (always journaled)."
    )
    mongo_timeout_ms: int = Field(
        5000, ge=100, description="Server selection / socket timeout of ledger calls."
    )

    lease_seconds: float = Field(
        60.0,
        gt=0,
        description="How long a claim is exclusive before another delivery may take over.",
    )
    result_retention_seconds: int = Field(
        7 * 24 * 3600, ge=60, description="How long succeeded records (results) are kept."
    )
    dead_retention_seconds: int = Field(
        30 * 24 * 3600, ge=60, description="How long dead records are kept."
    )
    error_history_limit: int = Field(
        20, ge=1, le=500, description="Errors kept per record (oldest dropped first)."
    )

    max_deliveries: int = Field(
        5, ge=1, description="Deliveries without an outcome (lost workers) before a job is poison."
    )
    retry_policies: dict[str, dict[str, float | int | str]] = Field(
        default_factory=dict,
        description="Per-tier retry defaults over the built-in ones (JSON), e.g."
        ' {"bulk": {"max_retries": 10}}.',
    )
    breakers: dict[str, dict[str, float | int | None]] = Field(
        default_factory=dict,
        description='Circuit breaker thresholds by name (JSON), e.g. {"payments":'
        ' {"failure_threshold": 5, "cooldown_seconds": 30}}.',
    )
    tier_limits: dict[str, dict[str, float | int | str | None]] = Field(
        default_factory=dict,
        description="Backpressure per tier over the defaults (JSON), e.g."
        ' {"bulk": {"high_water": 20000, "policy": "shed"}}; policies: block, reject, shed.',
    )
    rate_limits: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="Token buckets shared by all workers (JSON), e.g."
        ' {"reports": {"rate_per_second": 5, "burst": 10}}; tasks name one with rate_bucket=.',
    )
    throttle_latency_ms: float | None = Field(
        500.0, gt=0, description="Bulk workers pause while foreground p95 latency is above this."
    )
    throttle_critical_backlog: int | None = Field(
        100, ge=1, description="Bulk workers pause while the critical queue is deeper than this."
    )
    throttle_resume_ratio: float = Field(
        0.7, gt=0, lt=1, description="Resume when both signals are below this share of the mark."
    )
    throttle_check_seconds: float = Field(
        1.0, gt=0, description="How often bulk workers evaluate the throttle."
    )
    pressure_window_seconds: float = Field(
        30.0, gt=0, description="Window of reported foreground latencies (report_latency)."
    )
    reconcile_lease_grace_seconds: float = Field(
        30.0, ge=0, description="The reconciler republishes jobs whose lease ended this long ago."
    )
    reconcile_stale_after_seconds: float = Field(
        900.0, gt=0, description="...and queued or retrying jobs untouched for this long."
    )
    reconcile_every_seconds: float = Field(
        60.0, gt=0, description="How often celery beat runs the reconciler."
    )
    encryption_keys: list[str] = Field(
        default_factory=list,
        description="Fernet keys (JSON list, newest first) sealing sensitive tasks' data at rest.",
    )
    dedupe_on_publish: bool = Field(
        False, description="Write a queued record at publish and skip publishing known keys."
    )
    max_payload_bytes: int = Field(
        1_000_000, ge=1024, description="Largest serialised arguments a publish accepts."
    )

    busy_recheck_seconds: float = Field(
        5.0, gt=0, description="A delivery that finds a live lease checks again after at most this."
    )
    defer_poll_seconds: float = Field(
        1.0, gt=0, description="How often each worker publishes deferred messages that are due."
    )
    unavailable_backoff_base_seconds: float = Field(
        1.0, gt=0, description="First delay when the ledger is unreachable at claim time."
    )
    unavailable_backoff_cap_seconds: float = Field(
        60.0, gt=0, description="Largest delay when the ledger stays unreachable."
    )

    worker_prefetch_multiplier: int = Field(
        1, ge=1, description="Messages a worker process reserves ahead of what it runs."
    )
    visibility_timeout_seconds: int = Field(
        3600, ge=10, description="Redis transport: unacked messages are redelivered after this."
    )
    default_tier: str = Field("default", description="Tier of tasks that do not name one.")
    routing_rules: dict[str, str] = Field(
        default_factory=dict,
        description='Glob patterns on task names to tiers, e.g. {"reports.*": "bulk"} (JSON).',
    )

    # -- operations (celery_ledger.observability) --
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of each worker's Prometheus /metrics endpoint (unset: no metrics).",
    )
    metrics_address: str = Field(
        "0.0.0.0", description="Address the worker's metrics endpoint listens on."
    )
    sentry_dsn: str | None = Field(
        None,
        description="Sentry DSN: report dead letters, open breakers, lost leases (unset: off).",
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="Worker log lines: text, or one JSON object per line with task fields."
    )

    @field_validator("default_tier")
    @classmethod
    def _known_tier(cls, value: str) -> str:
        if value not in TIERS:
            raise ValueError(f"unknown tier {value!r}; known tiers: {', '.join(TIERS)}")
        return value
