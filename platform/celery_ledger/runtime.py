"""The runtime: one app's platform services, built once by ``create_app`` and handed to the
engines (guard, dead letters, reconciler, observability), which never see the Celery app.

It holds the settings, the ledger store, the tiers, the sealer, the observers and a ``publish``
function (the app's ``send_task``), and builds on first use, per process, what needs a
connection: the broker's Redis client, breakers, rate limits, queue depths, the backpressure gate,
the throttle and the delayed deliveries.

Per process, because a forked child must never use a connection pool of its parent's: the
worker's main process uses these clients from its own threads (the housekeeping lanes), and a
pool lock one of them holds at the moment of a fork stays held for ever in the child. redis-py
takes that lock when it first resets the inherited pool in the child, so the child would hang on
its first Redis call (seen: a pool process started to replace a killed one, stuck in
``ConnectionPool.reset`` on its first dead-letter copy, its job held for good). After a fork the
child forgets every such service (:data:`PER_PROCESS`) and builds its own on first use.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .clock import ClockBook, ClockReports, Reading, ServerClock, last_known_time, redis_time
from .crypto import Sealer
from .delayed import DelayedDeliveries
from .depth_history import DepthHistory
from .events import Observers
from .fairness import FairDispatch
from .handoff import Parking, parked_key
from .ledger.message import Publish
from .ledger.store import Ledger
from .locks import keep_inherited
from .policies.backpressure import BackpressureGate, QueueDepths
from .policies.breaker import Breakers, BreakerState
from .policies.rate_limit import RateLimits
from .policies.retry import TIER_RETRY_DEFAULTS, RetryPolicy
from .policies.tenants import TenantGate, TenantRates
from .policies.throttle import Throttle, ThrottleRule
from .pressure import Pressure
from .routing import DEAD_LETTER, Tiers
from .sentinel import RedisTarget, connection_options, primary_moved, redis_client
from .signing import Signer
from .unrecorded import Unrecorded
from .wakes import PendingWakes

if TYPE_CHECKING:
    from .settings import Settings


def delayed_key(namespace: str) -> str:
    """The Redis key of the delayed deliveries of the queues of ``namespace``."""
    return f"{namespace}:ledger:delayed" if namespace else "ledger:delayed"


# The services that hold a Redis connection pool (see the module docstring).
PER_PROCESS = (
    "redis",
    "breakers",
    "rate_limits",
    "queue_depths",
    "depth_history",
    "gate",
    "throttle",
    "delayed",
    "legacy_delayed",
    "pending_wakes",
    "clock_book",
    "unrecorded",
    "parking",
    "lanes",
    "tenant_gate",
)


def forget_after_fork(owner: object, names: tuple[str, ...]) -> None:
    """In every forked child, drop ``owner``'s cached ``names`` (``cached_property`` values
    holding a connection pool), so that the child builds its own on first use."""
    ref = weakref.ref(owner)

    def forget() -> None:
        alive = ref()
        if alive is not None:
            for name in names:
                if name in alive.__dict__:
                    keep_inherited(alive.__dict__.pop(name))

    os.register_at_fork(after_in_child=forget)


# A producer that found the ledger away publishes without the jobs' records this long before it
# tries again (each try costs a timeout, LEDGER_MONGO_TIMEOUT_MS): through a ledger outage a
# publish stays a broker write, and its claim still runs the job once.
LEDGER_AWAY_SECONDS = 10.0


class Absence:
    """When a server was last seen away, on this process's monotonic clock."""

    def __init__(self, hold_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._hold = hold_seconds
        self._clock = clock
        self._until = 0.0

    def away(self) -> bool:
        """Whether it was seen away within the hold."""
        return self._clock() < self._until

    def seen_away(self) -> None:
        self._until = self._clock() + self._hold


class Runtime:
    """The services of one app (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        *,
        name: str,
        tiers: Tiers,
        ledger: Ledger,
        publish: Publish,
        tier_of: Callable[[str], str | None],
        observers: Observers | None = None,
        transport_options: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.settings = settings
        self.name = name  # the app's name: it namespaces the platform's keys in Redis
        self.tiers = tiers
        self.ledger = ledger
        self.publish = publish
        # The tier a task (by name) is routed to, or None if no such task is registered here.
        self.tier_of = tier_of
        self.observers = observers or Observers()
        # The broker's transport options (master_name, sentinel_kwargs: create_app's reads the
        # app's configuration), read at the first use of a Redis client
        self._transport_options = transport_options or (lambda: connection_options(settings))
        ledger.open_text = self.sealer.open
        ledger.clock.on_reading = self._clock_read
        ledger.clock.warn_offset_seconds = settings.clock_warn_seconds
        self.ledger_absence = Absence(LEDGER_AWAY_SECONDS)  # (see LEDGER_AWAY_SECONDS)
        forget_after_fork(self, PER_PROCESS)

    @cached_property
    def sealer(self) -> Sealer:
        """Encryption at rest for sensitive tasks (``LEDGER_ENCRYPTION_KEYS``)."""
        return Sealer([key.get_secret_value() for key in self.settings.encryption_keys])

    @cached_property
    def signer(self) -> Signer:
        """Message authentication (``LEDGER_SIGNING_KEYS``)."""
        return Signer(
            [key.get_secret_value() for key in self.settings.signing_keys],
            required=self.settings.signatures_required,
        )

    @cached_property
    def broker_target(self) -> RedisTarget:
        """Where the broker's Redis is: its URL and, through Sentinel, its primary's name and
        the sentinels' options (see sentinel.py). Every Redis client here is made from it."""
        return RedisTarget(self.settings.require_broker_url(), dict(self._transport_options()))

    @cached_property
    def redis(self) -> redis.Redis:
        """A client of the broker's Redis (its primary, through Sentinel), for the platform's
        shared state."""
        timeout = self.settings.broker_timeout_seconds
        return redis_client(
            self.broker_target,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            # A lost connection is tried once more at once (a pooled one the server closed is
            # replaced, a failover's old primary asked again through the sentinels); a timeout
            # is not: against a broker that hangs, each try waits LEDGER_BROKER_TIMEOUT_SECONDS
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        )

    @cached_property
    def broker_clock(self) -> ServerClock:
        """The broker's clock (Redis ``TIME``): every time kept in Redis or stamped on a
        message (due times, enqueue and publish times, ages) is the broker's. Not per process:
        a forked child keeps its parent's reading, and reads through its own client."""
        return ServerClock(
            "broker",
            lambda: redis_time(self.redis),
            on_reading=self._clock_read,
            warn_offset_seconds=self.settings.clock_warn_seconds,
        )

    @cached_property
    def clock_book(self) -> ClockBook:
        """The fleet's offsets from the servers' clocks, as each worker last measured them."""
        return ClockBook(self.redis, namespace=self.tiers.namespace)

    @cached_property
    def unrecorded(self) -> Unrecorded:
        """Jobs published while the ledger was away, kept until the reconciler records them."""
        settings = self.settings
        return Unrecorded(
            self.redis,
            namespace=self.tiers.namespace,
            now=self.message_time,
            retention_seconds=min(
                settings.result_retention_seconds, settings.dead_retention_seconds
            ),
            signer=self.signer,
            unverified_seconds=settings.unrunnable_window_seconds,  # (a deploy's length)
            confirm_replicas=settings.replicas_to_confirm(),
            # (within the client's own timeout, which would end the wait as a broker away)
            confirm_seconds=settings.broker_timeout_seconds / 2,
            primary_moved=primary_moved(self.redis),
        )

    @cached_property
    def clock_reports(self) -> ClockReports:
        """This process's offsets, written to the fleet's book on its own readings (producers,
        the console; a worker's housekeeping reports instead, and turns this off)."""
        return ClockReports(lambda: self.clock_book, lambda: (self.ledger.clock, self.broker_clock))

    def _clock_read(self, reading: Reading) -> None:
        self.observers.clock_read(reading)
        self.clock_reports.reading_taken(reading)

    def message_time(self) -> float:
        """Now, on the clock every message's times are on (the broker's), in unix seconds."""
        return self.broker_clock.now()

    def on_ledger_clock(self, message_time: float | None, away: bool = False) -> datetime:
        """A time stamped on a message (the broker's clock) as the ledger's clock tells it,
        to keep on a record beside the ledger's own times; now if it is None. ``away``: the
        ledger seen away, its clock followed from the last reading (never read again now)."""
        now = datetime.fromtimestamp(last_known_time("ledger"), UTC) if away else self.ledger.now()
        if message_time is None:
            return now
        return now - timedelta(seconds=self.broker_clock.now() - message_time)

    @cached_property
    def breakers(self) -> Breakers:
        """Circuit breakers shared through Redis by every worker: ``breakers["payments"]``."""
        return Breakers(
            self.broker_target,
            configs=self.settings.breakers,
            on_transition=self._breaker_changed,
        )

    def _breaker_changed(self, name: str, old: BreakerState, new: BreakerState) -> None:
        self.observers.breaker(name, str(old.value), str(new.value))

    @cached_property
    def rate_limits(self) -> RateLimits:
        return RateLimits(self.redis, self.settings.rate_limits)

    @cached_property
    def tenant_rates(self) -> TenantRates:
        return TenantRates(self.redis, self.settings.tenants, namespace=self.tiers.namespace)

    @cached_property
    def lanes(self) -> FairDispatch:
        """The tiers' tenant lanes (fairness.py), whether fair dispatch is on here or not (a
        worker with it off drains what they hold). On a client of its own that gives up within
        a second, without retries: a slot's renewal from the heartbeat thread, or a release at
        a task's end, must never wait out a broker that hangs (the ledger's heartbeat, on the
        same thread, would miss its lease)."""
        client = redis_client(
            self.broker_target,
            socket_timeout=1,
            socket_connect_timeout=1,
            retry=Retry(NoBackoff(), 0),
        )
        depth = max(self.settings.fair_queue_depth, 1)
        return FairDispatch(client, depth=depth, lease_seconds=self.settings.lease_seconds)

    @property
    def fair(self) -> FairDispatch | None:
        """The tiers' fair lanes, or None with fair dispatch off (``LEDGER_FAIR_QUEUE_DEPTH=0``)."""
        return self.lanes if self.settings.fair_queue_depth else None

    @cached_property
    def tenant_gate(self) -> TenantGate | None:
        """Per-tenant backpressure (``max_waiting``), or None when no tenant has a limit."""
        fair = self.fair
        if fair is None:
            return None
        gate = TenantGate(fair, self.settings.tenants, on_refused=self.observers.tenant_refused)
        return gate if gate.limited() else None

    @cached_property
    def queue_depths(self) -> QueueDepths:
        """Depths of the tiers' queues and the dead letters' queue, by tier name."""
        names = (*self.tiers.names, DEAD_LETTER)
        return QueueDepths(self.redis, {name: self.tiers.queue(name) for name in names})

    @cached_property
    def depth_history(self) -> DepthHistory:
        """The tiers' queue depths per minute over the last hour (the console's chart)."""
        return DepthHistory(self.redis, namespace=self.tiers.namespace)

    def sample_depths(self) -> None:
        """Sample every tier's queue depth now into :attr:`depth_history`."""
        self.depth_history.record(self.queue_depths.refresh(), at=self.message_time())

    @cached_property
    def gate(self) -> BackpressureGate:
        """Publish-side backpressure per tier (``LEDGER_TIER_LIMITS``)."""
        return BackpressureGate(
            self.queue_depths,
            {tier: self.settings.tier_limits[tier] for tier in self.tiers.names},
            on_shed=self.observers.shed,
        )

    @cached_property
    def throttle(self) -> Throttle:
        settings = self.settings
        rule = ThrottleRule(
            latency_threshold_ms=settings.throttle_latency_ms,
            critical_backlog=settings.throttle_critical_backlog,
            resume_ratio=settings.throttle_resume_ratio,
        )
        pressure = Pressure(self.redis, window_seconds=settings.pressure_window_seconds)
        return Throttle(
            pressure, self.queue_depths, rule, interval_seconds=settings.throttle_check_seconds
        )

    @cached_property
    def delayed(self) -> DelayedDeliveries:
        """Retries, deferrals and countdowns held in Redis until due (never in a worker's
        memory). One set per queue namespace, like the queues whose messages it holds: a
        producer app of another name that publishes to these queues (LEDGER_QUEUE_NAMESPACE)
        shares it with their workers, which drain it."""
        namespace = self.tiers.namespace
        return DelayedDeliveries(
            self.broker_target,
            key=delayed_key(namespace),
            signer=self.signer,
            parked_key=parked_key(namespace),
        )

    @cached_property
    def parking(self) -> Parking:
        """The messages a worker could not run, parked for one that can (the handoff)."""
        namespace = self.tiers.namespace
        return Parking(self.redis, delayed_key=delayed_key(namespace), key=parked_key(namespace))

    @cached_property
    def pending_wakes(self) -> PendingWakes:
        """The marks of the workflows with a wake waiting in the broker (one wake at a time)."""
        return PendingWakes(self.redis, namespace=self.tiers.namespace)

    @cached_property
    def legacy_delayed(self) -> DelayedDeliveries | None:
        """The set of releases that keyed it by the app's name, where that differs from the
        namespace: workers drain what such a producer left there."""
        old = f"{self.name}:ledger:delayed"
        if old == delayed_key(self.tiers.namespace):
            return None
        return DelayedDeliveries(self.broker_target, key=old, signer=self.signer)

    def retry_policy_for(self, tier: str) -> RetryPolicy:
        """The tier's retry default: built-in, replaced by ``LEDGER_RETRY_POLICIES``."""
        return self.settings.retry_policies.get(tier) or TIER_RETRY_DEFAULTS.get(
            tier, RetryPolicy()
        )
