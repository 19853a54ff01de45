"""The outbox: jobs and workflow starts made in the app's own MongoDB transaction.

An app that writes an order and then publishes ``charge`` can die between the two (an order
with no charge), or publish a charge for an order whose transaction then aborts. Here the job's
``queued`` record (with its kept message, sealed for a sensitive task) or the workflow's state
document is written *in the app's transaction*, and nothing is published yet:

- the transaction aborts: there is no record, so there is no job;
- it commits: the committing process publishes the jobs it staged (:meth:`Outbox.flush`, which
  :meth:`Outbox.transaction` calls after the commit) and marks them published;
- the committing process dies between the commit and that publish, or the broker refuses it:
  the relay (every worker's housekeeping, one relay at a time across the fleet, every
  ``LEDGER_OUTBOX_RELAY_SECONDS``) publishes records left unpublished for
  ``LEDGER_OUTBOX_GRACE_SECONDS``, and wakes the workflows due for a check: a workflow started
  in a transaction is due once that grace has passed.

Both may publish one job (a flush that died after its publish, before its mark): the copy is
a duplicate delivery, which the claim suppresses, so the job still runs once.

Backpressure cannot wait inside someone's transaction (it would hold the transaction open
against its lifetime limit): a tier above its mark with the ``reject`` policy refuses the
enqueue (``Backpressure`` raised into the transaction, which the app may abort or catch); with
``block`` or ``shed`` the job is kept in the outbox, durable, and published once the tier is
back under its mark. Nothing is shed: the job is already part of the app's committed data.

A job made in a transaction carries no callbacks, chain or countdown (the kept message holds
the call and its ledger headers only): compose with a workflow, started in the transaction.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pymongo.client_session import ClientSession
from pymongo.read_concern import ReadConcern

from .errors import Backpressure, ConfigurationError, StoreError
from .ledger.dead import DeadJob
from .ledger.message import KeptMessage, UnreplayableMessage
from .ledger.ports import OutboxStore
from .ledger.record import State
from .ledger.store import UNPUBLISHED, Unchanged
from .locks import ForkSafeLock

if TYPE_CHECKING:
    from .broker import SweepLock
    from .runtime import Runtime

logger = logging.getLogger("celery_ledger.outbox")
# Workflows a relay pass wakes at most (a backlog of due checks after an outage is the
# reconciler's, whose sweep takes up to 200; a pass stays well within the relay's lease).
WAKES_PER_PASS = 20
# How long the relay passes over a record it could not open, and how many it remembers.
PASS_OVER_SECONDS = 300.0
PASS_OVER_MAX = 10_000
T = TypeVar("T")


@dataclass
class _Staged:
    """What one session's transaction wrote for the outbox (every attempt's: a retried
    transaction writes again, and only what committed is found by :meth:`Outbox.flush`)."""

    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> its record's fields
    workflows: dict[str, str] = field(default_factory=dict)  # id -> tier


class Outbox:
    """The app's outbox (see the module docstring); ``app.outbox``."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        publish_wake: Callable[[str, str], object],
        workflow_states: Callable[[list[str]], Iterable[str]],
        lock: SweepLock | None = None,
        announce_dead: Callable[[str], None] | None = None,
        wake_due_workflows: Callable[[int, frozenset[str]], int] | None = None,
    ) -> None:
        self._runtime = runtime
        # The workflow engine's wake of workflows due for a check: a workflow started in a
        # transaction is due once its committer's grace has passed, so a committer that died
        # before its wake costs a relay period, not a reconciler sweep.
        self._wake_due_workflows = wake_due_workflows
        # The dead-letter flow's announcement of a record the relay recorded dead (its metric,
        # Sentry, and its copy to the dead letters' queue without waiting for housekeeping).
        self._announce_dead = announce_dead
        self._ledger: OutboxStore = runtime.ledger
        self._publish_wake = publish_wake
        # Which of these workflows' state documents exist (committed), by id.
        self._workflow_states = workflow_states
        self._lock = lock
        # Sessions are the app's: staging ends with them (a session never flushed is the
        # relay's, like a process that died).
        self._staged: weakref.WeakKeyDictionary[ClientSession, _Staged] = (
            weakref.WeakKeyDictionary()
        )
        self._staged_lock = ForkSafeLock()
        # Records this process could not publish (a key it lacks, a damaged record), by id:
        # until when to pass over them (read and written by the relay's one lane).
        self._passed_over: dict[str, float] = {}

    # -- in the transaction ---------------------------------------------------------------------

    @staticmethod
    def require_transaction(session: Any) -> ClientSession:
        """``session`` if it is a pymongo session inside a transaction.

        Raises:
            ConfigurationError: it is not (a write outside a transaction would publish
                nothing and promise nothing).
        """
        if not isinstance(session, ClientSession):
            raise ConfigurationError(
                f"session= takes a pymongo ClientSession, not {type(session).__name__}"
            )
        if not session.in_transaction:
            raise ConfigurationError(
                "session= enqueues in the session's transaction: start one first"
                " (session.with_transaction(...), or app.outbox.transaction(...))"
            )
        return session

    def stage_job(
        self,
        session: ClientSession,
        record_id: str,
        *,
        task: str,
        key: str,
        tier: str,
        message: KeptMessage,
    ) -> None:
        """Remember a job written in ``session``'s transaction (what its record holds, so that
        a publish after a commit known to have happened reads nothing)."""
        fields: dict[str, Any] = {"_id": record_id, "task": task, "key": key, "tier": tier}
        fields["message"] = message.document()
        with self._staged_lock:
            self._staged.setdefault(session, _Staged()).jobs[record_id] = fields

    def stage_workflow(self, session: ClientSession, workflow_id: str, tier: str) -> None:
        with self._staged_lock:
            self._staged.setdefault(session, _Staged()).workflows[workflow_id] = tier

    def admit(self, tier: str) -> None:
        """The tier's backpressure inside a transaction: only a ``reject`` policy applies here
        (raised into the transaction); under ``block`` or ``shed`` the job waits in the outbox
        until the tier is back under its mark (see the module docstring).

        Raises:
            Backpressure: the tier is above its mark and its policy is ``reject``.
        """
        gate = self._runtime.gate
        if gate.policy(tier) != "reject":
            return
        try:
            engaged = gate.engaged_now(tier)
        except Exception as exc:  # the broker is away: the publish after the commit says so
            logger.warning("backpressure check on %s skipped: %s", tier, exc)
            return
        if engaged:
            limit = gate.limits[tier]
            raise Backpressure(tier, gate.depths.depth(tier), limit.high_water or 0)

    # -- after the commit -----------------------------------------------------------------------

    def transaction(self, callback: Callable[[ClientSession], T], **options: Any) -> T:
        """Run ``callback(session)`` in a transaction on the ledger's deployment (pymongo's
        ``with_transaction``: retried on transient errors), then publish what it enqueued.
        ``options`` go to ``with_transaction`` (the default: majority reads and the ledger's
        journaled majority writes). The app's collections are reached through the session's
        client: ``session.client[db][collection]``."""
        options.setdefault("read_concern", ReadConcern("majority"))
        options.setdefault("write_concern", self._ledger.write_concern)

        ended_by_callback = False

        def attempt(session: ClientSession) -> T:
            nonlocal ended_by_callback
            # A retried attempt starts afresh: what an aborted one staged was rolled back
            self.discard(session)
            result = callback(session)
            # A callback may commit or abort the transaction itself (with_transaction then
            # returns as if committed): only the ledger can say what exists
            ended_by_callback = not session.in_transaction
            return result

        with self._ledger.client.start_session() as session:
            try:
                result = session.with_transaction(attempt, **options)
            except BaseException:
                self.discard(session)
                raise
            # Committed by with_transaction: what is staged is the committed attempt's, and is
            # published unread
            self._flush(session, committed=not ended_by_callback)
            return result

    def discard(self, session: ClientSession) -> None:
        """Forget what ``session`` staged (its transaction aborted: nothing of it exists)."""
        with self._staged_lock:
            self._staged.pop(session, None)

    def flush(self, session: ClientSession) -> int:
        """Publish what ``session``'s committed transaction enqueued; returns how many jobs
        and workflow wakes it sent. Call it after the commit. Never raises for an outage:
        what it could not send is the relay's (the records are durable)."""
        if session.in_transaction:
            raise ConfigurationError("flush after the commit: the transaction is still open")
        return self._flush(session, committed=False)

    def _flush(self, session: ClientSession, *, committed: bool) -> int:
        """``committed``: the staged work is exactly what committed (:meth:`transaction` saw
        the commit of the attempt that staged it); else the ledger says what did (an aborted
        attempt's records do not exist)."""
        with self._staged_lock:
            staged = self._staged.pop(session, None)
        if staged is None:
            return 0
        sent = 0
        try:
            if staged.jobs:
                ids = sorted(staged.jobs)
                docs = (
                    [staged.jobs[i] for i in ids]
                    if committed
                    else self._ledger.unpublished(ids=ids)
                )
                sent += self._publish(docs, by="committer")
            if staged.workflows:
                ids = sorted(staged.workflows)
                for workflow_id in ids if committed else self._workflow_states(ids):
                    self._publish_wake(workflow_id, staged.workflows[workflow_id])
                    sent += 1
        except Exception as exc:
            logger.warning("outbox: publish after the commit failed (the relay sends it): %s", exc)
        return sent

    # -- the relay ------------------------------------------------------------------------------

    def relay_if_leader(self) -> int | None:
        """:meth:`relay` if this process holds (or takes) the fleet's relay lock; else None."""
        if self._lock is None or self._lock.acquire() is None:
            return None
        return self.relay()

    def relay(self, *, limit: int = 500) -> int:
        """Publish committed outbox records that nobody published within the grace time
        (their committing process died, or its publish failed), then wake up to
        ``WAKES_PER_PASS`` workflows due for a check; returns how many records it published."""
        runtime = self._runtime
        grace = runtime.settings.outbox_grace_seconds
        held = runtime.gate.held(runtime.tiers.names)

        def skip(doc: Mapping[str, Any]) -> bool:
            """Another app's (its relay's), held in the outbox by its tier's mark, or one this
            process cannot open (for now)."""
            tier = runtime.tiers.for_record(doc, runtime.tier_of(str(doc.get("task"))))
            return tier is None or tier in held or self._passed_over_now(str(doc["_id"]))

        docs = self._ledger.unpublished(older_than_seconds=grace, limit=limit, skip=skip)
        sent = self._publish(docs, by="relay") if docs else 0
        if sent:
            logger.warning("outbox relay: published %d job(s) their committer did not", sent)
        if self._wake_due_workflows is not None:
            woken = self._wake_due_workflows(WAKES_PER_PASS, held)
            if woken:
                logger.info("outbox relay: woke %d workflow(s) due for a check", woken)
        return sent

    def _publish(self, docs: list[dict[str, Any]], *, by: str) -> int:
        """Publish each record's kept message (tiers above their mark wait, in the outbox),
        then mark the sent ones published in one write. Another app's task is left (its own
        relay publishes it); a record with no kept message, or one whose arguments cannot be
        rebuilt, is recorded dead with the reason; one sealed with a key this process lacks is
        passed over for ``PASS_OVER_SECONDS`` (logged as an error; the health check reports it
        unpublished)."""
        runtime = self._runtime
        sent: list[str] = []
        held: dict[str, bool] = {}
        per_tier: dict[str, int] = {}
        try:
            for doc in docs:
                record_id = str(doc["_id"])
                try:
                    ready = self._ready(doc, held)
                except Exception as exc:  # a damaged record is never in the way of the rest
                    self._pass_over(record_id)
                    logger.error("outbox: %s cannot be published: %r", record_id, exc)
                    continue
                if ready is None:
                    continue
                message, tier, arguments = ready
                message.republish_record(
                    runtime.publish, runtime.sealer, doc, tier=tier, arguments=arguments
                )
                sent.append(record_id)
                per_tier[tier] = per_tier.get(tier, 0) + 1
        finally:
            # What was sent is marked even when a later publish failed (the broker went away)
            if sent:
                self._ledger.mark_published(sent)
            for tier, count in per_tier.items():
                runtime.observers.outbox_published(tier, by, count)
        return len(sent)

    def _ready(
        self, doc: Mapping[str, Any], held: dict[str, bool]
    ) -> tuple[KeptMessage, str, tuple[list[Any], dict[str, Any]]] | None:
        """A record's message, tier and arguments, if the relay publishes it now; else None,
        having left it (another app's task: its own relay publishes it; a tier above its
        mark), recorded it dead (nothing to publish it from) or passed over it (sealed with a
        key this process lacks: an operator may bring the key back, or another worker has it)."""
        runtime = self._runtime
        record_id, task = str(doc["_id"]), str(doc.get("task"))
        # None: another app's task (apps may share a ledger, and tier names); a task of this
        # fleet this release lacks is published all the same (the handoff takes it on)
        tier = runtime.tiers.for_record(doc, runtime.tier_of(str(doc.get("task"))))
        if tier is None:
            return None
        message = KeptMessage.from_document(doc.get("message"))
        if message is None or not message.replayable:
            self._bury(doc, task, tier, "outbox: no replayable message was kept", message)
            return None
        if tier not in held:
            held[tier] = runtime.gate.holds(tier)
        if held[tier]:
            return None
        try:
            arguments = message.arguments(runtime.sealer)
        except UnreplayableMessage as exc:
            self._bury(doc, task, tier, f"outbox: unpublishable message: {exc}", message)
            return None
        except StoreError as exc:
            self._pass_over(record_id)
            logger.error("outbox: %s (%s) cannot be opened: %s", record_id, task, exc)
            return None
        return message, tier, arguments

    def _bury(
        self,
        doc: Mapping[str, Any],
        task: str,
        tier: str,
        reason: str,
        message: KeptMessage | None,
    ) -> None:
        """A record no relay can ever publish would stay in the relay's view for good, read
        and logged at every pass: it is recorded dead with the reason instead (an operator sees
        it among the dead letters), if it is still exactly as read."""
        dead = DeadJob.of_reason("bad-arguments", reason, task=task, message=message)
        match = Unchanged(int(doc.get("fence", 0)), State.QUEUED.value, UNPUBLISHED)
        record_id = str(doc["_id"])
        try:
            buried = self._ledger.bury(
                record_id, dead, match=match, task=task, key=str(doc.get("key")), tier=tier
            )
        except StoreError as exc:  # the next pass tries again
            logger.warning("outbox: %s could not be recorded dead: %s", record_id, exc)
            return
        if not buried:
            return
        if self._announce_dead is None:
            logger.error("outbox: %s (%s) recorded dead: %s", record_id, task, reason)
        else:  # logged as every dead letter is
            self._announce_dead(record_id)

    def _pass_over(self, record_id: str) -> None:
        """Leave ``record_id`` out of the relay's reads for ``PASS_OVER_SECONDS`` (records that
        cannot be published here never fill a read's window and hide the rest)."""
        now = self._ledger.now().timestamp()  # the relay's clock (its grace's too)
        self._passed_over[record_id] = now + PASS_OVER_SECONDS
        if len(self._passed_over) > PASS_OVER_MAX:  # the expired, then the first to expire
            live = sorted((until, rid) for rid, until in self._passed_over.items() if until > now)
            self._passed_over = {rid: until for until, rid in live[-PASS_OVER_MAX:]}

    def _passed_over_now(self, record_id: str) -> bool:
        until = self._passed_over.get(record_id)
        return until is not None and until > self._ledger.now().timestamp()


__all__ = ["Outbox"]
