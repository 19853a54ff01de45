"""Jobs published while the ledger was away: kept in the broker until their record is written.

With dedupe on publish a job's ``queued`` record is written before its message is sent, and
that record is what brings the job back if its message is lost before its first claim (kombu's
Redis transport pops a message and books it as taken in two round trips: a worker killed, or a
connection reset, between the two drops it; see the reconciler's look for missing messages).
A producer that finds the ledger away publishes anyway (a publish is a broker write, and the
claim runs the job once), so such a job had no record, and a message lost in that window was
lost for good: nothing knew the job existed.

So the producer keeps each such job here, in one Redis hash of the app's namespace
(``<namespace>:ledger:unrecorded``: record id -> the job's queued record, as kombu's JSON),
written before its message is sent (and kept if the send fails, as a record would be). The
fleet's reconciler (one sweeper at a time) writes those records once the ledger answers, as the
publish would have (an insert of a record not known: a job whose claim wrote its record
meanwhile, or that has ended, is left as it is), and only then removes the entries. From there
on the job is an ordinary recorded job: a message that is nowhere in the broker is published
again from the record. An entry older than the results' retention is dropped unwritten (its job
may have ended and its record expired: a record written then would run it again).

Why the broker: it is the one server the publish is known to reach (the message goes there
next). A broker that loses its data loses these entries with the messages, as it loses any
job's message; only the ledger's records outlive that, and these jobs had none yet. So where the
broker fails over (Sentinel, or a managed Redis: ``LEDGER_BROKER_CONFIRM_REPLICAS``), an entry
is not enough until a replica holds it: Redis replicates after it answers, and a failover
promotes a replica that may never have received the primary's last writes (or leaves a stalled
old primary taking writes until it is demoted and drops them). The entry's write is followed by
``WAIT`` on the same connection (through Sentinel, then one question to the sentinels: a
replica of an old primary they replaced, not moved yet, confirms in vain), and a publish whose
entry no replica confirms in time is refused before its message is sent (the caller publishes
again; the key runs it once).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import redis

from .errors import LedgerUnavailable, NotReplicated, StoreError
from .headers import SIGNATURE
from .ledger.message import KeptMessage
from .ledger.store import ENQUEUE_BATCH, EnqueueOutcome, QueuedJob
from .signing import Signer
from .wire import dumps, loads

logger = logging.getLogger("celery_ledger.unrecorded")

# How long one sweep writes records (bulk writes of ENQUEUE_BATCH, about 1,000 a second on the
# embedded server); the rest are the next sweep's. Well within the sweep lock's time to live.
RECORD_BUDGET_SECONDS = 10.0
# Pages of the notes beside the entries (see Unrecorded.aside) one sweep tidies at most
TIDY_PAGES = 20

EnqueueMany = Callable[[Sequence[QueuedJob]], list[EnqueueOutcome]]


def unrecorded_key(namespace: str) -> str:
    """The Redis hash of the jobs published without their record (per app namespace)."""
    return f"{namespace}:ledger:unrecorded" if namespace else "ledger:unrecorded"


class UnknownSigningKey(ValueError):
    """An entry signed with a key this process does not hold (another worker of the fleet may:
    a key added by a deploy under way)."""


def _signed(scope: str, record_id: str, fields: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """What an entry's signature covers, as (headers, body) for :class:`Signer`: what it is,
    where it is kept (its app's hash: an entry moved to another app's is refused), its record
    id (moved to another id: refused) and the whole entry but its signature."""
    return {"task": fields.get("task")}, ["unrecorded", scope, record_id, fields]


def encode(job: QueuedJob, kept_at: float, signer: Signer | None = None, scope: str = "") -> str:
    """An entry's value: the job's record as :class:`QueuedJob` holds it, and when it was kept
    (the broker's time); signed when ``signer`` signs."""
    fields = job.arguments()
    fields["message"] = job.message.document()
    fields["kept_at"] = kept_at
    if signer is not None and signer.enabled:
        fields["sig"] = signer.sign(*_signed(scope, job.record_id, fields))
    return dumps(fields)


def decode(
    record_id: str, raw: bytes | str, signer: Signer | None = None, scope: str = ""
) -> tuple[QueuedJob, float]:
    """The job an entry keeps, and when it was kept. With ``signer`` holding keys, the entry
    must carry a good signature of one of them (whether or not signatures are required of
    messages yet: no release kept unsigned entries).

    Raises:
        UnknownSigningKey: signed with a key this process does not hold.
        ValueError: not an entry this module wrote, or not signed as it must be.
    """
    try:
        fields: Any = loads(raw)
        if not isinstance(fields, dict):
            raise ValueError("not an object")
        signature = fields.pop("sig", None)
        if signer is not None and signer.enabled:
            if signer.lacks_key({SIGNATURE: signature}):
                raise UnknownSigningKey(f"unrecorded entry {record_id!r}: {signature!r}")
            headers, body = _signed(scope, record_id, fields)
            problem = signer.problem({**headers, SIGNATURE: signature}, body, strict=True)
            if problem is not None:
                raise ValueError(f"not signed as this fleet signs: {problem}")
        message = KeptMessage.from_document(fields["message"])
        if message is None or not all(
            isinstance(fields.get(name), str) for name in ("task", "key", "tier")
        ):
            raise ValueError("missing fields")
        claimable_at = fields.get("claimable_at")
        if claimable_at is not None and not isinstance(claimable_at, datetime):
            raise ValueError(f"claimable_at {claimable_at!r}")
        job = QueuedJob(
            record_id,
            task=fields["task"],
            key=fields["key"],
            tier=fields["tier"],
            message=message,
            objective=fields.get("objective") or None,
            claimable_at=claimable_at,
        )
        return job, float(fields["kept_at"])
    except UnknownSigningKey:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"unrecorded entry {record_id!r} is not a job's record: {exc}") from exc


class Unrecorded:
    """The jobs of one app namespace published without their record (see the module
    docstring). ``client``: the app's Redis client (the broker)."""

    def __init__(
        self,
        client: Any,
        *,
        namespace: str,
        now: Callable[[], float] = time.time,
        retention_seconds: float = float("inf"),
        signer: Signer | None = None,
        unverified_seconds: float = float("inf"),
        confirm_replicas: int = 0,
        confirm_seconds: float = 1.0,
        primary_moved: Callable[[], bool] | None = None,
    ) -> None:
        self._client = client
        # How many replicas must hold an entry before its publish goes on, and how long for
        self._confirm = confirm_replicas
        self._confirm_ms = max(1, round(confirm_seconds * 1000))  # (WAIT 0 waits for ever)
        self._moved = primary_moved  # (through Sentinel: sentinel.primary_moved)
        self._signer = signer
        self.key = unrecorded_key(namespace)
        # When each entry signed with a key this worker lacks was first seen so: the entry's own
        # times cannot be trusted before its signature is checked
        self.aside = f"{self.key}:unverified"
        self._now = now  # the broker's clock
        # How long the ledger keeps an ended job's record (the shortest of its kinds)
        self._retention = retention_seconds
        # How long such an entry waits for a worker that holds its key (a deploy adding it)
        self._unverified = unverified_seconds

    def keep(self, jobs: Sequence[QueuedJob]) -> bool:
        """Keep these jobs until their records are written (one round trip, the replicas'
        confirmation in it). An entry stays if the publish then fails, as a record written at
        publish stays (marked unpublished): the caller may not know whether the message went
        out, and the job's claim and a retried publish dedupe it.

        With no replica to confirm (one server), False if the broker refused (logged: the jobs
        are then published as before, without a record: the publish that follows says whether
        the broker is away).

        Raises:
            NotReplicated: replicas to confirm, and fewer than asked confirmed that they hold
                the entries (or the broker could not be asked): the messages must not be sent.
        """
        if not jobs:
            return True
        acked, moved, failure = self._confirm, False, None
        try:
            now = self._now()
            mapping = {job.record_id: encode(job, now, self._signer, self.key) for job in jobs}
            if not self._confirm:
                self._client.hset(self.key, mapping=mapping)
            else:  # (WAIT counts the writes of its own connection: one pipeline, no MULTI)
                with self._client.pipeline(transaction=False) as pipe:
                    pipe.hset(self.key, mapping=mapping)
                    pipe.execute_command("WAIT", self._confirm, self._confirm_ms)
                    acked = int(pipe.execute()[-1])
                # A confirmation by the replica of an old primary the sentinels have replaced
                # (one they have not moved yet) is lost with it: asked once confirmed
                moved = acked >= self._confirm and self._moved is not None and self._moved()
        except Exception as exc:
            if not self._confirm:
                logger.warning(
                    "could not keep %d jobs published without their records: %s", len(jobs), exc
                )
                return False
            acked, failure = 0, exc
        if acked < self._confirm or moved:
            # (one replica's confirmation is no proof against every failover: the sentinels
            # promote the replica furthest along, which is the one that confirmed unless it is
            # out of their reach; the wait makes a loss that needs two faults at once)
            if failure is not None:
                why = f"the broker could not be asked to keep them ({failure!r})"
            elif moved:
                why = "the sentinels name another primary than the one that kept them"
            else:
                why = (
                    f"{acked} of the {self._confirm} replica(s) asked confirmed them within"
                    f" {self._confirm_ms} ms (a failover under way, or replicas behind)"
                )
            raise NotReplicated(
                f"not published: the ledger is away, so {len(jobs)} job(s) ({jobs[0].task},"
                f" {jobs[0].record_id}...) have only the broker to keep them, and {why}: publish"
                " again, the same key runs once (if the broker kept them after all, they may"
                " run without it)"
            ) from failure
        return True

    def count(self) -> int:
        """Entries waiting for their record."""
        return int(self._client.hlen(self.key))

    def record(
        self,
        enqueue_many: EnqueueMany,
        *,
        budget_seconds: float = RECORD_BUDGET_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> int:
        """Write the records of waiting jobs (``enqueue_many``: the ledger's bulk enqueue) and
        drop their entries, for up to ``budget_seconds``; returns how many were written or
        found known.

        An entry kept longer ago than the ledger keeps an ended job's record is dropped
        unwritten: its job may have run and its record expired since, and a record
        written now would run it again. One the ledger refuses (a batch that fails whole is
        written again one job at a time) is dropped with an error: its job still runs from
        its message, as before this store existed.

        Raises what ``enqueue_many`` raises when the ledger is away (``LedgerUnavailable``),
        and what the Redis client raises: entries are dropped only after their batch is
        written, so a failed sweep leaves them for the next."""
        done = 0
        kept_since = self._now() - self._retention
        deadline = monotonic() + budget_seconds
        cursor = 0
        while monotonic() < deadline:
            cursor, found = self._client.hscan(self.key, cursor, count=ENQUEUE_BATCH)
            batch: list[QueuedJob] = []
            dropped: list[Any] = []
            for field, raw in found.items():
                record_id = field.decode() if isinstance(field, bytes) else str(field)
                try:
                    job, kept_at = decode(record_id, raw, self._signer, self.key)
                except UnknownSigningKey as exc:  # left for a worker that holds the key...
                    if self._waited(field) <= self._unverified:
                        logger.warning("leaving %s: this worker lacks its signing key", exc)
                        continue
                    # ...for as long as a deploy adding it takes, then dropped as unverifiable
                    logger.error("dropping %s: no worker has verified it since it was seen", exc)
                    dropped.append(field)
                    continue
                except ValueError as exc:
                    logger.error("dropping %s", exc)
                    dropped.append(field)
                    continue
                if kept_at < kept_since:
                    logger.error(
                        "dropping the record of %s (%s), kept while the ledger was away longer"
                        " ago than the results are retained: its job may have run already",
                        record_id,
                        job.task,
                    )
                    dropped.append(field)
                    continue
                batch.append(job)
            for start in range(0, len(batch), ENQUEUE_BATCH):
                part = batch[start : start + ENQUEUE_BATCH]
                self._write(enqueue_many, part)
                # Only the entries as read: a publish of the same job since (the ledger away
                # again) kept the same record, which the next sweep finds known.
                self._client.hdel(self.key, *(job.record_id for job in part))
                done += len(part)
            if dropped:
                self._client.hdel(self.key, *dropped)
            if cursor == 0:
                break
        self._tidy_aside()
        return done

    def _waited(self, field: Any) -> float:
        """Seconds since the entry ``field`` was first found signed with an unknown key (0 if
        that cannot be noted: a broker full to its memory limit refuses the note, and the
        entries it can verify are recorded all the same)."""
        now = self._now()
        try:
            if self._client.hsetnx(self.aside, field, repr(now)):
                return 0.0
            return now - float(self._client.hget(self.aside, field))
        except redis.ResponseError as exc:
            logger.warning("could not note an unverified entry's first sight: %s", exc)
            return 0.0
        except (TypeError, ValueError):  # (not a time this wrote: from now on, then)
            with contextlib.suppress(redis.ResponseError):
                self._client.hset(self.aside, field, repr(now))
            return 0.0

    def _tidy_aside(self) -> None:
        """Forget when entries no longer kept (written or dropped since, by this worker or
        another) were first seen unverified; one ``HLEN`` when there are none. (The sweep lock
        holder sweeps: an entry is judged by the workers that hold it in turn.)"""
        if not self._client.hlen(self.aside):
            return
        cursor = 0
        for _ in range(TIDY_PAGES):
            cursor, seen = self._client.hscan(self.aside, cursor, count=ENQUEUE_BATCH)
            gone = [field for field in seen if not self._client.hexists(self.key, field)]
            if gone:
                self._client.hdel(self.aside, *gone)
            if cursor == 0:
                return

    @staticmethod
    def _write(enqueue_many: EnqueueMany, jobs: list[QueuedJob]) -> None:
        try:
            enqueue_many(jobs)
        except LedgerUnavailable:
            raise
        except StoreError:
            for job in jobs:  # one refused record must not hold the others back forever
                try:
                    enqueue_many([job])
                except LedgerUnavailable:
                    raise
                except StoreError as exc:
                    logger.error("dropping the record of %s (%s): %s", job.record_id, job.task, exc)
