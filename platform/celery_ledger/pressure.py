"""Foreground latency, reported by the apps' web tier: the signal of the bulk throttle.

Apps call ``celery_ledger.pressure.report_latency(ms)`` after each foreground request; the
samples of the last ``window_seconds`` live in one Redis sorted set shared by every host, scored
by the Redis server's clock. Bulk workers read the p95 through
:class:`celery_ledger.policies.throttle.Throttle`.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid

import redis

from .errors import ConfigurationError
from .locks import ForkSafeLock

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
        self._lock = ForkSafeLock()
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


_default: Pressure | None = None
_default_lock = ForkSafeLock()
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
