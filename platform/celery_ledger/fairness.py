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
  nothing waiting and nothing in the queue, arriving while other tenants' backlogs keep the
  queue full, skips its lane: its message goes to the front of the queue, ahead of what the
  lanes staged there. Without this it would wait for the staged message to be taken and for
  its turn of the ring after that: two or three job ends behind a flood that fills every
  worker process, where an idle tier starts it at once. As in start-time fair queuing, a
  newcomer is owed the turn before a backlogged tenant's next one; to bound what it costs the
  backlogged, at most one message goes ahead this way between two moves from the ring (a
  stream of new tenants never holds the ring back by more than half the takes);
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

This module imports nothing of the library (the broker view, the transport and the runtime all
use it); bad policies raise :class:`ValueError`, which the settings turn into their errors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

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


def queue_list(queue: str, step: int) -> str:
    """kombu's list of ``queue``'s messages of priority step ``step``."""
    return queue if step == 0 else f"{queue}{_PRIORITY_SEPARATOR}{step}"


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


# ARGV[1] op: put | refill | release | feed | drain; ARGV[2] queue; ARGV[3] depth; ARGV[4] batch;
# ARGV[5] the priority steps, comma-separated; ARGV[6] the lease of a moved message's concurrency
# entry (s); put: ARGV[7] tenant, ARGV[8] step, ARGV[9] message; release: ARGV[7] tenant, ARGV[8]
# job id; feed: ARGV[7] how long the queue's feeder mark lasts (ms).
# Keys are made here from the queue's name: kombu's transport runs on one Redis (or a Sentinel
# primary), never a cluster. Returns the messages moved to the queue.
SCRIPT = r"""
local op, q = ARGV[1], ARGV[2]
local p = q .. ':fair:'
local ring, active, credit, policy = p .. 'ring', p .. 'active', p .. 'credit', p .. 'policy'
local waiting, jumped = p .. 'waiting', p .. 'jumped'
local steps = {}
for s in string.gmatch(ARGV[5], '[^,]+') do steps[#steps + 1] = s end
local function qlist(s) if s == '0' then return q end return q .. '\6\22' .. s end
local function lane(t, s) return p .. 'lane:' .. s .. ':' .. t end
local function running(t) return p .. 'running:' .. t end
local function rule(tenant)
  -- "weight,limit"; anything else (another release's form, a hand's) is the default
  local r = redis.call('HGET', policy, tenant) or redis.call('HGET', policy, '*') or ''
  local w, l = string.match(r, '^(%d+),(%d+)$')
  return math.max(tonumber(w) or 1, 1), tonumber(l) or 0
end
local function clock_now()
  local clock = redis.call('TIME')
  return tonumber(clock[1]) + tonumber(clock[2]) / 1000000
end
local function queued()
  local n = 0
  for _, s in ipairs(steps) do n = n + redis.call('LLEN', qlist(s)) end
  return n
end
local function envelope_of(item)
  local ok, envelope = pcall(cjson.decode, item)
  if ok and type(envelope) == 'table' then return envelope end
  return {}
end
-- A limited tenant's slot for a message moved to the queue (its delivery tag, which a
-- redelivery keeps and a retry's copy does not, else its task id), a lease ahead
local function hold(tenant, item, now, lease)
  local envelope = envelope_of(item)
  local props, heads, slot = envelope['properties'], envelope['headers'], nil
  if type(props) == 'table' and type(props['delivery_tag']) == 'string' then
    slot = props['delivery_tag']
  elseif type(heads) == 'table' and type(heads['id']) == 'string' then
    slot = heads['id']
  end
  if slot then redis.call('ZADD', running(tenant), now + lease, slot) end
end
local function full(tenant, limit, now)
  if limit <= 0 then return false end
  redis.call('ZREMRANGEBYSCORE', running(tenant), '-inf', now)
  return redis.call('ZCARD', running(tenant)) >= limit
end
local function idle(tenant)
  for _, s in ipairs(steps) do
    if redis.call('LLEN', lane(tenant, s)) > 0 then return false end
  end
  return true
end
local function gone(tenant)
  redis.call('SREM', active, tenant)
  redis.call('HDEL', credit, tenant)
  if redis.call('SCARD', active) == 0 then redis.call('DEL', ring, waiting, jumped) end
end
-- Moves at most a batch (the broker waits while a script runs); the next call goes on.
local function drain(budget)
  local drained = 0
  for _, tenant in ipairs(redis.call('SMEMBERS', active)) do
    for _, s in ipairs(steps) do
      while drained < budget and redis.call('RPOPLPUSH', lane(tenant, s), qlist(s)) do
        drained = drained + 1
      end
    end
    if idle(tenant) then
      redis.call('LREM', ring, 0, tenant)
      gone(tenant)
    end
    if drained >= budget then break end
  end
  if drained > 0 and redis.call('EXISTS', waiting) == 1 then
    redis.call('DECRBY', waiting, drained)
  end
  return drained
end
local target, budget, lease = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[6])
-- A tenant with nothing waiting, arriving while others' backlogs keep the queue full: its
-- message goes to the front of the queue, ahead of what the lanes staged there (see put).
local function jump(tenant, s, item)
  if redis.call('EXISTS', jumped) == 1 or redis.call('SCARD', active) == 0 then return false end
  if redis.call('SISMEMBER', active, tenant) == 1 or queued() > target then return false end
  for _, staged in ipairs(redis.call('LRANGE', qlist(s), 0, -1)) do
    local props = envelope_of(staged)['properties']
    if type(props) == 'table' and props['ledger_tenant'] == tenant then return false end
  end
  local _, limit = rule(tenant)
  local now = 0
  if limit > 0 then
    now = clock_now()
    if full(tenant, limit, now) then return false end
    hold(tenant, item, now, lease)
  end
  redis.call('RPUSH', qlist(s), item)
  redis.call('SET', jumped, '1')
  return true
end
if op == 'put' then
  if redis.call('EXISTS', p .. 'feeder') == 0 then
    -- no worker feeds the lanes now (rolled back to a release without them): a batch of what
    -- they hold goes to the queue first, then this message
    if redis.call('SCARD', active) > 0 then drain(tonumber(ARGV[4]) * 10) end
    redis.call('LPUSH', qlist(ARGV[8]), ARGV[9])
    return 0
  end
  if jump(ARGV[7], ARGV[8], ARGV[9]) then return 1 end
  redis.call('LPUSH', lane(ARGV[7], ARGV[8]), ARGV[9])
  redis.call('INCR', waiting)
  if redis.call('SADD', active, ARGV[7]) == 1 then redis.call('RPUSH', ring, ARGV[7]) end
elseif op == 'release' then
  redis.call('ZREM', running(ARGV[7]), ARGV[8])
elseif op == 'feed' then
  redis.call('SET', p .. 'feeder', '1', 'PX', ARGV[7])
elseif op == 'drain' then
  return drain(tonumber(ARGV[4]) * 10)
end
local tenants = redis.call('SCARD', active)
if tenants == 0 then return 0 end
if redis.call('LLEN', ring) ~= tenants then
  -- the ring lost or doubled a tenant (an eviction, a hand): made again from the set
  redis.call('DEL', ring)
  for _, tenant in ipairs(redis.call('SMEMBERS', active)) do redis.call('RPUSH', ring, tenant) end
end
local now = clock_now()
local depth = queued()
local moved, passed = 0, 0
while depth < target and moved < budget do
  local n = redis.call('LLEN', ring)
  if n == 0 or passed >= n or passed >= budget then break end
  local tenant = redis.call('LINDEX', ring, 0)
  local weight, limit = rule(tenant)
  if full(tenant, limit, now) then
    redis.call('RPUSH', ring, redis.call('LPOP', ring))
    passed = passed + 1
  else
    local item, from = nil, nil
    for _, s in ipairs(steps) do
      item = redis.call('RPOP', lane(tenant, s))
      if item then from = s break end
    end
    if item then
      redis.call('LPUSH', qlist(from), item)
      if redis.call('EXISTS', waiting) == 1 then redis.call('DECR', waiting) end
      depth, moved, passed = depth + 1, moved + 1, 0
      if limit > 0 then hold(tenant, item, now, lease) end
    end
    if idle(tenant) then
      redis.call('LPOP', ring)
      gone(tenant)
    elseif redis.call('HINCRBY', credit, tenant, 1) >= weight then
      redis.call('HDEL', credit, tenant)
      redis.call('RPUSH', ring, redis.call('LPOP', ring))
    end
  end
end
-- a message of the ring moved: the next newcomer may go ahead of it
if moved > 0 then redis.call('DEL', jumped) end
return moved
"""

# ARGV[1] queue, ARGV[2] steps. Returns {tenant, waiting, ...} for every tenant with work.
WAITING_SCRIPT = r"""
local p = ARGV[1] .. ':fair:'
local out = {}
for _, tenant in ipairs(redis.call('SMEMBERS', p .. 'active')) do
  local n = 0
  for s in string.gmatch(ARGV[2], '[^,]+') do
    n = n + redis.call('LLEN', p .. 'lane:' .. s .. ':' .. tenant)
  end
  out[#out + 1] = tenant
  out[#out + 1] = n
end
return out
"""


def waiting_key(queue: str) -> str:
    """How many messages wait in ``queue``'s lanes (kept by the script: a ``GET`` reads it)."""
    return f"{prefix(queue)}waiting"


# ARGV[1] queue, ARGV[2] lease (s), ARGV[3] tenant, ARGV[4] job id: keep a running job's
# concurrency entry a lease ahead (on the broker's clock, as the script's).
RENEW_SCRIPT = r"""
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
redis.call('ZADD', ARGV[1] .. ':fair:running:' .. ARGV[3], now + tonumber(ARGV[2]), ARGV[4])
return 1
"""

# ARGV[1] queue, ARGV[2] lease (s), ARGV[3] tenant, ARGV[4] job id: whether a delivery of a
# tenant's job may start its body (1) or must wait (0), holding its entry at least a lease ahead
# if so. It starts while fewer than the limit of the tenant's other entries live: its own entry,
# even lapsed, is its slot (every move drops lapsed entries before it counts, so none took it),
# and the others are counted, not trusted (a running body's renewal after a ledger outage may
# bring back an entry whose slot went to another meanwhile). The limit is read as the refill
# reads it; none, and every delivery may start.
ADMIT_SCRIPT = r"""
local p = ARGV[1] .. ':fair:'
local running, policy = p .. 'running:' .. ARGV[3], p .. 'policy'
local rule = redis.call('HGET', policy, ARGV[3]) or redis.call('HGET', policy, '*') or ''
local _, l = string.match(rule, '^(%d+),(%d+)$')
local limit = tonumber(l) or 0
if limit <= 0 then return 1 end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local mine = tonumber(redis.call('ZSCORE', running, ARGV[4]))
if mine then redis.call('ZREM', running, ARGV[4]) end
redis.call('ZREMRANGEBYSCORE', running, '-inf', now)
if redis.call('ZCARD', running) >= limit then
  if mine then redis.call('ZADD', running, mine, ARGV[4]) end
  return 0
end
redis.call('ZADD', running, math.max(mine or 0, now + tonumber(ARGV[2])), ARGV[4])
return 1
"""

_STEPS = ",".join(str(step) for step in PRIORITY_STEPS)
# Run by its digest (EVALSHA): a take's refill sends some 80 bytes, not the script's 3 KB. A
# broker that does not know it (restarted, failed over) says NOSCRIPT, and it is sent whole once.
SCRIPT_SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()


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

    def feed(self, queue: str, seconds: float = FEEDER_SECONDS) -> int:
        """Mark ``queue`` as fed by a worker that knows the lanes (for ``seconds``), then
        refill it. Without the mark a put goes straight to the queue (see FEEDER_SECONDS)."""
        return self._run(_args("feed", queue, self.depth, self.lease_seconds, int(seconds * 1000)))

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
