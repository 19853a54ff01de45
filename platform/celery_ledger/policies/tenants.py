"""Per-tenant policies: whose policy applies, a tenant's backpressure at publish
(``max_waiting`` of its jobs in its lanes, fairness.py), its concurrency slot while a job runs,
and its rate at the claim (a shared token bucket per tenant). The dispatch is fairness.py's."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from ..errors import Backpressure
from ..fairness import DEFAULT_TENANT, FairDispatch, TenantPolicy
from .rate_limit import TokenBucket

logger = logging.getLogger("celery_ledger.tenancy")

# A tenant's waiting count is read at most this often per process (a producer publishing
# thousands of a tenant's jobs a second costs the broker one read a second per tenant).
WAITING_TTL_SECONDS = 1.0
BLOCK_POLL_SECONDS = 0.05


def policy_of(policies: Mapping[str, TenantPolicy], tenant: str) -> TenantPolicy:
    """``tenant``'s policy: its own, else the ``*`` one, else the default."""
    return policies.get(tenant) or policies.get(DEFAULT_TENANT) or TenantPolicy()


class TenantGate:
    """Per-tenant backpressure at publish: ``max_waiting`` of a tenant's jobs in its lanes."""

    def __init__(
        self,
        fair: FairDispatch,
        policies: Mapping[str, TenantPolicy],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        on_refused: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self._fair = fair
        self._policies = policies
        self._on_refused = on_refused  # (tier, tenant, policy): the observers' event
        self._clock = clock
        self._sleep = sleep
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def limited(self) -> bool:
        return any(policy.max_waiting is not None for policy in self._policies.values())

    def over(self, queue: str, tenant: str, *, fresh: bool = False) -> int | None:
        """The tenant's waiting count if it is at or past its ``max_waiting``, else None."""
        most = policy_of(self._policies, tenant).max_waiting
        if most is None:
            return None
        now = self._clock()
        seen = self._seen.get((queue, tenant))
        if fresh or seen is None or now - seen[0] >= WAITING_TTL_SECONDS:
            seen = (now, self._fair.waiting_of(queue, tenant))
            if len(self._seen) > 10_000:  # (tenants are many: keep the memory bounded)
                self._seen.clear()
            self._seen[(queue, tenant)] = seen
        return seen[1] if seen[1] >= most else None

    def check(
        self, tier: str, queue: str, tenant: str, *, policy: str, block_seconds: float
    ) -> bool:
        """True: publish. False: shed (the tier's policy is shed). Raises
        :class:`Backpressure` for reject, and for block once ``block_seconds`` pass."""
        try:
            waiting = self.over(queue, tenant)
        except redis.RedisError as exc:  # the publish itself says if the broker is down
            logger.warning("tenant backpressure check of %s skipped: %s", tenant, exc)
            return True
        if waiting is None:
            return True
        most = policy_of(self._policies, tenant).max_waiting or 0
        if policy == "block":
            deadline = self._clock() + block_seconds
            while self._clock() < deadline:
                self._sleep(BLOCK_POLL_SECONDS)
                if self.over(queue, tenant, fresh=True) is None:
                    return True
        if self._on_refused is not None:
            self._on_refused(tier, tenant, policy)
        if policy == "shed":
            return False
        raise Backpressure(f"{tier} (tenant {tenant!r})", waiting, most)


class TenantRates:
    """Each tenant's shared token bucket, for a policy with ``rate_per_second`` (a ``*``
    policy's rate is each other tenant's own, not their sum), made at its first job."""

    def __init__(
        self, client: redis.Redis, policies: Mapping[str, TenantPolicy], *, namespace: str
    ) -> None:
        self._client = client
        self._policies = policies
        self._prefix = f"celery_ledger:rate:{namespace}" if namespace else "celery_ledger:rate"
        self._buckets: dict[str, TokenBucket | None] = {}

    def bucket(self, tenant: str) -> TokenBucket | None:
        """``tenant``'s bucket, None if its policy sets no rate."""
        if tenant in self._buckets:
            return self._buckets[tenant]
        policy = policy_of(self._policies, tenant)
        bucket = None
        if policy.rate_per_second is not None:
            burst = policy.burst or max(1, math.ceil(policy.rate_per_second))
            bucket = TokenBucket(
                self._client,
                f"tenant:{tenant}",
                rate_per_second=policy.rate_per_second,
                burst=burst,
                key_prefix=self._prefix,
            )
        if len(self._buckets) > 10_000:  # (tenants are many: keep the memory bounded)
            self._buckets.clear()
        self._buckets[tenant] = bucket
        return bucket


@dataclass
class TenantSlot:
    """Whose job a delivery is, from the queue it was taken from, and its message's delivery
    tag: the slot its tenant's concurrency limit counts (fairness.py). One per delivery: its
    request carries it from the guard to Celery's ``task_postrun`` (:func:`release_slot`)."""

    tenant: str
    queue: str | None
    tag: str | None
    # This delivery started without the slot (see :func:`leave_slot`). Kept on the delivery,
    # not in the process: two deliveries of one tag in one process (a copy of the message
    # under a threads pool) each end by what they did.
    left: bool = field(default=False, compare=False)


def slot_keeper(runtime: Any, delivery: Any, lease_seconds: float) -> Callable[[], None] | None:
    """For a ``delivery`` (the guard's) of a tenant with a concurrency limit: a callable that
    keeps its slot (fairness.py) ``lease_seconds`` ahead, which its heartbeat calls after each
    beat of the lease; else None. (Its slot lives a lease from its move to the queue: the first
    beat, a third of a lease into the body, comes before it lapses.)"""
    slot: TenantSlot | None = delivery.tenant_slot
    if slot is None or not slot.queue or not slot.tag:
        return None
    queue, tenant, job_id = slot.queue, slot.tenant, slot.tag
    fair, policies = runtime.fair, runtime.settings.tenants
    if fair is None:
        return None
    if policy_of(policies, tenant).concurrency is None:
        return None

    def keep() -> None:
        try:
            fair.renew(queue, tenant, job_id, lease_seconds)
        except redis.RedisError as exc:  # lapses after a lease at worst
            logger.warning("could not renew %s's slot of tenant %s: %s", job_id, tenant, exc)

    return keep


def leave_slot(slot: TenantSlot | None) -> None:
    """This delivery starts without its slot: refused at its start, or its claim found its job
    run by another delivery (a copy of the same message: the same tag). Its end then leaves the
    entry of its tag as it is (the running delivery's, or one that lapses within a lease)."""
    if slot is not None:
        slot.left = True


def slot_admitted(runtime: Any, slot: TenantSlot | None, lease_seconds: float) -> bool:
    """Whether a delivery (its ``slot``) may start its body under its tenant's concurrency
    limit, holding the slot ``lease_seconds`` ahead (its body's first heartbeat renews it) if
    so: its own entry (moved from its lane), or a free one. False: its tenant is at its limit
    (the entry lapsed while it waited and went to another message, or it came back to the queue
    past its lane), and it waits. True without a limit or a slot, and when the broker does not
    answer (a deferral's publish would fail as well: the limit may be passed meanwhile)."""
    fair = runtime.fair
    if fair is None or slot is None or not slot.queue or not slot.tag:
        return True
    if policy_of(runtime.settings.tenants, slot.tenant).concurrency is None:
        return True
    try:
        admitted = bool(fair.admit(slot.queue, slot.tenant, slot.tag, lease_seconds))
    except redis.RedisError as exc:
        logger.warning("could not hold %s's slot of tenant %s: %s", slot.tag, slot.tenant, exc)
        return True
    if not admitted:
        leave_slot(slot)
    return admitted


def release_slot(
    fair: FairDispatch | None, policies: Mapping[str, TenantPolicy], slot: TenantSlot | None
) -> None:
    """A delivery of a tenant's job ended: free its concurrency slot (if its tenant has a
    limit) and feed the queue, unless it started without one (:func:`leave_slot`). A failure
    leaves the slot to lapse within a lease."""
    if slot is None or slot.left:
        return
    queue, tenant, job_id = slot.queue, slot.tenant, slot.tag
    if fair is None or not queue or not isinstance(tenant, str) or not job_id:
        return
    if policy_of(policies, tenant).concurrency is None:
        return
    try:
        fair.release(queue, tenant, job_id)
    except redis.RedisError as exc:
        logger.warning("could not free %s's slot of tenant %s: %s", job_id, tenant, exc)
