"""Fallbacks: what a task serves instead of waiting while its dependency is down or slow.

A task's ``fallback=`` option names one or more options, tried in order until one serves:

    LastGood(cache=None, max_age_seconds=None)   the last good result of this task for the
                                                 job's key, or for a named cache key (a report
                                                 served from cache while it is rebuilt)
    Alternate(provider, breaker=None)            another provider (a callable, or a task whose
                                                 body runs in this attempt), behind its own
                                                 circuit breaker
    Placeholder(value)                           a fixed answer

It is used on one of its triggers (``on=``, all three by default):

    circuit-open       the task's breaker, or one used in its body, is open
    timeout            a dependency call timed out (``DeadlineExceeded``, any ``TimeoutError``)
    retries-exhausted  a retryable error came back with the retry budget spent

A served fallback ends the job ``succeeded`` with ``degraded`` on its record (the trigger and
the option used). With ``replace=True`` (the default) the real job runs again under the same
key when the breaker lets calls through again (or ``replace_after_seconds`` after a timeout or
an exhausted budget); its result replaces the degraded one, exactly once. Until then, readers
get the degraded result.

This module is the vocabulary and the decision (pure); serving is
:mod:`celery_ledger.fallback_serving`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from ..errors import CircuitOpen, ConfigurationError

# Why a fallback was served instead of waiting (its cause; a metric label)
Cause: TypeAlias = Literal["circuit-open", "timeout", "retries-exhausted"]
CAUSES: tuple[Cause, ...] = ("circuit-open", "timeout", "retries-exhausted")


@dataclass(frozen=True)
class Call:
    """The job's call: its arguments as sent, and by parameter name (defaults applied)."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    named: Mapping[str, Any]


@dataclass(frozen=True)
class LastGood:
    """The last good (not degraded) result of the task for a cache key.

    ``cache``: None for the job's idempotency key (served when the same key runs again after
    its record expired; results are cached 30 days or the result retention, whichever is
    longer); a ``str.format`` template over the call's
    arguments by name (``"report-{customer_id}"``); or a callable taking the call's arguments.
    ``max_age_seconds``: an older result is not served (the next option is tried).
    """

    cache: str | Callable[..., Any] | None = None
    max_age_seconds: float | None = None

    @property
    def label(self) -> str:
        return "last-good"

    def cache_key(self, key: str, call: Call) -> str:
        if self.cache is None:
            return key
        if callable(self.cache):
            return str(self.cache(*call.args, **call.kwargs))
        return self.cache.format(*call.args, **call.named)


@dataclass(frozen=True)
class Alternate:
    """Another provider of the same answer, called with the job's arguments.

    ``provider``: a callable, or a Celery task (its body runs here, in this attempt, without a
    record of its own). ``breaker``: the alternate's own circuit breaker (skipped while open,
    told of its failures). ``name``: how records and metrics name it (default: its name).
    """

    provider: Callable[..., Any]
    breaker: str | None = None
    name: str | None = None

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        named = getattr(self.provider, "name", None) or getattr(self.provider, "__name__", None)
        return f"alternate:{named or type(self.provider).__name__}"

    def call(self, call: Call) -> Any:
        run = getattr(self.provider, "run", None)  # a task: its body, not a publish
        return (run if callable(run) else self.provider)(*call.args, **call.kwargs)


@dataclass(frozen=True)
class Placeholder:
    """A fixed answer (it must be JSON, like any result)."""

    value: Any = None

    @property
    def label(self) -> str:
        return "placeholder"


Option: TypeAlias = LastGood | Alternate | Placeholder


@dataclass(frozen=True)
class Fallback:
    """A task's fallback: its options in order, when they apply, and the replacement."""

    options: tuple[Option, ...]
    on: frozenset[str] = field(default_factory=lambda: frozenset(CAUSES))
    replace: bool = True
    replace_after_seconds: float = 60.0

    def __post_init__(self) -> None:
        # Lists and sets are accepted as written (``on={"circuit-open"}``); kept immutable.
        object.__setattr__(self, "options", tuple(self.options))
        object.__setattr__(self, "on", frozenset(self.on))
        if not self.options:
            raise ConfigurationError("a fallback needs at least one option")
        for option in self.options:
            if not isinstance(option, LastGood | Alternate | Placeholder):
                raise ConfigurationError(
                    f"fallback option {option!r} is not LastGood, Alternate or Placeholder"
                )
        unknown = set(self.on) - set(CAUSES)
        if unknown:
            raise ConfigurationError(
                f"unknown fallback triggers {sorted(unknown)}; known: {', '.join(CAUSES)}"
            )
        if not math.isfinite(self.replace_after_seconds) or self.replace_after_seconds < 0:
            raise ConfigurationError("replace_after_seconds must be a finite number >= 0")

    @classmethod
    def of(cls, value: Any) -> Fallback | None:
        """The ``fallback=`` task option as a :class:`Fallback` (None: no fallback)."""
        if value is None or isinstance(value, Fallback):
            return value
        if isinstance(value, LastGood | Alternate | Placeholder):
            return cls((value,))
        if isinstance(value, Iterable) and not isinstance(value, str | bytes | dict):
            return cls(tuple(value))
        raise ConfigurationError(
            f"fallback= takes LastGood, Alternate, Placeholder, a list of them or a Fallback;"
            f" got {value!r}"
        )

    @property
    def remembers(self) -> bool:
        """Whether the task's good results are kept for a :class:`LastGood` option."""
        return any(isinstance(option, LastGood) for option in self.options)

    def applies(self, trigger: Cause | None) -> bool:
        return trigger is not None and trigger in self.on


def cause_of(exc: BaseException, *, retryable: bool, retry_left: bool) -> Cause | None:
    """Which fallback trigger a failure of the body is, or None (a failure a fallback must not
    hide: a permanent error, or one the retry budget still covers)."""
    if isinstance(exc, CircuitOpen):
        return "circuit-open"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if retryable and not retry_left:
        return "retries-exhausted"
    return None


# The names before 0.1.0's change-stream triggers took the word, kept for one release
Trigger = Cause
TRIGGERS = CAUSES
trigger_of = cause_of
