"""The reconciler: brings back jobs whose message is gone or stuck, without anyone watching.

It finds (1) running records whose lease ended a grace period ago (their worker died, and Redis
would only redeliver the message after its visibility timeout, an hour by default), and (2) queued
or retrying records untouched for a long time (a lost retry, a message lost before its first
claim), and queued records whose first publish failed, at once (a record never published whose tier
is above its backpressure mark is left in the outbox: the relay publishes it under the mark); (3)
degraded results whose replacement is as overdue (its message was lost: see policies/fallback.py);
(4) this app's jobs' messages a worker took and holds unacknowledged, without a running claim, for
a lease and the grace (it died before its claim, or after a claim it released for a requeue it
never sent), and workflow wakes held a minute: these are put back on their queue; (5) queued or
retrying jobs whose message is nowhere in the broker (not in its queue, the delayed set or a
worker's hands, in two looks a second apart), untouched for
``LEDGER_RECONCILE_MISSING_AFTER_SECONDS``, long before the stale time of (2) (a job published
while the ledger was away has its record written by the sweep first: unrecorded.py): a worker
killed between kombu's pop of a message and its booking as taken, a broker that lost data. That
look reads the queues, so it runs at most once in that time and while they are short
(:data:`MISSING_SCAN_MAX_MESSAGES`), and at once, whatever their depth, when the broker may have
lost data (its marker gone or changed, its primary moved: :func:`celery_ledger.broker.data_lost`);
the queues' bindings are declared again then, since a wiped broker forgot them too, and every
active workflow is woken again (at the timer it waits for), since its wakes lived only in the
broker, and the dead letters' queue copies it no longer holds are made due again; and for a while
after, it looks at each sweep (failover_watch.py: a failover's old primary may take writes, then
drop them). For each of (1) to (3), a job whose message still waits in its tier's queue or the
delayed set is only slow and is left alone (under a deep backlog, copies would cost a claim each).
Else it puts the job's unacknowledged message back on its queue, so it comes back as sent (marked
redelivered, as kombu marks the copies it restores), or republishes it from the message kept on the
record, under the job's own identity and with its headers (age, retry state). Fencing keeps this
safe against a slow original holder: the new delivery claims with a higher token, and the old
holder's late writes are refused.

Every worker's housekeeping runs it (:meth:`Reconciler.sweep_if_leader`), one sweeper at a
time across the fleet; ``celery -A APP ledger reconcile`` and the periodic task
``celery_ledger.reconcile`` (for celery beat) run it too. A record that cannot be handled (say,
sealed with a key that was rotated out) is counted and skipped, never stopping the sweep.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from .broker import (
    NOT_WATCHING,
    BrokerView,
    Continuity,
    CopiesOwed,
    Stranded,
    SweepLock,
    Unacked,
    Watch,
    WatchState,
    data_lost,
)
from .failover_watch import FailoverWatch
from .ledger.message import KeptMessage
from .ledger.ports import ReconcilerStore
from .ledger.record import State
from .ledger.store import UNPUBLISHED
from .quiet_slices import QuietLook
from .unrecorded import Unrecorded

if TYPE_CHECKING:
    from .runtime import Runtime

logger = logging.getLogger("celery_ledger.reconciler")

# A workflow's wake takes well under a second; one unacknowledged this long was held by a worker
# that died (or one so slow that running the wake twice costs nothing).
STRANDED_AFTER_SECONDS = 60.0
# Unacknowledged messages one sweep looks at, oldest first (long jobs' stay first for their
# whole run: the rest must be reached behind them).
STRANDED_PER_SWEEP = 5_000
# Looking for missing messages reads every queue (an LRANGE of each tier): while the queues and
# the delayed set hold at most this many messages (a few MB read a sweep). Deeper, a job waiting
# is most likely only slow, and the stale time (2) covers the rest.
MISSING_SCAN_MAX_MESSAGES = 20_000
# Queued jobs the look considers per sweep (ids only; the few not found are read whole).
MISSING_PER_SWEEP = 5_000
MISSING_KEPT = 4 * MISSING_PER_SWEEP  # ...and those kept for the next look, at most
# A message between two places (popped by a worker and not booked yet; its record written and
# the message not yet sent) is in one of them a moment later: a job is missing only if it is
# absent from both looks, this far apart.
MISSING_CONFIRM_SECONDS = 1.0
# After a failover, the dead letters' copies made within three sweeps and this long before it
# noticed are made again (a replica's lag and the sweep lock's move, with room to spare); and
# for this long and two sweeps more after it, the copies missing are made at each sweep and
# the jobs whose message is missing looked for (failover_watch.py: what an old primary, stopped
# or stalled, took from clients still connected to it once it ran again, until the sentinels
# made it a replica, which dropped it: seen in the soak, and in a double failover under load).
FAILOVER_MARGIN_SECONDS = 30.0
# Right after the broker may have lost data, and within the watch after a failover, jobs
# untouched this long are looked for...
AFTER_DATA_LOSS_SECONDS = 2.0
# ...within the watch, at most this often (each look reads the queues twice, a second apart).
WATCH_LOOK_EVERY_SECONDS = 5.0


@dataclass
class ReconcileReport:
    expired_leases: int = 0
    restored_from_broker: int = 0
    republished: int = 0
    stale_queued: int = 0
    stale_retrying: int = 0
    stale_replacements: int = 0  # degraded results whose replacement's message was lost
    still_waiting: int = 0  # their message is still queued or delayed: left alone
    held: int = 0  # never published, their tier above its mark: the outbox relay's, later
    workflows_woken: int = 0  # active workflows nothing woke within their check time
    # active workflows woken again (at their timer) because the broker may have lost their wake
    workflows_rewoken: int = 0
    wakes_restored: int = 0  # workflow wakes a dead worker held, put back on their queue
    # jobs' messages a worker took and died holding before its claim, or after its claim
    # ended without an outcome (released for a requeue it never sent), put back on their queue
    stranded_restored: int = 0
    # jobs whose message was nowhere in the broker (brought back: republished or restored)
    missing: int = 0
    # jobs published while the ledger was away whose records this sweep wrote (unrecorded.py)
    recorded: int = 0
    # dead letters whose queue copy the broker lost, made due again (after a loss)
    dead_letters_copied_again: int = 0
    broker_data_lost: str | None = None  # why the broker may have lost data, if it may have
    failed: int = 0  # a record that raised: counted and skipped
    skipped: list[str] = field(default_factory=list)  # nothing to republish it from (or no task)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @property
    def found_any(self) -> bool:
        return bool(
            self.expired_leases
            or self.stale_queued
            or self.stale_retrying
            or self.stale_replacements
            or self.stranded_restored
            or self.missing
            or self.recorded
            or self.broker_data_lost
        )


class Reconciler:
    """One app's reconciler (see the module docstring)."""

    def __init__(
        self,
        runtime: Runtime,
        broker: BrokerView,
        lock: SweepLock | None = None,
        *,
        wake_overdue_workflows: Callable[[frozenset[str]], int] | None = None,
        wake_workflows_after_loss: Callable[[frozenset[str]], int] | None = None,
        idempotent_tasks: tuple[str, ...] = (),
        declare_queues: Callable[[], None] | None = None,
        unrecorded: Unrecorded | None = None,
        copy_dead_letters_again: Callable[[datetime | None], int] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._runtime = runtime
        self._ledger: ReconcilerStore = runtime.ledger
        self._broker = broker
        self._lock = lock
        # Workflows whose wake-up was lost (their engine wakes them; it republishes lost steps).
        self._wake_overdue_workflows = wake_overdue_workflows
        # Every active workflow, woken again after the broker may have lost its wake.
        self._wake_workflows_after_loss = wake_workflows_after_loss
        # Tasks without a ledger record whose messages a dead worker strands (workflow wakes).
        self._idempotent_tasks = idempotent_tasks
        # Declares the tiers' queues (their bindings) again, after the broker lost data.
        self._declare_queues = declare_queues
        # Jobs published while the ledger was away, whose records the sweep writes.
        self._unrecorded = unrecorded
        # Makes the dead letters' queue copies the broker lost due again (deadletter.py), after
        # a loss (those made since a time, or all: None); at the end of each sweep until it
        # succeeds once. What is owed is noted in the broker (any sweeper pays it) and here
        # (should the broker refuse the note).
        self._copy_dead_letters_again = copy_dead_letters_again
        self._dead_letters_lost = False
        self._dead_letters_since: datetime | None = None
        self._sleep = sleep
        self._monotonic = monotonic
        self._looked_at: float | None = None  # when this process last looked for missing jobs
        self._slices = QuietLook(sleep=sleep, monotonic=monotonic)  # ...and how it reads
        self._recent = QuietLook(sleep=sleep, monotonic=monotonic)
        self._left: list[str] = []  # missing jobs a look found past the sweep's limit
        # The broker as this process last saw it, and why it may have lost data since, until a
        # sweep has looked for the missing jobs.
        self._continuity: Continuity | None = None
        self._data_lost: str | None = None
        # After a failover, missing messages are looked for at each sweep for a while
        self._watch = FailoverWatch(
            broker, monotonic=monotonic, sweep_every=runtime.settings.reconcile_every_seconds
        )

    def sweep_if_leader(self) -> ReconcileReport | None:
        """Sweep if this process holds (or takes) the fleet's sweep lock; else None."""
        if self._lock is None or self._lock.acquire() is None:
            return None
        return self.sweep()

    def sweep(
        self,
        *,
        lease_grace_seconds: float | None = None,
        stale_after_seconds: float | None = None,
        limit: int = 500,
        dry_run: bool = False,
    ) -> ReconcileReport:
        """One sweep; returns what it found and did."""
        settings = self._runtime.settings
        grace = (
            settings.reconcile_lease_grace_seconds
            if lease_grace_seconds is None
            else lease_grace_seconds
        )
        stale_after = (
            settings.reconcile_stale_after_seconds
            if stale_after_seconds is None
            else stale_after_seconds
        )
        report = ReconcileReport()
        candidates: list[tuple[str, dict[str, Any]]] = [
            ("expired_leases", doc)
            for doc in self._ledger.expired_leases(grace_seconds=grace, limit=limit)
        ]
        for state, counter in ((State.QUEUED, "stale_queued"), (State.RETRYING, "stale_retrying")):
            candidates += [
                (counter, doc)
                for doc in self._ledger.stale(state, older_than_seconds=stale_after, limit=limit)
            ]
        candidates += [
            ("stale_replacements", doc)
            for doc in self._ledger.replacements_due(older_than_seconds=stale_after, limit=limit)
        ]
        for counter, _ in candidates:
            setattr(report, counter, getattr(report, counter) + 1)
        if not dry_run and self._wake_overdue_workflows is not None:
            try:
                # Not those of a tier above its mark: they stay due until it drains
                held = self._runtime.gate.held(self._runtime.tiers.names)
                report.workflows_woken = self._wake_overdue_workflows(held)
            except Exception as exc:  # the jobs' part of the sweep goes on
                report.failed += 1
                logger.warning("reconcile: waking overdue workflows failed: %s", exc)
        if dry_run:
            return report
        self._notice_data_loss(report)
        watch = self._watch.now()
        if self._unrecorded is not None:
            try:  # first: a job recorded now is one the looks below can bring back
                report.recorded = self._unrecorded.record(self._ledger.enqueue_many)
            except Exception as exc:  # the ledger or the broker is away: the next sweep's
                report.failed += 1
                logger.warning("reconcile: recording unrecorded jobs failed: %s", exc)
        unacked: dict[str, Unacked] | None = None
        waiting: set[str] | None = None
        if candidates:
            unacked = self._broker.unacked()
            waiting = self._broker.waiting()
            for _, doc in candidates:
                try:
                    self._bring_back(doc, unacked, waiting, report)
                except Exception as exc:  # one bad record never stops the sweep
                    report.failed += 1
                    logger.warning("reconcile: %s failed: %s", doc.get("_id"), exc)
                    self._set_aside(doc)
        handled = {d["_id"] for _, d in candidates}
        looked = False
        try:
            self._bring_back_missing(report, handled, unacked, waiting, limit=limit, watch=watch)
            looked = True
        except Exception as exc:  # the ledger or the broker is away: the next sweep's
            report.failed += 1
            logger.warning("reconcile: looking for missing messages failed: %s", exc)
        if watch.phase is Watch.ENDED and looked and self._wake_at_watch_end(report):
            self._watch.done()  # (else the next sweep sees to the watch's end again)
        try:  # after the records' part: what it brought back is not stranded
            self._restore_stranded(report, grace=grace, handled=handled)
        except Exception as exc:  # the ledger or the broker is away: the next sweep's
            report.failed += 1
            logger.warning("reconcile: restoring stranded messages failed: %s", exc)
        if self._copy_dead_letters_again is not None:
            self._pay_copies(report)  # last: the jobs come first
        if report.found_any:
            logger.warning("reconcile: %s", report.as_dict())
        return report

    def _owe_copies(self, since: datetime | None) -> None:
        """Owe the dead letters' copies made since ``since`` (all: None) again: in the broker,
        so whichever process sweeps next makes them should this one stop first; in this
        process only should the broker refuse the note (kept here as well, a debt another
        worker paid meanwhile would be paid twice)."""
        if self._copy_dead_letters_again is None:
            return
        try:
            # (held after a failover, for the margin and two sweeps more: see the margin's note;
            # not after a wipe, whose every copy is owed, and whose lost copies are lost already)
            every = self._runtime.settings.reconcile_every_seconds
            hold = 0.0 if since is None else FAILOVER_MARGIN_SECONDS + 2 * every
            self._broker.owe_copies(since, hold_seconds=hold)
        except Exception as exc:  # this process still owes them
            logger.warning("reconcile: could not note the dead letters' copies owed: %s", exc)
            own = self._dead_letters_since if self._dead_letters_lost else since
            self._dead_letters_since = CopiesOwed.wider(own, since)
            self._dead_letters_lost = True

    def _pay_copies(self, report: ReconcileReport) -> None:
        """Make the dead letters' copies owed again (see :meth:`_owe_copies`), if any are."""
        assert self._copy_dead_letters_again is not None
        try:
            owed = self._broker.copies_owed()
        except Exception as exc:  # the broker is away: what this process owes, if anything
            logger.warning("reconcile: could not read the dead letters' copies owed: %s", exc)
            owed = None
        if owed is None and not self._dead_letters_lost:
            return
        if owed is not None and self._dead_letters_lost:
            since = CopiesOwed.wider(owed.since, self._dead_letters_since)
        else:
            since = owed.since if owed is not None else self._dead_letters_since
        try:
            report.dead_letters_copied_again = self._copy_dead_letters_again(since)
        except Exception as exc:  # the ledger or the broker is away: the next sweep's
            report.failed += 1
            logger.warning("reconcile: copying dead letters again failed: %s", exc)
            return
        self._dead_letters_lost = False
        if owed is not None and not owed.held:  # (held: paid again at the next sweeps)
            try:
                self._broker.copies_paid(owed)
            except Exception as exc:  # the next sweep makes them again: copies are idempotent
                logger.warning("reconcile: could not note the dead letters' copies made: %s", exc)

    def _notice_data_loss(self, report: ReconcileReport) -> None:
        """Compare the broker with this process's last look (see :func:`data_lost`)."""
        try:
            now = self._broker.continuity()
        except Exception as exc:  # the broker is away: the next sweep looks again
            logger.warning("reconcile: the broker's marker could not be read: %s", exc)
            return
        if now is None:
            return
        before, self._continuity = self._continuity, now
        why = data_lost(before, now)
        if why is None:
            return
        self._data_lost = report.broker_data_lost = why
        # A broker without its marker lost everything; a failover, only the last writes its
        # replica had not received: the copies made since this fleet's previous sweeps
        wiped = now.created or (before is not None and before.marker != now.marker)
        every = self._runtime.settings.reconcile_every_seconds
        recent = self._ledger.now() - timedelta(seconds=every * 3 + FAILOVER_MARGIN_SECONDS)
        self._owe_copies(None if wiped else recent)
        # (after a wipe too: a new primary whose replication had not begun lacks the marker as
        # well, and its old primary may run again)
        self._watch.start(recent, FAILOVER_MARGIN_SECONDS + 2 * every)
        logger.warning("reconcile: the broker may have lost data: %s", why)
        if self._declare_queues is not None:
            try:
                self._declare_queues()
            except Exception as exc:  # the next sweep after another loss tries again
                logger.warning("reconcile: declaring the queues again failed: %s", exc)
        if self._wake_workflows_after_loss is not None:
            # A workflow's wakes are only in the broker: the jobs' records bring the jobs back,
            # and this its wakes, or it would wait for its next check (engine.py says more)
            try:
                held = self._runtime.gate.held(self._runtime.tiers.names)
                report.workflows_rewoken = self._wake_workflows_after_loss(held)
            except Exception as exc:  # left to the workflows' own checks
                report.failed += 1
                logger.warning("reconcile: waking the workflows again failed: %s", exc)

    def _wake_at_watch_end(self, report: ReconcileReport) -> bool:
        """Wake every active workflow once more at the watch's end (failover_watch.py): a wake
        a stale primary took and dropped is only in the broker. False if it failed."""
        if self._wake_workflows_after_loss is None:
            return True
        try:
            held = self._runtime.gate.held(self._runtime.tiers.names)
            woken = self._wake_workflows_after_loss(held)
        except Exception as exc:  # the next sweep, the watch's end still, tries again
            report.failed += 1
            logger.warning("reconcile: waking the workflows after the watch failed: %s", exc)
            return False
        report.workflows_rewoken += woken
        logger.warning("reconcile: the watch after a failover ended: %d workflow(s) woken", woken)
        return True

    def _bring_back_missing(
        self,
        report: ReconcileReport,
        handled: set[Any],
        unacked: dict[str, Unacked] | None,
        waiting: set[str] | None,
        *,
        limit: int,
        watch: WatchState = NOT_WATCHING,
    ) -> None:
        """(5) of the module docstring: jobs whose message is nowhere in the broker; within
        the watch after a failover (or at its end), those touched since its start."""
        lost = self._data_lost
        settings = self._runtime.settings
        now = self._monotonic()
        after, since = AFTER_DATA_LOSS_SECONDS, None
        if lost is None:
            # At most once a wait (the look reads the queues and asks the ledger for every quiet
            # job: once per sweep, every few seconds, it slowed a soak's whole fleet); a job
            # missing is then brought back within twice the wait. Within a watch, at most once
            # every few seconds, and the end's look always.
            if watch.phase is Watch.NONE:
                after = settings.reconcile_missing_after_seconds
                every = after
            else:
                since = watch.since
                every = 0.0 if watch.phase is Watch.ENDED else WATCH_LOOK_EVERY_SECONDS
            if self._looked_at is not None and now - self._looked_at < every:
                return
            if self._broker.depth() > MISSING_SCAN_MAX_MESSAGES:
                return
        self._looked_at = now
        runtime = self._runtime
        # A slice at a time (quiet_slices.py); within a watch, in rounds of their own
        slices = self._slices if lost is None and watch.phase is Watch.NONE else self._recent
        if lost is not None:  # (one look, at every job: from the newest, not where a round stood)
            slices = self._recent = QuietLook(sleep=self._sleep, monotonic=self._monotonic)
        look = max(settings.reconcile_every_seconds / 4, 1.0)  # (its lock lasts 2.5 sweeps)
        found = slices.look(self._ledger, after, limit=MISSING_PER_SWEEP, since=since, seconds=look)
        quiet = [
            str(doc["_id"])
            for doc in found
            if doc["_id"] not in handled
            # (another app's job sharing the ledger: its queues are not read here)
            and runtime.tiers.for_record(doc, runtime.tier_of(str(doc.get("task")))) is not None
        ]
        # The last look's excess first (its round has gone on), kept until the broker is read
        quiet = self._left = list(dict.fromkeys([*self._left, *quiet]))[:MISSING_KEPT]
        if quiet:
            if unacked is None or waiting is None:
                unacked, waiting = self._broker.unacked(), self._broker.waiting()
            absent = [i for i in quiet if i not in waiting and i not in unacked]
            if absent:
                self._sleep(MISSING_CONFIRM_SECONDS)
                unacked, waiting = self._broker.unacked(), self._broker.waiting()
                absent = [i for i in absent if i not in waiting and i not in unacked]
            self._left = absent  # (until the records are read: then those past the limit)
            for doc in self._ledger.records(absent[:limit]):
                if doc.get("state") not in (State.QUEUED.value, State.RETRYING.value):
                    continue  # claimed or ended since
                if runtime.tiers.for_record(doc, runtime.tier_of(str(doc.get("task")))) is None:
                    continue  # another app's job: its queues are not read here
                try:
                    republished = report.republished + report.restored_from_broker
                    self._bring_back(doc, unacked, waiting, report)
                    if report.republished + report.restored_from_broker > republished:
                        report.missing += 1
                        logger.warning(
                            "reconcile: %s (%s) brought back: its message was nowhere in the"
                            " broker",
                            doc["_id"],
                            doc.get("task"),
                        )
                except Exception as exc:  # one bad record never stops the sweep
                    report.failed += 1
                    logger.warning("reconcile: %s failed: %s", doc.get("_id"), exc)
                    self._set_aside(doc)
            self._left = absent[limit:]
        # Looked with the data loss in view: later sweeps are ordinary ones
        if lost is not None and self._data_lost == lost:
            self._data_lost = None

    def _restore_stranded(
        self, report: ReconcileReport, *, grace: float, handled: set[Any]
    ) -> None:
        """Put back the messages of this app's jobs that a worker took and holds without a
        live claim, long after it took them: its process died before the claim, or after a
        claim it released for a requeue it never sent (a warm shutdown cut short, a broker
        away at the requeue). kombu would restore them only after its visibility timeout (an
        hour by default), and the job's record says nothing is wrong (none yet, or ``queued``).

        A job's message is unacknowledged from its take to its acknowledgement, its whole
        run for a long job: one whose record is running is left alone (a lease that ended is
        the expired leases' part of the sweep, which also republishes a message that is gone),
        and so is one the records' part of this sweep handled. A claim follows a take within
        milliseconds, so a message held a whole lease (and the grace) without one is stranded,
        or waits behind a busy process (a large prefetch): its copy then costs a claim, which
        tells the job's second delivery and acknowledges it."""
        runtime = self._runtime
        jobs_after = runtime.settings.lease_seconds + grace
        found = self._broker.stranded(
            older_than_seconds=min(STRANDED_AFTER_SECONDS, jobs_after), limit=STRANDED_PER_SWEEP
        )
        if not found:
            return
        now = runtime.message_time()  # the transport books takes on the broker's clock
        jobs: list[Stranded] = []
        for entry in found:
            if entry.task in self._idempotent_tasks:
                if now - entry.since >= STRANDED_AFTER_SECONDS:
                    report.wakes_restored += self._broker.restore(entry.message)
            elif (
                # (a job's record id is known only from a message naming its key: a ledger
                # task's publish; a plain task's message, or one without the key, is kombu's)
                entry.record_id is not None
                and entry.task is not None
                and now - entry.since >= jobs_after
            ):
                jobs.append(entry)
        if not jobs:
            return
        records = self._ledger.states_of([str(entry.record_id) for entry in jobs])
        for entry in jobs:
            record = records.get(str(entry.record_id))
            state = None if record is None else record.state
            if state == State.RUNNING.value or entry.record_id in handled:
                continue
            if runtime.tier_of(str(entry.task)) is None and (
                # Not a task of this release: put back only if its record says it is this
                # fleet's (a newer or older release's task during a rolling deploy, whose
                # taker died); another app's is left to kombu
                record is None or record.fleet != runtime.tiers.namespace
            ):
                continue
            if self._broker.restore(entry.message):
                report.stranded_restored += 1
                logger.warning(
                    "reconcile: %s (%s) put back on %s: taken %.0fs ago, no live claim",
                    entry.record_id,
                    state or "no record",
                    entry.message.queue,
                    now - entry.since,
                )

    def _set_aside(self, doc: dict[str, Any]) -> None:
        """Out of the sweep's view until its grace or stale time passes again, as read in
        ``doc``, so that records it
        leaves (held, nothing to bring them back from, or failing) never fill its window and
        hide the rest. A never-published one stays in the outbox relay's view: it is the
        relay's (another app's relay's, if its task is not registered here)."""
        try:
            if doc.get("claimable_at") == UNPUBLISHED:
                self._ledger.leave_unpublished(doc)
            else:
                self._ledger.mark_reconciled(doc)
        except Exception as exc:  # the ledger is away: the next sweep reads it again
            logger.warning("reconcile: %s could not be set aside: %s", doc.get("_id"), exc)

    def _bring_back(
        self,
        doc: dict[str, Any],
        unacked: dict[str, Any],
        waiting: set[str],
        report: ReconcileReport,
    ) -> None:
        record_id = doc["_id"]
        if record_id in waiting:  # only slow (a backlog): a copy would cost a claim
            report.still_waiting += 1
            return
        runtime = self._runtime
        # None: another app's job (left to its sweeps); a job of this fleet whose task this
        # release lacks is brought back all the same (the handoff takes it on)
        tier = runtime.tiers.for_record(doc, runtime.tier_of(str(doc.get("task"))))
        if tier is not None and doc.get("claimable_at") == UNPUBLISHED and runtime.gate.holds(tier):
            # Never published (enqueued in an app's transaction, or its publish failed), and its
            # tier is above its mark: it waits in the outbox, durable, until the relay publishes
            # it under the mark; a copy from here would skip the mark. It stays in the relay's
            # view, and leaves this sweep's for the stale time (never filling its window).
            report.held += 1
            self._set_aside(doc)
            return
        message = KeptMessage.from_document(doc.get("message"))
        republishable = message is not None and message.replayable and tier is not None
        arguments = None
        if republishable and record_id not in unacked:
            assert message is not None
            # Before the mark: one it cannot open (a key rotated out, a damaged record) raises
            # into the sweep, which sets it aside as it was
            arguments = message.arguments(runtime.sealer)
        if record_id not in unacked and not republishable:
            report.skipped.append(record_id)
            self._set_aside(doc)
            return
        if not self._ledger.mark_reconciled(doc):
            return  # changed since it was read (claimed, finished, or another sweep)
        if record_id in unacked and self._broker.restore(unacked[record_id]):
            report.restored_from_broker += 1
            return
        if not republishable:
            report.skipped.append(record_id)
            return
        assert message is not None and tier is not None
        message.republish_record(
            runtime.publish, runtime.sealer, doc, tier=tier, arguments=arguments
        )
        report.republished += 1
