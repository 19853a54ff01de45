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

Only a signature vouches for a message's headers. A poison message that fails it (unsigned
while signatures are required, badly signed, or unreadable so that it cannot be checked) is
never filed under the identity its headers claim: a dead record under a job's id refuses every
later delivery of that job, so anyone who can write to the broker could stop any job whose key
they can guess. It is filed under a digest of its bytes instead (``poison-<digest>``), with the
identity it claims kept as information only, and it is not replayed (which would sign it)
unless its signature checks by then or an operator forces it.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import itertools
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from . import dead_letter_feed as feed
from . import headers, wire
from .crypto import PREFIX
from .errors import LedgerError, LedgerUnavailable, StoreError
from .events import Job
from .identity import Identity, identity_of
from .ledger.dead import DeadJob, DeadLetter, Death
from .ledger.message import KeptMessage, UnreplayableMessage
from .ledger.ports import DeadLetterStore
from .ledger.record import State
from .ledger.store import Unclaimed
from .untrusted import storable, storable_value

if TYPE_CHECKING:
    from .crypto import Sealer
    from .runtime import Runtime

logger = logging.getLogger("celery_ledger.deadletter")

PublishRaw = Callable[[str, dict[str, Any], dict[str, Any]], None]

# Dead records read per ledger query when every match is wanted (a replay by filter).
PAGE_SIZE = 500


def poison_key(app_name: str) -> str:
    """The Redis list of poison messages waiting to be recorded (per app)."""
    return f"{app_name}:ledger:poison"


# Record ids of one purge go into its audit entry (one document): 20,000 ids stay far below
# MongoDB's 16 MB document limit.
PURGE_LIMIT = 20_000


def group_of(doc: Mapping[str, Any]) -> str:
    """The group a dead record is listed under: its error fingerprint ("?" for a record
    without one: a workflow's own, a plain Celery task's)."""
    return str(doc.get("fingerprint") or "?")


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since_of(value: str | None, now: Callable[[], datetime] | None = None) -> datetime | None:
    """A ``since`` filter: ``30m``, ``2h``, ``7d`` ago (from ``now``: the ledger's clock, which
    the records' times are on; this host's if not given), or an ISO time (UTC if naive).

    Raises:
        ValueError: neither.
    """
    if not value:
        return None
    match = _DURATION.match(value.strip())
    try:
        if match:
            ago = timedelta(seconds=float(match[1]) * _UNITS[match[2]])
            return (now() if now is not None else datetime.now(UTC)) - ago
        parsed = datetime.fromisoformat(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{value!r}: use 30m, 2h, 7d or an ISO time") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@dataclass(frozen=True)
class ReplayOutcome:
    record_id: str
    replayed: bool
    detail: str
    # published although its message failed authentication (``force_unsigned``)
    forced: bool = False


class DeadLetters:
    """Quarantine, announcement, triage and replay of an app's dead jobs."""

    def __init__(self, runtime: Runtime, publish_raw: PublishRaw) -> None:
        self._runtime = runtime
        self._ledger: DeadLetterStore = runtime.ledger
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
            self.announce(DeadLetter.of_record(record, now=self._runtime.ledger.now()), job=job)

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
            # Every worker's housekeeping reads the same due copies: one takes each
            if not self._ledger.take_copy(doc["_id"], doc["claimable_at"]):
                continue
            if not self._copy(DeadLetter.of_record(doc, now=self._runtime.ledger.now())):
                self._ledger.mark_copy_pending(doc["_id"], True)  # due again at once
                break  # the broker is still away: the next tick tries again
            self._ledger.mark_copy_pending(doc["_id"], False)
            published += 1
        return published

    def copy_again_after_loss(self, since: datetime | None = None) -> int:
        """After the broker lost data: make the queue copies it no longer holds due again
        (``copy_pending`` publishes them); returns how many (see dead_letter_feed.py).

        ``since``: only copies made since then (a failover loses only the last writes its
        replica had not received); None: every copy the queue would still hold (a broker that
        lost everything): this app's deaths within ``LEDGER_DEAD_RETENTION_SECONDS``, the
        newest ``LEDGER_DEAD_LETTER_QUEUE_MAX``. The broker cannot tell a copy it lost from
        one a consumer took before the loss: a consumer may see a death twice."""
        runtime = self._runtime
        queue, cap = runtime.tiers.dead_letter_queue, runtime.settings.dead_letter_queue_max
        oldest = self.ledger_now() - timedelta(seconds=runtime.settings.dead_retention_seconds)
        read_since = oldest if since is None else max(oldest, since - feed.COPY_LOOKBACK)
        # The records first, then the queue: a copy published and confirmed between the two
        # reads is then seen in the queue (read the other way, it was missing from the queue
        # and confirmed in its record: made twice)
        records = list(itertools.islice(self.each(since=read_since, page_size=feed.PAGE), cap))
        due = feed.lost(
            records,
            present=feed.held(runtime.redis, queue, cap),
            since=since,
            cap=cap,
            ours=lambda doc: (
                runtime.tiers.for_record(doc, runtime.tier_of(str(doc.get("task")))) is not None
            ),
        )
        return self._ledger.mark_copies_due(due) if due else 0

    # -- quarantine --------------------------------------------------------------------------------

    def push_poison(
        self,
        *,
        queue: str,
        reason: str,
        raw: bytes,
        kind: str = "body",
        message_headers: Any = None,
        final: bool = False,
    ) -> None:
        """Keep a poison message in Redis (cheap, from the event loop); ``final``: given up."""
        entry = {
            "queue": queue,
            "reason": reason,
            "at": self._runtime.message_time(),  # (the broker's clock)
            "raw_base64": base64.b64encode(raw).decode(),
            "raw_kind": kind,
            "headers": _jsonable(message_headers),
            **({"final": True} if final else {}),
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
        found: dict[str, Any] = entry["headers"] if isinstance(entry.get("headers"), dict) else {}
        task, ident = found.get("task"), found.get("id")
        reason = storable(str(entry.get("reason") or "poison message"))
        queue = _str(entry.get("queue"))
        raw = base64.b64decode(_str(entry.get("raw_base64")))
        kind = entry.get("raw_kind")
        message = KeptMessage.of_raw(
            raw,
            kind=kind if kind in ("envelope", "entry") else "body",
            queue=queue,
            message_headers=found,
        )
        tiers = self._runtime.tiers
        alias = None
        claimed = _claimed(task, ident, found.get(headers.KEY))
        distrust = None if claimed is None else self._authentication_problem(message)
        death: Death = "unknown-task" if reason.startswith("unknown task") else "poison"
        if claimed is not None and distrust is None:
            identity = identity_of(claimed["task"], claimed["id"], key_header=claimed["key"])
            record_id, key, alias = identity.record_id, identity.key, identity.alias
            task = identity.task
            tier = self._runtime.tier_of(task) or tiers.tier_of_queue(queue) or tiers.default
            dead = DeadJob.of_reason(death, reason, task=task, message=message)
        elif claimed is not None:
            # Filed under its own bytes: the identity it claims is information, not a record id.
            task = storable(claimed["task"])
            digest = hashlib.sha256(
                raw + json.dumps(message.document()["headers"], sort_keys=True).encode()
            ).hexdigest()
            record_id = key = f"poison-{digest[:32]}"
            tier = tiers.tier_of_queue(queue) or tiers.default
            dead = dataclasses.replace(
                DeadJob.of_reason(death, reason, task=task, message=message),
                unauthenticated=storable(distrust or ""),
                claimed=storable_value(claimed),
            )
        else:  # no usable identity: one record per distinct entry
            task = storable(str(task)) if isinstance(task, str) and task else "(unknown)"
            digest = hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()
            record_id = key = f"poison-{digest[:32]}"
            tier = tiers.tier_of_queue(queue) or tiers.default
            dead = DeadJob.of_reason(death, reason, task=task, message=message)
        if alias is not None:  # the message's own id finds the job (AsyncResult, dlq show)
            self._ledger.alias(alias, record_id=record_id, task=task, key=key)
        final = entry.get("final") is True and claimed is not None and distrust is None
        inserted = self._ledger.bury(
            record_id, dead, match=Unclaimed(kill_waiting=final), task=task, key=key, tier=tier
        )
        return record_id, inserted

    def _authentication_problem(self, message: KeptMessage, *, strict: bool = False) -> str | None:
        """Why the headers of a raw kept message cannot be trusted, or None.

        As a worker decides whether the message may run: without keys nothing is checked, and
        while unsigned messages are accepted (a rollout) an unsigned or unreadable one is taken
        as it is (stripping its signature would make it acceptable anyway). Otherwise its
        signature must check against its body, so a body that cannot be read (undecodable, or
        sealed with a key not listed here) leaves it unauthenticated. ``strict``: as if
        signatures were required here (for a message a worker that required them refused).
        """
        signer = self._runtime.signer
        if not signer.enabled:
            return None
        required = signer.required or strict
        found = message.headers
        if found.get(headers.SIGNATURE) is None and not required:
            return None
        try:
            body = _task_body(message, self._runtime.sealer)
        except Exception as exc:  # kombu's decoder can raise anything on hostile bytes
            if not required:
                return None
            return (
                f"its signature cannot be checked: its body cannot be read ({type(exc).__name__})"
            )
        return signer.problem(found, body, strict=strict)

    # -- triage ----------------------------------------------------------------------------------

    def find(
        self,
        *,
        task: str | None = None,
        reason: str | None = None,
        since: datetime | None = None,
        tenant: str | None = None,
        limit: int = 1000,
    ) -> list[dict[str, Any]]:
        """Dead records (not purged), newest first; every filter applies before the limit."""
        ledger = self._ledger
        return ledger.find_dead(task=task, since=since, reason=reason, tenant=tenant, limit=limit)

    def each(
        self,
        *,
        task: str | None = None,
        reason: str | None = None,
        since: datetime | None = None,
        tenant: str | None = None,
        page_size: int = PAGE_SIZE,
    ) -> Iterator[dict[str, Any]]:
        """Every dead record that matches (not purged), newest first, ``page_size`` per ledger
        query. Each page starts after the last record of the one before (by death time and
        id), so a record replayed or purged while the pages are read moves none of the others,
        and one that dies again meanwhile (now newer than the pages) is not read twice."""
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        after: tuple[Any, str] | None = None
        while True:
            page = self._ledger.find_dead(
                task=task, since=since, reason=reason, tenant=tenant, limit=page_size, after=after
            )
            yield from page
            if len(page) < page_size:
                return
            after = (page[-1].get("finished_at"), page[-1]["_id"])

    @staticmethod
    def groups(docs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Dead records grouped by error fingerprint, biggest group first."""
        grouped: dict[str, dict[str, Any]] = {}
        for doc in docs:
            key = group_of(doc)
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
        self,
        doc: dict[str, Any],
        *,
        dry_run: bool = False,
        actor: str = "",
        force_unsigned: bool = False,
    ) -> ReplayOutcome:
        """Publish a dead job again under its own identity, attempts reset: it runs once.

        The publish signs the message, so a message that failed authentication (see the module
        docstring) is replayed only if its signature checks now (its key was listed since) or
        with ``force_unsigned``, an operator's word for it. One that was filed under its own
        digest runs as the job it claims to be, and its quarantine record is purged.
        """
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
        target = _replay_identity(doc)
        task = target.task
        task_tier = self._runtime.tier_of(task)
        if task_tier is None:
            return ReplayOutcome(record_id, False, f"task {task} is not registered here")
        # A poison message's queue is what the message said of itself: route by the task.
        routed = doc.get("death") not in ("poison", "unknown-task")
        tier = self._runtime.tiers.of_record(doc.get("tier") if routed else None, task_tier)
        try:
            arguments = message.arguments(self._runtime.sealer)
        except StoreError as exc:  # UnreplayableMessage included
            return ReplayOutcome(record_id, False, f"cannot rebuild the arguments: {exc}")
        # Only a raw message can be unauthenticated: the other kept messages were built by a
        # worker from a delivery it had verified. One that a worker requiring signatures
        # refused needs a signature that checks, whatever this process accepts unsigned.
        strict = bool(doc.get("unauthenticated"))
        problem = (
            None
            if message.raw_base64 is None
            else self._authentication_problem(message, strict=strict)
        )
        if problem is not None and not force_unsigned:
            return ReplayOutcome(
                record_id,
                False,
                f"not replayed: its message failed authentication ({problem}), and a replay"
                " would sign it as it is; check it (`ledger dlq show`), then replay it with"
                " --force-unsigned if it is genuine",
            )
        forced = problem is not None
        elsewhere = target.record_id != record_id
        where = f"{tier} as job {target.record_id}" if elsewhere else tier
        if dry_run:
            return ReplayOutcome(record_id, True, f"would replay to {where} (dry run)", forced)
        if elsewhere:
            return self._replay_elsewhere(
                record_id, message, arguments, target, tier, actor, forced
            )
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
                arguments=arguments,
            )
        except Exception as exc:
            self._ledger.undo_reopen(record_id, reopened)
            return ReplayOutcome(record_id, False, f"publish failed, left dead: {exc}")
        if forced:
            logger.warning("%s replayed unauthenticated (by %s): %s", record_id, actor, problem)
        return ReplayOutcome(record_id, True, f"replayed to {tier}", forced)

    def _replay_elsewhere(
        self,
        record_id: str,
        message: KeptMessage,
        arguments: tuple[list[Any], dict[str, Any]],
        target: Identity,
        tier: str,
        actor: str,
        forced: bool,
    ) -> ReplayOutcome:
        """Replay a message kept under its own digest as the job it names, then purge the
        quarantine record (a tombstone, out of triage): the job's own record runs it once, and
        replaying the quarantine record again finds nothing to do."""
        try:
            message.republish(
                self._runtime.publish,
                self._runtime.sealer,
                task=target.task,
                record_id=target.record_id,
                key=target.key,
                tier=tier,
                arguments=arguments,
            )
        except Exception as exc:
            return ReplayOutcome(record_id, False, f"publish failed, left dead: {exc}")
        if forced:
            logger.warning(
                "%s replayed unauthenticated as job %s (by %s)", record_id, target.record_id, actor
            )
        detail = f"replayed to {tier} as job {target.record_id}; quarantine record purged"
        try:
            self._ledger.purge([record_id], actor=actor)
        except LedgerError as exc:  # replaying it again publishes a duplicate the ledger drops
            detail = f"replayed to {tier} as job {target.record_id}; not purged here: {exc}"
        return ReplayOutcome(record_id, True, detail, forced)

    def purge(self, docs: Iterable[dict[str, Any]], *, actor: str = "") -> int:
        """Drop dead records from triage (see :meth:`purge_ids`); returns how many."""
        return len(self.purge_ids(docs, actor=actor))

    def purge_ids(self, docs: Iterable[dict[str, Any]], *, actor: str = "") -> list[str]:
        """Drop dead records from triage. Each stays as a tombstone until its retention ends,
        so a late copy of the job still cannot run; its message and errors are deleted.

        Returns the ids of the records this call removed: one replayed (no longer dead) or
        purged by someone else since it was read is left as it is and not listed."""
        ids = [d["_id"] for d in docs if d.get("state") == State.DEAD.value]
        if not ids:
            return []
        purged = self._ledger.purge_dead(ids, actor=actor)
        logger.warning("purged %d dead records (by %s)", len(purged), actor or "?")
        try:
            self.drop_copies(purged)
        except Exception as exc:  # the copies then leave with their age (trim_copies)
            logger.warning("could not drop the queue copies of purged records: %s", exc)
        return purged

    # -- the queue copies' lifetime -----------------------------------------------------------
    # A copy never outlives its record: a purge drops the purged records' copies, and the
    # workers' housekeeping drops copies older than the dead records' retention (the ledger
    # has deleted their records by then). The queue is capped, so both scans are bounded.

    def drop_copies(self, record_ids: Iterable[str]) -> int:
        """Remove the queue copies of these records; returns how many."""
        return feed.drop(self._runtime.redis, self._runtime.tiers.dead_letter_queue, record_ids)

    def ledger_now(self) -> datetime:
        """Now on the ledger's clock (the dead records' times are on it)."""
        return self._runtime.ledger.now()

    def trim_copies(self, limit: int = 100) -> int:
        """Remove queue copies older than ``LEDGER_DEAD_RETENTION_SECONDS``, oldest first (at
        the tail, where the queue is consumed); returns how many."""
        runtime = self._runtime
        cutoff = runtime.ledger.now().timestamp() - runtime.settings.dead_retention_seconds
        return feed.trim(runtime.redis, runtime.tiers.dead_letter_queue, cutoff, limit)


def _replay_identity(doc: Mapping[str, Any]) -> Identity:
    """The job a dead record's replay runs as: the record's own, or, for a poison message kept
    under its digest, the job its headers name (or, naming none, a job keyed by the digest)."""
    record_id, task, key = str(doc["_id"]), str(doc.get("task")), str(doc.get("key"))
    claimed = doc.get("claimed")
    if isinstance(claimed, Mapping) and _claimed(claimed.get("task"), claimed.get("id"), None):
        return identity_of(str(claimed["task"]), str(claimed["id"]), key_header=claimed.get("key"))
    if record_id.startswith("poison-") and key == record_id:
        # The digest alone is not the id of a job of this task: it would be replayed into a
        # record no delivery claims, which the reconciler would then republish for ever.
        return identity_of(task, record_id, key_header=key)
    return Identity(task, key, record_id, record_id)


def _claimed(task: Any, ident: Any, key: Any) -> dict[str, Any] | None:
    """The identity a message's headers claim (task, message id, key header), if usable."""
    if not (isinstance(task, str) and task and isinstance(ident, str) and ident):
        return None
    if not _utf8(task + ident):
        return None
    return {"task": task, "id": ident, "key": key if isinstance(key, str) else None}


def _task_body(message: KeptMessage, sealer: Sealer) -> Any:
    """The decoded body of a raw kept message: what its signature covers (the worker's decode:
    kombu's JSON, opened first if sealed).

    Raises:
        Exception: the bytes are not a task body this app can read.
    """
    if message.raw_base64 is None or message.raw_kind not in ("body", "envelope"):
        raise UnreplayableMessage("no message body was kept")
    raw = base64.b64decode(message.raw_base64)
    if message.raw_kind == "envelope":  # the queue item as the transport stores it
        envelope = json.loads(raw)
        body = envelope["body"]
        if (envelope.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        raw = body if isinstance(body, bytes) else str(body).encode()
    if raw.startswith(PREFIX.encode()):  # a sensitive task's sealed body
        raw = sealer.open(raw.decode()).encode()
    return wire.loads(raw)


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
