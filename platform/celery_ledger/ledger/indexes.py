"""The ledger's indexes (made at start, retired by ``ledger finish-upgrade``) and the
retention sweep of servers without a TTL monitor.
"""

from __future__ import annotations

from typing import Any

from pymongo import ASCENDING, UpdateOne
from pymongo.collection import Collection
from pymongo.errors import (
    BulkWriteError,
    DuplicateKeyError,
    OperationFailure,
)

from ..errors import StoreError
from .base import LedgerBase
from .core import (
    AUDIT_INDEXES,
    COPY_DUE_SHIFT,
    INDEX_NOT_FOUND,
    LEGACY_INDEXES,
    SWEEP_INDEX,
    _objective_update,
    translate_errors,
)
from .record import State


class Indexes(LedgerBase):
    """The ledger's indexes and its retention sweep."""

    def ensure_indexes(self) -> None:
        """Create the retention index (TTL, or plain for :meth:`expire`) and the sweepers' index.

        Switching ``ttl_index`` drops the other kind first: MongoDB refuses two indexes on
        ``expires_at`` with different options.
        """
        wanted, other = ("retention", "retention_sweep")
        if not self.ttl_index:
            wanted, other = other, wanted
        groups, cache = self.companion("groups"), self.companion("cache")
        with translate_errors("index creation"):
            # A group's members expire with them; a last good result like a result.
            for collection in (self.collection, groups, cache):
                if other in collection.index_information():
                    collection.drop_index(other)
                if self.ttl_index:
                    collection.create_index("expires_at", expireAfterSeconds=0, name=wanted)
                else:
                    collection.create_index("expires_at", name=wanted)
            # Groups saved before they expired: from now on, like a result
            groups.update_many(
                {"expires_at": {"$exists": False}},
                {"$set": {"expires_at": self.now() + self.result_retention}},
            )
            # The records carry two secondary indexes and no more: on the embedded server every
            # write of every job pays for each index, whether or not it changes its key (about
            # 0.1-0.15 ms a write an index, sparse ones on a field no record has too: see
            # ops/bench/indexes.py). Whatever only some jobs need has its own companion
            # collection instead (``_objectives``), or rides this one (degraded results
            # awaiting their replacement: see replacements_due). A ledger made by an earlier
            # release keeps the indexes it made until finish_upgrade (LEGACY_INDEXES).
            # updated_at last: a sweep's "untouched since" is then a bound of the index, not a
            # filter over every record of the state (a backlog of 20,000 queued records cost
            # the reconciler's every sweep about 2 s of a scan with ``(state, claimable_at)``
            # alone, found empty, and on the embedded server held every other write that long).
            # Its reads use equalities and ``$lt`` on claimable_at: on the embedded server a
            # ``$lte`` there drops the records equal to its bound (see the store contract's
            # test of filter shapes)
            self.collection.create_index(
                [("state", ASCENDING), ("claimable_at", ASCENDING), ("updated_at", ASCENDING)],
                name=SWEEP_INDEX,
            )
            self._objectives.create_index("slo_at", name="due")
            self._retire_copy_due_index()
        self.ensure_audit_indexes(self.companion("audit"))

    def _retire_copy_due_index(self) -> None:
        """Dead records' pending queue copies had an index of their own (``copy_due_at``);
        ``state_claimable`` finds them now, one index fewer to write on every job. While the
        old index exists (the first start of this release), the records buried before carry
        their due time in ``copy_due_at``: it moves to ``claimable_at``, then the index goes.
        Several workers may do this at once: each move is conditional, a second drop is fine."""
        if "copy_due" not in self.collection.index_information():
            return
        for doc in self.collection.find(
            {"copy_due_at": {"$exists": True}}, {"copy_due_at": 1, "state": 1}
        ):
            update: dict[str, Any] = {"$unset": {"copy_due_at": ""}}
            if doc.get("state") == State.DEAD.value:
                update["$set"] = {"claimable_at": doc["copy_due_at"] + COPY_DUE_SHIFT}
            self.collection.update_one(
                {"_id": doc["_id"], "copy_due_at": doc["copy_due_at"]}, update
            )
        try:
            self.collection.drop_index("copy_due")
        except OperationFailure as exc:
            if exc.code != INDEX_NOT_FOUND:  # another worker dropped it first
                raise

    def legacy_indexes(self) -> list[str]:
        """The records' indexes an earlier release made that this one no longer needs."""
        with translate_errors("index listing"):
            found = [n for n in LEGACY_INDEXES if n in self.collection.index_information()]
        self._objective_index_gone = "objective" not in found
        return found

    def finish_upgrade(self) -> dict[str, int]:
        """Retire the records' sparse ``objective`` and ``replacement_due`` indexes, once no
        worker or producer of a release before 2026-11-26 runs (``ledger finish-upgrade``).

        Such a release writes ``slo_at`` on records without an objective document, and its
        workers read both indexes; so while ``objective`` exists, :meth:`overdue` also reads
        the records on it, and nothing is retired at a worker's start (a rolling deploy runs
        both releases at once). This copies the open objectives to ``_objectives`` and drops
        both indexes; ``replace_due`` needs no copy (a degraded result awaiting its
        replacement has ``claimable_at`` at its replacement time). Idempotent.

        Returns:
            ``{"objectives copied": n, "indexes dropped": n}``.
        """
        copied = dropped = 0
        with translate_errors("upgrade"):
            if "objective" in self.legacy_indexes():
                # Read to the end before anything is dropped (a cursor on a dropped index dies).
                open_ones = list(
                    self.collection.find(
                        {"slo_at": {"$exists": True}}, {"slo_at": 1, "slo_seconds": 1}
                    )
                )
                # Copied writes that raise (not _track_objective's best effort): an index is
                # dropped only once every open objective is in _objectives.
                for start in range(0, len(open_ones), 500):
                    chunk = open_ones[start : start + 500]
                    try:
                        self._objectives.bulk_write(
                            [
                                UpdateOne(
                                    {"_id": doc["_id"]},
                                    _objective_update(doc["slo_at"], doc.get("slo_seconds")),
                                    upsert=True,
                                )
                                for doc in chunk
                            ],
                            ordered=False,
                        )
                    except BulkWriteError as exc:
                        raise StoreError(
                            f"the open objectives could not be copied; nothing dropped: {exc}"
                        ) from exc
                    copied += len(chunk)
            for name in self.legacy_indexes():
                try:
                    self.collection.drop_index(name)
                    dropped += 1
                except OperationFailure as exc:
                    if exc.code != INDEX_NOT_FOUND:  # another run dropped it first
                        raise
        return {"objectives copied": copied, "indexes dropped": dropped}

    @staticmethod
    def ensure_audit_indexes(audit: Collection[dict[str, Any]], *, strict: bool = False) -> None:
        """The audit trail's indexes: one outcome per action (a unique index on ``of``, which
        actions leave out), and its time. Where the app's role may not create indexes on the
        trail (``ledger.access``: a TTL index would delete it), the provisioning step made
        them with the administrator's connection, and this is a no-op; ``strict`` (that
        step): it is not.

        Raises:
            StoreError: the indexes could not be made (the trail holds two outcomes of one
                action, or, with ``strict``, this connection may not create indexes).
        """
        try:
            with translate_errors("audit index creation"):
                for name, keys, options in AUDIT_INDEXES:
                    audit.create_index(keys, name=name, **options)
        except DuplicateKeyError as exc:
            raise StoreError(
                "the audit trail holds two outcomes of one action (a second writer's): its"
                f" one-outcome index cannot be made until an operator reviews them: {exc}"
            ) from exc
        except StoreError as exc:
            unauthorized = isinstance(exc.__cause__, OperationFailure) and exc.__cause__.code == 13
            if strict or not unauthorized:
                raise

    def expire(self) -> int:
        """Delete records past their ``expires_at`` (what the TTL index does when it is on).

        One indexed range delete. SecantusDB's TTL sweeper instead reads the whole collection
        under its global lock, stalling every write for seconds per 100k records.
        """
        past = {"expires_at": {"$lt": self.now()}}
        with translate_errors("expiry"):
            self.companion("groups").delete_many(past)
            self.companion("cache").delete_many(past)
            return self.collection.delete_many(past).deleted_count
