"""The claim protocol (see ``store.py``'s docstring) and the fenced outcomes of an attempt:
complete, keep a degraded result, finish without one, retry, release. Reads of one record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from ..errors import NotApplied, StoreError
from .core import (
    DUPLICATE_KEY,
    EPOCH,
    FOREVER,
    Claim,
    ClaimOutcome,
    Unchanged,
    _on_one_record,
    _replacement_pending,
    translate_errors,
)
from .dead import DeadJob
from .dead_records import DeadRecords
from .group_commit import Insert, Outcome, Statement, Write
from .message import KeptMessage
from .record import SCHEMA_VERSION, ErrorEntry, LedgerRecord, State


class Claims(DeadRecords):
    """The claim protocol and the fenced outcomes of an attempt (a job out of its budget or
    its deliveries is buried at its claim)."""

    def get(self, task_name: str, key: str) -> LedgerRecord | None:
        """The record of job ``(task_name, key)``, or ``None`` if the ledger has none."""
        from ..identity import derive_task_id

        return self.get_by_id(derive_task_id(task_name, key))

    def get_by_id(self, record_id: str) -> LedgerRecord | None:
        """The record with this id, or the one it is an alias of (a message id)."""
        doc = self.resolve(record_id)
        if doc is None:
            return None
        if isinstance(doc.get("result"), str):
            doc["result"] = self.open_text(doc["result"])
        return LedgerRecord.model_validate(doc)

    def find_raw(self, record_id: str) -> dict[str, Any] | None:
        """The stored document with this ``_id`` as it is (an alias document stays one)."""
        with translate_errors("read"):
            return self.collection.find_one({"_id": record_id})

    def resolve(self, ident: str) -> dict[str, Any] | None:
        """The record named by ``ident``: its own id, or an alias of it (one more read)."""
        doc = self.find_raw(ident)
        if doc is not None and isinstance(doc.get("alias_of"), str) and "state" not in doc:
            return self.find_raw(doc["alias_of"])
        return doc

    def load_progress(self, record_id: str) -> dict[str, Any]:
        """The record's checkpoint, completed steps and artefacts (one read)."""
        with translate_errors("progress read"):
            doc = self.collection.find_one(
                {"_id": record_id}, {"checkpoint": 1, "steps": 1, "artefacts": 1}
            )
        return doc or {}

    def claim(
        self,
        record_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        owner: str,
        lease_seconds: float | None = None,
        message: KeptMessage | None = None,
        max_attempts: int | None = None,
        alias: str | None = None,
        slo_at: datetime | None = None,
        slo_seconds: float | None = None,
        new: bool = False,
        handed_back: int = 0,
    ) -> Claim:
        """Try to take the exclusive lease on a record (creating it if needed). See module doc.

        ``message`` is kept on the record so that the reconciler can republish a job whose
        message is gone; ``max_attempts`` is the job's attempts budget; ``alias`` the message's
        own id when it is not ``record_id``; ``slo_at`` when a new record's job is late (its
        latency objective from its enqueue time). ``new``: the message says no record was
        written for the job (its first publish): the claim is tried as an insert first. A
        hint only: wrong, it costs up to two writes and claims the same. ``handed_back``: how
        many earlier deliveries of the job were handed back alive while the ledger could not
        record it (the message says so): not counted as lost workers by the poison check.

        Raises:
            LedgerUnavailable: unreachable, or the claim's outcome is unknown (the caller puts
                the delivery off; a claim that did apply holds its lease until it ends).
        """
        lease = timedelta(seconds=lease_seconds or self.lease_seconds)
        at_least = 0
        for turn in range(5):
            now = self.now()
            fence = self._fences.next(at_least)
            outcome = self._try_claim(
                record_id,
                fence,
                now,
                now + lease,
                insert=new and turn == 0,
                task=task,
                key=key,
                tier=tier,
                owner=owner,
                message=message,
                max_attempts=max_attempts,
                alias=alias,
                slo_at=slo_at,
                slo_seconds=slo_seconds,
                handed_back=handed_back,
            )
            if outcome is not None:
                return outcome
            doc = self.find_raw(record_id)  # the rare path: why was it not claimable?
            if doc is None:
                continue  # expired between the two calls: claim afresh
            if (
                doc.get("fence") == fence
                and doc.get("lease_owner") == owner
                and doc.get("state") == State.RUNNING.value
            ):
                # Our own claim, applied by a bulk write whose outcome we did not learn and
                # sent again (see GroupCommit): fences are unique, so the lease is ours.
                self._track_objective(record_id, {"slo_at": slo_at, "slo_seconds": slo_seconds})
                return Claim(ClaimOutcome.CLAIMED, fence=fence)
            if doc.get("task") != task or doc.get("key") != key:
                return Claim(ClaimOutcome.CONFLICT)
            state = doc.get("state")
            claimable_at: datetime = doc.get("claimable_at") or EPOCH
            if state == State.SUCCEEDED:
                if _replacement_pending(doc):
                    if claimable_at > self.now():  # early: back when it is due
                        return Claim(ClaimOutcome.BUSY, retry_at=claimable_at)
                    at_least = int(doc.get("fence", 0)) + 1  # due: claim it (a lagging clock)
                continue  # it finished between our two calls: the next claim counts the duplicate
            if state == State.DEAD:
                return Claim(ClaimOutcome.DEAD)
            if claimable_at > self.now():
                return Claim(ClaimOutcome.BUSY, retry_at=claimable_at)
            verdict = self._out_of_budget(
                doc, task=task, max_attempts=max_attempts, handed_back=handed_back
            )
            if verdict is not None:
                if self.bury(
                    record_id,
                    verdict,
                    # A holder's heartbeat since the read renews the lease: then it stands.
                    match=Unchanged(int(doc.get("fence", 0)), str(state), claimable_at),
                    task=task,
                    key=key,
                    tier=tier,
                ):
                    return Claim(ClaimOutcome.DEAD, killed=True)
                continue  # the record moved on under us: decide again
            at_least = int(doc.get("fence", 0)) + 1  # our clock lags the last claimer's
        raise NotApplied(f"could not claim {record_id}: the record keeps changing under us")

    def _out_of_budget(
        self, doc: Mapping[str, Any], *, task: str, max_attempts: int | None, handed_back: int
    ) -> DeadJob | None:
        """Why a claimable record must not be claimed again (poison, attempts budget)."""
        message = KeptMessage.from_document(doc.get("message"))
        inflight = int(doc.get("inflight", 0))
        if inflight >= self.max_deliveries + handed_back:
            return DeadJob.of_reason(
                "poison",
                f"poison: delivered {inflight - handed_back} times without an outcome"
                " (the worker was lost each time)",
                task=task,
                message=message,
            )
        if max_attempts is not None and int(doc.get("attempts", 0)) >= max_attempts:
            return DeadJob.of_reason(
                "retired",
                f"attempts budget exhausted ({doc.get('attempts')} attempts)",
                task=task,
                message=message,
            )
        return None

    def _try_claim(
        self,
        record_id: str,
        fence: int,
        now: datetime,
        lease_until: datetime,
        *,
        insert: bool = False,
        task: str,
        key: str,
        tier: str,
        owner: str,
        message: KeptMessage | None,
        max_attempts: int | None,
        alias: str | None,
        slo_at: datetime | None = None,
        slo_seconds: float | None = None,
        handed_back: int = 0,
    ) -> Claim | None:
        """One claim write (``insert``: as a new record's insert first; see the module doc),
        and the duplicate marker when it did not apply; None when only a read can say why."""
        claim_filter: dict[str, Any] = {
            "_id": record_id,
            "task": task,
            "key": key,
            "claimable_at": {"$lte": now},
            # A dead record's claimable_at is its queue copy's due time (see bury): never a claim.
            "state": {"$ne": State.DEAD.value},
            "fence": {"$lt": fence},
            "inflight": {"$lt": self.max_deliveries + handed_back},
        }
        if max_attempts is not None:
            claim_filter["attempts"] = {"$lt": max_attempts}
        claim_filter = _on_one_record(claim_filter)
        fields: dict[str, Any] = {
            "v": SCHEMA_VERSION,
            "tier": tier,
            "state": State.RUNNING.value,
            "fence": fence,
            "lease_owner": owner,
            "lease_expires_at": lease_until,
            "claimable_at": lease_until,
            "started_at": now,
            "updated_at": now,
        }
        if message is not None:
            fields["message"] = message.document()
        if self.fleet is not None:
            fields["fleet"] = self.fleet
        on_insert: dict[str, Any] = {"created_at": now}
        if slo_at is not None:  # a job's objective, from its publish (see escalation.py)
            on_insert |= {"slo_at": slo_at, "slo_seconds": slo_seconds}
        update = {
            "$set": fields,
            "$inc": {"attempts": 1, "inflight": 1},
            "$setOnInsert": on_insert,
            "$unset": {"unpublished_at": ""},
        }
        first: Write = Statement(claim_filter, update, upsert=True)
        if insert:
            # The record the upsert makes of a missing one: the filter's equalities, the update.
            first = Insert(
                {"_id": record_id, "task": task, "key": key, **fields}
                | {"attempts": 1, "inflight": 1, **on_insert}
            )
        ops = [first]
        if alias is not None:
            ops.append(
                Statement(
                    {"_id": alias},
                    {"$setOnInsert": self._alias(record_id, task, key, now)},
                    upsert=True,
                )
            )
        claim = self._write_claim(record_id, ops)
        if claim.error is not None:
            # Not claimable. A duplicate of a finished job is the common reason: count it
            # (the marker modifies the record iff it succeeded); anything else needs a read.
            # A degraded result awaiting its replacement is not a duplicate's: read it.
            with translate_errors("claim"):
                marked = self.collection.update_one(
                    _on_one_record(
                        {
                            "_id": record_id,
                            "task": task,
                            "key": key,
                            "state": State.SUCCEEDED.value,
                            "degraded.replace_at": None,
                        }
                    ),
                    {"$inc": {"duplicates": 1}, "$set": {"last_duplicate_at": now}},
                )
            if marked.modified_count == 1:
                return Claim(ClaimOutcome.DUPLICATE)
            if not insert:
                return None
            # A record exists that no success marks (queued, retrying, held, dead, or this
            # claim's own insert applied by a write sent again): the conditional claim decides.
            # Its marker is not sent twice: a job that ended meanwhile is read, then counted.
            claim = self._write_claim(record_id, [Statement(claim_filter, update, upsert=True)])
            if claim.error is not None:
                return None
        self._track_objective(record_id, {"slo_at": slo_at, "slo_seconds": slo_seconds})
        return Claim(ClaimOutcome.CLAIMED, fence=fence, created=claim.upserted)

    def _write_claim(self, record_id: str, ops: list[Write]) -> Outcome:
        """Send a claim's statements (the claim first, an alias after it); the claim's outcome.
        Only the claim may fail, and only on a duplicate key (the record is not claimable)."""
        with translate_errors("claim"):
            claim, *others = self.writes.write(ops)
        errors = [o.error for o in (claim, *others) if o.error is not None]
        if any(e is not claim.error or e.get("code") != DUPLICATE_KEY for e in errors):
            raise StoreError(f"ledger claim of {record_id} failed: {errors}")
        return claim

    def complete(
        self,
        record_id: str,
        fence: int,
        result_json: str,
        *,
        op: str,
        atomic_steps: Sequence[str] = (),
        degraded: Mapping[str, Any] | None = None,
        replace_at: datetime | None = None,
    ) -> None:
        """Store the result and mark the record succeeded, if ``fence`` still holds the lease
        and the record still has ``atomic_steps`` (the steps this attempt's result relies on).

        ``degraded``: the result is a fallback's (its trigger and option, kept on the record).
        With ``replace_at`` the record becomes claimable again then, so the real job runs under
        the same key; until a claim takes it, deliveries are suppressed duplicates as for any
        success. A result that is not degraded moves an earlier ``degraded`` to
        ``replaced_degraded``: the real result replaced it (fencing makes that happen once).

        Raises:
            LeaseLost: a newer claim took the job over.
            CommitLost: the record lost one of ``atomic_steps``; nothing was written.
        """
        now = self.now()
        fields: dict[str, Any] = {
            "state": State.SUCCEEDED.value,
            "result": result_json,
            **self._ended(now, FOREVER),
            "finished_at": now,
            "expires_at": now + self.result_retention,
        }
        unset = {"slo_at": "", "replace_due": ""}
        update: dict[str, Any] = {"$set": fields, "$unset": unset}
        if degraded is not None:
            fields["degraded"] = {**degraded, "at": now, "replace_at": replace_at}
            if replace_at is not None:
                # Its replacement is a fresh run: a budget of attempts spent getting here
                # (max_attempts) must not stop it. ``replace_due`` puts it in the reconciler's
                # view (a sparse index: a query on the state of successes would read them all).
                fields |= {"claimable_at": replace_at, "attempts": 0, "replace_due": replace_at}
                del unset["replace_due"]
        else:
            # Renaming a field the record does not have changes nothing: one write either way.
            update["$rename"] = {"degraded": "replaced_degraded"}
        self._end_attempt(record_id, fence, op, update, "completion", atomic_steps=atomic_steps)

    def keep_degraded(
        self, record_id: str, fence: int, error: ErrorEntry | None, *, op: str, reason: str
    ) -> None:
        """End a replacement attempt that failed for good: the degraded result stands (the
        record is ``succeeded`` again, not claimable), with the error in its history."""
        now = self.now()
        update: dict[str, Any] = {
            "$set": {
                "state": State.SUCCEEDED.value,
                **self._ended(now, FOREVER),
                "degraded.replace_at": None,
                "degraded.replacement_failed": reason[:2000],
            },
            "$unset": {"replace_due": ""},
        }
        if error is not None:
            update["$push"] = {
                "errors": {"$each": [error.model_dump()], "$slice": -self.error_history_limit}
            }
        self._end_attempt(record_id, fence, op, update, "degraded record")

    def finish_without_result(
        self,
        record_id: str,
        fence: int,
        *,
        outcome: str,
        note: str,
        op: str,
        replaced_by: str | None = None,
        atomic_steps: Sequence[str] = (),
    ) -> None:
        """Mark the job finished by its body's own say (``ignored``, ``replaced``): terminal
        like a success, without a result of its own (``atomic_steps`` as for :meth:`complete`)."""
        now = self.now()
        fields: dict[str, Any] = {
            "state": State.SUCCEEDED.value,
            "outcome": outcome,
            "note": note[:2000],
            **self._ended(now, FOREVER),
            "finished_at": now,
            "expires_at": now + self.result_retention,
        }
        if replaced_by is not None:
            fields["replaced_by"] = replaced_by
        self._end_attempt(
            record_id, fence, op, {"$set": fields}, "finish", atomic_steps=atomic_steps
        )

    def record_retry(
        self,
        record_id: str,
        fence: int,
        error: ErrorEntry,
        *,
        retry_at: datetime,
        op: str,
        traceback: str = "",
        retries: int | None = None,
        previous_delay: float | None = None,
    ) -> None:
        """Append ``error`` to the history and mark the record ``retrying`` (claimable at once:
        the retry message is the timer, and an early delivery that claims first is as good).

        ``retries`` and ``previous_delay`` update the kept message's headers, so a republish
        by the reconciler continues the retry budget instead of restarting it.
        """
        now = self.now()
        fields: dict[str, Any] = {
            "state": State.RETRYING.value,
            **self._ended(now, now),
            "next_attempt_at": retry_at,
            "traceback": traceback[-8000:],
        }
        if retries is not None:
            fields["message.headers.retries"] = retries
        if previous_delay is not None:
            fields["message.headers.ledger_previous_delay"] = previous_delay
        update = {
            "$set": fields,
            "$push": {
                "errors": {"$each": [error.model_dump()], "$slice": -self.error_history_limit}
            },
        }
        self._end_attempt(record_id, fence, op, update, "retry record")

    def release(self, record_id: str, fence: int, *, op: str, refund_attempt: bool = False) -> None:
        """Give a claim back without an outcome (the message goes back to the queue);
        ``refund_attempt``: the claim did not count as an attempt (nothing was run)."""
        now = self.now()
        update: dict[str, Any] = {"$set": {"state": State.QUEUED.value, **self._ended(now, now)}}
        if refund_attempt:
            update["$inc"] = {"attempts": -1}
        self._end_attempt(record_id, fence, op, update, "release")
