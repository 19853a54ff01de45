"""Foreground latency, reported by the apps' web tier: the signal of the bulk throttle.

Apps call ``celery_ledger.pressure.report_latency(ms)`` after each foreground request; the
samples of the last ``window_seconds`` live in one Redis sorted set shared by every host, scored
by the Redis server's clock. A report costs the request no broker round trip: it is buffered in
the process and a background thread sends the buffer once per ``flush_seconds`` (1 s) in one
pipelined round trip, whatever the request rate. Bulk workers read the p95 through
:class:`celery_ledger.policies.throttle.Throttle`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections import deque

import redis

from .errors import ConfigurationError
from .locks import ForkSafeLock, keep_inherited
from .sentinel import (
    RedisTarget,
    SentinelSettings,
    connection_options,
    fresh_client,
    redis_client,
)

logger = logging.getLogger(__name__)

MAX_SAMPLES = 10_000


class Pressure:
    """Latency samples in a Redis sorted set (member ``"<ms>:<random>"``, score server time).

    Reports are buffered (at most ``MAX_SAMPLES``, the oldest dropped first) and sent by a
    daemon thread every ``flush_seconds``, or by :meth:`flush`; each sample keeps the time it
    was reported. The server clock is read with ``TIME`` once per ``resync_seconds`` and
    followed locally with ``time.monotonic``, so a flush is one pipelined round trip.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        window_seconds: float = 30.0,
        key_prefix: str = "celery_ledger:pressure",
        resync_seconds: float = 300.0,
        flush_seconds: float = 1.0,
    ) -> None:
        if window_seconds <= 0 or flush_seconds <= 0:
            raise ConfigurationError("window_seconds and flush_seconds must be positive")
        self.client = client
        self.window_seconds = window_seconds
        self.flush_seconds = flush_seconds
        self.key = f"{key_prefix}:latency"
        self._resync_seconds = resync_seconds
        self._lock = ForkSafeLock()
        self._clock_base: tuple[float, float] | None = None  # (server time, monotonic) pair
        self._pending: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (ms, monotonic)
        self._flusher: threading.Thread | None = None
        self._pid = os.getpid()
        self._client_pid = os.getpid()
        self._last_warning: float | None = None
        self._closed = threading.Event()

    def _here(self) -> None:
        """In a forked child, a client of its own (never its parent's pool: see runtime.py)."""
        if self._client_pid != os.getpid():
            inherited = self.client
            keep_inherited(inherited)
            self.client = fresh_client(inherited)
            self._client_pid = os.getpid()

    def server_now(self) -> float:
        """The Redis server's clock, in unix seconds."""
        self._here()
        with self._lock:
            base = self._clock_base
            if base is None or time.monotonic() - base[1] >= self._resync_seconds:
                before = time.monotonic()
                seconds, micros = self.client.time()
                base = (seconds + micros / 1e6, (before + time.monotonic()) / 2)
                self._clock_base = base
        return base[0] + time.monotonic() - base[1]

    def report_latency(self, ms: float) -> None:
        """Record one foreground latency sample (in memory; the flusher sends it)."""
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(f"latency must be a finite, non-negative number of ms, not {ms!r}")
        with self._lock:
            if (
                self._pid != os.getpid()
            ):  # a forked child: its parent's buffer and thread are not its
                self._pending.clear()
                self._flusher, self._pid = None, os.getpid()
            self._pending.append((float(ms), time.monotonic()))
            if self._flusher is None:
                self._flusher = threading.Thread(
                    target=self._flush_forever, name="ledger-latency-flush", daemon=True
                )
                self._flusher.start()

    def flush(self) -> int:
        """Send the buffered samples (one pipelined round trip) and drop those older than the
        window; returns how many were sent. A broker error drops them and raises."""
        with self._lock:
            samples = list(self._pending)
            self._pending.clear()
        if not samples:
            return 0
        now, now_monotonic = self.server_now(), time.monotonic()  # (a client of this process)
        members = {
            f"{ms!r}:{uuid.uuid4().hex[:16]}": now - (now_monotonic - at) for ms, at in samples
        }
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self.key, members)
        pipe.zremrangebyscore(self.key, "-inf", now - self.window_seconds)
        pipe.expire(self.key, math.ceil(self.window_seconds) + 1)
        pipe.execute()
        return len(samples)

    def flush_quietly(self) -> None:
        """:meth:`flush`, logging a broker error (at most one warning per 30 s) instead of
        raising: a latency report must never fail anything."""
        try:
            self.flush()
        except redis.RedisError as exc:
            now = time.monotonic()
            if self._last_warning is None or now - self._last_warning >= 30.0:
                logger.warning("cannot report latency: %s", exc)
                self._last_warning = now

    def _flush_forever(self) -> None:
        while not self._closed.wait(self.flush_seconds):
            self.flush_quietly()

    def close(self) -> None:
        """Send what is buffered, stop the flusher and close the client."""
        self._here()
        self._closed.set()
        self.flush_quietly()
        self.client.close()

    def p95_ms(self) -> float | None:
        """The 95th percentile (nearest rank) of the window's most recent samples, or None
        (this process's buffered samples are sent first)."""
        self.flush()
        since = self.server_now() - self.window_seconds
        members = self.client.zrevrangebyscore(self.key, "+inf", since, start=0, num=MAX_SAMPLES)
        texts = (str(m, "ascii") if isinstance(m, bytes) else str(m) for m in members)
        values = sorted(float(text.partition(":")[0]) for text in texts)
        return values[math.ceil(0.95 * len(values)) - 1] if values else None


_default: Pressure | None = None
_default_lock = ForkSafeLock()


def _build(redis_url: str | RedisTarget, window_seconds: float) -> Pressure:
    client = redis_client(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    return Pressure(client, window_seconds=window_seconds)


def configure(redis_url: str | RedisTarget, *, window_seconds: float = 30.0) -> Pressure:
    """Set the :class:`Pressure` that :func:`report_latency` uses (closing any previous one).

    ``redis_url``: the broker's URL, or (through Sentinel) a :class:`RedisTarget` of it, as
    ``app.runtime.broker_target``."""
    global _default
    pressure = _build(redis_url, window_seconds)
    with _default_lock:
        previous, _default = _default, pressure
    if previous is not None:
        previous.close()
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
            _default = _build(_target_from_environment(url), 30.0)
        return _default


def _target_from_environment(url: str) -> RedisTarget:
    """``LEDGER_BROKER_URL`` with, for a list of sentinels, the ``LEDGER_SENTINEL_*`` options."""
    return RedisTarget(url, connection_options(SentinelSettings(broker_url=url)))


def report_latency(ms: float) -> None:
    """Report one foreground latency sample (configured, or from ``LEDGER_BROKER_URL``).

    No broker round trip: the sample is buffered and sent within ``flush_seconds``; broker
    errors are logged there (at most one warning per 30 s), never raised to the request.
    """
    (_default or _configured()).report_latency(ms)
