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

from .errors import ConfigurationError, PayloadError
from .fairness import TENANT_PROPERTY, FairDispatch, check_tenant
from .identity import bind_arguments
from .policies.tenants import TenantGate, policy_of, release_slot, slot_keeper
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
    if callable(spec):
        try:
            tenant = spec(*args, **kwargs)
        except TypeError as exc:
            raise PayloadError(f"tenant of {task_name} cannot take these arguments: {exc}") from exc
    elif isinstance(spec, str):
        try:
            tenant = spec.format(**bind_arguments(run, args, kwargs))
        except (KeyError, IndexError) as exc:
            raise ConfigurationError(
                f"tenant template {spec!r} of {task_name} names unknown argument {exc}"
            ) from exc
    else:
        raise ConfigurationError(
            f"tenant of {task_name} must be a callable or a str.format template,"
            f" not {type(spec).__name__}"
        )
    return checked(tenant, task_name=task_name)


def checked(tenant: Any, *, task_name: str) -> str | None:
    """``tenant`` (None: no tenant) if usable, else :class:`PayloadError` naming the task."""
    if tenant is None:
        return None
    try:
        return check_tenant(tenant)
    except ValueError as exc:
        raise PayloadError(f"tenant of {task_name}: {exc}") from None


def refill_all(fair: FairDispatch, queues: Callable[[], Iterable[str]]) -> int:
    """Mark every queue this worker consumes as fed, and feed it from its lanes (what a crashed
    producer or worker left unfed, and slots that lapsed). Returns the messages moved."""
    return sum(fair.feed(queue) for queue in queues())


# How often a worker writes the app's tenant policies where the dispatch reads them (a broker
# that lost its data, or a worker of another release that wrote its own, is set right within it).
POLICIES_EVERY_SECONDS = 30.0


def worker_jobs(app: Any, queues: Callable[[], Iterable[str]]) -> list[Callable[[], object]]:
    """A worker's part in fair dispatch: the app's policies written, each delivery's slot freed
    at its end (``task_postrun``), and its queues fed from their lanes at each housekeeping
    tick. None with fair dispatch off."""
    runtime = app.runtime
    fair = runtime.fair
    if fair is None:
        return []
    policies = runtime.settings.tenants
    tier_queues = [runtime.tiers.queue(tier) for tier in runtime.tiers.names]
    written = [float("-inf")]
    try:  # before this worker takes a message (its housekeeping's first tick may come later)
        fair.write_policies(tier_queues, policies)
        written[0] = time.monotonic()
        refill_all(fair, queues)
    except redis.RedisError as exc:  # the broker may come up later: the ticks write them
        logger.warning("could not write the tenant policies at start: %s", exc)

    def tick() -> None:
        now = time.monotonic()
        if now - written[0] >= POLICIES_EVERY_SECONDS:
            fair.write_policies(tier_queues, policies)
            written[0] = now
        refill_all(fair, queues)

    def released(sender: Any = None, task_id: Any = None, **_: Any) -> None:
        request = getattr(sender, "request", None)
        info = getattr(request, "delivery_info", None) or {}
        # (a pool process's own client: runtime.fair is made again after the fork)
        release_slot(
            runtime.fair,
            policies,
            queue=info.get("routing_key") if isinstance(info, dict) else None,
            tenant=request_property(request, TENANT_PROPERTY),
            job_id=task_id if isinstance(task_id, str) else None,
        )

    signals.task_postrun.connect(released, weak=False)
    return [tick]


__all__ = [
    "TENANT_PROPERTY",
    "TenantGate",
    "TenantSpec",
    "checked",
    "policy_of",
    "refill_all",
    "release_slot",
    "slot_keeper",
    "tenant_of_call",
    "worker_jobs",
]
