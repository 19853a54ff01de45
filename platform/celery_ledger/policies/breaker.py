"""Circuit breakers whose state lives in Redis, shared by every worker process on every host.

Why not pybreaker: its ``CircuitRedisStorage`` keeps the state and counters in Redis, but each
process runs the state machine itself (read, decide, write), so two processes can both trip or
both close the breaker and transitions are not atomic across processes. It also has no
failure-ratio-over-a-window threshold, and half-open admits a single trial call, not N probes.

Here every operation is one Lua script call, so each transition happens exactly once and is
returned to the one caller that caused it (who logs it and calls ``on_transition``). The
scripts read the clock with ``redis.call('TIME')``: client clocks never matter. Per breaker,
three keys share a hash tag (``<prefix>:{<name>}:state|window|probes``): the state hash, the
sliding window (30 buckets of ``window_seconds / 30`` each) and the in-flight probes (a sorted
set scored by lease expiry, so a probe that never reports back frees its slot after
``cooldown_seconds``). Keys expire when idle, except a forced state, which stays until cleared.
Processes sharing a breaker must use the same :class:`BreakerConfig`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import redis

from ..errors import CircuitOpen, ConfigurationError
from ..locks import ForkSafeLock
from ..sentinel import RedisTarget, redis_client

logger = logging.getLogger("celery_ledger.breaker")

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_KEY_PREFIX = "celery_ledger:breaker"


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


Transition = Callable[[str, BreakerState, BreakerState], None]


@dataclass(frozen=True)
class BreakerConfig:
    """When a breaker opens, and how it recovers.

    It opens after ``failure_threshold`` consecutive failures or, if ``failure_ratio`` is set,
    when failures/calls over the last ``window_seconds`` reach it with at least ``min_calls``
    calls. After ``cooldown_seconds`` it admits ``half_open_probes`` probes; all must succeed
    to close it, and any failure opens it again.
    """

    failure_threshold: int = 5
    failure_ratio: float | None = None
    window_seconds: float = 60.0
    min_calls: int = 10
    cooldown_seconds: float = 30.0
    half_open_probes: int = 1

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.min_calls < 1 or self.half_open_probes < 1:
            raise ConfigurationError(
                "failure_threshold, min_calls and half_open_probes must be at least 1"
            )
        if self.failure_ratio is not None and not 0.0 < self.failure_ratio <= 1.0:
            raise ConfigurationError("failure_ratio must be in (0, 1]")
        if self.window_seconds <= 0 or self.cooldown_seconds <= 0:
            raise ConfigurationError("window_seconds and cooldown_seconds must be positive")

    @property
    def idle_ttl_seconds(self) -> float:
        """How long an unforced breaker's keys outlive its last recorded call."""
        return max(300.0, 10.0 * max(self.window_seconds, self.cooldown_seconds))


@dataclass(frozen=True)
class BreakerStatus:
    """A snapshot; ``opened_at``/``retry_at`` are unix seconds (server clock).

    An open breaker whose ``retry_at`` has passed still reads ``open``: it becomes
    ``half_open`` on the next :meth:`CircuitBreaker.admit`.
    """

    name: str
    state: BreakerState
    consecutive_failures: int
    calls_in_window: int
    failures_in_window: int
    opened_at: float | None
    retry_at: float | None
    forced: bool


@dataclass(frozen=True)
class Admission:
    """The answer of :meth:`CircuitBreaker.admit`.

    ``retry_at``: when to come back if not ``allowed``. ``probe``: this call is a half-open
    probe; report its outcome with ``record_success/record_failure(probe=True)``.
    """

    allowed: bool
    retry_at: float | None = None
    probe: bool = False


# KEYS = state hash, window hash, probes zset. ARGV[1..7] = failure_threshold, failure_ratio
# (negative: off), window_seconds, min_calls, cooldown_seconds, half_open_probes, idle TTL ms;
# ARGV[8] = the operation's argument. Scripts return the old and new state last.
_PRELUDE = """
local state_key, window_key, probes_key = KEYS[1], KEYS[2], KEYS[3]
local threshold, ratio = tonumber(ARGV[1]), tonumber(ARGV[2])
local window, min_calls = tonumber(ARGV[3]), tonumber(ARGV[4])
local cooldown, max_probes, ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local BUCKETS = 30
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local bucket = math.floor(now / (window / BUCKETS))

local function fmt(x) return string.format('%.6f', x) end

local function load()
  local h = redis.call('HMGET', state_key, 'state', 'consecutive', 'opened_at', 'forced',
                       'successes')
  return {state = h[1] or 'closed', consecutive = tonumber(h[2]) or 0,
          opened_at = tonumber(h[3]), forced = h[4] or '', successes = tonumber(h[5]) or 0}
end

local function save(s)
  redis.call('HSET', state_key, 'state', s.state, 'consecutive', s.consecutive,
             'forced', s.forced, 'successes', s.successes)
  if s.opened_at then
    redis.call('HSET', state_key, 'opened_at', fmt(s.opened_at))
  else
    redis.call('HDEL', state_key, 'opened_at')
  end
  if s.forced ~= '' then
    redis.call('PERSIST', state_key)
  else
    redis.call('PEXPIRE', state_key, ttl)
  end
  redis.call('PEXPIRE', window_key, ttl)
  redis.call('PEXPIRE', probes_key, ttl)
end

-- calls and failures in the window; prune drops buckets that slid out of it
local function counts(prune)
  local flat = redis.call('HGETALL', window_key)
  local calls, failures = 0, 0
  for i = 1, #flat, 2 do
    local field = flat[i]
    if tonumber(string.sub(field, 3)) <= bucket - BUCKETS then
      if prune then redis.call('HDEL', window_key, field) end
    elseif string.sub(field, 1, 1) == 'c' then
      calls = calls + tonumber(flat[i + 1])
    else
      failures = failures + tonumber(flat[i + 1])
    end
  end
  return calls, failures
end

local function open(s)
  s.state, s.opened_at, s.successes = 'open', now, 0
  redis.call('DEL', probes_key)
end

local function close(s)
  s.state, s.opened_at, s.successes, s.consecutive = 'closed', nil, 0, 0
  redis.call('DEL', window_key, probes_key)
end
"""

# ARGV[8] unused. Returns {allowed, retry_at or '', probe, old, new}.
_ADMIT = (
    _PRELUDE
    + """
local s = load()
local old = s.state
if s.forced == 'open' then return {0, '', 0, old, old} end
if s.state == 'closed' then return {1, '', 0, old, old} end
if s.state == 'open' then
  local retry_at = (s.opened_at or 0) + cooldown
  if now < retry_at then return {0, fmt(retry_at), 0, old, old} end
  s.state, s.successes = 'half_open', 0
  redis.call('DEL', probes_key)
end
redis.call('ZREMRANGEBYSCORE', probes_key, '-inf', fmt(now))
if redis.call('ZCARD', probes_key) + s.successes < max_probes then
  local id = redis.call('HINCRBY', state_key, 'probe_seq', 1)
  redis.call('ZADD', probes_key, fmt(now + cooldown), id)
  save(s)
  return {1, '', 1, old, s.state}
end
if s.state ~= old then save(s) end
local first = redis.call('ZRANGE', probes_key, 0, 0, 'WITHSCORES')
return {0, first[2] or fmt(now + cooldown), 0, old, s.state}
"""
)

# ARGV[8] = 'failure' | 'success' | 'probe_success'. Returns {old, new}.
_RECORD = (
    _PRELUDE
    + """
local outcome = ARGV[8]
local s = load()
local old = s.state
if s.state == 'closed' then
  redis.call('HINCRBY', window_key, 'c:' .. string.format('%.0f', bucket), 1)
  if outcome == 'failure' then
    redis.call('HINCRBY', window_key, 'f:' .. string.format('%.0f', bucket), 1)
    s.consecutive = s.consecutive + 1
  else
    s.consecutive = 0
  end
  local calls, failures = counts(true)
  if outcome == 'failure' and s.forced == '' then
    if s.consecutive >= threshold
       or (ratio >= 0 and calls >= min_calls and failures / calls >= ratio) then
      open(s)
    end
  end
elseif s.state == 'half_open' then
  if outcome == 'failure' then
    s.consecutive = s.consecutive + 1
    open(s)
  elseif outcome == 'probe_success' then
    redis.call('ZPOPMIN', probes_key)
    s.successes = s.successes + 1
    if s.successes >= max_probes then close(s) end
  end
end
-- open: a late outcome of a call admitted before the breaker opened changes nothing
save(s)
return {old, s.state}
"""
)

# ARGV[8] unused. Returns {state, consecutive, calls, failures, opened_at, forced}.
_STATUS = (
    _PRELUDE
    + """
local s = load()
local calls, failures = counts(false)
return {s.state, s.consecutive, calls, failures, s.opened_at and fmt(s.opened_at) or '', s.forced}
"""
)

# ARGV[8] = 'open' | 'closed' | '' (clear). Returns {old, new}.
_FORCE = (
    _PRELUDE
    + """
local target = ARGV[8]
local s = load()
local old = s.state
if target == 'open' then
  if s.state ~= 'open' then open(s) end
elseif target == 'closed' then
  close(s)
elseif s.forced == 'open' then
  -- released by the operator: admit probes at once rather than after another cooldown
  s.state, s.successes = 'half_open', 0
end
s.forced = target
save(s)
return {old, s.state}
"""
)

# Returns {old, 'closed'}.
_RESET = """
local old = redis.call('HGET', KEYS[1], 'state') or 'closed'
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return {old, 'closed'}
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _time(value: Any) -> float | None:
    text = _text(value)
    return float(text) if text else None


def _key_base(prefix: str, name: str) -> str:
    return f"{prefix}:{{{name}}}"


class CircuitBreaker:
    """One named breaker. Also a context manager and a decorator around a guarded call."""

    def __init__(
        self,
        name: str,
        client: redis.Redis,
        config: BreakerConfig,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        on_transition: Transition | None = None,
    ) -> None:
        if not name:
            raise ConfigurationError("a circuit breaker needs a name")
        self.name = name
        self.config = config
        self.on_transition = on_transition
        base = _key_base(key_prefix, name)
        self.keys = [f"{base}:state", f"{base}:window", f"{base}:probes"]
        self._redis = client
        self._admit = client.register_script(_ADMIT)
        self._record = client.register_script(_RECORD)
        self._status = client.register_script(_STATUS)
        self._force = client.register_script(_FORCE)
        self._reset = client.register_script(_RESET)
        self._probes = threading.local()  # per-thread stack of `with` admissions

    def admit(self) -> Admission:
        """Ask to make one call (see :class:`BreakerConfig` for the rules)."""
        allowed, retry_at, probe, old, new = self._run(self._admit)
        self._report(old, new)
        return Admission(allowed=bool(allowed), retry_at=_time(retry_at), probe=bool(probe))

    def record_success(self, *, probe: bool = False) -> BreakerState:
        """Report a call that succeeded; pass ``probe=admission.probe``. Returns the new state."""
        return self._record_outcome("probe_success" if probe else "success")

    def record_failure(self, *, probe: bool = False) -> BreakerState:
        """Report a call that failed. Returns the new state.

        While half-open any failure opens the breaker again, probe or not.
        """
        return self._record_outcome("failure")

    def status(self) -> BreakerStatus:
        state, consecutive, calls, failures, opened_at, forced = self._run(self._status)
        current = BreakerState(_text(state))
        opened = _time(opened_at)
        retry_at = None
        if current is BreakerState.OPEN and opened is not None and not _text(forced):
            retry_at = opened + self.config.cooldown_seconds
        return BreakerStatus(
            name=self.name,
            state=current,
            consecutive_failures=int(consecutive),
            calls_in_window=int(calls),
            failures_in_window=int(failures),
            opened_at=opened,
            retry_at=retry_at,
            forced=bool(_text(forced)),
        )

    def force(self, state: BreakerState | None) -> None:
        """Hold the breaker OPEN or CLOSED until ``force(None)``; forced keys never expire.

        Releasing a forced OPEN breaker makes it half-open, so probes decide what follows.
        """
        if state is BreakerState.HALF_OPEN:
            raise ValueError("a breaker can only be forced open or closed")
        old, new = self._run(self._force, "" if state is None else state.value)
        self._report(old, new)

    def reset(self) -> None:
        """Forget everything, forced state included: the breaker is closed and idle."""
        old, new = self._reset(keys=self.keys)
        self._report(old, new)

    def __enter__(self) -> CircuitBreaker:
        admission = self.admit()
        if not admission.allowed:
            raise CircuitOpen(self.name, admission.retry_at)
        self._stack().append(admission.probe)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        probe = self._stack().pop()
        if exc is None or isinstance(exc, CircuitOpen):
            self.record_success(probe=probe)
        elif isinstance(exc, Exception):
            self.record_failure(probe=probe)
        # KeyboardInterrupt, SystemExit...: the call was interrupted, not failed; a probe's
        # slot frees itself when its lease ends.

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(func)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
            with self:
                return func(*args, **kwargs)

        return guarded

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.name!r})"

    def _record_outcome(self, outcome: str) -> BreakerState:
        old, new = self._run(self._record, outcome)
        self._report(old, new)
        return BreakerState(_text(new))

    def _run(self, script: Any, argument: str = "") -> list[Any]:
        c = self.config
        args = [
            c.failure_threshold,
            -1 if c.failure_ratio is None else c.failure_ratio,
            c.window_seconds,
            c.min_calls,
            c.cooldown_seconds,
            c.half_open_probes,
            int(c.idle_ttl_seconds * 1000),
            argument,
        ]
        return list(script(keys=self.keys, args=args))

    def _report(self, old: Any, new: Any) -> None:
        before, after = BreakerState(_text(old)), BreakerState(_text(new))
        if before is after:
            return
        level = logging.WARNING if after is BreakerState.OPEN else logging.INFO
        logger.log(level, "circuit %r: %s -> %s", self.name, before.value, after.value)
        if self.on_transition is not None:
            try:
                self.on_transition(self.name, before, after)
            except Exception:
                logger.exception("on_transition failed for circuit %r", self.name)

    def _stack(self) -> list[bool]:
        stack: list[bool] | None = getattr(self._probes, "stack", None)
        if stack is None:
            stack = self._probes.stack = []
        return stack


class Breakers:
    """The breakers of an app (``app.breakers``), each created on first use and cached."""

    def __init__(
        self,
        redis_url: str | RedisTarget,
        *,
        configs: Mapping[str, BreakerConfig] | None = None,
        default: BreakerConfig = BreakerConfig(),
        key_prefix: str = DEFAULT_KEY_PREFIX,
        on_transition: Transition | None = None,
    ) -> None:
        self.configs = dict(configs or {})
        self.default = default
        self.key_prefix = key_prefix
        self.on_transition = on_transition
        self._redis = redis_client(redis_url, socket_timeout=10, socket_connect_timeout=5)
        self._breakers: dict[str, CircuitBreaker] = {}
        self._lock = ForkSafeLock()

    def __getitem__(self, name: str) -> CircuitBreaker:
        with self._lock:
            breaker = self._breakers.get(name)
            if breaker is None:
                breaker = self._breakers[name] = CircuitBreaker(
                    name,
                    self._redis,
                    self.configs.get(name, self.default),
                    key_prefix=self.key_prefix,
                    on_transition=self.on_transition,
                )
            return breaker

    def names(self) -> list[str]:
        """Every breaker with state in Redis (from any process), plus the configured ones."""
        head, tail = f"{self.key_prefix}:{{", "}:state"
        found = set(self.configs)
        for key in self._redis.scan_iter(match=f"{_glob_escape(head)}*{tail}", count=500):
            found.add(_text(key)[len(head) : -len(tail)])
        return sorted(found)

    def statuses(self) -> list[BreakerStatus]:
        return [self[name].status() for name in self.names()]

    def close(self) -> None:
        self._redis.close()


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
