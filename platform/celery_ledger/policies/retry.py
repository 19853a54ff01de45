"""Which failures are retried, and after how long (pure: no I/O).

Retryable by default: connection errors and timeouts (the builtins, redis-py's and pymongo's),
plus whatever a task lists in ``retry_on``. Permanent: :class:`PermanentError` and whatever a
task lists in ``fail_on``; anything else is permanent too, since retrying an unknown bug only
repeats it. An exception may carry ``retry_after`` (seconds, e.g. from a 429) that the delay
honours.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, replace
from typing import Any

import pymongo.errors
import redis.exceptions

from ..errors import ConfigurationError, PermanentError
from ..exits import described
from .backoff import Jitter, backoff_seconds

RETRYABLE_BY_DEFAULT: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    pymongo.errors.ConnectionFailure,
)


@dataclass(frozen=True)
class RetryPolicy:
    """How a task retries: at most ``max_retries`` retries, delays from ``backoff_seconds``."""

    max_retries: int = 5
    base_seconds: float = 1.0
    cap_seconds: float = 300.0
    jitter: Jitter = "full"

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.base_seconds < 0 or self.cap_seconds < self.base_seconds:
            raise ConfigurationError(f"invalid retry policy {self}")

    def updated(self, **changes: Any) -> RetryPolicy:
        """A copy with the given fields changed (``None`` values are ignored)."""
        given = tuple((k, type(v), v) for k, v in changes.items() if v is not None)
        # (the policy's own types in the key too: RetryPolicy(5, 2, 60) equals
        # RetryPolicy(5, 2.0, 60.0), and a copy of one must not come back for the other)
        key = (self, tuple(type(v) for v in vars(self).values()), given)
        try:
            hash(key)
        except TypeError:  # a value that cannot be hashed (then it is checked as it comes)
            return replace(self, **{k: v for k, _, v in given})
        return _updated(*key)


@functools.lru_cache(maxsize=1024)
def _updated(
    policy: RetryPolicy, _types: tuple[type, ...], given: tuple[tuple[str, type, Any], ...]
) -> RetryPolicy:
    # Every delivery resolves its task's policy from the same few options: the copy is built and
    # validated once for each (a refused one raises each time: errors are not cached).
    return replace(policy, **{k: v for k, _, v in given})


# Critical work retries fast and briefly; bulk work backs off far and long.
TIER_RETRY_DEFAULTS: dict[str, RetryPolicy] = {
    "critical": RetryPolicy(max_retries=5, base_seconds=0.5, cap_seconds=30.0),
    "default": RetryPolicy(max_retries=5, base_seconds=2.0, cap_seconds=300.0),
    "bulk": RetryPolicy(
        max_retries=8, base_seconds=10.0, cap_seconds=3600.0, jitter="decorrelated"
    ),
}


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    delay_seconds: float = 0.0
    reason: str = ""  # why not retried: "permanent error", "retries exhausted", ...


def classify(
    exc: BaseException,
    *,
    retry_on: tuple[type[BaseException], ...] = (),
    fail_on: tuple[type[BaseException], ...] = (),
) -> bool:
    """True if ``exc`` is worth retrying."""
    if isinstance(exc, PermanentError) or (fail_on and isinstance(exc, fail_on)):
        return False
    return isinstance(exc, RETRYABLE_BY_DEFAULT + tuple(retry_on))


def decide(
    exc: BaseException,
    *,
    policy: RetryPolicy,
    retries_done: int,
    previous_delay: float | None = None,
    retry_on: tuple[type[BaseException], ...] = (),
    fail_on: tuple[type[BaseException], ...] = (),
    rng: random.Random | None = None,
) -> RetryDecision:
    """Retry (and after how long) or give up, for a failure after ``retries_done`` retries."""
    if not classify(exc, retry_on=retry_on, fail_on=fail_on):
        kind = (
            "permanent error"
            if isinstance(exc, (PermanentError, *fail_on))
            else "error not retryable"
        )
        return RetryDecision(False, reason=f"{kind}: {described(exc)[:250]}")
    if retries_done >= policy.max_retries:
        return RetryDecision(False, reason=f"retries exhausted after {retries_done} retries")
    delay = backoff_seconds(
        retries_done,
        base_seconds=policy.base_seconds,
        cap_seconds=policy.cap_seconds,
        jitter=policy.jitter,
        previous_seconds=previous_delay,
        rng=rng,
    )
    hint = retry_after_seconds(exc)
    if hint is not None:
        delay = max(delay, hint)
    return RetryDecision(True, delay_seconds=delay)


def retry_after_seconds(exc: BaseException) -> float | None:
    """The exception's ``retry_after`` hint in seconds, if it has a usable one."""
    try:
        hint = getattr(exc, "retry_after", None)
        seconds = None if hint is None else float(hint)
    except Exception:  # (no time, an int past a float's range, a property that raised)
        return None
    return max(0.0, seconds) if seconds is not None and math.isfinite(seconds) else None
