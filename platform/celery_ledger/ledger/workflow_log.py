"""The workflows' store: their state documents and event logs, beside the ledger.

Collections (named after the ledger's, ``<ledger>_workflows`` and ``<ledger>_workflow_events``):

- a **state** document per workflow (``_id`` = the workflow id): name, key, tier, arguments,
  coarse status, when the reconciler should look at it next (``check_at``), its parent, and
  once it ended, its retention (``expires_at``). Written at start, on status changes and by the
  reconciler; never on a plain step (a step costs no state write).
- the **event log**: one document per event, ``_id`` = ``<workflow id>:<sequence, 10 digits>``
  and unique on ``(wf, seq)``; schema-versioned (``v``). The unique sequence is the fence of the
  log: a wake appends the events it decided on from the prefix it read, in order; a concurrent
  wake that read the same prefix collides on the first sequence and stops there, so the log is
  always one sequential history. Each event names its worker and the sequence it was decided
  from (``fence``).
- **pending signals and the cancel request** live in the events collection too, under
  ``<workflow id>:~slot:<n>`` (one of the limit's slots; ``seq`` ``~s:<signal id>``) and
  ``<workflow id>:~cancel``: their string ``seq`` sorts after the events, so the resume's one
  read (newest first, down to the latest snapshot) returns them with the tail of the log. A
  consumed signal is deleted once its consumption is in the log.

Op shapes follow the ledger's (see ``store.py``): reads and writes on ``_id`` or on the
``(wf, seq)`` index (ranges and ``$in``), never ``findAndModify``.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from pymongo import ASCENDING, DESCENDING
from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.errors import BulkWriteError, DuplicateKeyError

from ..errors import WorkflowError
from .record import SCHEMA_VERSION as RECORD_SCHEMA
from .record import State
from .store import FOREVER, Ledger, translate_errors

EVENT_SCHEMA = 1
SEQ_DIGITS = 10
SIGNAL_MARK = "~s:"
# Above every pending signal's mark: the next character after the mark's last (the server
# compares UTF-8 bytes, and a signal id may start above U+FFFF).
SIGNAL_END = SIGNAL_MARK[:-1] + chr(ord(SIGNAL_MARK[-1]) + 1)
SIGNAL_SLOT = "~slot:"
# Lost races a send allows beyond one per slot (signals consumed while it sends free slots).
SLOT_RACES = 8
CANCEL_MARK = "~cancel"
EVENTS_BELOW = 2**62  # above every event's number (a comparison with a number matches numbers)
ACTIVE = ("running", "compensating", "stuck")
# The active states a wake moves on (a stuck workflow waits for an operator's retry).
WAKEABLE = ("running", "compensating")
# A job's record states that say it is still to end (its end wakes the workflow that waits)
IN_FLIGHT = (State.QUEUED.value, State.RUNNING.value, State.RETRYING.value)
# Kinds of the documents beside the events (no sequence): never the kind of an event.
PENDING_SIGNAL = "pending_signal"
CANCEL_REQUEST = "cancel_request"


def event_id(workflow_id: str, seq: int) -> str:
    return f"{workflow_id}:{seq:0{SEQ_DIGITS}d}"


def _signal_slot(workflow_id: str, n: int) -> str:
    return f"{workflow_id}:{SIGNAL_SLOT}{n}"


def is_event(doc: dict[str, Any]) -> bool:
    """An event of the log (an integer sequence), not a document kept beside it."""
    seq = doc.get("seq")
    return isinstance(seq, int) and not isinstance(seq, bool)


class WorkflowLog:
    """Reads and writes the workflows' collections (see the module docstring)."""

    def __init__(self, ledger: Ledger, *, retention_seconds: float) -> None:
        self.ledger = ledger
        self.retention = timedelta(seconds=retention_seconds)

    @property
    def states(self) -> Collection[dict[str, Any]]:
        return self.ledger.companion("workflows")

    @property
    def events(self) -> Collection[dict[str, Any]]:
        return self.ledger.companion("workflow_events")

    def now(self) -> datetime:
        return self.ledger.now()

    def ensure_indexes(self) -> None:
        with translate_errors("workflow index creation"):
            self.events.create_index(
                [("wf", ASCENDING), ("seq", ASCENDING)], unique=True, name="wf_seq"
            )
            # Ended workflows check at FOREVER: the reconciler's range reads only active ones.
            self.states.create_index("check_at", name="check")
            self.states.create_index(
                [("status", ASCENDING), ("updated_at", DESCENDING)], name="status_updated"
            )
            self.states.create_index("expires_at", name="retention_sweep")

    # -- state documents ------------------------------------------------------------------------

    def create(self, doc: dict[str, Any], *, session: ClientSession | None = None) -> bool:
        """Insert the state document of a new workflow; False if one with its id exists.

        ``session``: in that session's transaction (the app's own), with pymongo's errors
        untranslated so that its ``with_transaction`` retries a transient one."""
        now = self.now()
        fields = {"status": "running", "created_at": now, "updated_at": now, "check_at": now}
        fields.update(doc)
        if session is not None:
            result = self.ledger.collection_for(session, "workflows").update_one(
                {"_id": doc["_id"]}, {"$setOnInsert": fields}, upsert=True, session=session
            )
            return result.upserted_id is not None
        with translate_errors("workflow start"):
            result = self.states.update_one(
                {"_id": doc["_id"]}, {"$setOnInsert": fields}, upsert=True
            )
        return result.upserted_id is not None

    def running(self, workflow_ids: Sequence[str]) -> list[str]:
        """Which of these workflows have a state document and run (one read)."""
        with translate_errors("workflow read"):
            docs = self.states.find({"_id": {"$in": list(workflow_ids)}, "status": "running"}, {})
            return [str(d["_id"]) for d in docs]

    def get_state(self, workflow_id: str) -> dict[str, Any] | None:
        with translate_errors("workflow read"):
            return self.states.find_one({"_id": workflow_id})

    def set_status(self, workflow_id: str, status: str, **fields: Any) -> None:
        now = self.now()
        update: dict[str, Any] = {"status": status, "updated_at": now, **fields}
        if status in ACTIVE:
            update.setdefault("expires_at", None)
            if status not in WAKEABLE:  # stuck: an operator's retry sets its check again
                update.setdefault("check_at", FOREVER)
        else:
            update["expires_at"] = now + self.retention
            update["check_at"] = FOREVER
        with translate_errors("workflow status"):
            self.states.update_one({"_id": workflow_id}, {"$set": update})

    def check_by(
        self,
        workflow_id: str,
        when: datetime,
        *,
        earlier_only: bool = False,
        checks: int | None = None,
    ) -> None:
        """When the reconciler should look at the workflow if nothing wakes it before (and how
        many checks in a row found it still, which spaces the next ones)."""
        update: dict[str, Any] = {"$min" if earlier_only else "$set": {"check_at": when}}
        if checks is not None:
            update["$set"] = {**update.get("$set", {}), "checks": checks}
        with translate_errors("workflow check time"):
            self.states.update_one({"_id": workflow_id, "status": {"$in": list(ACTIVE)}}, update)

    def wait_until(self, workflow_id: str, timer_at: datetime, *, check_by: datetime) -> None:
        """Keep the time of the timer (or signal timeout) the workflow waits for, and check it
        by ``check_by`` at the latest: the reconciler's spaced checks never pass a due timer."""
        with translate_errors("workflow timer"):
            self.states.update_one(
                {"_id": workflow_id, "status": {"$in": list(ACTIVE)}},
                {"$set": {"timer_at": timer_at}, "$min": {"check_at": check_by}},
            )

    def last_event(self, workflow_id: str) -> tuple[datetime | None, str | None]:
        """When the log's newest event was written, and the job it started if it started one
        (a step's, or a compensation's run), as (at, job id): one read on the (wf, seq) index."""
        with translate_errors("workflow log read"):
            doc = self.events.find_one(
                {"wf": workflow_id, "seq": {"$lt": EVENTS_BELOW}},
                {"at": 1, "kind": 1, "data.kind": 1, "data.job_id": 1},
                sort=[("seq", DESCENDING)],
            )
        if doc is None:
            return None, None
        at = doc.get("at")
        if isinstance(at, datetime) and at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        found = doc.get("data")
        data: dict[str, Any] = found if isinstance(found, dict) else {}
        kind = doc.get("kind")
        started = (kind == "scheduled" and data.get("kind") == "step") or (
            kind == "compensation_scheduled"
        )
        job_id = data.get("job_id") if started else None
        return (at if isinstance(at, datetime) else None), (
            job_id if isinstance(job_id, str) else None
        )

    def in_flight(self, record_id: str) -> bool:
        """Whether this job's ledger record says it is still to end (queued, running or
        retrying): one read by ``_id``."""
        with translate_errors("workflow step outcomes"):
            doc = self.ledger.collection.find_one({"_id": record_id}, {"state": 1})
        return doc is not None and doc.get("state") in IN_FLIGHT

    def due_for_check(
        self, *, limit: int = 200, skip_tiers: Iterable[str] = ()
    ) -> list[dict[str, Any]]:
        """Active workflows whose check time passed (their wake-up may be lost), but those of
        ``skip_tiers`` (held by backpressure: they stay due, and do not fill the window)."""
        query: dict[str, Any] = {"check_at": {"$lte": self.now()}}
        skipped = sorted(skip_tiers)
        if skipped:
            query["tier"] = {"$nin": skipped}
        with translate_errors("workflow check query"):
            docs = list(self.states.find(query).limit(limit))
            # A stuck workflow waits for an operator (whose retry sets its check again), not
            # for a wake: out of this view, so that stuck ones never fill the window and hide
            # the rest (a state stuck before set_status parked it is parked here)
            parked = [d["_id"] for d in docs if d.get("status") not in WAKEABLE]
            if parked:
                self.states.update_many(
                    {"_id": {"$in": parked}, "status": {"$nin": list(WAKEABLE)}},
                    {"$set": {"check_at": FOREVER}},
                )
        return [d for d in docs if d.get("status") in WAKEABLE]

    def wakeable(self, *, limit: int, skip_tiers: Iterable[str] = ()) -> list[dict[str, Any]]:
        """Workflows a wake moves on (running or compensating), but those of ``skip_tiers``:
        their tier and the timer each waits for, if any (the wakes after a broker lost data).
        A read on the status index."""
        query: dict[str, Any] = {"status": {"$in": list(WAKEABLE)}}
        skipped = sorted(skip_tiers)
        if skipped:
            query["tier"] = {"$nin": skipped}
        with translate_errors("workflow wakeable query"):
            return list(self.states.find(query, {"tier": 1, "timer_at": 1}).limit(limit))

    def listing(self, *, status: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        query: dict[str, Any] = {} if status is None else {"status": status}
        with translate_errors("workflow list"):
            return list(self.states.find(query).sort("updated_at", DESCENDING).limit(limit))

    def count_by_status(self) -> dict[str, int]:
        with translate_errors("workflow count"):
            rows = self.states.aggregate([{"$group": {"_id": "$status", "n": {"$sum": 1}}}])
            return {str(row["_id"]): int(row["n"]) for row in rows}

    # -- the event log --------------------------------------------------------------------------

    def tail(self, workflow_id: str, *, limit: int) -> list[dict[str, Any]]:
        """The log's newest documents down to its latest snapshot (or its first event), with
        the pending signals and cancel request; newest first. One read unless more than
        ``limit`` documents follow the snapshot.

        One query on the (wf, seq) index: a pending document's ``seq`` is a string, and
        strings sort above numbers, so they come first, then the events newest first. (Not a
        range on ``_id``: the embedded server scans the collection for that.)"""
        query: dict[str, Any] = {"wf": workflow_id}
        marks_only = False  # whether ``query`` matches pending documents only
        found: list[dict[str, Any]] = []
        with translate_errors("workflow log read"):
            while True:
                # batch_size: the whole page in one reply (the server's default is 101)
                cursor = self.events.find(query).sort("seq", DESCENDING)
                batch = list(cursor.limit(limit).batch_size(limit))
                found += batch
                if any(d.get("kind") in ("snapshot", "started") for d in batch):
                    return found
                full = len(batch) == limit
                numbers = [d["seq"] for d in batch if isinstance(d.get("seq"), int)]
                marks = [d["seq"] for d in batch if isinstance(d.get("seq"), str)]
                if marks_only and not full:  # every pending document read: now the events
                    query, marks_only = {"wf": workflow_id, "seq": {"$lt": EVENTS_BELOW}}, False
                elif not full:
                    return found
                elif numbers:
                    query = {"wf": workflow_id, "seq": {"$lt": min(numbers)}}
                else:  # a comparison with a string matches strings only
                    query, marks_only = {"wf": workflow_id, "seq": {"$lt": min(marks)}}, True

    def all_events(self, workflow_id: str) -> list[dict[str, Any]]:
        """Every event of the log, oldest first (history and time travel)."""
        with translate_errors("workflow history read"):
            docs = self.events.find({"wf": workflow_id}).sort("seq", ASCENDING)
            return [d for d in docs if is_event(d)]  # not the pending signals beside them

    def append(
        self, workflow_id: str, after: int, events: Sequence[dict[str, Any]], *, worker: str
    ) -> int:
        """Append ``events`` after sequence ``after``; returns how many landed (fewer than all
        when a concurrent wake appended at the same sequence first)."""
        now = self.now()
        docs = [
            {
                "_id": event_id(workflow_id, after + 1 + i),
                "wf": workflow_id,
                "seq": after + 1 + i,
                "v": EVENT_SCHEMA,
                "at": now,
                "worker": worker,
                "fence": after,
                **event,
            }
            for i, event in enumerate(events)
        ]
        if not docs:
            return 0
        try:
            with translate_errors("workflow log append"):
                self.events.insert_many(docs, ordered=True)
        except BulkWriteError as exc:
            errors = exc.details.get("writeErrors", [])
            if errors and all(e.get("code") == 11000 for e in errors):
                return int(exc.details.get("nInserted", 0))
            raise
        return len(docs)

    def add_signal(
        self, workflow_id: str, signal_id: str, doc: dict[str, Any], *, limit: int
    ) -> bool:
        """Keep a signal until a wait consumes it; False if this signal id is kept already.
        Raises :class:`WorkflowError` when ``limit`` signals are kept.

        The limit holds under concurrent senders: each kept signal takes one of ``limit``
        slots, its ``_id`` ``<workflow id>:~slot:<n>``, and an insert into a slot another
        sender took first collides on the ``_id``, so the sender reads again. (A count, then
        an insert, let every sender that counted below the limit in: 9 kept against 5.)"""
        # Its "seq" is its own mark, never an event's number: the unique (wf, seq) index keeps
        # events apart and would make every pending document of a workflow collide on null.
        # It also makes a second send of one signal id collide, in whichever slot.
        mark = f"{SIGNAL_MARK}{signal_id}"
        fields = {"wf": workflow_id, "seq": mark, "kind": PENDING_SIGNAL, "signal_id": signal_id}
        fields.update(doc)
        # Each lost race means another signal was kept: ``limit`` of them fill the slots.
        for _ in range(limit + SLOT_RACES):
            with translate_errors("workflow signal"):
                kept = list(
                    self.events.find(
                        {"wf": workflow_id, "seq": {"$gte": SIGNAL_MARK, "$lt": SIGNAL_END}},
                        {"_id": 1, "seq": 1},
                    )
                )
            if any(d.get("seq") == mark for d in kept):
                return False
            slots = [_signal_slot(workflow_id, n) for n in range(limit)]
            taken = {str(d["_id"]) for d in kept}
            # A kept signal outside the slots (kept by a release before them, or in a slot of
            # a higher limit) takes one of the last slots from every sender: those only ever
            # go, so the kept signals never outnumber the limit.
            usable = slots[: limit - len(taken.difference(slots))]
            free = [slot for slot in usable if slot not in taken]
            if not free:
                raise WorkflowError(
                    f"workflow {workflow_id} already holds {limit} unconsumed signals"
                    " (LEDGER_WORKFLOW_MAX_PENDING_SIGNALS)"
                )
            with translate_errors("workflow signal"):
                try:
                    # (a free slot at random: senders at once seldom pick the same one)
                    self.events.insert_one({"_id": random.choice(free), **fields})
                except DuplicateKeyError:
                    continue  # the slot, or this signal id, was taken since: read again
            return True
        raise WorkflowError(
            f"workflow {workflow_id}: signals kept and consumed faster than a send could take a"
            " slot; send it again (the same signal id keeps it once)"
        )

    def count_signals(self, workflow_id: str) -> int:
        with translate_errors("workflow signal count"):
            return self.events.count_documents(
                {"wf": workflow_id, "seq": {"$gte": SIGNAL_MARK, "$lt": SIGNAL_END}}
            )

    def drop_signals(self, workflow_id: str, signal_ids: Iterable[Any]) -> None:
        """Delete kept signals (consumed, or left at the workflow's end) by their ids, never by
        their slots: a slot another wake emptied may hold a newer signal already."""
        marks = [f"{SIGNAL_MARK}{signal_id}" for signal_id in signal_ids]
        if marks:
            with translate_errors("workflow cleanup"):
                self.events.delete_many({"wf": workflow_id, "seq": {"$in": marks}})

    def request_cancel(self, workflow_id: str, doc: dict[str, Any]) -> None:
        with translate_errors("workflow cancel"), contextlib.suppress(DuplicateKeyError):
            self.events.update_one(
                {"_id": f"{workflow_id}:{CANCEL_MARK}"},
                {
                    "$setOnInsert": {
                        "wf": workflow_id,
                        "seq": CANCEL_MARK,
                        "kind": CANCEL_REQUEST,
                        **doc,
                    }
                },
                upsert=True,
            )

    def delete(self, ids: Sequence[str]) -> None:
        if ids:
            with translate_errors("workflow cleanup"):
                self.events.delete_many({"_id": {"$in": list(ids)}})

    def expire(self) -> int:
        """Delete ended workflows past their retention, with their logs."""
        with translate_errors("workflow expiry"):
            gone = [
                d["_id"] for d in self.states.find({"expires_at": {"$lt": self.now()}}, {"_id": 1})
            ]
            for workflow_id in gone:
                self.events.delete_many({"wf": workflow_id})
                self.states.delete_one({"_id": workflow_id})
        return len(gone)

    # -- the jobs the log waits on (records of the ledger itself) ------------------------------

    def outcomes(self, record_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The ledger records of these jobs (one read), by id."""
        if not record_ids:
            return {}
        fields = {"state": 1, "result": 1, "dead_reason": 1, "outcome": 1, "replaced_by": 1}
        with translate_errors("workflow step outcomes"):
            docs = self.ledger.collection.find({"_id": {"$in": list(record_ids)}}, fields)
            return {str(d["_id"]): d for d in docs}

    def finish_record(
        self,
        workflow_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        result: str | None,
        error: str | None,
        status: str,
    ) -> None:
        """The workflow's own ledger record, so ``AsyncResult(workflow_id)`` reads its end as
        any job's: succeeded with its result, or dead (``death: workflow``) with the reason."""
        now = self.now()
        fields: dict[str, Any] = {
            "v": RECORD_SCHEMA,
            "task": task,
            "key": key,
            "tier": tier,
            "attempts": 1,
            "fence": 0,
            "claimable_at": FOREVER,
            "finished_at": now,
            "updated_at": now,
            "workflow_status": status,
        }
        if error is None:
            fields |= {
                "state": State.SUCCEEDED.value,
                "result": result,
                "expires_at": now + self.ledger.result_retention,
            }
            unset = {"dead_reason": "", "death": "", "errors": ""}
        else:
            fields |= {
                "state": State.DEAD.value,
                "death": "workflow",
                "dead_reason": error[:2000],
                "expires_at": now + self.ledger.dead_retention,
                "errors": [
                    {
                        "type": "celery_ledger.errors.WorkflowFailed",
                        "message": error[:2000],
                        "at": now,
                        "action": "dead",
                    }
                ],
            }
            unset = {"result": ""}
        with translate_errors("workflow result"):
            self.ledger.collection.update_one(
                {"_id": workflow_id},
                {"$set": fields, "$unset": unset, "$setOnInsert": {"created_at": now}},
                upsert=True,
            )

    def reopen_record(self, workflow_id: str) -> None:
        """The workflow runs again (an operator's retry): its ended record goes, so
        ``AsyncResult`` waits for the new end."""
        with translate_errors("workflow result reopen"):
            self.ledger.collection.delete_one(
                {"_id": workflow_id, "workflow_status": {"$exists": True}}
            )
