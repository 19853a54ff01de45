"""The MongoDB ledger store: the only code that reads or writes the ledger's collections.

Op shapes are chosen for both real MongoDB and SecantusDB: every write is an ``update``
filtered on ``_id`` or an ``insert`` (never ``findAndModify``, which scans the whole collection
on SecantusDB), and a read happens only on the rare paths.

A claim is one write on the common path (a claim that succeeds):

1. the claim itself: an upsert on ``_id`` that matches only while the record is claimable
   (``claimable_at <= now``), names the same job (task and key) and its fencing token is older
   than ours. It inserts a new record, or takes a queued, retrying or lease-expired one. When the
   record exists but is not claimable, the upsert collides with it on ``_id`` (duplicate key),
   which is the signal. A message whose own id is not the record's (an alias) writes its alias
   document in the same unordered bulk write.
   A message that says it is its job's first publish with no record written for it
   (``new``: see ``Delivery.first_publish``) is claimed by a plain insert of the record the
   upsert would have made: on a new record that is the same document, and the cheapest write
   a server has (no filter to evaluate, no update to apply: on the embedded server the upsert
   claim costs 1.16x-1.20x the CPU per job, ``ops.bench.indexes``). If a record exists after all (a
   client's duplicate publish), the insert collides on ``_id`` and changes nothing; then the
   marker below, and only if that does not match either, the conditional upsert: a wrong hint
   costs up to two writes (on a claimable record: the insert and the marker), never a wrong
   claim.
2. only when the claim did not match, a duplicate marker: ``$inc duplicates`` on the same
   ``_id`` if it already ``succeeded`` (a suppressed duplicate: two operations).

Only a record held by a live lease or a dead record needs a third operation (a read) to say why.

Claims and the writes that end an attempt go through :class:`GroupCommit`: when several tasks of
one process (a threads or gevent pool) write at once, their updates share one unordered bulk
write, so one journal flush; a process running one task at a time sends each at once.

Fencing tokens are nanosecond timestamps: known to the claimer without a read, and the claim
filter (``fence < token``) guarantees they only grow. A claimer whose clock lags falls back to
``stored token + 1``.

Writes that end a holder's attempt (completion, retry, release, death) carry an operation id,
kept among the record's last few (``ops``): when a write's reply is lost and the write is
repeated, the repeat recognises the first one as its own instead of mistaking it for a lost
lease, even once a newer claim has taken the job over.

A dead job is written by one method, :meth:`Ledger.bury`, for every way a job can die.
"""

from __future__ import annotations

from .base import LedgerBase
from .claims import Claims
from .core import (  # the names this module always held
    AUDIT_INDEXES,
    CACHE_RETENTION,
    COPY_DUE_SHIFT,
    COPY_GRACE,
    DUPLICATE_KEY,
    ENDED_AS_WRITTEN,
    EPOCH,
    FOREVER,
    INDEX_NOT_FOUND,
    LEGACY_INDEXES,
    OBJECTIVE_PAGE,
    RECENT_OPS,
    UNPUBLISHED,
    UNPUBLISHED_SCAN,
    BuryMatch,
    Claim,
    ClaimOutcome,
    EnqueueOutcome,
    Fenced,
    HeldBy,
    QueuedJob,
    RecordState,
    Unchanged,
    Unclaimed,
    _on_one_record,
    new_op,
    translate_errors,
    utcnow,
)
from .dead_records import DeadRecords
from .indexes import Indexes
from .last_good import LastGood
from .long_jobs import LongJobs
from .objectives import Objectives, objective
from .publishing import ENQUEUE_BATCH, Publishing
from .resealing import Resealing
from .results import Results
from .views import Views

__all__ = [
    "AUDIT_INDEXES",
    "CACHE_RETENTION",
    "COPY_DUE_SHIFT",
    "COPY_GRACE",
    "DUPLICATE_KEY",
    "ENDED_AS_WRITTEN",
    "ENQUEUE_BATCH",
    "EPOCH",
    "FOREVER",
    "INDEX_NOT_FOUND",
    "LEGACY_INDEXES",
    "OBJECTIVE_PAGE",
    "RECENT_OPS",
    "UNPUBLISHED",
    "UNPUBLISHED_SCAN",
    "BuryMatch",
    "Claim",
    "ClaimOutcome",
    "EnqueueOutcome",
    "Fenced",
    "HeldBy",
    "Ledger",
    "LedgerBase",
    "QueuedJob",
    "RecordState",
    "Unchanged",
    "Unclaimed",
    "_on_one_record",
    "new_op",
    "objective",
    "translate_errors",
    "utcnow",
]


class Ledger(
    Claims,
    Objectives,
    LastGood,
    LongJobs,
    Publishing,
    Resealing,
    Views,
    Results,
    DeadRecords,
    Indexes,
):
    """The ledger of one app: a MongoDB collection of :class:`LedgerRecord` documents, plus
    its groups and audit collections (``<collection>_groups``, ``<collection>_audit``).

    Safe to share across threads; a forked process opens its own connection pool.
    ``clock`` (UTC now) is injectable for tests of the protocol.
    """
