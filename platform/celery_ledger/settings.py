"""Typed settings, read from ``LEDGER_*`` environment variables when the app is built."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import unquote_plus

import redis.connection
from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    field_validator,
)
from pydantic_settings import SettingsConfigDict, SettingsError
from pymongo import uri_parser
from pymongo.errors import InvalidURI, PyMongoError

from .errors import ConfigurationError
from .fairness import TenantPolicy
from .policies.backpressure import DEFAULT_TIER_LIMITS, TierLimit
from .policies.breaker import BreakerConfig
from .policies.rate_limit import RateLimit
from .policies.retry import TIER_RETRY_DEFAULTS, RetryPolicy
from .routing import TIERS
from .sentinel import SentinelSettings, check_sentinel_url, is_sentinel_url
from .settings_checks import (  # the validators' checks, and the names other modules import
    _BAD_DATABASE_CHARS,
    _ENCODED,
    _QUEUE_NAME,
    _SRV,
    BROKER_URL_UNSET,
    PLACEHOLDER_PREFIX,
    UNSET_BROKER_HOST,
    UNSET_BROKER_URL,
    ConsoleUser,
    _built,
    _check_tier,
    _mapping,
    _not_a_placeholder,
    _random_secret,
    check_sentry_dsn,
    describe_invalid,
    located,
    tenant_policies,
    unknown_settings,
)


class Settings(SentinelSettings):
    """Everything ``create_app`` needs; every default is safe for production.

    Read from the environment with the ``LEDGER_`` prefix, for example ``LEDGER_BROKER_URL``.
    """

    # Every float is finite: ``inf`` or ``nan`` would only fail later, at the first use.
    # Errors never echo the value they refuse: a URL carries a password, a key is the key.
    model_config = SettingsConfigDict(
        env_prefix="LEDGER_", extra="forbid", allow_inf_nan=False, hide_input_in_errors=True
    )

    # URLs and DSNs carry passwords: left out of the settings' repr. (broker_url: sentinel.py)
    mongo_uri: str = Field(
        "mongodb://127.0.0.1:27017/", repr=False, description="MongoDB URI of the ledger."
    )
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
    ttl_index: bool = Field(
        True,
        description="Expire old records with a MongoDB TTL index; `false`: a plain index and a"
        " delete every minute by each worker (for servers whose TTL sweep blocks writes, as"
        " SecantusDB's does; the embedded stack sets it).",
    )
    error_history_limit: int = Field(
        20, ge=1, le=500, description="Errors kept per record (oldest dropped first)."
    )
    group_commit_max: int = Field(
        128,
        ge=1,
        le=1000,
        description="Most ledger writes of one worker process's concurrent tasks sent as one"
        " bulk write (group commit; threads and gevent pools); 1 sends each alone.",
    )

    max_deliveries: int = Field(
        5, ge=1, description="Deliveries without an outcome (lost workers) before a job is poison."
    )
    retry_policies: dict[str, RetryPolicy] = Field(
        default_factory=dict,
        description="Per-tier retry defaults over the built-in ones (JSON), e.g."
        ' {"bulk": {"max_retries": 10}}; options: max_retries, base_seconds, cap_seconds,'
        " jitter (full, decorrelated, none).",
    )
    breakers: dict[str, BreakerConfig] = Field(
        default_factory=dict,
        description='Circuit breaker thresholds by name (JSON), e.g. {"payments":'
        ' {"failure_threshold": 5, "cooldown_seconds": 30}}.',
    )
    tier_limits: dict[str, TierLimit] = Field(
        default_factory=dict,
        description="Backpressure per tier over the defaults (JSON), e.g."
        ' {"bulk": {"high_water": 20000, "policy": "shed"}}; policies: block, reject, shed.',
    )
    tenants: dict[str, TenantPolicy] = Field(
        default_factory=dict,
        description='How tenants share each tier (JSON, `*`: the others), e.g. {"acme":'
        ' {"weight": 3, "concurrency": 20, "max_waiting": 10000, "rate_per_second": 50}}'
        " (docs/guide/tenants.md).",
    )
    fair_queue_depth: int = Field(
        0,
        ge=0,
        description="Fair dispatch of tenants' jobs: the most messages a tier queue holds while"
        " they wait in their lanes (0, the default: off; 1: on; workers first, see tenants.md).",
    )
    fair_express_slots: int = Field(
        1,
        ge=0,
        le=8,
        description="With fair dispatch on, pool processes a prefork worker keeps beyond its"
        " concurrency for the jobs of tenants that go ahead of a backlog (0: none; tenants.md).",
    )
    tenants_top: int = Field(
        10,
        ge=0,
        le=100,
        description="Tenants named per tier in the metrics and the console, the most waiting"
        ' first; the rest are summed as tenant "other" (bounded label values).',
    )
    rate_limits: dict[str, RateLimit] = Field(
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
    clock_warn_seconds: float = Field(
        1.0,
        gt=0,
        description="Past this offset between a host's clock and the ledger's or the broker's,"
        " the host is reported (a warning in its log, `ledger health` warns). Decisions use"
        " the servers' clocks; Celery's own absolute times (expires= in seconds, an eta an app"
        " computes) and log times use the host's.",
    )
    clock_down_seconds: float = Field(
        60.0,
        gt=0,
        description="Past this offset `ledger health` says the clock is down: such a host's"
        " expires= and etas are off by a whole default lease.",
    )
    reconcile_lease_grace_seconds: float = Field(
        10.0, ge=0, description="The reconciler republishes jobs whose lease ended this long ago."
    )
    reconcile_stale_after_seconds: float = Field(
        900.0, gt=0, description="...and queued or retrying jobs untouched for this long."
    )
    reconcile_missing_after_seconds: float = Field(
        30.0, gt=0, description="...and, sooner, those untouched this long whose message is gone."
    )
    reconcile_every_seconds: float = Field(
        30.0, gt=0, description="How often the workers (one at a time) run the reconciler."
    )
    reconcile_in_workers: bool = Field(
        True,
        description="Every worker's housekeeping runs the reconciler, one sweeper at a time"
        " across the fleet (a lease lock in Redis): no celery beat needed.",
    )
    schedules_in_workers: bool | None = Field(
        None,
        description="Every worker's housekeeping runs the app's beat_schedule, one scheduler"
        " at a time across the fleet (a lease lock in Redis): no celery beat needed. Unset: on,"
        " unless beat_scheduler names another scheduler class than celery-ledger's (which marks"
        " no slots: beat and the workers would both run each tick). A slot runs once however"
        " many schedulers fire it.",
    )
    outbox_relay_in_workers: bool = Field(
        True,
        description="Every worker's housekeeping runs the outbox relay, one relay at a time"
        " across the fleet (a lease in Redis).",
    )
    outbox_relay_seconds: float = Field(
        2.0,
        gt=0,
        description="How often the workers (one at a time) publish jobs enqueued in an app's"
        " transaction that their committing process did not (it died after the commit).",
    )
    outbox_grace_seconds: float = Field(
        5.0,
        ge=0,
        description="The outbox relay leaves a committed job this long to the process that"
        " committed it (its publish right after the commit) before publishing it itself.",
    )
    triggers_in_workers: bool = Field(
        True,
        description="Workers compete to watch the app's change-stream triggers (one watcher"
        " per trigger across the fleet); false on workers that must not.",
    )
    trigger_lease_seconds: float = Field(
        10.0,
        gt=0,
        description="A trigger's watcher lease: a dead watcher is replaced after this"
        " (a trigger's lease_seconds= overrides it).",
    )
    trigger_await_ms: int = Field(
        500, gt=0, description="How long one change-stream read waits for a change."
    )
    trigger_save_every: int = Field(
        100,
        ge=1,
        description="Changes between two saves of a trigger's resume token (it is also saved"
        " at the end of each read slice and when the stream is idle).",
    )
    workflow_check_seconds: float = Field(
        120.0,
        gt=0,
        description="The reconciler wakes an active workflow nothing woke for this long (a lost"
        " wake-up), and republishes its steps whose message was lost.",
    )
    workflow_snapshot_every: int = Field(
        100, ge=10, description="A workflow's log gets a snapshot every this many events."
    )
    workflow_retention_seconds: int = Field(
        30 * 24 * 3600, gt=0, description="How long an ended workflow's state and log are kept."
    )
    workflow_max_pending_signals: int = Field(
        1000, ge=1, description="Signals a workflow keeps unconsumed; more are refused."
    )
    encryption_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Fernet keys (JSON list, newest first) sealing sensitive tasks' data at rest.",
    )
    key_secret: SecretStr | None = Field(
        None,
        description="HMAC key of the idempotency keys a sensitive task derives from its"
        " arguments (32+ random characters). Never rotate it: the keys, and so the jobs'"
        " identities, would change.",
    )
    signing_keys: list[SecretStr] = Field(
        default_factory=list,
        description="HMAC keys (JSON list, newest first, 32+ characters each) signing every task"
        " message; workers refuse messages unsigned or badly signed (dead-lettered).",
    )
    signatures_required: bool = Field(
        True,
        description="With signing keys, refuse unsigned messages (false only while a deploy"
        " adds the keys to every producer; a signature that is there is always checked).",
    )
    dead_letter_queue_max: int = Field(
        10_000,
        ge=1,
        description="The dead letters' queue keeps its newest copies, at most this many (every"
        " dead record stays in the ledger); older copies are dropped from the queue.",
    )
    dedupe_on_publish: bool = Field(
        True, description="Write a queued record at publish (what a lost message comes back from)."
    )
    max_payload_bytes: int = Field(
        1_000_000, ge=1024, description="Largest serialised arguments a publish accepts."
    )
    max_result_bytes: int = Field(
        4_000_000,
        ge=1024,
        le=15_000_000,
        description="Largest serialised result the ledger stores; a larger one ends the job dead"
        " with that reason (a MongoDB document holds at most 16 MiB).",
    )

    unrunnable_window_seconds: float = Field(
        900.0,
        ge=0,
        description="A message of a task this worker does not know (or whose arguments no"
        " longer bind) is put off with backoff this long, for a rolling deploy to finish,"
        " before it is dead-lettered.",
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
    restore_unacked: bool = Field(
        True,
        description="Whether this process puts back messages left unacknowledged past the"
        " visibility timeout (workers: on; Flower: off, its broker user may not write queues).",
    )
    default_tier: str = Field("default", description="Tier of tasks that do not name one.")
    queue_namespace: str | None = Field(
        None,
        description="Prefix of the tier queues' names (`<namespace>.critical`, ...). Unset: the"
        " app's name, so apps sharing a broker never take each other's messages; empty: the bare"
        " tier names (the names before namespaces; share them only on purpose).",
    )
    routing_rules: dict[str, str] = Field(
        default_factory=dict,
        description='Glob patterns on task names to tiers, e.g. {"reports.*": "bulk"} (JSON).',
    )
    slo_seconds: dict[str, float] = Field(
        default_factory=dict,
        description='Latency objective per tier (JSON), e.g. {"critical": 60}: a job of the'
        " tier still unfinished this long after its publish is reported late, once (a task's"
        " slo_seconds= option wins).",
    )
    escalation_check_seconds: float = Field(
        5.0, gt=0, description="How often workers look for jobs past their latency objective."
    )

    # -- operations (celery_ledger.observability) --
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of each worker's Prometheus /metrics endpoint (unset: no metrics).",
    )
    metrics_address: str = Field(
        "127.0.0.1",
        description="Address the worker's metrics endpoint listens on (loopback unless set:"
        " 0.0.0.0 where a scraper on another host reads it).",
    )
    metrics_auth: SecretStr | None = Field(
        None,
        description="`user:password`: the metrics endpoint asks for HTTP basic authentication.",
    )
    metrics_cache_seconds: float = Field(
        10.0,
        ge=0,
        description="Scrape-time gauges (queue depths, delayed set, breakers, ledger counts) are"
        " read at most once per this many seconds, however often the endpoint is scraped.",
    )
    console_users: dict[str, ConsoleUser] = Field(
        default_factory=dict,
        repr=False,
        description='Who may log in to the web console (JSON), e.g. {"alice": {"password":'
        ' "...", "role": "operator"}}; roles: viewer (reads), operator (also replays, purges,'
        " forces breakers, signals workflows). None: the console refuses to start.",
    )
    console_secret: SecretStr | None = Field(
        None,
        description="Signs the console's session cookies (32+ random characters; unset: a"
        " random key per start, so a restart logs everyone out).",
    )
    console_https_only: bool = Field(
        False,
        description="Session cookies only over HTTPS (set it when the console is behind TLS).",
    )
    sentry_dsn: str | None = Field(
        None,
        repr=False,
        description="Sentry DSN: report dead letters, open breakers, lost leases (unset: off).",
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="Worker log lines: text, or one JSON object per line with task fields."
    )
    tracing: bool = Field(
        False,
        description="OpenTelemetry traces of every job (extra tracing; exporters from the"
        " standard OTEL_* variables, OTLP by default).",
    )
    tracing_dir: str | None = Field(
        None,
        description="With tracing on: also write every span as a JSON line to"
        " <dir>/spans-<pid>.jsonl.",
    )

    @field_validator("default_tier")
    @classmethod
    def _known_tier(cls, value: str) -> str:
        _check_tier(value)
        return value

    @field_validator("queue_namespace")
    @classmethod
    def _queue_namespace(cls, value: str | None) -> str | None:
        if value and not _QUEUE_NAME.fullmatch(value):
            raise ValueError(
                "a queue namespace is letters, digits and . _ - : (it names Redis keys and"
                " worker -Q lists)"
            )
        return value

    # A parser's message quotes what it could not read: in a URL whose password is not
    # percent-encoded, the password ("...cast to integer value as 's3cr3t'"). None is shown: each
    # refusal says what is expected, where (_located), raised outside the ``except`` (no chain).

    def require_broker_url(self) -> str:
        """The broker URL; a clear :class:`ConfigurationError` when it is not set.

        Raises:
            ConfigurationError: ``LEDGER_BROKER_URL`` is not set.
        """
        if self.broker_url is None:
            raise ConfigurationError(BROKER_URL_UNSET)
        return self.broker_url

    @field_validator("broker_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if is_sentinel_url(value):  # (a list of sentinels: Celery's form)
            return check_sentinel_url(value, _not_a_placeholder)
        try:
            parsed = redis.connection.parse_url(value)  # what breakers and shared state use
        except Exception:
            parsed = None
        if parsed is None:
            raise ValueError(
                f"not a Redis URL ({located(value)}): expected"
                " redis://[user:password@]host[:port][/db][?options] (rediss:// for TLS, or"
                f" unix://path), {_ENCODED}"
            )
        _not_a_placeholder(parsed.get("password"))
        return value

    @field_validator("mongo_uri")
    @classmethod
    def _mongodb_uri(cls, value: str) -> str:
        if value.startswith(_SRV):  # parsing resolves an SRV name (DNS): check its shape only
            userinfo, _, host = value.removeprefix(_SRV).partition("/")[0].rpartition("@")
            _not_a_placeholder(unquote_plus(userinfo.partition(":")[2]))
            if host and ":" not in host:
                return value
            raise ValueError(
                f"not a MongoDB URI ({located(value)}): a mongodb+srv:// URI names one host,"
                f" without a port, {_ENCODED}"
            )
        problem = None
        try:
            parsed = uri_parser.parse_uri(value)
        except InvalidURI:
            problem = (
                "expected mongodb://[user:password@]host[:port][,host...][/database][?options]"
                f" or mongodb+srv://, {_ENCODED}"
            )
        except PyMongoError:
            problem = "an option in its query is unknown or has a value it does not take"
        except Exception:  # a port or an option's value (pymongo raises ValueError for them)
            problem = f"a port or an option's value is not valid, {_ENCODED}"
        if problem is not None:
            raise ValueError(f"not a MongoDB URI ({located(value)}): {problem}")
        _not_a_placeholder(parsed.get("password"))
        return value

    @field_validator("mongo_db")
    @classmethod
    def _database_name(cls, value: str) -> str:
        if not value or len(value.encode()) > 63 or not _BAD_DATABASE_CHARS.isdisjoint(value):
            raise ValueError(
                'a MongoDB database name is 1-63 bytes without spaces, NUL or any of . $ / \\ "'
            )
        return value

    @field_validator("ledger_collection")
    @classmethod
    def _collection_name(cls, value: str) -> str:
        value.encode()  # lone surrogates: UnicodeEncodeError, a ValueError
        if (
            not value
            or not {"$", "\x00"}.isdisjoint(value)
            or ".." in value
            or value.startswith((".", "system."))
            or value.endswith(".")
        ):
            raise ValueError(
                "a MongoDB collection name is not empty, has no $, NUL or '..', does not start"
                " with 'system.' and neither starts nor ends with '.'"
            )
        return value

    @field_validator("retry_policies", mode="before")
    @classmethod
    def _retry_policies(cls, value: Any) -> dict[str, RetryPolicy]:
        checked: dict[str, RetryPolicy] = {}
        for tier, options in _mapping(value, "retry policies").items():
            _check_tier(tier)
            base = TIER_RETRY_DEFAULTS.get(tier, RetryPolicy())
            checked[tier] = _built(RetryPolicy, base, options, what=f"tier {tier!r}")
        return checked

    @field_validator("slo_seconds", mode="before")
    @classmethod
    def _slo_seconds(cls, value: Any) -> dict[str, float]:
        checked: dict[str, float] = {}
        for tier, seconds in _mapping(value, "latency objectives").items():
            _check_tier(tier)
            if (
                isinstance(seconds, bool)
                or not isinstance(seconds, int | float)
                or not (0 < seconds < float("inf"))
            ):
                raise ValueError(f"the latency objective of tier {tier!r} must be seconds > 0")
            checked[tier] = float(seconds)
        return checked

    @field_validator("breakers", mode="before")
    @classmethod
    def _breakers(cls, value: Any) -> dict[str, BreakerConfig]:
        return {
            name: _built(BreakerConfig, BreakerConfig(), options, what=f"breaker {name!r}")
            for name, options in _mapping(value, "breakers").items()
        }

    @field_validator("tier_limits", mode="before")
    @classmethod
    def _tier_limits(cls, value: Any) -> dict[str, TierLimit]:
        limits = dict(DEFAULT_TIER_LIMITS)
        for tier, options in _mapping(value, "tier limits").items():
            _check_tier(tier)
            limits[tier] = _built(TierLimit, limits[tier], options, what=f"tier {tier!r}")
        return limits

    @field_validator("rate_limits", mode="before")
    @classmethod
    def _rate_limits(cls, value: Any) -> dict[str, RateLimit]:
        default = RateLimit(rate_per_second=1.0, burst=1)
        checked: dict[str, RateLimit] = {}
        for name, options in _mapping(value, "rate limits").items():
            missing = {"rate_per_second", "burst"} - set(_mapping(options, f"bucket {name!r}"))
            if missing:
                raise ValueError(f"bucket {name!r}: needs {', '.join(sorted(missing))}")
            checked[name] = _built(RateLimit, default, options, what=f"bucket {name!r}")
        return checked

    @field_validator("metrics_auth")
    @classmethod
    def _metrics_auth(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return value
        user, colon, password = value.get_secret_value().partition(":")
        if not (user and colon and password):
            raise ValueError("metrics auth is user:password, both non-empty")
        return value

    @field_validator("console_secret")
    @classmethod
    def _console_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        _random_secret(value, "the console secret")
        return value

    @field_validator("encryption_keys")
    @classmethod
    def _encryption_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        for key in value:
            _not_a_placeholder(key.get_secret_value())
        return value

    @field_validator("key_secret")
    @classmethod
    def _key_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None  # unset (compose passes an empty variable)
        _random_secret(value, "the key secret")
        return value

    @field_validator("signing_keys")
    @classmethod
    def _signing_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        for key in value:
            _random_secret(key, "each signing key")
        return value

    @field_validator("sentry_dsn")
    @classmethod
    def _sentry_dsn(cls, value: str | None) -> str | None:
        return check_sentry_dsn(value)

    @field_validator("tenants", mode="before")
    @classmethod
    def _tenants(cls, value: Any) -> dict[str, TenantPolicy]:
        return tenant_policies(value)


def settings_from_environment() -> Settings:
    """``Settings()`` from ``LEDGER_*``; a bad value or an unknown ``LEDGER_*`` name is refused.

    Raises:
        ConfigurationError: naming the variable (and the closest known one for a misspelling).
    """
    problem = unknown_settings({f"LEDGER_{name.upper()}" for name in Settings.model_fields})
    if problem is not None:
        raise ConfigurationError(problem)
    try:
        return Settings()
    except (ValidationError, SettingsError) as exc:
        raise ConfigurationError(describe_invalid(exc)) from None


__all__ = [
    "BROKER_URL_UNSET",
    "PLACEHOLDER_PREFIX",
    "TIERS",
    "UNSET_BROKER_HOST",
    "UNSET_BROKER_URL",
    "ConsoleUser",
    "Settings",
    "describe_invalid",
    "located",
    "settings_from_environment",
]
