"""Publish-side backpressure: per-tier high-water marks on queue depth, with hysteresis.

With the Redis transport each tier's queue is a Redis list named after the queue, so its depth
is one ``LLEN`` (kombu's priority sub-queues, ``<queue>\\x06\\x16<n>``, are not counted: we do
not use priorities). :class:`QueueDepths` samples every tier in one pipelined round trip and
serves the sample for ``ttl_seconds``, so a producer publishing thousands of messages a second
costs the broker at most one round trip per ttl.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import redis

from .. import errors
from ..errors import ConfigurationError
from ..fairness import waiting_key
from ..locks import ForkSafeLock

Policy = Literal["block", "reject", "shed"]
Decision = Literal["publish", "shed"]


class QueueDepths:
    """Cached ``LLEN`` of each queue; redis errors propagate (nothing stale is served).

    ``queues`` names the queues to sample: a mapping from the name callers use (a tier) to the
    broker's queue name, or the queue names themselves.
    """

    def __init__(
        self,
        client: redis.Redis,
        queues: Mapping[str, str] | Iterable[str],
        *,
        ttl_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(queues, str):
            queues = (queues,)
        self._names = dict(queues) if isinstance(queues, Mapping) else {q: q for q in queues}
        self.queues = tuple(self._names)
        if not self.queues:
            raise ConfigurationError("QueueDepths needs at least one queue")
        self.ttl_seconds = ttl_seconds
        self._client = client
        self._clock = clock
        self._lock = ForkSafeLock()
        self._depths: dict[str, int] = {}
        self._sampled_at: float | None = None

    def refresh(self) -> dict[str, int]:
        """Sample every queue now (one pipelined round trip) and return the depths."""
        with self._lock:
            return self._sample()

    def depths(self) -> dict[str, int]:
        """Every queue's depth, sampled at most ``ttl_seconds`` ago."""
        with self._lock:
            sampled_at = self._sampled_at
            if sampled_at is None or self._clock() - sampled_at >= self.ttl_seconds:
                return self._sample()
            return dict(self._depths)

    def depth(self, queue: str) -> int:
        """One queue's depth, sampled at most ``ttl_seconds`` ago (``KeyError`` if unknown)."""
        if queue not in self.queues:
            raise KeyError(f"queue {queue!r} is not sampled; sampled: {', '.join(self.queues)}")
        return self.depths()[queue]

    def _sample(self) -> dict[str, int]:
        # Holding the lock across the round trip makes concurrent callers share one sample.
        pipe = self._client.pipeline(transaction=False)
        for queue in self.queues:
            pipe.llen(self._names[queue])
            # and its tenants' lanes (fairness.py), whose messages wait for it as much
            pipe.get(waiting_key(self._names[queue]))
        counts = pipe.execute()
        totals = [
            int(n) + int(lanes or 0) for n, lanes in zip(counts[::2], counts[1::2], strict=True)
        ]
        self._depths = dict(zip(self.queues, totals, strict=True))
        self._sampled_at = self._clock()
        return dict(self._depths)


@dataclass(frozen=True)
class TierLimit:
    """A tier's high-water mark and what a publish above it does.

    Once depth exceeds ``high_water`` the limit stays engaged until depth is at most
    ``low_water`` (default: 90% of ``high_water``). ``high_water=None`` means no limit.
    """

    high_water: int | None
    policy: Policy
    block_timeout_seconds: float = 5.0
    low_water: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in ("block", "reject", "shed"):
            raise ConfigurationError(f"unknown backpressure policy {self.policy!r}")
        if self.block_timeout_seconds < 0:
            raise ConfigurationError("block_timeout_seconds must not be negative")
        if self.high_water is not None and self.high_water < 0:
            raise ConfigurationError("high_water must not be negative")
        if self.low_water is not None and (
            self.high_water is None or not 0 <= self.low_water <= self.high_water
        ):
            raise ConfigurationError("low_water must be between 0 and high_water")

    @property
    def release_depth(self) -> int | None:
        """The depth at or below which an engaged limit releases."""
        if self.high_water is None:
            return None
        return self.low_water if self.low_water is not None else int(self.high_water * 0.9)


class BackpressureGate:
    """Decides, per publish, whether a tier may take another message."""

    def __init__(
        self,
        depths: QueueDepths,
        limits: Mapping[str, TierLimit],
        *,
        on_shed: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        poll_seconds: float = 0.05,
    ) -> None:
        unknown = sorted(set(limits) - set(depths.queues))
        if unknown:
            raise ConfigurationError(f"limits on queues that are not sampled: {unknown}")
        self.depths = depths
        self.limits = dict(limits)
        self.shed_counts: dict[str, int] = dict.fromkeys(self.limits, 0)
        self._on_shed = on_shed
        self._sleep = sleep
        self._clock = clock
        self._poll_seconds = poll_seconds
        self._engaged: dict[str, bool] = dict.fromkeys(self.limits, False)
        self._lock = ForkSafeLock()

    def engaged(self, tier: str) -> bool:
        return self._engaged.get(tier, False)

    def engaged_now(self, tier: str) -> bool:
        """Whether the tier is above its mark now (a fresh enough depth, with hysteresis),
        without waiting, shedding or raising: for work that is already durable and can wait
        where it is (the outbox's records), and for a decision inside someone's transaction,
        which must not wait with the transaction open."""
        limit = self.limits.get(tier)
        if limit is None or limit.high_water is None:
            return False
        return self._update(tier, limit, self.depths.depth(tier))

    def holds(self, tier: str) -> bool:
        """Whether durable work that can wait where it is (a job in the outbox) waits there:
        :meth:`engaged_now`, except that a broker that cannot tell lets it go (the publish
        then says what is wrong, and a job that waits for a depth nobody can read waits for
        good)."""
        try:
            return self.engaged_now(tier)
        except Exception:
            return False

    def held(self, tiers: Iterable[str]) -> frozenset[str]:
        """Those of ``tiers`` whose durable work waits where it is (:meth:`holds`)."""
        return frozenset(tier for tier in tiers if self.holds(tier))

    def policy(self, tier: str) -> Policy | None:
        """The tier's policy above its mark (None: the tier has no mark)."""
        limit = self.limits.get(tier)
        return None if limit is None or limit.high_water is None else limit.policy

    def check(self, tier: str) -> Decision:
        """``"publish"``, ``"shed"``, or raises :class:`celery_ledger.errors.Backpressure`."""
        limit = self.limits.get(tier)
        if limit is None or limit.high_water is None:
            return "publish"
        depth = self.depths.depth(tier)
        if not self._update(tier, limit, depth):
            return "publish"
        if limit.policy == "reject":
            raise errors.Backpressure(tier, depth, limit.high_water)
        if limit.policy == "shed":
            with self._lock:
                self.shed_counts[tier] += 1
            if self._on_shed is not None:
                self._on_shed(tier)
            return "shed"
        return self._block(tier, limit)

    def _update(self, tier: str, limit: TierLimit, depth: int) -> bool:
        """Apply hysteresis to a fresh depth; returns whether the tier is engaged."""
        assert limit.high_water is not None and limit.release_depth is not None
        with self._lock:
            if self._engaged[tier]:
                self._engaged[tier] = depth > limit.release_depth
            else:
                self._engaged[tier] = depth > limit.high_water
            return self._engaged[tier]

    def _block(self, tier: str, limit: TierLimit) -> Decision:
        assert limit.high_water is not None
        deadline = self._clock() + limit.block_timeout_seconds
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise errors.Backpressure(tier, self.depths.depth(tier), limit.high_water)
            self._sleep(min(self._poll_seconds, remaining))
            if not self._update(tier, limit, self.depths.depth(tier)):
                return "publish"


# Producers wait (up to 5 s) rather than grow a tier's backlog without bound; shed is opt-in.
DEFAULT_TIER_LIMITS = {
    "critical": TierLimit(high_water=10_000, policy="block", block_timeout_seconds=5.0),
    "default": TierLimit(high_water=50_000, policy="block", block_timeout_seconds=5.0),
    "bulk": TierLimit(high_water=100_000, policy="block", block_timeout_seconds=5.0),
}
