"""Fair dispatch inside a tier: each tenant's jobs wait in a lane of their own, and the tier's
queue is fed from the lanes round-robin, so one tenant's backlog never delays another's few.

Workers consume each tier's queue as before (kombu's BRPOP, acks_late, the visibility sweep,
poison handling: all unchanged); only what enters the queue is decided here. A message that
names a tenant (the ``ledger_tenant`` property) is pushed to its tenant's lane instead of the
queue, and the queue is kept at most ``depth`` messages deep from the lanes: a tenant arriving
behind another's backlog of 50,000 jobs finds ``depth`` messages ahead of it, not 50,000.

One Lua script owns every change, so a lane, the ring of tenants with work and the queue never
disagree, whoever runs it (a producer, a worker, a crashed one's successor):

- ``put``: the message to its lane (one list per priority step, so kombu's priorities hold
  inside a tenant), the tenant to the ring if it had no work, then a refill. A tenant with
  nothing waiting (in its lanes, nor of the same priority in the queue, which is at most
  ``depth`` deep), arriving while other tenants have backlogs, skips its lane: its message goes
  to the front of the queue, ahead of what the lanes staged there. Without this it would wait
  for the staged message to be taken and for its turn of the ring after that: two or three job
  ends behind a flood that fills every worker process, where an idle tier starts it at once. As
  in start-time fair queuing, a newcomer is owed the turn before a backlogged tenant's next one,
  and no more: a tenant goes ahead only once every tenant with work had its turn since its own
  last one (it went ahead, or left the ring), so one that publishes a job whenever its last has
  started gets the share of a tenant of weight 1 in the ring, not every other start; and at most
  one message goes ahead this way between two moves from the ring, so a stream of new tenants
  leaves the ring at least every other start. Going ahead of the queue still waits for a
  running job to end when a flood fills every pool process (a job starts only where one ended:
  most of a flood job's time, on top of the idle path). So a worker keeps one pool process more
  than its concurrency for these messages only (:mod:`celery_ledger.express`): while such a
  worker marks the queue (as the feeder mark, below), a message that goes ahead goes to the
  queue's express list of its priority, which every worker's take reads first and the express
  process reads alone; without the mark, to the front of the queue as before, and whatever the
  express lists still hold goes there with it, in order;
- ``refill``: while the queue is shallower than ``depth``, the tenant at the ring's head gives
  its oldest message of its highest priority to the queue's list of that priority; after
  ``weight`` messages in a row (its policy) it goes to the ring's tail; a tenant with nothing
  left leaves the ring; a tenant at its concurrency limit is passed over;
- ``release``: a job of a tenant with a concurrency limit ended: its slot is freed, then a refill.

A refill runs with every publish of a tenant's job, with every take from a tier queue (in the
same pipeline as kombu's booking of the take: no round trip more) and every second in each
worker (what a crashed process left unfed). Order inside a tenant is its lane's: first in,
first out, per priority. Lanes are used only while a worker that feeds them is up (see
:data:`FEEDER_SECONDS`): a put that finds none moves what the lanes hold to the queue first
(a fleet rolled back to a release without them), as ``drain`` does.

Concurrency limits count a tenant's jobs on each tier from their move to the queue until they
end, in a sorted set per tenant and queue scored by when each entry lapses (the broker's clock),
one entry per message (its delivery tag): moved, an entry lives a lease; running, the body's
heartbeats keep it a lease ahead; ended, the worker removes it. A worker that dies frees its
tenant's slots within a lease. The limit is held again where a body starts (``admit``): a
delivery whose entry lapsed while it waited (in a busy queue, in a worker's hands, through an
outage) and went to another message, or that skipped its lane (a copy kombu put back itself),
starts only if a slot is free, and is put off otherwise. Entries lost (a failover to a replica
that missed the last writes) or not written (a start while the broker does not answer) let the
tenant run past its limit until those bodies end.

What the lanes hold is read by :meth:`FairDispatch.shares`: each tenant's jobs waiting and
running, the ``top`` tenants by waiting each on a row of its own and the rest summed as
``other``, so that the metrics and the console stay bounded however many tenants there are.

Redis only holds the policies as the workers last wrote them (``<queue>:fair:policy``, a field
per tenant and ``*`` for the others): every worker writes the app's at start.

This module imports nothing of the library but its scripts (:mod:`celery_ledger.fair_scripts`;
the broker view, the transport and the runtime all use it); bad policies raise
:class:`ValueError`, which the settings turn into their errors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from .fair_scripts import ADMIT_SCRIPT, RENEW_SCRIPT, SCRIPT, SCRIPT_SHA, WAITING_SCRIPT

# A message's tenant: a message *property* (a worker of an earlier release refuses an unknown
# ``ledger_`` header, and ignores an unknown property), set again at each publish.
TENANT_PROPERTY = "ledger_tenant"
MAX_TENANT_LENGTH = 128
DEFAULT_TENANT = "*"  # the policy field of every tenant not named

# kombu's priority steps and list naming (restated: kombu stays above this layer; a unit test
# holds them equal to kombu's)
PRIORITY_STEPS = (0, 3, 6, 9)
_PRIORITY_SEPARATOR = "\x06\x16"

# The row of the tenants past the top ones (metrics labels, the console's rows). A tenant named
# "other" is summed there too, never shown as if it were the rest.
OTHER_TENANTS = "other"

# How many messages one refill moves at most, and how many tenants at their concurrency limit in
# a row it passes over before it stops (a script holds the broker while it runs: with thousands
# of tenants all at their limit, a refill at every take must not read them all; the next one
# goes on from where this one stopped, the ring having turned).
REFILL_BATCH = 100
# Only a worker of a release with fair dispatch feeds a queue from its lanes. Each marks the
# queues it consumes as fed, for this long, at each housekeeping tick (about every second); a
# put onto a queue that no such worker marked goes straight to the queue, as before fair
# dispatch. So a producer upgraded before the workers (a rolling deploy) strands nothing in
# lanes that no worker would feed.
FEEDER_SECONDS = 10.0


@dataclass(frozen=True)
class TenantPolicy:
    """How a tenant shares its tier (``LEDGER_TENANTS``).

    ``weight``: messages it gives the queue per turn (a tenant of weight 3 gets three jobs
    started for another's one while both have work). ``concurrency``: at most this many of its
    jobs moved to a tier's queue and not ended, fleet-wide, on each tier (None: no limit).
    ``max_waiting``: at most this many of its jobs waiting in its lanes per tier; past it, its
    publishes get the tier's backpressure policy (block, reject or shed), others' are
    unaffected. ``rate_per_second`` (and ``burst``, the rate rounded up unless given): its jobs
    started at most this fast, fleet-wide, over all its tiers and tasks (a token bucket in
    Redis, :mod:`celery_ledger.policies.tenants`); a job over it is deferred until its turn, as
    a task's own rate limit defers, and other tenants' are unaffected.
    """

    weight: int = 1
    concurrency: int | None = None
    max_waiting: int | None = None
    rate_per_second: float | None = None
    burst: int | None = None

    def __post_init__(self) -> None:
        if not _whole(self.weight) or not 1 <= self.weight <= 1000:
            raise ValueError("weight must be a whole number from 1 to 1000")
        if self.concurrency is not None and not (
            _whole(self.concurrency) and self.concurrency >= 1
        ):
            raise ValueError("concurrency must be a whole number, at least 1 (or null: no limit)")
        if self.max_waiting is not None and not (
            _whole(self.max_waiting) and self.max_waiting >= 0
        ):
            raise ValueError("max_waiting must be a whole number, not negative (or null: no limit)")
        rate = self.rate_per_second
        if rate is not None and (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not 0 < rate < float("inf")
        ):
            raise ValueError("rate_per_second must be a positive number (or null: no limit)")
        if self.burst is not None and (rate is None or not _whole(self.burst) or self.burst < 1):
            raise ValueError("burst must be a whole number, at least 1, with a rate_per_second")

    def encoded(self) -> str:
        """The policy as the script reads it: ``weight,concurrency`` (0: none)."""
        return f"{self.weight},{self.concurrency or 0}"


@dataclass(frozen=True)
class TenantShare:
    """A tenant's part of a queue now: its jobs ``waiting`` in its lanes, and ``running``, its
    jobs moved to the queue and not ended (counted only for a tenant with a concurrency
    limit: see the module docstring). The ``other`` row sums ``tenants`` tenants."""

    tenant: str
    waiting: int
    running: int
    tenants: int = 1


def top_shares(
    waiting: Mapping[str, int], running: Mapping[str, int], *, top: int
) -> list[TenantShare]:
    """The ``top`` tenants by jobs waiting (then running, then name), a row each, and after
    them one row ``other`` summing the rest (only if there is a rest): at most ``top + 1``
    rows, whatever the number of tenants."""
    if top < 0:
        raise ValueError("top must not be negative")
    tenants = set(waiting) | set(running)
    order = sorted(tenants, key=lambda t: (-waiting.get(t, 0), -running.get(t, 0), t))
    named = [t for t in order if t != OTHER_TENANTS][:top]
    rows = [TenantShare(t, waiting.get(t, 0), running.get(t, 0)) for t in named]
    rest = tenants - set(named)
    if rest:
        rows.append(
            TenantShare(
                OTHER_TENANTS,
                sum(waiting.get(t, 0) for t in rest),
                sum(running.get(t, 0) for t in rest),
                len(rest),
            )
        )
    return rows


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_tenant(tenant: Any) -> str:
    """``tenant`` if it is a usable tenant name, else :class:`ValueError` saying why."""
    if not isinstance(tenant, str):
        raise ValueError(f"a tenant is a string, not {type(tenant).__name__}")
    if not tenant or len(tenant) > MAX_TENANT_LENGTH:
        raise ValueError(f"a tenant is 1 to {MAX_TENANT_LENGTH} characters, not {len(tenant)}")
    if tenant == DEFAULT_TENANT or not tenant.isprintable():
        raise ValueError(f"tenant {tenant!r}: printable characters, not {DEFAULT_TENANT!r}")
    return tenant


def message_tenant(message: Any) -> str | None:
    """The tenant a message names (its ``ledger_tenant`` property), if it names a usable one."""
    properties = message.get("properties") if isinstance(message, dict) else None
    tenant = properties.get(TENANT_PROPERTY) if isinstance(properties, dict) else None
    try:
        return check_tenant(tenant) if tenant is not None else None
    except ValueError:
        return None  # (refused at publish; one made otherwise is dispatched as any other)


def queue_list(queue: str, step: int) -> str:
    """kombu's list of ``queue``'s messages of priority step ``step``."""
    return queue if step == 0 else f"{queue}{_PRIORITY_SEPARATOR}{step}"


def express_list(queue: str, step: int) -> str:
    """The list of ``queue``'s messages of priority step ``step`` that went ahead of the queue
    (see the module docstring). Named as kombu names a priority list of ``queue`` (its name,
    the separator, a suffix), so a take from it is read as a take from ``queue``."""
    return f"{queue}{_PRIORITY_SEPARATOR}x{step}"


def take_keys(
    queues: Sequence[str], steps: Sequence[int], kombu_list: Any, *, express_only: bool
) -> list[str]:
    """What a worker's take (kombu's BRPOP) reads, in order: at each priority step, the express
    lists of ``queues`` before the lists ``kombu_list(queue, step)`` names; the express
    process's take (``express_only``) reads the express lists alone."""
    keys: list[str] = []
    for step in steps:
        keys += [express_list(queue, step) for queue in queues]
        if not express_only:
            keys += [kombu_list(queue, step) for queue in queues]
    return keys


def prefix(queue: str) -> str:
    return f"{queue}:fair:"


def lane(queue: str, tenant: str, step: int) -> str:
    """The list of ``tenant``'s messages of priority step ``step`` waiting for ``queue``."""
    return f"{prefix(queue)}lane:{step}:{tenant}"


def ring_key(queue: str) -> str:
    return f"{prefix(queue)}ring"


def policy_key(queue: str) -> str:
    return f"{prefix(queue)}policy"


def running_key(queue: str, tenant: str) -> str:
    return f"{prefix(queue)}running:{tenant}"


def waiting_key(queue: str) -> str:
    """How many messages wait in ``queue``'s lanes (kept by the script: a ``GET`` reads it)."""
    return f"{prefix(queue)}waiting"


_STEPS = ",".join(str(step) for step in PRIORITY_STEPS)


def _args(op: str, queue: str, depth: int, lease_seconds: float, *rest: Any) -> list[Any]:
    return [op, queue, depth, REFILL_BATCH, _STEPS, lease_seconds, *rest]


def put_arguments(
    queue: str, tenant: str, step: int, payload: str | bytes, depth: int, lease_seconds: float
) -> list[Any]:
    """The script's arguments that push ``payload`` to its tenant's lane (and refill)."""
    return _args("put", queue, depth, lease_seconds, tenant, step, payload)


class FairDispatch:
    """The fair lanes of some queues on one Redis client (the script's callers)."""

    def __init__(self, client: Any, *, depth: int, lease_seconds: float) -> None:
        if depth < 1:
            raise ValueError("the fair queue depth must be at least 1")
        self.client = client
        self.depth = depth
        self.lease_seconds = lease_seconds

    def _run(self, args: list[Any]) -> int:
        try:
            return int(self.client.evalsha(SCRIPT_SHA, 0, *args))
        except NoScriptError:
            return int(self.client.eval(SCRIPT, 0, *args))  # (which caches it again)

    def put(self, queue: str, tenant: str, step: int, payload: str | bytes) -> int:
        """Push a message to its tenant's lane (and refill): see the module docstring."""
        return self._run(
            put_arguments(queue, tenant, step, payload, self.depth, self.lease_seconds)
        )

    def refill(self, queue: str, pipe: Any = None) -> Any:
        """Feed ``queue`` from its lanes; into ``pipe`` (queued with it) when given: there the
        result may be :class:`NoScriptError` (see :data:`SCRIPT_SHA`), and the caller refills
        again without a pipeline."""
        args = _args("refill", queue, self.depth, self.lease_seconds)
        if pipe is not None:
            return pipe.evalsha(SCRIPT_SHA, 0, *args)
        return self._run(args)

    def feed(self, queue: str, seconds: float = FEEDER_SECONDS, *, express: bool = False) -> int:
        """Mark ``queue`` as fed by a worker that knows the lanes (for ``seconds``), then
        refill it. Without the mark a put goes straight to the queue (see FEEDER_SECONDS).
        ``express``: the worker also takes from the queue's express lists with a process of
        their own (marked the same way: without the mark a newcomer goes to the queue's front)."""
        milliseconds = int(seconds * 1000)
        args = _args("feed", queue, self.depth, self.lease_seconds, milliseconds, int(express))
        return self._run(args)

    def drain(self, queue: str) -> int:
        """Move a batch (1,000) of the lanes' messages to ``queue`` as they are (fairness given
        up: before a rollback to a release without fair dispatch); call until it returns 0.
        Returns how many moved."""
        return self._run(_args("drain", queue, self.depth, 0))

    def release(self, queue: str, tenant: str, job_id: str) -> int:
        """A job of ``tenant`` ended: free its concurrency slot, then refill."""
        return self._run(_args("release", queue, self.depth, self.lease_seconds, tenant, job_id))

    def admit(self, queue: str, tenant: str, job_id: str, lease_seconds: float) -> bool:
        """Whether a delivery of ``tenant``'s job may start its body now, under the tenant's
        concurrency limit (its slot is its own entry, or a free one), holding the entry
        ``lease_seconds`` ahead if so (see :data:`ADMIT_SCRIPT`)."""
        return bool(self.client.eval(ADMIT_SCRIPT, 0, queue, lease_seconds, tenant, job_id))

    def renew(self, queue: str, tenant: str, job_id: str, lease_seconds: float) -> bool:
        """Keep a running job's concurrency entry ``lease_seconds`` ahead."""
        return bool(self.client.eval(RENEW_SCRIPT, 0, queue, lease_seconds, tenant, job_id))

    def write_policies(self, queues: Iterable[str], policies: Mapping[str, TenantPolicy]) -> None:
        """Write the app's tenant policies where the script reads them (each queue's hash), in
        one transaction: a refill between the delete and the write would see no limits."""
        pipe = self.client.pipeline(transaction=True)
        for queue in queues:
            key = policy_key(queue)
            pipe.delete(key)
            fields = {name: policy.encoded() for name, policy in policies.items()}
            if fields:
                pipe.hset(key, mapping=fields)
        pipe.execute()

    def waiting(self, queue: str) -> dict[str, int]:
        """Each tenant with work and how many of its messages wait in its lanes."""
        found = self.client.eval(WAITING_SCRIPT, 0, queue, _STEPS)
        pairs = iter(found or ())
        return {_text(tenant): int(n) for tenant, n in zip(pairs, pairs, strict=True)}

    def waiting_of(self, queue: str, tenant: str) -> int:
        """How many of ``tenant``'s messages wait in its lanes of ``queue``."""
        pipe = self.client.pipeline(transaction=False)
        for step in PRIORITY_STEPS:
            pipe.llen(lane(queue, tenant, step))
        return sum(int(n or 0) for n in pipe.execute())

    def running(self, queue: str) -> dict[str, int]:
        """Each limited tenant's jobs moved and not ended (lapsed entries not counted)."""
        now = _server_now(self.client)
        counts: dict[str, int] = {}
        for key in self.client.scan_iter(match=f"{_glob(prefix(queue))}running:*", count=500):
            name = _text(key)[len(prefix(queue)) + len("running:") :]
            n = int(self.client.zcount(key, now, "+inf"))
            if n:
                counts[name] = n
        return counts

    def shares(self, queue: str, *, top: int) -> list[TenantShare]:
        """The tenants of ``queue`` with work, waiting or running (:func:`top_shares`)."""
        return top_shares(self.waiting(queue), self.running(queue), top=top)

    def lanes(self, queue: str) -> list[str]:
        """Every lane of ``queue`` that holds messages (the reconciler reads them as the
        queue's own lists: a message there is in the broker)."""
        tenants = self.client.smembers(f"{prefix(queue)}active") or ()
        return [lane(queue, _text(t), step) for t in tenants for step in PRIORITY_STEPS]


def lane_lists(client: Any, queues: Sequence[str]) -> list[str]:
    """The lanes of every tenant with work in ``queues`` (see :meth:`FairDispatch.lanes`)."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.smembers(f"{prefix(queue)}active")
    found: list[str] = []
    for queue, tenants in zip(queues, pipe.execute(), strict=True):
        found += [lane(queue, _text(t), step) for t in tenants or () for step in PRIORITY_STEPS]
    return found


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _glob(text: str) -> str:
    """``text`` with Redis's glob characters escaped (a queue's name may hold any)."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def _server_now(client: Any) -> float:
    seconds, micros = client.time()
    return float(seconds) + float(micros) / 1_000_000
