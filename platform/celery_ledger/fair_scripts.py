"""The Lua scripts that own every change to the fair lanes (:mod:`celery_ledger.fairness` says
what they do and why; :class:`celery_ledger.fairness.FairDispatch` runs them).

Kept apart from their caller for their size: a script runs whole on Redis, so each of its
rules lives in one place here, and the Python around it stays short.
"""

from __future__ import annotations

import hashlib

# How long a tenant's last turn is remembered (a key per tenant, at the turn counter's value):
# one that went ahead of the queue, or left the ring, may go ahead again only once every other
# tenant with work had a turn since (see ``put``). Forgotten, it may go ahead once more: the
# memory bounds the keys to the tenants seen in the last hour.
TURN_MEMORY_SECONDS = 3600

# ARGV[1] op: put | refill | release | feed | drain; ARGV[2] queue; ARGV[3] depth; ARGV[4] batch;
# ARGV[5] the priority steps, comma-separated; ARGV[6] the lease of a moved message's concurrency
# entry (s); put: ARGV[7] tenant, ARGV[8] step, ARGV[9] message; release: ARGV[7] tenant, ARGV[8]
# job id; feed: ARGV[7] how long the queue's feeder mark lasts (ms), ARGV[8] '1' when the feeding
# worker also takes from the express lists with a process of their own (its express mark).
# Keys are made here from the queue's name: kombu's transport runs on one Redis (or a Sentinel
# primary), never a cluster. Returns the messages moved to the queue.
SCRIPT = r"""
local op, q = ARGV[1], ARGV[2]
local p = q .. ':fair:'
local ring, active, credit, policy = p .. 'ring', p .. 'active', p .. 'credit', p .. 'policy'
local waiting, jumped, turns = p .. 'waiting', p .. 'jumped', p .. 'turns'
local steps = {}
for s in string.gmatch(ARGV[5], '[^,]+') do steps[#steps + 1] = s end
local function qlist(s) if s == '0' then return q end return q .. '\6\22' .. s end
local function xlist(s) return q .. '\6\22x' .. s end
local express = p .. 'express'
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
  -- not again before every tenant with work had its turn since its last (a negative
  -- difference: the count was lost, and starts again)
  local now_turn = tonumber(redis.call('GET', turns) or '0') or 0
  local last = tonumber(redis.call('GET', p .. 'turn:' .. tenant) or '')
  if last and now_turn >= last and now_turn - last < redis.call('LLEN', ring) then
    return false
  end
  for _, staged in ipairs(redis.call('LRANGE', qlist(s), 0, -1)) do
    local props = envelope_of(staged)['properties']
    if type(props) == 'table' and props['ledger_tenant'] == tenant then return false end
  end
  local _, limit = rule(tenant)
  if limit > 0 then
    local now = clock_now()
    if full(tenant, limit, now) then return false end
    hold(tenant, item, now, lease)
  end
  if redis.call('EXISTS', express) == 1 then
    redis.call('LPUSH', xlist(s), item)  -- first in, first out: BRPOP takes the oldest
  else
    redis.call('RPUSH', qlist(s), item)
  end
  redis.call('SET', jumped, '1')
  redis.call('SET', p .. 'turn:' .. tenant, now_turn, 'EX', @TURN_MEMORY@)
  return true
end
-- No worker with an express process marks the queue now (or the lanes are drained): what the
-- express lists hold goes to the front of the queue, in its order (a worker of an earlier
-- release reads no express list)
if op == 'drain' or redis.call('EXISTS', express) == 0 then
  for _, s in ipairs(steps) do
    while redis.call('LMOVE', xlist(s), qlist(s), 'LEFT', 'RIGHT') do end
  end
end
local ahead = 0
if op == 'put' then
  if redis.call('EXISTS', p .. 'feeder') == 0 then
    -- no worker feeds the lanes now (rolled back to a release without them): a batch of what
    -- they hold goes to the queue first, then this message
    if redis.call('SCARD', active) > 0 then drain(tonumber(ARGV[4]) * 10) end
    redis.call('LPUSH', qlist(ARGV[8]), ARGV[9])
    return 0
  end
  if jump(ARGV[7], ARGV[8], ARGV[9]) then
    ahead = 1
  else
    redis.call('LPUSH', lane(ARGV[7], ARGV[8]), ARGV[9])
    redis.call('INCR', waiting)
    if redis.call('SADD', active, ARGV[7]) == 1 then redis.call('RPUSH', ring, ARGV[7]) end
  end
elseif op == 'release' then
  redis.call('ZREM', running(ARGV[7]), ARGV[8])
elseif op == 'feed' then
  redis.call('SET', p .. 'feeder', '1', 'PX', ARGV[7])
  if ARGV[8] == '1' then redis.call('SET', express, '1', 'PX', ARGV[7]) end
elseif op == 'drain' then
  return drain(tonumber(ARGV[4]) * 10)
end
local tenants = redis.call('SCARD', active)
if tenants == 0 then return ahead end
if redis.call('LLEN', ring) ~= tenants then
  -- the ring lost or doubled a tenant (an eviction, a hand): made again from the set
  redis.call('DEL', ring)
  for _, tenant in ipairs(redis.call('SMEMBERS', active)) do redis.call('RPUSH', ring, tenant) end
end
local now = clock_now()
local depth = queued()
local moved, passed, ended = 0, 0, 0
local turns_before = nil
while depth < target and moved < budget do
  local n = redis.call('LLEN', ring)
  if n == 0 or passed >= n or passed >= budget then break end
  local tenant = redis.call('LINDEX', ring, 0)
  local weight, limit = rule(tenant)
  if full(tenant, limit, now) then
    redis.call('RPUSH', ring, redis.call('LPOP', ring))
    passed, ended = passed + 1, ended + 1
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
      -- its last turn, from which it waits for the others' before it may go ahead
      ended = ended + 1
      turns_before = turns_before or tonumber(redis.call('GET', turns) or '0') or 0
      redis.call('SET', p .. 'turn:' .. tenant, turns_before + ended, 'EX', @TURN_MEMORY@)
    elseif redis.call('HINCRBY', credit, tenant, 1) >= weight then
      redis.call('HDEL', credit, tenant)
      redis.call('RPUSH', ring, redis.call('LPOP', ring))
      ended = ended + 1
    end
  end
end
-- a message of the ring moved: the next newcomer may go ahead of it
if moved > 0 then redis.call('DEL', jumped) end
-- the turns the ring gave (a tenant's weight in messages, or passed over at its limit), by
-- which a tenant that went ahead waits for every other tenant's turn before it may again
if ended > 0 then redis.call('INCRBY', turns, ended) end
return moved + ahead
"""

SCRIPT = SCRIPT.replace("@TURN_MEMORY@", str(TURN_MEMORY_SECONDS))

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

# Run by its digest (EVALSHA): a take's refill sends some 80 bytes, not the script's 7.5 KB. A
# broker that does not know it (restarted, failed over) says NOSCRIPT, and it is sent whole once.
SCRIPT_SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()
