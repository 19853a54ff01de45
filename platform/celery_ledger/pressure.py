"""Foreground pressure: latency the apps report, and a throttle for background work.

Apps call ``celery_ledger.pressure.report_latency(ms)`` after each foreground request; the
samples of the last ``window_seconds`` live in one Redis sorted set shared by every host, scored
by the Redis server's clock. Bulk workers ask :class:`Throttle` whether to hold back while the
foreground p95 or the critical backlog is too high.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis

from .errors import ConfigurationError
from .policies.backpressure import QueueDepths

logger = logging.getLogger(__name__)

MAX_SAMPLES = 10_000


class Pressure:
    """Latency samples in a Redis sorted set (member ``"<ms>:<random>"``, score server time).

    The server clock is read with ``TIME`` once per ``resync_seconds`` and followed locally with
    ``time.monotonic``, so a report is one pipelined round trip (two on the first call).
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        window_seconds: float = 30.0,
        key_prefix: str = "celery_ledger:pressure",
        resync_seconds: float = 300.0,
    ) -> None:
        if window_seconds <= 0:
            raise ConfigurationError("window_seconds must be positive")
        self.client = client
        self.window_seconds = window_seconds
        self.key = f"{key_prefix}:latency"
        self._resync_seconds = resync_seconds
        self._lock = threading.Lock()
        self._clock_base: tuple[float, float] | None = None  # (server time, monotonic) pair

    def server_now(self) -> float:
        """The Redis server's clock, in unix seconds."""
        with self._lock:
            base = self._clock_base
            if base is None or time.monotonic() - base[1] >= self._resync_seconds:
                before = time.monotonic()
                seconds, micros = self.client.time()
                base = (seconds + micros / 1e6, (before + time.monotonic()) / 2)
                self._clock_base = base
        return base[0] + time.monotonic() - base[1]

    def report_latency(self, ms: float) -> None:
        """Record one foreground latency sample and drop samples older than the window."""
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(f"latency must be a finite, non-negative number of ms, not {ms!r}")
        now = self.server_now()
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self.key, {f"{float(ms)!r}:{uuid.uuid4().hex[:16]}": now})
        pipe.zremrangebyscore(self.key, "-inf", now - self.window_seconds)
        pipe.expire(self.key, math.ceil(self.window_seconds) + 1)
        pipe.execute()

    def p95_ms(self) -> float | None:
        """The 95th percentile (nearest rank) of the window's most recent samples, or None."""
        since = self.server_now() - self.window_seconds
        members = self.client.zrevrangebyscore(self.key, "+inf", since, start=0, num=MAX_SAMPLES)
        texts = (str(m, "ascii") if isinstance(m, bytes) else str(m) for m in members)
        values = sorted(float(text.partition(":")[0]) for text in texts)
        return values[math.ceil(0.95 * len(values)) - 1] if values else None


@dataclass(frozen=True)
class ThrottleRule:
    """Engage above either threshold; release once both are at or below ``resume_ratio`` of it.

    ``None`` disables a signal.
    """

    latency_threshold_ms: float | None = 500.0
    critical_backlog: int | None = 100
    resume_ratio: float = 0.7

    def __post_init__(self) -> None:
        if not 0 < self.resume_ratio <= 1:
            raise ConfigurationError("resume_ratio must be in (0, 1]")
        if (self.latency_threshold_ms or 0) < 0 or (self.critical_backlog or 0) < 0:
            raise ConfigurationError("thresholds must not be negative")


class Throttle:
    """Whether background work should hold back; re-evaluated at most every ``interval_seconds``."""

    def __init__(
        self,
        pressure: Pressure,
        depths: QueueDepths,
        rule: ThrottleRule,
        *,
        critical_queue: str = "critical",
        interval_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rule.critical_backlog is not None and critical_queue not in depths.queues:
            raise ConfigurationError(f"queue {critical_queue!r} is not sampled by the depths")
        self.pressure = pressure
        self.depths = depths
        self.rule = rule
        self.critical_queue = critical_queue
        self._interval = interval_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._checked_at: float | None = None
        self._engaged = False
        self._reason: str | None = None

    def should_throttle(self) -> bool:
        """True while the foreground is under pressure (see :class:`ThrottleRule`)."""
        with self._lock:
            if self._checked_at is None or self._clock() - self._checked_at >= self._interval:
                self._engaged, self._reason = self._evaluate()
                self._checked_at = self._clock()
            return self._engaged

    def reason(self) -> str | None:
        """Why the last :meth:`should_throttle` said to throttle (None if it did not)."""
        return self._reason

    def _evaluate(self) -> tuple[bool, str | None]:
        rule = self.rule
        p95 = self.pressure.p95_ms() if rule.latency_threshold_ms is not None else None
        backlog = None
        if rule.critical_backlog is not None:
            backlog = self.depths.depth(self.critical_queue)
        over: list[str] = []  # above the threshold: engages
        held: list[str] = []  # above the resume level only: keeps an engaged throttle engaged
        ratio, limit = rule.resume_ratio, rule.latency_threshold_ms
        if limit is not None and p95 is not None:
            if p95 > limit:
                over.append(f"foreground p95 {_num(p95)}ms > {_num(limit)}ms")
            elif p95 > limit * ratio:
                held.append(f"foreground p95 {_num(p95)}ms > resume {_num(limit * ratio)}ms")
        cap = rule.critical_backlog
        if cap is not None and backlog is not None:
            if backlog > cap:
                over.append(f"critical backlog {backlog} > {cap}")
            elif backlog > cap * ratio:
                held.append(f"critical backlog {backlog} > resume {_num(cap * ratio)}")
        engaged = bool(over) or (self._engaged and bool(held))
        return engaged, "; ".join(over + held) if engaged else None


def _num(value: float) -> str:
    return f"{round(value, 1):g}"


_default: Pressure | None = None
_default_lock = threading.Lock()
_last_warning: float | None = None


def _build(redis_url: str, window_seconds: float) -> Pressure:
    client = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    return Pressure(client, window_seconds=window_seconds)


def configure(redis_url: str, *, window_seconds: float = 30.0) -> Pressure:
    """Set the :class:`Pressure` that :func:`report_latency` uses (closing any previous one)."""
    global _default
    pressure = _build(redis_url, window_seconds)
    with _default_lock:
        previous, _default = _default, pressure
    if previous is not None:
        previous.client.close()
    return pressure


def _configured() -> Pressure:
    global _default
    with _default_lock:
        if _default is None:
            url = os.environ.get("LEDGER_BROKER_URL")
            if not url:
                raise ConfigurationError(
                    "celery_ledger.pressure is not configured: call configure(redis_url) "
                    "or set LEDGER_BROKER_URL"
                )
            _default = _build(url, 30.0)
        return _default


def report_latency(ms: float) -> None:
    """Report one foreground latency sample (configured, or from ``LEDGER_BROKER_URL``).

    Broker errors are logged (at most one warning per 30 s) and swallowed: a latency report
    must never fail the request that makes it.
    """
    global _last_warning
    pressure = _default or _configured()
    try:
        pressure.report_latency(ms)
    except redis.RedisError as exc:
        now = time.monotonic()
        if _last_warning is None or now - _last_warning >= 30.0:
            logger.warning("cannot report latency: %s", exc)
            _last_warning = now
