"""The dead-letter flow: quarantine what cannot succeed, then triage and replay it.

The ledger is the source of truth: a dead job is its record in state ``dead`` with the reason,
an error fingerprint, the full error history and the original message (arguments and headers).
A copy of each dead letter is also published to the ``dead_letter`` queue, for consumers that
want a stream of them.

Poison messages that never reached a task body (undecodable bytes, unknown task, invalid
headers, refused content type) are caught in the worker's consumer, which only pushes them to a
Redis list (no ledger I/O in the event loop); the worker's background thread moves them into
the ledger as dead records (:meth:`DeadLetters.drain_poison`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
import traceback
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import redis
from bson.errors import InvalidDocument
from kombu.entity import Queue

from . import headers
from .errors import LedgerUnavailable, StoreError
from .ledger.record import State
from .ledger.store import EPOCH, FOREVER, Ledger, translate_errors, utcnow
from .routing import DEAD_LETTER_QUEUE

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger("celery_ledger.deadletter")

POISON_KEY = "celery_ledger:poison"

DeadLetterHook = Callable[[dict[str, Any]], None]


def fingerprint(exc: BaseException) -> tuple[str, str]:
    """(digest, text) of the exception type and the frame that raised it, to group failures."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].name}" if frames else "?"
    text = f"{type(exc).__module__}.{type(exc).__qualname__} at {where}"
    return hashlib.sha256(text.encode()).hexdigest()[:12], text


def reason_fingerprint(reason: str, task: str) -> tuple[str, str]:
    """A fingerprint for dead letters without an exception (poison messages)."""
    text = _storable(f"{reason.split(':', 1)[0]} ({task})")
    return hashlib.sha256(text.encode()).hexdigest()[:12], text


@dataclass(frozen=True)
class ReplayOutcome:
    record_id: str
    replayed: bool
    detail: str


class DeadLetters:
    """Quarantine, triage and replay of an app's dead jobs."""

    def __init__(self, app: Celery, ledger: Ledger, redis_url: str) -> None:
        self._app = app
        self._ledger = ledger
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=5)
        self.hooks: list[DeadLetterHook] = []  # observability hangs Sentry and metrics here

    # -- quarantine ---------------------------------------------------------------------------

    def announce(self, entry: dict[str, Any]) -> None:
        """Log a new dead letter, publish its copy to the queue, call the hooks (never raises)."""
        logger.error(
            "dead-lettered %s [%s] key=%s: %s (fingerprint %s: %s)",
            entry.get("task"),
            entry.get("record_id"),
            entry.get("key"),
            entry.get("reason"),
            entry.get("fingerprint"),
            entry.get("fingerprint_text"),
        )
        try:
            with self._app.producer_or_acquire() as producer:
                producer.publish(
                    entry,
                    exchange="",
                    routing_key=DEAD_LETTER_QUEUE,
                    serializer="json",
                    declare=[Queue(DEAD_LETTER_QUEUE)],
                    retry=True,
                    headers={"ledger_dead_reason": entry.get("reason", "")},
                )
        except Exception:
            logger.warning(
                "could not copy dead letter %s to the %s queue (the ledger has it)",
                entry.get("record_id"),
                DEAD_LETTER_QUEUE,
                exc_info=True,
            )
        for hook in self.hooks:
            try:
                hook(entry)
            except Exception:
                logger.warning("dead-letter hook %r failed", hook, exc_info=True)

    def push_poison(
        self,
        *,
        queue: str,
        reason: str,
        raw: bytes,
        message_headers: Any = None,
        properties: Any = None,
    ) -> None:
        """Keep a poison message in Redis (cheap, from the consumer's event loop)."""
        entry = {
            "queue": queue,
            "reason": reason,
            "at": time.time(),
            "raw_base64": base64.b64encode(raw).decode(),
            "headers": _jsonable(message_headers),
            "properties": _jsonable(properties),
        }
        self._redis.lpush(POISON_KEY, json.dumps(entry))

    def drain_poison(self, limit: int = 100) -> int:
        """Move poison messages from Redis into the ledger as dead records; returns how many."""
        moved = 0
        for _ in range(limit):
            raw_entry = self._redis.lindex(POISON_KEY, -1)  # oldest; removed only once stored
            if raw_entry is None:
                break
            record = self._store_poison(raw_entry)
            self._redis.lrem(POISON_KEY, -1, raw_entry)  # type: ignore[arg-type]
            self.announce(_entry_of(record))
            moved += 1
        return moved

    def _store_poison(self, raw_entry: bytes | str) -> dict[str, Any]:
        """Store the dead record of a poison entry, and return it.

        An entry the ledger cannot hold as it is (BSON refuses a NUL in a key and integers past
        64 bits; or the entry is not one of ours) is stored sanitized instead, so that it never
        blocks the entries behind it. Only a transient ledger outage leaves it in the list.
        """
        try:
            record = self._poison_record(json.loads(raw_entry))
            self._insert_dead(record)
        except LedgerUnavailable:
            raise
        except (ValueError, TypeError, KeyError, OverflowError, InvalidDocument, StoreError) as exc:
            logger.warning("poison entry stored sanitized: %s: %s", type(exc).__name__, exc)
            record = self._sanitized_poison_record(raw_entry, exc)
            self._insert_dead(record)
        return record

    def _insert_dead(self, record: dict[str, Any]) -> None:
        with translate_errors("dead-letter insert"):
            self._ledger.collection.replace_one(
                {"_id": record["_id"], "state": State.DEAD.value}, record, upsert=True
            )

    def _sanitized_poison_record(self, raw_entry: bytes | str, exc: Exception) -> dict[str, Any]:
        """A poison record with only the entry's reason, queue, raw message and identity, and
        the whole entry (headers and properties included) as base64."""
        try:
            entry = json.loads(raw_entry)
        except ValueError:
            entry = None
        entry = entry if isinstance(entry, dict) else {}
        found = entry.get("headers")
        found = found if isinstance(found, dict) else {}
        identity = {
            name: found[name]
            for name in ("id", "task", headers.KEY)
            if isinstance(found.get(name), str) and "\x00" not in found[name]
        }
        reason = str(entry.get("reason") or "unreadable poison entry")
        raw = entry.get("raw_base64")
        record = self._poison_record(
            {
                "queue": str(entry.get("queue") or ""),
                "reason": f"{reason} (kept sanitized, {type(exc).__name__}: {exc})",
                "raw_base64": raw if isinstance(raw, str) else "",
                "headers": identity,
            }
        )
        data = raw_entry.encode() if isinstance(raw_entry, str) else raw_entry
        record["message"]["entry_base64"] = base64.b64encode(data).decode()
        return record

    def _poison_record(self, entry: dict[str, Any]) -> dict[str, Any]:
        message_headers = entry.get("headers") or {}
        message_headers = _jsonable(message_headers) or {}
        task = str(message_headers.get("task") or "(unknown)")
        message_id = str(message_headers.get("id") or "")
        now = utcnow()
        # A poison message gets its own record: it never shares an id with a live job.
        record_id = f"poison-{message_id or uuid.uuid4()}"
        digest, text = reason_fingerprint(entry["reason"], task)
        return {
            "_id": record_id,
            "v": 1,
            "task": task,
            "key": str(message_headers.get(headers.KEY) or record_id),
            "tier": _storable(entry.get("queue", "")),
            "state": State.DEAD.value,
            "attempts": 0,
            "fence": 0,
            "claimable_at": FOREVER,
            "created_at": now,
            "updated_at": now,
            "finished_at": now,
            "expires_at": now + self._ledger.dead_retention,
            "dead_reason": _storable(entry["reason"]),
            "fingerprint": digest,
            "fingerprint_text": text,
            "poison": True,
            "message": {
                "queue": entry.get("queue"),
                "headers": message_headers,
                "properties": _jsonable(entry.get("properties")),
                "raw_base64": entry["raw_base64"],
                "original_id": message_id,
            },
            "errors": [],
        }

    # -- triage ---------------------------------------------------------------------------------

    def find(
        self,
        *,
        task: str | None = None,
        reason: str | None = None,
        since: datetime | None = None,
        limit: int = 1000,
    ) -> list[dict[str, Any]]:
        """Dead records, newest first, filtered by task, reason (substring) and time."""
        query: dict[str, Any] = {"state": State.DEAD.value}
        if task:
            query["task"] = task
        if since:
            query["finished_at"] = {"$gte": since}
        with translate_errors("dead-letter query"):
            docs = list(self._ledger.collection.find(query).sort("finished_at", -1).limit(limit))
        if reason:
            docs = [d for d in docs if reason.lower() in str(d.get("dead_reason", "")).lower()]
        return docs

    @staticmethod
    def groups(docs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Dead records grouped by error fingerprint, biggest group first."""
        grouped: dict[str, dict[str, Any]] = {}
        for doc in docs:
            key = str(doc.get("fingerprint", "?"))
            group = grouped.setdefault(
                key,
                {
                    "fingerprint": key,
                    "fingerprint_text": doc.get("fingerprint_text", ""),
                    "count": 0,
                    "tasks": set(),
                    "reasons": set(),
                    "first": None,
                    "last": None,
                    "example": doc.get("key"),
                },
            )
            group["count"] += 1
            group["tasks"].add(doc.get("task"))
            group["reasons"].add(str(doc.get("dead_reason", "")).split(":", 1)[0])
            at = doc.get("finished_at")
            if at is not None:
                group["first"] = at if group["first"] is None else min(group["first"], at)
                group["last"] = at if group["last"] is None else max(group["last"], at)
        result = sorted(grouped.values(), key=lambda g: -g["count"])
        for group in result:
            group["tasks"], group["reasons"] = sorted(group["tasks"]), sorted(group["reasons"])
        return result

    def get(self, ident: str, *, task: str | None = None) -> dict[str, Any] | None:
        """A record by id, or by idempotency key (optionally of one task)."""
        doc = self._ledger.find_raw(ident)
        if doc is not None:
            return doc
        query: dict[str, Any] = {"state": State.DEAD.value, "key": ident}
        if task:
            query["task"] = task
        with translate_errors("dead-letter lookup"):
            return self._ledger.collection.find_one(query)

    # -- replay and purge ---------------------------------------------------------------------

    def replay(
        self, doc: dict[str, Any], *, dry_run: bool = False, actor: str = ""
    ) -> ReplayOutcome:
        """Republish a dead job to its tier with attempts reset and the same key (runs once)."""
        record_id = doc["_id"]
        if doc.get("state") != State.DEAD.value:
            return ReplayOutcome(
                record_id, False, f"not dead (state {doc.get('state')}): nothing to do"
            )
        message = doc.get("message") or {}
        if "args_json" not in message and not message.get("raw_base64"):
            return ReplayOutcome(record_id, False, "no original message kept: cannot replay")
        if doc.get("poison") and doc.get("task") not in self._app.tasks:
            return ReplayOutcome(record_id, False, f"task {doc.get('task')} is not registered here")
        if dry_run:
            return ReplayOutcome(record_id, True, "would replay (dry run)")
        now = utcnow()
        with translate_errors("replay"):
            reset = self._ledger.collection.update_one(
                {"_id": record_id, "state": State.DEAD.value},
                {
                    "$set": {
                        "state": State.QUEUED.value,
                        "attempts": 0,
                        "inflight": 0,
                        "claimable_at": EPOCH,
                        "updated_at": now,
                        "replayed_at": now,
                    },
                    "$unset": {"expires_at": "", "finished_at": ""},
                    "$inc": {"replays": 1},
                    "$push": {"audit": {"action": "replay", "by": actor, "at": now}},
                },
            )
        if reset.matched_count == 0:
            return ReplayOutcome(record_id, False, "no longer dead: nothing to do")
        try:
            self._publish_original(doc)
        except Exception as exc:
            with translate_errors("replay rollback"):
                self._ledger.collection.update_one(
                    {"_id": record_id, "state": State.QUEUED.value},
                    {
                        "$set": {
                            "state": State.DEAD.value,
                            "claimable_at": FOREVER,
                            "finished_at": now,
                            "expires_at": now + self._ledger.dead_retention,
                        }
                    },
                )
            return ReplayOutcome(record_id, False, f"publish failed, left dead: {exc}")
        return ReplayOutcome(record_id, True, f"replayed to {doc.get('tier')}")

    def _publish_original(self, doc: dict[str, Any]) -> None:
        message = doc["message"]
        if "args_json" in message:
            opened = self._app.sealer.open
            args = json.loads(opened(message["args_json"]))
            kwargs = json.loads(opened(message["kwargs_json"]))
            message_headers = {headers.KEY: doc["key"], headers.TIER: doc.get("tier")}
            self._app.send_task(
                doc["task"],
                args,
                kwargs,
                task_id=doc["_id"],
                queue=doc.get("tier") or None,
                headers=message_headers,
            )
            return
        body = json.loads(base64.b64decode(message["raw_base64"]))  # poison of a known task
        args, kwargs = body[0], body[1]
        self._app.send_task(
            doc["task"],
            args,
            kwargs,
            task_id=doc["_id"],
            queue=message.get("queue") or None,
            headers={headers.KEY: doc["key"]},
        )

    def purge(self, docs: Iterable[dict[str, Any]], *, actor: str = "") -> int:
        """Delete dead records (they stop blocking nothing: a dead key never runs again anyway)."""
        ids = [d["_id"] for d in docs if d.get("state") == State.DEAD.value]
        if not ids:
            return 0
        with translate_errors("purge"):
            result = self._ledger.collection.delete_many({"_id": {"$in": ids}, "state": "dead"})
        logger.warning("purged %d dead records (by %s)", result.deleted_count, actor or "?")
        return int(result.deleted_count)


def dead_letter_fields(
    *, reason: str, digest: str, text: str, args: Any, kwargs: Any, message_headers: dict[str, Any]
) -> dict[str, Any]:
    """The fields a record gets when it dies (written with the failure, in one round trip)."""
    return {
        "dead_reason": reason,
        "fingerprint": digest,
        "fingerprint_text": text,
        "message": {
            "args_json": json.dumps(args),
            "kwargs_json": json.dumps(kwargs),
            "headers": _jsonable(message_headers),
        },
    }


def _entry_of(record: dict[str, Any]) -> dict[str, Any]:
    """The announcement of a dead record (what the queue copy and the hooks get)."""
    return {
        "record_id": record["_id"],
        "task": record.get("task"),
        "key": record.get("key"),
        "tier": record.get("tier"),
        "reason": record.get("dead_reason"),
        "fingerprint": record.get("fingerprint"),
        "fingerprint_text": record.get("fingerprint_text"),
        "message": _jsonable(record.get("message")),
        "errors": _jsonable(record.get("errors", [])),
        "at": datetime.now(UTC).isoformat(),
    }


def entry_of(record: dict[str, Any]) -> dict[str, Any]:
    return _entry_of(record)


def _jsonable(value: Any) -> Any:
    """``value`` as plain JSON types whose strings any BSON encoder accepts (raw messages can
    carry lone surrogates, which would make the ledger write fail)."""
    return None if value is None else _storable(json.loads(json.dumps(value, default=str)))


def _storable(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, list):
        return [_storable(item) for item in value]
    if isinstance(value, dict):
        return {_storable(key): _storable(item) for key, item in value.items()}
    return value
