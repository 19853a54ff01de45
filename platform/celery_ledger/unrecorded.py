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
written before its message is sent and dropped again if the send fails. The fleet's reconciler
(one sweeper at a time) writes those records once the ledger answers, exactly as the publish
would have (an insert of a record not known: a job whose claim wrote its record meanwhile, or
that has ended, is left as it is), and only then removes the entries. From there on the job is
an ordinary recorded job: a message that is nowhere in the broker is published again from the
record.

Why the broker: it is the one server the publish is known to reach (the message goes there
next). A broker that loses its data loses these entries with the messages, as it loses any
job's message; only the ledger's records outlive that, and these jobs had none yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from .ledger.message import KeptMessage
from .ledger.store import ENQUEUE_BATCH, EnqueueOutcome, QueuedJob
from .wire import dumps, loads

logger = logging.getLogger("celery_ledger.unrecorded")

# Entries one sweep records at most (in bulk writes of ENQUEUE_BATCH); the rest are the next's.
RECORD_PER_SWEEP = 2_000

EnqueueMany = Callable[[Sequence[QueuedJob]], list[EnqueueOutcome]]


def unrecorded_key(namespace: str) -> str:
    """The Redis hash of the jobs published without their record (per app namespace)."""
    return f"{namespace}:ledger:unrecorded" if namespace else "ledger:unrecorded"


def encode(job: QueuedJob) -> str:
    """An entry's value: the job's record as :class:`QueuedJob` holds it."""
    fields = job.arguments()
    fields["message"] = job.message.document()
    return dumps(fields)


def decode(record_id: str, raw: bytes | str) -> QueuedJob:
    """The job an entry keeps.

    Raises:
        ValueError: not an entry this module wrote.
    """
    try:
        fields: Any = loads(raw)
        message = KeptMessage.from_document(fields["message"])
        if message is None or not all(
            isinstance(fields.get(name), str) for name in ("task", "key", "tier")
        ):
            raise ValueError("missing fields")
        return QueuedJob(
            record_id,
            task=fields["task"],
            key=fields["key"],
            tier=fields["tier"],
            message=message,
            objective=fields.get("objective") or None,
            claimable_at=fields.get("claimable_at"),
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"unrecorded entry {record_id!r} is not a job's record: {exc}") from exc


class Unrecorded:
    """The jobs of one app namespace published without their record (see the module
    docstring). ``client``: the app's Redis client (the broker)."""

    def __init__(self, client: Any, *, namespace: str) -> None:
        self._client = client
        self.key = unrecorded_key(namespace)

    def keep(self, jobs: Sequence[QueuedJob]) -> bool:
        """Keep these jobs until their records are written (one round trip); False if the
        broker refused (logged: the jobs are then published as before, without a record)."""
        if not jobs:
            return True
        try:
            self._client.hset(self.key, mapping={job.record_id: encode(job) for job in jobs})
        except Exception as exc:  # the publish that follows says whether the broker is away
            logger.warning(
                "could not keep %d jobs published without their records: %s", len(jobs), exc
            )
            return False
        return True

    def forget(self, record_ids: Sequence[str]) -> None:
        """Drop the entries of jobs whose publish failed (the caller was told it failed: the
        job must not run from here). Never raises: an entry left is a job recorded and, its
        message absent, published again, which the caller's retry of the publish dedupes."""
        if not record_ids:
            return
        try:
            self._client.hdel(self.key, *record_ids)
        except Exception as exc:
            logger.warning("could not drop %d unrecorded entries: %s", len(record_ids), exc)

    def count(self) -> int:
        """Entries waiting for their record."""
        return int(self._client.hlen(self.key))

    def record(self, enqueue_many: EnqueueMany, *, limit: int = RECORD_PER_SWEEP) -> int:
        """Write the records of up to ``limit`` waiting jobs (``enqueue_many``: the ledger's
        bulk enqueue) and drop their entries; returns how many were written or found known.

        Raises what ``enqueue_many`` and the Redis client raise (the ledger or the broker
        away): entries are dropped only after their batch is written, so a failed sweep leaves
        them for the next."""
        done = 0
        cursor = 0
        while done < limit:
            cursor, found = self._client.hscan(self.key, cursor, count=ENQUEUE_BATCH)
            batch: list[QueuedJob] = []
            bad: list[Any] = []
            for field, raw in found.items():
                record_id = field.decode() if isinstance(field, bytes) else str(field)
                try:
                    batch.append(decode(record_id, raw))
                except ValueError as exc:
                    logger.error("dropping %s", exc)
                    bad.append(field)
            for start in range(0, len(batch), ENQUEUE_BATCH):
                part = batch[start : start + ENQUEUE_BATCH]
                enqueue_many(part)
                # Only the entries as read: a publish of the same job since (the ledger away
                # again) wrote the same record, which the next sweep finds known.
                self._client.hdel(self.key, *(job.record_id for job in part))
                done += len(part)
            if bad:
                self._client.hdel(self.key, *bad)
            if cursor == 0:
                break
        return done
