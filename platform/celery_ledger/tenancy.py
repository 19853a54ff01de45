"""Tenants: whose job a message is, and what that changes (see fairness.py for the dispatch).

A task names its jobs' tenant with its ``tenant=`` option (a callable over its arguments, or a
``str.format`` template over them by name, as ``idempotency_key``); a call may name one with
``apply_async(..., tenant="acme")``, which wins. The tenant travels as the message's
``ledger_tenant`` property, is kept on the job's record (``tenant``), and is set again at every
republish (a retry, a deferral, the reconciler's copy) from the delivery or the kept message.

Per tenant (``LEDGER_TENANTS``): a weight and a concurrency limit, which the dispatch applies,
and ``max_waiting``, the backpressure of one tenant: past it, that tenant's publishes get its
tier's policy (block, reject or shed) while everyone else's go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import redis
from celery import signals

from .errors import PayloadError
from .fairness import TENANT_PROPERTY, FairDispatch, check_tenant
from .identity import apply_spec
from .policies.tenants import TenantGate, TenantSlot, policy_of, release_slot, slot_keeper
from .untrusted import request_property

logger = logging.getLogger("celery_ledger.tenancy")

TenantSpec = str | Callable[..., Any] | None


def tenant_of_call(
    spec: TenantSpec,
    *,
    task_name: str,
    run: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    given: Any = None,
) -> str | None:
    """The tenant of a call: ``given`` (the call's own, or a republish's), else the one the
    task's ``tenant=`` option names for these arguments (None: no tenant)."""
    if given is not None:
        return checked(given, task_name=task_name)
    if spec is None:
        return None
    tenant = apply_spec(spec, "tenant", task_name=task_name, run=run, args=args, kwargs=kwargs)
    return checked(tenant, task_name=task_name)


def tenant_slot_of(request: Any) -> TenantSlot | None:
    """Whose job a delivery is (its message's ``ledger_tenant`` property), from which queue,
    and its delivery tag; None for a message without a usable tenant (one made around our API
    with a name no publish would take is run as no tenant's, never refused for it)."""
    tenant = request_property(request, TENANT_PROPERTY)
    if tenant is None:
        return None
    try:
        check_tenant(tenant)
    except ValueError as exc:
        logger.warning("tenant of message %s ignored: %s", getattr(request, "id", "?"), exc)
        return None
    info = getattr(request, "delivery_info", None)
    queue = info.get("routing_key") if isinstance(info, dict) else None
    tag = request_property(request, "delivery_tag")
    return TenantSlot(
        tenant, queue if isinstance(queue, str) else None, tag if isinstance(tag, str) else None
    )


def checked(tenant: Any, *, task_name: str) -> str | None:
    """``tenant`` (None: no tenant) if usable, else :class:`PayloadError` naming the task."""
    if tenant is None:
        return None
    try:
        return check_tenant(tenant)
    except ValueError as exc:
        raise PayloadError(f"tenant of {task_name}: {exc}") from None


def refill_all(
    fair: FairDispatch,
    queues: Callable[[], Iterable[str]],
    express: Callable[[], frozenset[str]] = frozenset,
) -> int:
    """Mark every queue this worker consumes as fed, and feed it from its lanes (what a crashed
    producer or worker left unfed, and slots that lapsed); those whose express lists it takes
    from with a process of their own (``express``: celery_ledger.express) marked so too.
    Returns the messages moved."""
    served = express()
    return sum(fair.feed(queue, express=queue in served) for queue in queues())


# How often a worker writes the app's tenant policies where the dispatch reads them (a broker
# that lost its data, or a worker of another release that wrote its own, is set right within it).
POLICIES_EVERY_SECONDS = 30.0
# How often a worker marks its queues as fed and feeds them (its housekeeping lane of its own:
# well within the mark's life, fairness.FEEDER_SECONDS, whatever else housekeeping does).
FEED_EVERY_SECONDS = 0.5


class Feeder:
    """A worker's part in fair dispatch: the app's policies written, the queues it consumes
    (or would: a throttle may have cancelled one for a while) marked as fed and fed from their
    lanes, and each delivery's slot freed at its end (:meth:`released`, Celery's
    ``task_postrun``). With fair dispatch off here, it drains the lanes instead (what a fleet
    with it on left there)."""

    def __init__(
        self,
        runtime: Any,
        queues: Callable[[], Iterable[str]],
        express: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        self._runtime = runtime
        self._queues = queues
        self._express = express
        self._policies = runtime.settings.tenants
        self._tier_queues = [runtime.tiers.queue(tier) for tier in runtime.tiers.names]
        self._written = float("-inf")

    def start(self) -> None:
        """Before the worker takes a message (its lane's first tick may come later)."""
        try:
            self.tick()
        except redis.RedisError as exc:  # the broker may come up later: the ticks do it
            logger.warning("could not write the tenant policies at start: %s", exc)

    def tick(self) -> float:
        """One pass; returns when the next is due (a paced housekeeping job)."""
        fair = self._runtime.fair
        if fair is None:
            lanes = self._runtime.lanes
            for queue in self._queues():
                lanes.drain(queue)
            return FEED_EVERY_SECONDS
        now = time.monotonic()
        if now - self._written >= POLICIES_EVERY_SECONDS:
            fair.write_policies(self._tier_queues, self._policies)
            self._written = now
        refill_all(fair, self._queues, self._express)
        return FEED_EVERY_SECONDS

    def released(self, sender: Any = None, **_: Any) -> None:
        request: Any = getattr(sender, "request", None)
        # A ledger task's delivery keeps its slot on its request (the guard notes there whether
        # it started without it); any other task's is read from its message
        if "ledger_tenant_slot" in getattr(request, "__dict__", {}):
            slot = request.ledger_tenant_slot
        else:
            slot = tenant_slot_of(request)
        if slot is not None:  # (a pool process's own client: made again after the fork)
            release_slot(self._runtime.fair, self._policies, slot)


def worker_feeder(
    app: Any, queues: Callable[[], Iterable[str]], express: Callable[[], frozenset[str]]
) -> list[Callable[[], float]]:
    """The worker's :class:`Feeder`, started, its release connected to ``task_postrun``: its
    housekeeping job."""
    feeder = Feeder(app.runtime, queues, express)
    feeder.start()
    signals.task_postrun.connect(feeder.released, weak=False)
    return [feeder.tick]


__all__ = [
    "TENANT_PROPERTY",
    "Feeder",
    "TenantGate",
    "TenantSpec",
    "checked",
    "policy_of",
    "refill_all",
    "release_slot",
    "slot_keeper",
    "tenant_of_call",
    "worker_feeder",
]
