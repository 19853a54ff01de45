"""The dead-letter flow: quarantine what cannot succeed, announce it, triage and replay it.

The ledger is the source of truth: a dead job is its record in state ``dead`` with the reason,
an error fingerprint, the error history and its kept message. Each new dead letter is announced
once: a log line, a copy on the dead letters' queue (for consumers that want a stream), and the
observers' ``dead`` event (metrics, Sentry).

Poison messages that never reached a task body (undecodable bytes, a malformed envelope, an
invalid task message, a refused content type) are caught in the worker's transport and consumer,
which only push them to a Redis list (no ledger I/O in the event loop); each worker's
housekeeping thread moves them into the ledger (:meth:`DeadLetters.drain_poison`). A poison
message of a known job is recorded under that job's identity, so a late copy of it never runs
and its replay runs the job at most once; storing an entry is idempotent, so two workers
draining the same entry make one record and one announcement.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from . import headers
from .errors import LedgerError, LedgerUnavailable, StoreError
from .events import Job
from .keys import identity_of
from .ledger.dead import DeadJob, DeadLetter, Death
from .ledger.message import KeptMessage, UnreplayableMessage
from .ledger.record import State
from .ledger.store import Unclaimed
from .untrusted import storable, storable_value

if TYPE_CHECKING:
    from .runtime import Runtime

logger = logging.getLogger("celery_ledger.deadletter")

PublishRaw = Callable[[str, dict[str, Any], dict[str, Any]], None]


def poison_key(app_name: str) -> str:
    """The Redis list of poison messages waiting to be recorded (per app)."""
    return f"{app_name}:ledger:poison"


@dataclass(frozen=True)
class ReplayOutcome:
    record_id: str
    replayed: bool
    detail: str


class DeadLetters:
    """Quarantine, announcement, triage and replay of an app's dead jobs."""

    def __init__(self, runtime: Runtime, publish_raw: PublishRaw) -> None:
        self._runtime = runtime
        self._ledger = runtime.ledger
        self._publish_raw = publish_raw
        self.poison_key = poison_key(runtime.name)

    # -- announcing ------------------------------------------------------------------------------

    def announce_record(self, record_id: str, *, job: Job | None = None) -> None:
        """Announce the dead record ``record_id`` (never raises: observing never fails a job)."""
        try:
            record = self._ledger.find_raw(record_id)
        except LedgerError as exc:
            logger.warning("could not read dead letter %s to announce it: %s", record_id, exc)
            return
        if record is not None:
            self.announce(DeadLetter.of_record(record), job=job)

    def announce(self, letter: DeadLetter, *, job: Job | None = None) -> None:
        """Log a new dead letter, copy it to the dead letters' queue, tell the observers."""
        logger.error(
            "dead-lettered %s [%s] key=%s: %s (fingerprint %s: %s)",
            letter.task,
            letter.record_id,
            letter.key,
            letter.reason,
            letter.fingerprint,
            letter.fingerprint_text,
        )
        copied = self._copy(letter)
        try:  # done; or due now, for the workers' housekeeping (copy_pending)
            self._ledger.mark_copy_pending(letter.record_id, not copied)
        except LedgerError as exc:  # it falls due by itself (COPY_GRACE)
            logger.warning("could not note the copy of %s: %s", letter.record_id, exc)
        job = job or Job(str(letter.task), letter.tier, letter.record_id, letter.key)
        self._runtime.observers.dead(job, letter)

    def _copy(self, letter: DeadLetter) -> bool:
        """Publish the dead letter's copy to the dead letters' queue; False if it failed."""
        queue = self._runtime.tiers.dead_letter_queue
        try:
            self._publish_raw(queue, letter.as_json(), {"ledger_dead_reason": letter.reason or ""})
        except Exception:
            logger.warning(
                "could not copy dead letter %s to the %s queue yet (the ledger has it)",
                letter.record_id,
                queue,
                exc_info=True,
            )
            return False
        # The queue is a feed of the newest deaths (the ledger keeps every dead record):
        # capped, so that a burst of deaths nobody consumes cannot fill the broker's memory.
        # kombu's Redis transport pushes on the left and consumes from the right.
        try:
            self._runtime.redis.ltrim(queue, 0, self._runtime.settings.dead_letter_queue_max - 1)
        except Exception as exc:  # the next copy trims it
            logger.warning("could not trim the %s queue: %s", queue, exc)
        return True

    def copy_pending(self, limit: int = 100) -> int:
        """Publish the queue copies that could not be published when their job died (run by
        each worker's housekeeping); returns how many were published."""
        published = 0
        for doc in self._ledger.copies_pending(limit=limit):
            if not self._copy(DeadLetter.of_record(doc)):
                break  # the broker is still away: the next tick tries again
            self._ledger.mark_copy_pending(doc["_id"], False)
            published += 1
        return published

    # -- quarantine --------------------------------------------------------------------------------

    def push_poison(
        self,
        *,
        queue: str,
        reason: str,
        raw: bytes,
        kind: str = "body",
        message_headers: Any = None,
    ) -> None:
        """Keep a poison message in Redis (cheap, from the consumer's event loop)."""
        entry = {
            "queue": queue,
            "reason": reason,
            "at": time.time(),
            "raw_base64": base64.b64encode(raw).decode(),
            "raw_kind": kind,
            "headers": _jsonable(message_headers),
        }
        self._runtime.redis.lpush(self.poison_key, json.dumps(entry))

    def drain_poison(self, limit: int = 100) -> int:
        """Move poison messages from Redis into the ledger as dead records; returns how many.

        The oldest entry is read, stored (idempotently) and only then removed, so a worker that
        dies in between leaves it for the next drain; only a ledger outage leaves it waiting.
        """
        moved = 0
        redis = self._runtime.redis
        for _ in range(limit):
            raw_entry = redis.lindex(self.poison_key, -1)
            if raw_entry is None:
                break
            record_id, inserted = self._store_poison(raw_entry)
            redis.lrem(self.poison_key, -1, raw_entry)  # type: ignore[arg-type]
            if inserted:
                self.announce_record(record_id)
            moved += 1
        return moved

    def _store_poison(self, raw_entry: bytes | str) -> tuple[str, bool]:
        """Record one poison entry dead; returns (record id, whether this call recorded it).

        An entry the ledger cannot hold as it is, or that is not one of ours, is stored
        sanitized instead (as its bytes, or, when even those are too large, as its size and
        digest), so that it never blocks the entries behind it.
        """
        try:
            entry = json.loads(raw_entry)
            if not isinstance(entry, dict):
                raise ValueError("not a JSON object")
            return self._bury_poison(entry)
        except LedgerUnavailable:
            raise
        except (ValueError, TypeError, KeyError, OverflowError, StoreError) as exc:
            logger.warning("poison entry stored sanitized: %s: %s", type(exc).__name__, exc)
            data = raw_entry.encode() if isinstance(raw_entry, str) else raw_entry
            sanitized = {
                "queue": "",
                "reason": f"unreadable poison entry (kept sanitized, {type(exc).__name__})",
                "raw_base64": base64.b64encode(data).decode(),
                "raw_kind": "entry",
            }
            try:
                return self._bury_poison(sanitized)
            except StoreError as again:  # too large even so: its size and digest, not its bytes
                digest = hashlib.sha256(data).hexdigest()
                logger.error(
                    "poison entry of %d bytes kept without its bytes: %s", len(data), again
                )
                return self._bury_poison(
                    {
                        "queue": "",
                        "reason": f"unstorable poison entry ({len(data)} bytes, sha256 {digest}),"
                        " kept without its bytes",
                        "raw_base64": "",
                        "raw_kind": "entry",
                    }
                )

    def _bury_poison(self, entry: dict[str, Any]) -> tuple[str, bool]:
        found = entry.get("headers")
        found = found if isinstance(found, dict) else {}
        task, ident = found.get("task"), found.get("id")
        reason = storable(str(entry.get("reason") or "poison message"))
        queue = _str(entry.get("queue"))
        raw_b64 = _str(entry.get("raw_base64"))
        raw = base64.b64decode(raw_b64)
        kind = entry.get("raw_kind")
        message = KeptMessage.of_raw(
            raw,
            kind=kind if kind in ("envelope", "entry") else "body",
            queue=queue,
            message_headers=found,
        )
        tiers = self._runtime.tiers
        alias = None
        if (
            isinstance(task, str)
            and task
            and isinstance(ident, str)
            and ident
            and _utf8(task + ident)
        ):
            identity = identity_of(task, ident, key_header=found.get(headers.KEY))
            record_id, key, alias = identity.record_id, identity.key, identity.alias
            tier = self._runtime.tier_of(task) or tiers.tier_of_queue(queue) or tiers.default
        else:  # no usable identity: one record per distinct entry
            task = storable(str(task)) if isinstance(task, str) and task else "(unknown)"
            digest = hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()
            record_id = key = f"poison-{digest[:32]}"
            tier = tiers.tier_of_queue(queue) or tiers.default
        death: Death = "unknown-task" if reason.startswith("unknown task") else "poison"
        dead = DeadJob.of_reason(death, reason, task=task, message=message)
        if alias is not None:  # the message's own id finds the job (AsyncResult, dlq show)
            self._ledger.alias(alias, record_id=record_id, task=task, key=key)
        inserted = self._ledger.bury(
            record_id, dead, match=Unclaimed(), task=task, key=key, tier=tier
        )
        return record_id, inserted

    # -- triage ----------------------------------------------------------------------------------

    def find(
        self,
        *,
        task: str | None = None,
        reason: str | None = None,
        since: datetime | None = None,
        limit: int = 1000,
    ) -> list[dict[str, Any]]:
        """Dead records (not purged), newest first, filtered by task, reason (substring), time
        (every filter before the limit)."""
        return self._ledger.find_dead(task=task, since=since, reason=reason, limit=limit)

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
        """A record by id (or a message id that is an alias of one), or a dead record by key."""
        doc = self._ledger.resolve(ident)
        if doc is not None:
            return doc
        return self._ledger.find_dead_by_key(ident, task=task)

    # -- replay and purge ------------------------------------------------------------------------

    def replay(
        self, doc: dict[str, Any], *, dry_run: bool = False, actor: str = ""
    ) -> ReplayOutcome:
        """Publish a dead job again under its own identity, attempts reset: it runs once."""
        record_id = doc["_id"]
        if doc.get("state") != State.DEAD.value:
            return ReplayOutcome(
                record_id, False, f"not dead (state {doc.get('state')}): nothing to do"
            )
        if doc.get("purged_at"):
            return ReplayOutcome(record_id, False, "purged: its message is no longer kept")
        if doc.get("death") == "workflow":
            return ReplayOutcome(
                record_id,
                False,
                f"a workflow ({doc.get('workflow_status')}): run it again with"
                f" `ledger workflows retry {record_id}`",
            )
        message = KeptMessage.from_document(doc.get("message"))
        if message is None or not message.replayable:
            return ReplayOutcome(record_id, False, "no original message kept: cannot replay")
        task = str(doc.get("task"))
        task_tier = self._runtime.tier_of(task)
        if task_tier is None:
            return ReplayOutcome(record_id, False, f"task {task} is not registered here")
        # A poison message's queue is what the message said of itself: route by the task.
        tier = task_tier if doc.get("death") in ("poison", "unknown-task") else doc.get("tier")
        tier = tier if tier in self._runtime.tiers.names else task_tier
        try:
            message.arguments(self._runtime.sealer)
        except (UnreplayableMessage, StoreError, ValueError) as exc:
            return ReplayOutcome(record_id, False, f"cannot rebuild the arguments: {exc}")
        if dry_run:
            return ReplayOutcome(record_id, True, f"would replay to {tier} (dry run)")
        reopened = self._ledger.reopen(record_id, actor=actor)
        if reopened is None:
            return ReplayOutcome(record_id, False, "no longer dead: nothing to do")
        try:
            message.republish(
                self._runtime.publish,
                self._runtime.sealer,
                task=task,
                record_id=record_id,
                key=str(doc.get("key")),
                tier=tier,
            )
        except Exception as exc:
            self._ledger.undo_reopen(record_id, reopened)
            return ReplayOutcome(record_id, False, f"publish failed, left dead: {exc}")
        return ReplayOutcome(record_id, True, f"replayed to {tier}")

    def purge(self, docs: Iterable[dict[str, Any]], *, actor: str = "") -> int:
        """Drop dead records from triage. Each stays as a tombstone until its retention ends,
        so a late copy of the job still cannot run; its message and errors are deleted."""
        ids = [d["_id"] for d in docs if d.get("state") == State.DEAD.value]
        if not ids:
            return 0
        purged = self._ledger.purge(ids, actor=actor)
        logger.warning("purged %d dead records (by %s)", purged, actor or "?")
        return purged


def _jsonable(value: Any) -> Any:
    return None if value is None else storable_value(json.loads(json.dumps(value, default=str)))


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return "\x00" not in text
