"""Token buckets shared in Redis by every worker and host (unlike Celery's per-worker rate_limit).

One Lua script call per attempt refills the bucket from the Redis server's ``TIME`` (so host
clocks do not matter), takes the tokens if there are enough and otherwise says how long to wait.
Tokens are stored fractionally; an idle bucket expires once it would be full again, which is
the same as a bucket that never existed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import redis

from ..errors import ConfigurationError

logger = logging.getLogger("celery_ledger.rate_limit")


@dataclass(frozen=True)
class RateLimit:
    """A shared bucket's refill rate and burst (``LEDGER_RATE_LIMITS``)."""

    rate_per_second: float
    burst: int

    def __post_init__(self) -> None:
        if not self.rate_per_second > 0 or self.burst < 1:
            raise ConfigurationError("rate_per_second must be positive and burst at least 1")


# KEYS[1] = the bucket hash; ARGV = rate per second, burst, tokens wanted.
# Returns the seconds to wait as a string (0 when the tokens were taken).
_TAKE = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local wanted = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = burst
elseif now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate)
else
  now = ts
end
local wait = 0
if tokens >= wanted then
  tokens = tokens - wanted
else
  wait = (wanted - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens),
  'ts', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return string.format('%.17g', wait)
"""


class TokenBucket:
    """``rate_per_second`` tokens a second, at most ``burst`` saved up, shared via Redis."""

    def __init__(
        self,
        client: redis.Redis,
        name: str,
        *,
        rate_per_second: float,
        burst: int,
        key_prefix: str = "celery_ledger:rate",
    ) -> None:
        if rate_per_second <= 0 or burst < 1:
            raise ValueError("rate_per_second must be positive and burst at least 1")
        self.name = name
        self.rate_per_second = rate_per_second
        self.burst = burst
        self.key = f"{key_prefix}:{name}"
        self._take = client.register_script(_TAKE)

    def try_acquire(self, tokens: int = 1) -> float:
        """0.0 if ``tokens`` were taken, else the seconds until that many may be available."""
        if not 1 <= tokens <= self.burst:
            raise ValueError(f"tokens must be between 1 and the burst ({self.burst})")
        wait = self._take(keys=[self.key], args=[self.rate_per_second, self.burst, tokens])
        return float(wait)

    def acquire(self, tokens: int = 1, *, timeout: float | None = None) -> bool:
        """Take ``tokens``, sleeping as needed; False if that would take longer than ``timeout``.

        Gives up early (without sleeping) once the bucket says the wait exceeds what is left.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = self.try_acquire(tokens)
            if wait <= 0.0:
                return True
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if wait > remaining:
                    return False
            time.sleep(wait)


class RateLimits(Mapping[str, TokenBucket]):
    """Named buckets from ``{name: RateLimit}``; ``limits["api"].acquire()``."""

    def __init__(
        self,
        client: redis.Redis,
        limits: Mapping[str, RateLimit],
        *,
        key_prefix: str = "celery_ledger:rate",
    ) -> None:
        self._buckets = {
            name: TokenBucket(
                client,
                name,
                rate_per_second=limit.rate_per_second,
                burst=limit.burst,
                key_prefix=key_prefix,
            )
            for name, limit in limits.items()
        }

    def __getitem__(self, name: str) -> TokenBucket:
        return self._buckets[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._buckets)

    def __len__(self) -> int:
        return len(self._buckets)


def first_wait(*buckets: TokenBucket | None) -> tuple[float, str]:
    """0 once a token is taken from each bucket in turn (None: no limit), and ``""``; else the
    wait for one and that bucket's name. A bucket whose store is down is passed (fail open: a
    rate limit never stops the fleet). A token taken before a later bucket says wait is spent:
    each rate is met from below, never exceeded."""
    for bucket in buckets:
        if bucket is None:
            continue
        try:
            wait = bucket.try_acquire()
        except redis.RedisError as exc:
            logger.warning("rate bucket %s unavailable (%s); running", bucket.name, exc)
            continue
        if wait > 0:
            return wait, bucket.name
    return 0.0, ""
