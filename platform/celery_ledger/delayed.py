"""Delayed deliveries held durably in Redis instead of as ETA messages in worker memory.

Why not Celery's ETA/countdown messages: with the Redis transport a worker holds an ETA message
unacknowledged in memory until it is due. Past the visibility timeout the broker delivers it
again, it can be lost when the worker restarts, and it occupies the worker's prefetch. Here a
delayed message is a member of one sorted set, scored by its due time, so a delay of hours costs
no worker memory and survives any restart (with the broker's AOF).

Each worker's housekeeping thread runs :class:`DelayedPublisher`. A Lua script hands out
due entries atomically, pushing their score forward by a hand-out lease, so one publisher at a
time holds an entry; the publisher publishes the message, then removes the entry. A publisher
that dies in between leaves the entry to be handed out again when that lease ends: delivery is
at least once, and the ledger turns a repeat into a suppressed duplicate.

With ``LEDGER_SIGNING_KEYS`` an entry is signed by the process that schedules it, and the
publisher checks it before it publishes (and so signs) the message: a writer to the broker who
adds or changes an entry must not get a task run by a worker's signature. An entry that fails
the check is kept as a dead letter with its reason, never published.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import redis

from . import tracecontext
from .crypto import Sealer
from .errors import ConfigurationError, PublishError, StoreError
from .headers import SIGNATURE
from .reseal import Reseal, Tally, reseal_tree, resealed_queue_item
from .sentinel import RedisTarget, redis_client
from .signing import Signer
from .wire import dumps, loads

# KEYS[1] = the sorted set; ARGV = now ("" for the server's clock), hand-out lease seconds,
# batch limit. Due is judged on the broker's clock, whichever worker's clock is off: scores are
# the broker's times (producers stamp with ``Runtime.message_time``).
_TAKE_DUE = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
local hold_until = now + tonumber(ARGV[2])
for _, member in ipairs(due) do
  redis.call('ZADD', KEYS[1], 'XX', hold_until, member)
end
return due
"""

# KEYS[1] = the sorted set, KEYS[2] = the index of parked messages (celery_ledger.handoff);
# ARGV = the member as read, the member to put in its place (same score), the parked entry's id
# ("" for an entry that is not parked: its index entry names the new member).
_REPLACE = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return 0 end
redis.call('ZADD', KEYS[1], score, ARGV[2])
redis.call('ZREM', KEYS[1], ARGV[1])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[2], ARGV[3], ARGV[2]) end
return 1
"""

# KEYS[1] = the sorted set, KEYS[2] = the index of parked messages, KEYS[3] = the queue;
# ARGV = the member, the message to push, the parked entry's id ("" if not parked). A held raw
# message back on its queue, out of the set, and out of the index if it was parked: one step.
_PUSH_BACK = """
redis.call('LPUSH', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[1], ARGV[1])
if ARGV[3] ~= '' then redis.call('HDEL', KEYS[2], ARGV[3]) end
return 1
"""


class DelayedDeliveries:
    """The sorted set of delayed messages, shared by every producer and worker of an app."""

    def __init__(
        self,
        redis_url: str | RedisTarget,
        *,
        key: str = "celery_ledger:delayed",
        handout_seconds: float = 30.0,
        signer: Signer | None = None,
        parked_key: str = "celery_ledger:parked",
    ) -> None:
        self.key = key
        self.parked_key = parked_key  # the index of the parked among these (the handoff)
        self.handout_seconds = handout_seconds
        self._signer = signer
        self._redis = redis_client(redis_url, socket_timeout=10, socket_connect_timeout=5)
        self._take_due = self._redis.register_script(_TAKE_DUE)
        self._replace = self._redis.register_script(_REPLACE)
        self._push_back = self._redis.register_script(_PUSH_BACK)

    def schedule(
        self,
        task_name: str,
        args: Any,
        kwargs: Any,
        options: dict[str, Any],
        due_at: float,
        *,
        sealer: Sealer | None = None,
    ) -> None:
        """Hold a message until ``due_at`` (unix seconds on the broker's clock:
        ``Runtime.message_time``); ``options`` go to ``send_task``.

        With ``sealer`` (a sensitive task) the set holds the arguments sealed, as the body
        the codec would send: ``[args, kwargs, {}]``.
        """
        if tracecontext.enabled():
            # Published later by a thread with no span current: the message carries the span
            # that scheduled it (a retry's is the failed attempt), or its trace would fork.
            options = {**options, "headers": dict(options.get("headers") or {})}
            tracecontext.stamp(options["headers"])
        envelope: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "task": task_name,
            "options": options,
        }
        if sealer is None:
            envelope.update(args=args, kwargs=kwargs)
        else:
            try:
                envelope["sealed"] = sealer.seal(dumps([args, kwargs, {}]))
            except TypeError as exc:
                raise PublishError(f"cannot delay {task_name}: {exc}") from exc
        try:
            self._sign(envelope)
            member = dumps(envelope)
        except TypeError as exc:
            raise PublishError(
                f"cannot delay {task_name}: options are not serialisable: {exc}"
            ) from exc
        try:
            self._redis.zadd(self.key, {member: due_at})
        except redis.RedisError as exc:
            raise PublishError(f"cannot delay {task_name}: broker unavailable: {exc}") from exc

    def push_back(self, member: bytes, envelope: dict[str, Any]) -> None:
        """Put a held raw message back on its queue (kombu's Redis transport: LPUSH) and take
        its entry out of the set, and out of the index of parked messages if it is one."""
        keys = [self.key, self.parked_key, envelope["queue"]]
        self._push_back(keys=keys, args=[member, dumps(envelope["raw"]), _parked_id(envelope)])

    def take_due(self, *, limit: int = 100, now: float | None = None) -> list[tuple[bytes, Any]]:
        """Hand out up to ``limit`` due entries to this caller (see the module docstring):
        each as (member, its decoded JSON, or None if it is not JSON). Due by the broker's
        clock unless ``now`` is given."""
        members = self._take_due(
            keys=[self.key], args=["" if now is None else now, self.handout_seconds, limit]
        )
        return [(member, _decoded(member)) for member in members]

    def done(self, member: bytes) -> None:
        self._redis.zrem(self.key, member)

    def reseal(self, reseal: Reseal, *, apply: bool) -> Tally:
        """Seal the held entries' sealed arguments (and sealed raw messages) again with the
        newest key (``apply``), or count the ones that need it. An entry is replaced under its
        score only if it is still there: one published meanwhile is gone, and one a publisher
        holds is published from the old copy and then again from the new (at least once: the
        ledger suppresses the repeat).

        Signatures rotate with it: an entry signed with an older signing key, or unsigned
        while signatures are not required yet, is signed again with the newest (and counted),
        so an old signing key can go once nothing is left to do here either (a timer or a
        countdown may wait in the set for days).

        Raises:
            ConfigurationError: a signed entry must be rewritten, and this process has no
                signing keys to sign it again (it would be refused when due).
        """
        tally = Tally()
        for member, _score in self._redis.zscan_iter(self.key, count=500):
            try:
                envelope = loads(member)
            except ValueError:
                continue  # not an entry this platform wrote; the publisher reports it
            if not isinstance(envelope, dict):
                continue
            new = dict(envelope)
            if isinstance(envelope.get("sealed"), str):
                new["sealed"] = reseal_tree(envelope["sealed"], reseal, tally)
            if "raw" in envelope:
                new["raw"] = resealed_queue_item(envelope["raw"], reseal, tally)
            changed = any(
                new[name] is not envelope[name] for name in ("sealed", "raw") if name in new
            )
            if "task" in envelope and self._resign_needed(envelope, changed):
                if self._signer is None or not self._signer.enabled:
                    raise ConfigurationError(
                        "the delayed set holds signed entries to reseal: run it with"
                        " LEDGER_SIGNING_KEYS set, so they are signed again"
                    )
                if not changed:
                    tally.stale += 1  # only its signature is old
                changed = True
                self._sign(new)
            replaced = (
                changed
                and apply
                and self._replace(
                    keys=[self.key, self.parked_key], args=[member, dumps(new), _parked_id(new)]
                )
            )
            tally.changed_meanwhile += int(changed and apply and not replaced)
        return tally

    def pending(self) -> int:
        return int(self._redis.zcard(self.key))

    def _resign_needed(self, envelope: dict[str, Any], changed: bool) -> bool:
        """Whether a task entry must be signed again: its content changed under a signature,
        or it is signed with an older key, or unsigned while signatures are not required."""
        signer = self._signer
        signature = envelope.get("sig")
        if changed:
            return signature is not None or bool(signer and signer.enabled and not signer.required)
        if signer is None or not signer.enabled:
            return False
        if signature is None:
            return not signer.required  # once required, an unsigned entry is refused when due
        return Signer.key_id_of(signature) != signer.newest_key_id

    def _sign(self, envelope: dict[str, Any]) -> None:
        """Sign a task entry in place (``sig``), if this process signs."""
        if self._signer is not None and self._signer.enabled:
            envelope.pop("sig", None)
            envelope["sig"] = self._signer.sign(*_signed(envelope))

    def entry_problem(self, envelope: dict[str, Any]) -> str | None:
        """Why a held task entry must not be published (unsigned where signatures are required,
        or badly signed), or None."""
        if self._signer is None:
            return None
        found = dict(envelope)
        signature = found.pop("sig", None)
        headers, body = _signed(found)
        problem = self._signer.problem({**headers, SIGNATURE: signature}, body)
        return None if problem is None else f"delayed entry: {problem}"

    def close(self) -> None:
        self._redis.close()


def _parked_id(envelope: dict[str, Any]) -> str:
    """The id a parked entry has in the index of parked messages, or "" (not parked)."""
    if isinstance(envelope.get("parked"), dict) and isinstance(envelope.get("id"), str):
        return str(envelope["id"])
    return ""


def _decoded(member: bytes) -> Any:
    try:
        return loads(member)
    except ValueError:
        return None


def entry_shape_problem(envelope: Any) -> str | None:
    """Why a held member is not an entry this platform writes, or None: one entry a writer to
    the broker (or a bug) made unreadable must not hold back the others handed out with it."""
    if not isinstance(envelope, dict):
        return "unreadable delayed entry (not a JSON object)"
    if "raw" in envelope:
        ok = isinstance(envelope.get("raw"), dict) and isinstance(envelope.get("queue"), str)
        return None if ok else "unreadable delayed entry (a raw message without its queue)"
    if not isinstance(envelope.get("task"), str) or not isinstance(envelope.get("options"), dict):
        return "unreadable delayed entry (no task name or options)"
    if "sealed" in envelope:
        return None if isinstance(envelope["sealed"], str) else "unreadable delayed entry"
    if not isinstance(envelope.get("args"), list) or not isinstance(envelope.get("kwargs"), dict):
        return "unreadable delayed entry (no arguments)"
    return None


def _signed(envelope: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """What an entry's signature covers, as (headers, body) for :class:`Signer`: the whole
    entry but its signature (its id, task, options, and arguments, sealed or not)."""
    return {"task": envelope.get("task")}, ["delayed", envelope]


Publish = Callable[[str, Any, Any, dict[str, Any]], None]
# Keeps an entry that must not be published as a dead letter: (task, options, raw text, reason);
# the raw text is the body the codec would send (still sealed), or the entry itself.
KeepUnopenable = Callable[[str, dict[str, Any], str, str], None]


class DelayedPublisher:
    """Publishes due delayed messages (run periodically by the worker's housekeeping thread)."""

    def __init__(
        self,
        deliveries: DelayedDeliveries,
        publish: Publish,
        *,
        sealer: Sealer | None = None,
        keep_unopenable: KeepUnopenable | None = None,
    ) -> None:
        self._deliveries = deliveries
        self._publish = publish
        self._sealer = sealer
        self._keep_unopenable = keep_unopenable

    def publish_due(self) -> int:
        """Publish every due entry; returns how many were published."""
        published = 0
        while True:
            batch = self._deliveries.take_due()
            for member, envelope in batch:
                refused = entry_shape_problem(envelope)
                if refused is None and "raw" not in envelope:
                    refused = self._deliveries.entry_problem(envelope)
                if refused is not None:
                    if not self._keep(envelope, member, refused):
                        continue  # left in the set: its hand-out lease brings it back
                elif "raw" in envelope:
                    # A message as the transport held it: its own signature is checked when a
                    # worker consumes it, so this entry vouches for nothing.
                    self._deliveries.push_back(member, envelope)
                    published += 1
                    continue  # (out of the set already)
                elif "sealed" in envelope:
                    if not self._publish_sealed(envelope):
                        continue  # left in the set: its hand-out lease brings it back
                else:
                    self._publish(
                        envelope["task"], envelope["args"], envelope["kwargs"], envelope["options"]
                    )
                self._deliveries.done(member)
                published += 1
            if len(batch) < 100:
                return published

    def _keep(self, envelope: Any, member: bytes, reason: str) -> bool:
        """Keep a refused entry as a dead letter (its text as held); False if it cannot be."""
        if self._keep_unopenable is None:
            return False
        found = envelope if isinstance(envelope, dict) else {}
        task = found.get("task")
        options = found.get("options")
        self._keep_unopenable(
            task if isinstance(task, str) else "?",
            options if isinstance(options, dict) else {},
            member.decode("utf-8", "replace"),
            reason,
        )
        return True

    def _publish_sealed(self, envelope: dict[str, Any]) -> bool:
        """Publish a sensitive task's entry (the codec seals it again); one whose arguments
        no key here opens is kept as a poison message with its reason, never retried in a
        loop. False: it could not be kept either (it stays in the set)."""
        task, options, sealed = envelope["task"], envelope["options"], envelope["sealed"]
        try:
            if self._sealer is None:
                raise StoreError("no LEDGER_ENCRYPTION_KEYS here to open it")
            args, kwargs, _embed = loads(self._sealer.open(sealed))
        except StoreError as exc:
            if self._keep_unopenable is None:
                return False
            self._keep_unopenable(task, options, sealed, f"sealed delayed message: {exc}")
            return True
        self._publish(task, args, kwargs, options)
        return True
