"""The handoff: a message a worker cannot run reaches a worker that can, within seconds.

A fleet is rarely uniform: in a rolling deploy old and new releases consume the same queues, so
a new task (or a call with a new argument) reaches workers that cannot run it. Putting such a
message back on its queue leaves its fate to the race for that queue: with nine old workers to
one new, or an old worker that happens to be waiting first, it can bounce for minutes. So a
worker that cannot run a message *parks* it, and every worker looks at what is parked and takes
what it can run: a designed handoff, not a race.

- **Parking** is the delayed set with an index. The message goes into the delayed set, as it
  was sent, due back on its queue after the put-off's backoff (so a worker of an earlier
  release, which does not look at the index, still gets its chance from the queue), and into
  the index (``<namespace>:ledger:parked``: id -> the delayed set's member) with its reason.
- **Taking**: each worker's housekeeping looks at up to :data:`SAMPLE` parked entries every
  :data:`LOOK_EVERY_SECONDS` and checks each, once, with the same checks the worker's consumer
  makes (:func:`celery_ledger.worker.check_message`). An entry it can run, as many as it has
  room to run now, it takes (one script: a lease so that no other worker takes it meanwhile,
  its return to the queue pushed past the lease) and pushes onto its own *inbox* queue, which
  only it consumes (bound to an exchange of its own, so no publish reads its binding).
- **Receipt**: when the worker's consumer receives the copy, booked as taken by kombu, and
  finds it sound, it removes the entry from the index and the delayed set (only the copy of
  that very message can: the property that names the entry is not signed). The copy keeps the
  original queue in its delivery info, so a worker that dies holding it has it put back on
  that queue by the visibility sweep, like any message taken.

Nothing is lost on any path: the entry leaves the delayed set only once a copy is safely taken
(or when it comes back on its queue). A worker that dies between its take and its receipt
leaves the entry parked: the lease ends and another worker takes it (the stale copy, if that
worker's inbox is ever consumed again, is a duplicate the ledger suppresses). When a parked
message goes back to its queue (its backoff), one script pushes it and takes it out of the
delayed set and the index, so the index holds only what is parked. Needs Redis 6.2 or later
(``HRANDFIELD``, ``ZADD ... GT``). Why not ask the
workers what they can run (advertised task names, signature versions, key ids) and route by
it: a worker's word goes stale the moment it dies, and every check would need to be restated
as data; here the check that decides is the code that will run the message, and a dead
taker costs a lease, not a job.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis

from .headers import PARKED
from .untrusted import float_or_none
from .wire import dumps, loads

logger = logging.getLogger(__name__)

# Every worker looks this often: a parked message waits about this long for a worker that is
# up and can run it (plus its turn in that worker's prefetch).
LOOK_EVERY_SECONDS = 1.0
# A look reads at most this many entries (chosen at random, so that a large backlog of parked
# messages one worker cannot run does not hide the others from it).
SAMPLE = 100
# A take holds its entry this long: the receipt comes within milliseconds (a worker takes only
# while it has room to run what it takes); past it another worker may take the entry again
# (its taker died, or its copy waits behind work that came first).
TAKE_LEASE_SECONDS = 60.0
# Entries this worker found it cannot run, remembered (its code and keys do not change while
# it runs): each is checked once per worker, not once per look.
REMEMBERED = 20_000

# KEYS: the delayed set, the index. ARGV: member, id, due (broker seconds).
_PARK = """
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1])
return 1
"""

# KEYS: the delayed set, the index, the take's lease key, the taker's inbox.
# ARGV: id, the copy to push, lease seconds.
# Returns 1 taken, 0 held by another taker, -1 no longer parked (its entry was cleaned up).
_TAKE = """
local member = redis.call('HGET', KEYS[2], ARGV[1])
if not member then return -1 end
if not redis.call('ZSCORE', KEYS[1], member) then
  redis.call('HDEL', KEYS[2], ARGV[1])
  return -1
end
local lease = tonumber(ARGV[3])
if not redis.call('SET', KEYS[3], '1', 'NX', 'PX', math.floor(lease * 1000)) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], 'XX', 'GT', now + lease, member)
redis.call('LPUSH', KEYS[4], ARGV[2])
-- a dead worker's inbox is never consumed again: let it go (a live one empties it at once)
redis.call('EXPIRE', KEYS[4], 86400)
return 1
"""

# KEYS: the delayed set, the index, the take's lease key. ARGV: id, the arriving copy's message
# id. Only the copy of that very message ends the entry (the property naming the entry is not
# signed: a message that names another's entry removes nothing).
_RELEASE = """
local member = redis.call('HGET', KEYS[2], ARGV[1])
if not member then return 0 end
local ok, entry = pcall(cjson.decode, member)
if not ok or type(entry) ~= 'table' or type(entry['raw']) ~= 'table'
    or type(entry['raw']['headers']) ~= 'table' or entry['raw']['headers']['id'] ~= ARGV[2] then
  return 0
end
redis.call('ZREM', KEYS[1], member)
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3])
return 1
"""


@dataclass(frozen=True)
class Parked:
    """One parked message: its queue, the message as the transport stores it, why it was
    parked, and since when (broker seconds) a worker first put it off."""

    id: str
    queue: str
    raw: dict[str, Any]
    why: str
    since: float | None


def parked_key(namespace: str) -> str:
    """The Redis key of the index of the parked messages of the queues of ``namespace``."""
    return f"{namespace}:ledger:parked" if namespace else "ledger:parked"


def inbox_of(namespace: str, hostname: str) -> str:
    """The queue only worker ``hostname`` consumes, where it puts the messages it takes."""
    return f"{namespace}.inbox.{hostname}" if namespace else f"inbox.{hostname}"


class Parking:
    """The parked messages of one queue namespace (see the module docstring)."""

    def __init__(self, client: redis.Redis, *, delayed_key: str, key: str) -> None:
        self._redis = client
        self.delayed_key = delayed_key
        self.key = key  # the index (see parked_key)
        self._park = client.register_script(_PARK)
        self._take = client.register_script(_TAKE)
        self._release = client.register_script(_RELEASE)

    def _lease_key(self, parked_id: str) -> str:
        return f"{self.key}:taken:{parked_id}"

    def park(
        self, queue: str, raw: dict[str, Any], *, due_at: float, why: str, since: float
    ) -> str:
        """Park a message (raises ``redis.RedisError``: the caller hands it back instead)."""
        parked_id = uuid.uuid4().hex
        member = dumps(
            {"id": parked_id, "queue": queue, "raw": raw, "parked": {"why": why, "since": since}}
        )
        self._park(keys=[self.delayed_key, self.key], args=[member, parked_id, due_at])
        return parked_id

    def sample(
        self, limit: int = SAMPLE, *, skip: Callable[[str], bool] = lambda _id: False
    ) -> list[Parked]:
        """Up to ``limit`` parked entries, at random (all of them when there are fewer), but
        those ``skip`` passes over (read by id first: only the others' messages are read)."""
        ids = [_text(raw) for raw in self._redis.hrandfield(self.key, limit) or []]
        wanted = [i for i in ids if not skip(i)]
        if not wanted:
            return []
        values = self._redis.hmget(self.key, wanted)
        found = (_parked(i, v) for i, v in zip(wanted, values, strict=True) if v is not None)
        return [p for p in found if p is not None]

    def all(self, *, limit: int = 2_000) -> list[Parked]:
        """Up to ``limit`` parked entries (for the metrics and the health check)."""
        entries: list[Parked] = []
        for key, value in self._redis.hscan_iter(self.key, count=500):
            entry = _parked(key, value)
            if entry is not None:
                entries.append(entry)
            if len(entries) >= limit:
                break
        return entries

    def count(self) -> int:
        return int(self._redis.hlen(self.key))

    def take(self, entry: Parked, inbox: str) -> bool:
        """Take ``entry`` into ``inbox``; False if another worker holds it or it is gone."""
        copy = dict(entry.raw)
        found = copy.get("properties")
        properties = dict(found) if isinstance(found, dict) else {}
        # A delivery tag of its own: a copy that meets the original in one worker's bookings
        # must not share its entry there
        properties.update({"delivery_tag": str(uuid.uuid4()), PARKED: entry.id})
        copy["properties"] = properties
        taken = self._take(
            keys=[self.delayed_key, self.key, self._lease_key(entry.id), inbox],
            args=[entry.id, dumps(copy), TAKE_LEASE_SECONDS],
        )
        return int(taken) == 1

    def release(self, parked_id: str, message_id: str) -> bool:
        """The copy of ``parked_id`` (message ``message_id``) was received: the entry is done.
        False if there is no such entry, or it is not that message's."""
        keys = [self.delayed_key, self.key, self._lease_key(parked_id)]
        return bool(self._release(keys=keys, args=[parked_id, message_id]))


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _parked(key: Any, value: Any) -> Parked | None:
    """An index entry as a :class:`Parked`, or None if it is not one this platform wrote."""
    try:
        member = loads(value)
        parked_id = key.decode() if isinstance(key, bytes) else str(key)
        about = member.get("parked") or {}
        raw, queue = member["raw"], member["queue"]
        if not isinstance(raw, dict) or not isinstance(queue, str):
            return None
        return Parked(
            parked_id,
            queue,
            raw,
            str(about.get("why") or "unrunnable"),
            float_or_none(about.get("since")),
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


NotRunnable = Callable[["Parked"], str | None]


class Handoff:
    """One worker's look at the parked messages (run by its housekeeping, every
    :data:`LOOK_EVERY_SECONDS`): it takes into its inbox each one it can run."""

    def __init__(
        self,
        parking: Parking,
        inbox: str,
        not_runnable: NotRunnable,
        *,
        held: Callable[[Parked], bool] = lambda _entry: False,
        room: Callable[[], int] = lambda: SAMPLE,
    ) -> None:
        self._parking = parking
        self.inbox = inbox
        self._not_runnable = not_runnable
        self._held = held
        self._room = room
        # Entries this worker cannot run, and those it took (its copy is in its inbox: it is
        # not taken again by this worker, whose receipt ends it)
        self._cannot: OrderedDict[str, None] = OrderedDict()
        self._taken: OrderedDict[str, None] = OrderedDict()

    def look(self) -> int:
        """Take what this worker can run of a sample of the parked; returns how many.
        ``not_runnable`` says why it cannot run an entry (remembered: asked once per entry);
        ``held``: not now (asked again at the next look); ``room``: how many more this worker
        can run now (it takes no more: a busy worker leaves the entries to an idle one)."""
        taken, room = 0, self._room()
        if room <= 0:
            return 0
        for entry in self._parking.sample(skip=self._known):
            if self._held(entry):
                continue
            problem = self._check(entry)
            if problem is not None:
                _remember(self._cannot, entry.id)
                continue
            if self._parking.take(entry, self.inbox):
                _remember(self._taken, entry.id)
                taken += 1
                headers = entry.raw.get("headers")
                found = headers if isinstance(headers, dict) else {}
                logger.info(
                    "took %s of task %r (parked: %s) to run here",
                    found.get("id"),
                    found.get("task"),
                    entry.why,
                )
                if taken >= room:
                    break
        return taken

    def _known(self, parked_id: str) -> bool:
        return parked_id in self._cannot or parked_id in self._taken

    def _check(self, entry: Parked) -> str | None:
        try:
            return self._not_runnable(entry)
        except Exception as exc:  # a check that fails is a "no" (another worker may say yes)
            logger.warning("could not check parked message %s: %s", entry.id, exc)
            return f"check failed: {exc}"


def _remember(ids: OrderedDict[str, None], parked_id: str) -> None:
    ids[parked_id] = None
    while len(ids) > REMEMBERED:
        ids.popitem(last=False)


def tally(entries: Iterable[Parked], *, now: float) -> tuple[dict[tuple[str, str], int], float]:
    """Parked messages by (reason, task), and the oldest one's age in seconds (0 if none)."""
    counts: dict[tuple[str, str], int] = {}
    oldest = 0.0
    for entry in entries:
        headers = entry.raw.get("headers")
        task = headers.get("task") if isinstance(headers, dict) else None
        label = (entry.why, task if isinstance(task, str) else "?")
        counts[label] = counts.get(label, 0) + 1
        if entry.since is not None:
            oldest = max(oldest, now - entry.since)
    return counts, oldest
