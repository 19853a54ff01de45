"""What the reconciler reads and does in the broker (Redis): which jobs still have a message
waiting, which messages a worker took and never acknowledged, and putting one of those back.

kombu's Redis transport keeps each queue as a list, and every delivered but unacknowledged
message in a hash (delivery tag -> message) with an index sorted by delivery time; delayed
deliveries wait in the ledger's sorted set (:mod:`celery_ledger.delayed`). Messages are read as
jobs: a message's record id is derived from its task and ``ledger_key`` headers, the way the
guard derives it, so an alias message (a canvas member) is recognised as its job's.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, cast

import redis

from . import headers
from .fairness import express_list, lane_lists, waiting_key
from .identity import identity_of
from .untrusted import float_or_none

logger = logging.getLogger("celery_ledger.broker")
_PAGE = 500  # unacknowledged messages read per command

# kombu's Redis transport keeps priority n of queue q in the list "q\x06\x16n" (priority 0 in
# q itself), for these steps: restated here, kombu staying above this layer (a unit test holds
# them equal to kombu's).
PRIORITY_STEPS = (0, 3, 6, 9)
# The note of a watch's end is kept this long at most (no sweeper at all meanwhile: it is moot).
WATCH_END_KEPT_SECONDS = 86_400
_PRIORITY_SEPARATOR = "\x06\x16"


def queue_lists(queue: str) -> list[str]:
    """The Redis lists that hold ``queue``'s messages, one per priority step, after the lists of
    those that went ahead of it (fair dispatch's express lists: a message moves from one of
    them to the queue, never back; read in this order, one that moved is seen)."""
    kombu_lists = [queue if p == 0 else f"{queue}{_PRIORITY_SEPARATOR}{p}" for p in PRIORITY_STEPS]
    return [express_list(queue, p) for p in PRIORITY_STEPS] + kombu_lists


# Move one unacked message back to the front of its queue, atomically.
_DELETE_IF_UNCHANGED = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Owe the copies since ARGV[1] (unix seconds, or 'all'), widening what is owed already, under a
# new token (ARGV[2]): in one step, as the sweep lock may pass to another worker while a slow
# sweep still runs, and a payment of the older note must not clear this one. A value this
# script did not write owes everything. KEYS[2] holds the note for ARGV[3] ms (0: not held, an
# earlier hold dropped: see RedisBroker.owe_copies).
_OWE = """
if tonumber(ARGV[3]) > 0 then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
else
  redis.call('DEL', KEYS[2])
end
local since = ARGV[1]
local found = redis.call('GET', KEYS[1])
if found then
  local before = string.match(found, '^([^|]*)|')
  local a, b = tonumber(before), tonumber(since)
  local odd = a == nil or a ~= a or a == math.huge or a == -math.huge
  if before == nil or before == 'all' or since == 'all' or odd or b == nil then
    since = 'all'
  elseif a < b then
    since = before
  end
end
redis.call('SET', KEYS[1], since .. '|' .. ARGV[2])
return since
"""
_RESTORE = """
local payload = redis.call('HGET', KEYS[1], ARGV[1])
if not payload then return 0 end
redis.call('RPUSH', ARGV[2], ARGV[3])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# Start or widen the watch after a failover: KEYS = the watch (expiring after ARGV[2] ms), its
# end's note (until the sweep after it has seen to it, or ARGV[3] s); ARGV[1] = since (unix
# seconds). A watch under way keeps the earlier since and the later end.
_WATCH = """
local since = tonumber(ARGV[1])
local before = tonumber(redis.call('GET', KEYS[2]))
if before and before < since then since = before end
local ms = tonumber(ARGV[2])
local left = redis.call('PTTL', KEYS[1])
if left > ms then ms = left end
redis.call('SET', KEYS[1], since, 'PX', ms)
redis.call('SET', KEYS[2], since, 'EX', ARGV[3])
return 1
"""

# Take or renew the sweep lock. KEYS = lock, token counter; ARGV = owner, ttl ms.
# Returns the holder's fencing token, or false when another owner holds it.
_ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder then
  local sep = string.find(holder, '|', 1, true)
  if string.sub(holder, 1, sep - 1) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(string.sub(holder, sep + 1))
  end
  return false
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
return token
"""
# Give the lock up if this owner holds it (a stopping worker's successor need not wait it out).
_RELEASE = """
local holder = redis.call('GET', KEYS[1])
if holder then
  local sep = string.find(holder, '|', 1, true)
  if string.sub(holder, 1, sep - 1) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
  end
end
return 0
"""


@dataclass(frozen=True)
class Unacked:
    """A message a worker took and has not acknowledged."""

    tag: str
    queue: str
    payload: bytes


@dataclass(frozen=True)
class Stranded:
    """A message unacknowledged since ``since`` (seconds since the epoch, when a worker took
    it): its task's name and its job's record id, when it is a ledger job's."""

    message: Unacked
    task: str | None
    record_id: str | None
    since: float


@dataclass(frozen=True)
class Continuity:
    """What tells that the broker still holds what it held: a marker the platform keeps in it
    (gone: a new broker, one restarted without its data, a wiped database) and the primary
    serving it (another one: a failover, whose new primary may lack the last writes)."""

    marker: str
    primary: str | None
    created: bool  # this read wrote the marker: the broker had none
    # The primary the fleet's previous look saw (recorded in the broker by whichever process
    # looked: the sweep lock moves between workers), None if none was recorded
    seen_primary: str | None = None


def data_lost(before: Continuity | None, now: Continuity) -> str | None:
    """Why the broker may have lost data since ``before`` (this process's previous look), or
    None. A marker this look had to write means the broker had none: a new broker (its first
    look costs one short sweep) or one that lost everything."""
    if now.created:
        return "its marker was missing (a new broker, a restart without its data, or a wipe)"
    if before is None:
        # This process's first look (it just took the sweep lock): the primary the fleet saw
        # last, as the broker recorded it. Without it, a failover during which the lock moved
        # to another worker (its holder could not renew it while the sentinels promoted a
        # replica) went unnoticed: the new sweeper had nothing to compare with, and the jobs
        # and workflow wakes the failover lost waited for the ordinary missing-message look
        # (30 s) or their checks (minutes) (tests/integration/test_sentinel_failover_matrix.py)
        if now.seen_primary and now.primary and now.seen_primary != now.primary:
            return (
                f"its primary moved from {now.seen_primary} to {now.primary} (a failover,"
                " before this process swept)"
            )
        return None
    if before.marker != now.marker:
        return "its marker changed (a restart without its data, or a wipe)"
    if before.primary and now.primary and before.primary != now.primary:
        return f"its primary moved from {before.primary} to {now.primary} (a failover)"
    return None


@dataclass(frozen=True)
class CopiesOwed:
    """Dead letters' queue copies a broker's data loss took, still to be made again: those of
    the deaths since ``since`` (every one within retention: None). ``token`` is how the broker
    holds it (what :meth:`BrokerView.copies_paid` compares)."""

    since: datetime | None
    token: str
    held: bool = False  # paid at every sweep until the hold lapses (see RedisBroker.owe_copies)

    @staticmethod
    def wider(a: datetime | None, b: datetime | None) -> datetime | None:
        """The window covering both (None: all)."""
        return None if a is None or b is None else min(a, b)


class Watch(enum.Enum):
    """Where a sweep stands in the watch after a failover (failover_watch.py)."""

    NONE = 0
    WATCHING = 1
    ENDED = 2  # (lapsed, its end not seen to yet: this sweep's look is the watch's last)


@dataclass(frozen=True)
class WatchState:
    """Where a sweep stands in the watch, and since when the records it looks at were touched
    (the jobs a stale primary took are recent: under a backlog, the oldest would hide them)."""

    phase: Watch
    since: datetime | None = None


NOT_WATCHING = WatchState(Watch.NONE)


class BrokerView(Protocol):
    """The reconciler's view of the broker (a fake one in unit tests)."""

    def unacked(self) -> dict[str, Unacked]:
        """Unacknowledged messages by the record id of their job."""

    def waiting(self) -> set[str]:
        """Record ids of the jobs whose message waits in a tier's queue or the delayed set."""

    def restore(self, message: Unacked) -> bool:
        """Put an unacknowledged message back on its queue; False if it was gone already."""

    def stranded(self, *, older_than_seconds: float, limit: int) -> list[Stranded]:
        """Messages unacknowledged for longer than that, oldest first (at most ``limit``)."""

    def depth(self) -> int:
        """Messages waiting in the tiers' queues and the delayed set."""

    def continuity(self) -> Continuity | None:
        """The broker's marker and primary now (None if it cannot be read)."""

    def owe_copies(self, since: datetime | None, hold_seconds: float) -> None:
        """Record that the dead letters' copies made since ``since`` (all: None) are owed,
        widening what is owed already, held for ``hold_seconds`` (paid again at each sweep
        meanwhile; 0: not held, and a hold under way dropped)."""

    def copies_owed(self) -> CopiesOwed | None:
        """The copies owed (by any process's sweep), or None."""

    def copies_paid(self, owed: CopiesOwed) -> None:
        """Forget ``owed``, unless a later loss changed it meanwhile."""

    def watch_after_failover(self, seconds: float, since: datetime) -> None:
        """Note, for every sweeper, that the jobs touched since ``since`` whose message is
        missing are looked for at each sweep for ``seconds`` (a failover's old primary may take
        writes it then drops), and once more after that (a watch under way: the wider one)."""

    def watch(self) -> WatchState:
        """Where a sweep stands in such a watch."""

    def watch_done(self) -> None:
        """Forget the watch's end (its last look made)."""


class RedisBroker:
    """:class:`BrokerView` over kombu's Redis transport and the delayed set."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        queues: Iterable[str],
        delayed_key: str,
        unacked_key: str = "unacked",
        unacked_index_key: str = "unacked_index",
        now: Callable[[], float] = time.time,
        marker_key: str = "ledger:broker-marker",
        primary: Callable[[], str] | None = None,
    ) -> None:
        self._client = client
        self._marker_key = marker_key
        self._primary_key = f"{marker_key}:primary"  # the primary the fleet's last look saw
        self._primary = primary
        # The broker's clock: the index's scores are the broker's (the transport books with it)
        self._now = now
        self._queues = tuple(queues)
        self._delayed_key = delayed_key
        self._unacked_key = unacked_key
        self._unacked_index_key = unacked_index_key
        self._restore = client.register_script(_RESTORE)
        self._owed_key = f"{marker_key}:copies-owed"
        self._held_key = f"{marker_key}:copies-owed:held"
        self._watch_key = f"{marker_key}:watch"
        self._watch_end_key = f"{marker_key}:watch:end"
        self._paid = client.register_script(_DELETE_IF_UNCHANGED)
        self._owe = client.register_script(_OWE)
        self._watch = client.register_script(_WATCH)

    def unacked(self) -> dict[str, Unacked]:
        found: dict[str, Unacked] = {}
        for tag, payload in self._client.hscan_iter(self._unacked_key, count=500):
            try:
                message, _exchange, routing_key = json.loads(payload)
                record_id = record_id_of(message["headers"])
            except (ValueError, KeyError, TypeError):
                continue
            if record_id is None:
                continue
            found[record_id] = Unacked(
                tag.decode() if isinstance(tag, bytes) else str(tag),
                str(routing_key),  # kombu names each queue's list after its routing key
                _restored_copy(message),
            )
        return found

    def waiting(self) -> set[str]:
        found: set[str] = set()
        # (a tenant's message waits in its lane until fed to the queue: fairness.py)
        # Lanes first: a message moves from its lane to its queue, never back (read the other
        # way, one moved between the reads would be seen in neither)
        lists = [name for queue in self._queues for name in queue_lists(queue)]
        for name in lane_lists(self._client, self._queues) + lists:
            for raw in self._client.lrange(name, 0, -1):
                try:
                    record_id = record_id_of(json.loads(raw)["headers"])
                except (ValueError, KeyError, TypeError):
                    continue
                if record_id is not None:
                    found.add(record_id)
        members = cast("list[bytes]", self._client.zrange(self._delayed_key, 0, -1))
        for member in members:
            try:
                entry = json.loads(member)
                if "raw" in entry:  # a message as the transport held it (parked, put off)
                    record_id = record_id_of(entry["raw"]["headers"])
                else:
                    options = entry["options"]
                    record_id = record_id_of(
                        {
                            **(options.get("headers") or {}),
                            "task": entry["task"],
                            "id": options["task_id"],
                        }
                    )
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            if record_id is not None:
                found.add(record_id)
        return found

    def stranded(self, *, older_than_seconds: float, limit: int) -> list[Stranded]:
        """kombu's index scores each unacknowledged message by the time a worker took it; the
        hash holds the message. One acknowledged between the two reads is passed over. Read a
        page at a time, up to ``limit`` oldest: long jobs' messages, unacknowledged for their
        whole run, stay first in the index and must not hide the newer ones behind them."""
        cutoff = self._now() - older_than_seconds
        found: list[Stranded] = []
        for start in range(0, limit, _PAGE):
            scored = cast(
                "list[tuple[bytes, float]]",
                self._client.zrangebyscore(
                    self._unacked_index_key, 0, cutoff, start=start, num=_PAGE, withscores=True
                ),
            )
            if not scored:
                break
            payloads = cast(
                "list[bytes | None]",
                self._client.hmget(self._unacked_key, [t for t, _ in scored]),
            )
            found += self._read_stranded(scored, payloads)
            if len(scored) < _PAGE:
                break
        return found

    @staticmethod
    def _read_stranded(
        scored: list[tuple[bytes, float]], payloads: list[bytes | None]
    ) -> list[Stranded]:
        found: list[Stranded] = []
        for (tag, since), payload in zip(scored, payloads, strict=True):
            if payload is None:
                continue
            try:
                message, _exchange, routing_key = json.loads(payload)
                message_headers = message["headers"]
                task = message_headers.get("task")
                # Only a message naming its job's key names its record for sure (the guard
                # may key one without it by its arguments)
                keyed = isinstance(message_headers, dict) and headers.KEY in message_headers
                record_id = record_id_of(message_headers) if keyed else None
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not a task message kombu could restore either: its own sweep's
            found.append(
                Stranded(
                    Unacked(tag.decode(), str(routing_key), _restored_copy(message)),
                    task if isinstance(task, str) else None,
                    record_id,
                    float(since),
                )
            )
        return found

    def depth(self) -> int:
        pipe = self._client.pipeline(transaction=False)
        for queue in self._queues:
            for name in queue_lists(queue):
                pipe.llen(name)
            pipe.get(waiting_key(queue))  # (its tenants' lanes)
        pipe.zcard(self._delayed_key)
        return sum(int(n or 0) for n in pipe.execute())

    def continuity(self) -> Continuity | None:
        mine = uuid.uuid4().hex
        try:
            # Never expires: its absence is the news (SET NX: the first look writes it)
            created = bool(self._client.set(self._marker_key, mine, nx=True))
            marker = mine if created else self._client.get(self._marker_key)
        except redis.ResponseError as exc:  # a full broker refuses the write: no news
            logger.debug("broker marker not written: %s", exc)
            return None
        if marker is None:  # wiped between the two commands: the next look writes it
            return None
        primary = seen = None
        if self._primary is not None:
            try:
                primary = self._primary()
                # (written on the primary it names: what a later look by any process compares)
                found = self._client.set(self._primary_key, primary, get=True)
                seen = found.decode() if isinstance(found, bytes) else found
            except (redis.RedisError, OSError) as exc:  # the sentinels are away: no news
                logger.debug("broker primary not read: %s", exc)
        return Continuity(
            marker if isinstance(marker, str) else bytes(marker).decode(),
            primary,
            created,
            seen if isinstance(seen, str) else None,
        )

    # The copies owed are kept in the broker, not in the sweeper's memory: the sweep lock may
    # move to another worker (this one stopped, or could not renew it) before the copies are
    # made, and a loss is noticed only once (by the sweep that compares the marker).
    def owe_copies(self, since: datetime | None, hold_seconds: float) -> None:
        """(A failover's old primary may take writes for a while after the fleet noticed the
        new one: from clients still connected to it, until the sentinels make it a replica,
        which drops them. Copies made meanwhile are owed as well: the note is held, and paid
        again at each sweep, until ``hold_seconds`` have passed.)"""
        at = "all" if since is None else repr(since.timestamp())
        hold_ms = max(int(hold_seconds * 1000), 0)
        self._owe(keys=[self._owed_key, self._held_key], args=[at, uuid.uuid4().hex, hold_ms])

    def copies_owed(self) -> CopiesOwed | None:
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self._owed_key)
        pipe.exists(self._held_key)
        found, held = pipe.execute()
        if found is None:
            return None
        token = found.decode() if isinstance(found, bytes) else str(found)
        at, _, _ = token.partition("|")
        try:
            since = None if at == "all" else datetime.fromtimestamp(float(at), UTC)
        except (ValueError, OverflowError, OSError):  # not this module's: owe everything
            since = None
        return CopiesOwed(since, token, held=bool(held))

    def copies_paid(self, owed: CopiesOwed) -> None:
        self._paid(keys=[self._owed_key], args=[owed.token])

    # (In the broker, as the copies owed: the sweep lock may move to another worker meanwhile.
    # A wipe of the primary ends a watch under way; the wipe's own notice starts another.)
    def watch_after_failover(self, seconds: float, since: datetime) -> None:
        ms = max(int(seconds * 1000), 1)
        args = [int(since.timestamp()), ms, WATCH_END_KEPT_SECONDS]
        self._watch(keys=[self._watch_key, self._watch_end_key], args=args)

    def watch(self) -> WatchState:
        pipe = self._client.pipeline(transaction=False)
        pipe.exists(self._watch_key)
        pipe.get(self._watch_end_key)
        watching, end = pipe.execute()
        if end is None:  # (a watch without its end's note: not this module's, moot)
            return NOT_WATCHING
        try:
            since = datetime.fromtimestamp(int(end), UTC)
        except (ValueError, OverflowError, OSError):  # not this module's: the whole window
            since = None
        return WatchState(Watch.WATCHING if watching else Watch.ENDED, since)

    def watch_done(self) -> None:
        self._client.delete(self._watch_end_key)

    def restore(self, message: Unacked) -> bool:
        return bool(
            self._restore(
                keys=[self._unacked_key, self._unacked_index_key],
                args=[message.tag, message.queue, message.payload],
            )
        )


def _restored_copy(message: dict[str, Any]) -> bytes:
    """The payload that puts ``message`` back on its queue, marked redelivered as kombu marks
    the copies it restores itself: in its headers and its delivery info. The mark is what tells
    the claim that the job's record may exist (the message's ``ledger_new`` property says the
    publish wrote none): without it the claim tries the insert first, and a record that exists
    costs it up to two writes more. A signature does not cover it (it binds the headers in
    signing.BOUND_HEADERS), as it does not cover the mark kombu adds."""
    message_headers, properties = message.get("headers"), message.get("properties")
    if isinstance(message_headers, dict):
        message_headers["redelivered"] = True
    info = properties.get("delivery_info") if isinstance(properties, dict) else None
    if isinstance(info, dict):
        info["redelivered"] = True
    return json.dumps(message).encode()


def oldest_ages(client: redis.Redis, queues: Iterable[str], now: float) -> dict[str, float | None]:
    """Seconds the oldest message of each queue has waited since it was published (None: the
    queue is empty, or its oldest message does not say when it was sent). kombu pushes on the
    left and takes from the right, so the oldest is the last element."""
    ages: dict[str, float | None] = {}
    for queue in queues:
        raw = client.lindex(queue, -1)
        ages[queue] = None
        if raw is None:
            continue
        try:
            found = json.loads(raw).get("headers") or {}
        except (ValueError, AttributeError):
            continue
        sent = float_or_none(found.get(headers.SENT_AT)) or float_or_none(
            found.get(headers.ENQUEUED_AT)
        )
        if sent is not None:
            ages[queue] = max(now - sent, 0.0)
    return ages


def record_id_of(message_headers: Any) -> str | None:
    """The record id of the job a message's headers name (as the guard derives it), or None.

    A message without a ``ledger_key`` header is identified by its own id here; the guard may
    key it by its arguments instead, in which case the reconciler only sees it as not waiting.
    """
    if not isinstance(message_headers, dict):
        return None
    task, ident = message_headers.get("task"), message_headers.get("id")
    if not isinstance(task, str) or not isinstance(ident, str):
        return None
    return identity_of(task, ident, key_header=message_headers.get(headers.KEY)).record_id


class SweepLock:
    """One sweeper at a time across the fleet: a lease in Redis with a fencing token.

    Its holder renews it at every sweep; a holder that dies stops renewing, and the lease ends
    after ``ttl_seconds``, when another worker takes it with a higher token.
    """

    def __init__(self, client: redis.Redis, key: str, *, ttl_seconds: float) -> None:
        self._key = key
        self._ttl_ms = max(int(ttl_seconds * 1000), 1000)
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)
        self._client = client

    def acquire(self) -> int | None:
        """This process's fencing token if it holds (or now took) the lock, else None."""
        token = self._acquire(
            keys=[self._key, f"{self._key}:token"], args=[self.owner, self._ttl_ms]
        )
        return None if token is None else int(token)

    def release(self) -> bool:
        """Give the lock up if this process holds it; whether it did."""
        return bool(self._release(keys=[self._key], args=[self.owner]))

    def holds(self, token: int) -> bool:
        """Whether this process still holds the lock with ``token``."""
        value = self._client.get(self._key)
        text = value.decode() if isinstance(value, bytes) else value
        return text == f"{self.owner}|{token}"
