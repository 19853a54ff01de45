"""Periodic tasks: a scheduled run's identity is (schedule entry, slot), whoever fires it.

Celery's ``beat_schedule`` entries (interval, ``crontab``, ``solar``) stay the way an app
declares its periodic tasks. What this module adds is the identity of each run: the job of an
entry's slot has the key ``schedule:<entry>@<slot>`` (``keys.slot_key``), never a hash of its
arguments (which would make every later tick a duplicate of the first). Two schedulers firing
the same slot (two beats, beat and the workers, two fleets during a deploy) publish the same
job, and the ledger runs it once. The body reads its slot back from its key
(``self.scheduled_for``).

The slot is when the run was due, not when a scheduler got to it:

- ``crontab``: the occurrence the entry was due for (the first one after its last run, in the
  app's time zone, as Celery computes it), a wall time the schedule defines, the same for
  every scheduler; ``solar`` and an app's own schedule class: its next event after the last
  run, to the second;
- an interval (``schedule``, or a number of seconds): the window of its period on a grid from
  the epoch, on the broker's clock, and it fires once in each window (:meth:`LedgerScheduling.
  is_due`). Celery's intervals run from each scheduler's last send, so their phase drifts and
  two schedulers have different ones: the window is what every scheduler agrees on.

Who fires: :class:`LedgerScheduler` is ``celery beat``'s scheduler (``create_app`` makes it the
default), and :class:`FleetScheduler` runs the same schedules in the workers' housekeeping, one
worker at a time under a fleet-wide lease, so that no beat process is needed. Each entry's last
slot sent is kept in the broker: a worker that takes the lease over resumes from it.

A message sent by a scheduler that names no slot (``celery beat`` with another scheduler class,
which marks its messages with Celery's ``celery_beat_task`` header, :data:`BEAT_HEADER`) is a
job of its own each tick: every tick runs, and two such schedulers run a tick twice, as in plain
Celery. While such a beat fires (:func:`note_foreign_beat`), the fleet's scheduler stands down,
or every tick would run twice.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule

from . import headers
from .broker import SweepLock
from .errors import ConfigurationError, LedgerError, StoreError
from .explain import exiting_on_mistakes
from .identity import slot_key
from .ledger.record import TERMINAL
from .ledger.schedule_controls import ScheduleControls
from .policies.schedule import (
    Overlap,
    SchedulePolicy,
    catch_up,
    in_range,
    jitter_of,
    overlap,
)
from .schedule_definitions import beat_problems, definition_of, stored_entries, stored_spec
from .untrusted import utc_of_unix

logger = logging.getLogger("celery_ledger.schedules")

# Celery's own header (5.7): beat marks every message it sends with it (true). A periodic run of
# celery-ledger's schedulers names its entry and slot in its key, not in a header of its own: a
# worker of an earlier release refuses an unknown ledger_ header, and takes the key.
BEAT_HEADER = "celery_beat_task"
# Tasks of the default beat schedule that the workers run by themselves (the reconciler's
# sweep, in their housekeeping): the fleet's scheduler does not publish them.
IN_HOUSEKEEPING = frozenset({"celery_ledger.reconcile"})
# ``beat_scheduler``: Celery's default, and celery-ledger's (create_app sets it in its place)
CELERY_BEAT_SCHEDULER = "celery.beat:PersistentScheduler"
LEDGER_BEAT_SCHEDULER = "celery_ledger.schedules:LedgerScheduler"
# The fleet scheduler's lease: a holder renews it every housekeeping pass; a dead holder's
# successor fires what fell due within about this long.
FLEET_LEASE_SECONDS = 10.0
MAX_FIRED_PER_TICK = 1000  # entries fired in one housekeeping pass (the rest in the next)
# While a slot is buffered behind a running one (overlap ``buffer_one``), the scheduler looks
# at least this often whether that run ended
BUFFERED_CHECK_SECONDS = 1.0
# A pause or a resume reaches every scheduler within this long (each reads the ledger's
# schedule controls at most this often)
PAUSED_READ_SECONDS = 2.0
# A backfill sends at most this many runs (a wider range is refused: narrow it)
MAX_BACKFILL = 10_000
# How long a send by a beat of another scheduler class keeps the fleet's scheduler standing
# down (beat sends at least every max loop interval, 5 minutes by default, when it has entries).
FOREIGN_BEAT_SECONDS = 600
_WARN_EVERY_SECONDS = 600.0


def lease_key(app_name: str) -> str:
    """The fleet scheduler's lease (its holder: ``<host>:<pid>|<token>``)."""
    return f"{app_name}:ledger:schedules"


def slots_key(app_name: str) -> str:
    """The broker's hash of each schedule entry's last slot sent (by any scheduler)."""
    return f"{lease_key(app_name)}:slots"


def buffered_key(app_name: str) -> str:
    """Each entry's buffered slot (overlap ``buffer_one``: sent when the run before it ends)."""
    return f"{app_name}:ledger:schedules:buffered"


def foreign_key(app_name: str) -> str:
    """Set while a beat of another scheduler class sends this app's periodic runs."""
    return f"{lease_key(app_name)}:foreign-beat"


def note_foreign_beat(client: redis.Redis, app_name: str, host: str) -> None:
    """A beat that names no slot sent a run (``LedgerTask.apply_async`` saw it): the fleet's
    scheduler stands down for :data:`FOREIGN_BEAT_SECONDS`. Best effort (a broker away)."""
    try:
        client.set(foreign_key(app_name), host, ex=FOREIGN_BEAT_SECONDS)
    except redis.RedisError as exc:
        logger.warning("could not note the beat of another scheduler class: %s", exc)


def fleet_entries(beat_schedule: Mapping[str, Any] | None) -> dict[str, Any]:
    """The entries of ``beat_schedule`` the fleet's scheduler fires (not the reconciler's)."""
    return {
        name: entry
        for name, entry in (beat_schedule or {}).items()
        if not (isinstance(entry, Mapping) and entry.get("task") in IN_HOUSEKEEPING)
    }


def is_interval(entry: ScheduleEntry) -> bool:
    return type(entry.schedule) is interval_schedule


def window_seconds(entry: ScheduleEntry) -> float:
    """An interval entry's window: its period (a sub-second one: a second, since a slot is
    named to the second; windows of a second or more always fall in distinct seconds)."""
    return float(max(entry.schedule.run_every.total_seconds(), 1.0))


def slot_of(entry: ScheduleEntry, *, broker_now: float) -> float:
    """When the run ``entry`` is firing now was due (unix seconds, whole seconds).

    ``broker_now``: the broker's clock (an interval's window is on its grid)."""
    sched = entry.schedule
    if is_interval(entry):
        period = window_seconds(entry)
        return float(math.floor(broker_now / period) * period)
    if isinstance(sched, crontab):
        # The occurrence itself (not "now" plus the time left, which reads the clock twice):
        # wall-clock arithmetic in the schedule's time zone, then to UTC (a DST change moves
        # the UTC instant, never the wall time the crontab names).
        start, delta, _now = sched.remaining_delta(entry.last_run_at)
        return float(round((start + delta).astimezone(UTC).timestamp()))
    # solar or an app's own schedule: the next event after the last run; the time left is
    # added in UTC (an aware local time plus a timedelta is wall-clock arithmetic)
    now = sched.now()
    now = now if now.tzinfo is not None else now.replace(tzinfo=UTC)
    due = now.astimezone(UTC) + sched.remaining_estimate(entry.last_run_at)
    return float(round(due.timestamp()))


@dataclass(frozen=True)
class BrokerNow:
    """A calendar schedule's ``nowfun`` (Celery's hook for a schedule's clock): now on the
    broker's clock, in the app's time zone, as ``app.now()`` would give it on this host's.

    A crontab or solar schedule judges what is due, and which occurrence comes next, from its
    ``now()``: on the host's clock, a scheduler whose clock runs 40 s fast fires every
    minute's run 40 s early, and one that runs slow fires late. Compared by app: crontab's
    equality compares its ``nowfun``, and Celery rebuilds its heap when a schedule changes."""

    app: Any

    def __call__(self) -> datetime:
        now = self.app.runtime.message_time()
        return datetime.fromtimestamp(now, UTC).astimezone(self.app.timezone)


class LedgerEntry(ScheduleEntry):  # type: ignore[misc]
    """Celery's schedule entry, its schedule on the broker's clock (:class:`BrokerNow`): what
    is due, and when Celery's heap looks at an entry again (its last run, on the clock of the
    scheduler that sent it, against now on this one's), all on one clock. A ``nowfun`` the app
    gave its schedule itself is left as it is."""

    def __init__(
        self, *args: Any, policy: SchedulePolicy | Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        # (set first: Celery's entries copy themselves with ``dict(entry)``, which keeps it)
        self.policy = SchedulePolicy.of(policy)
        super().__init__(*args, **kwargs)
        self._on_broker_clock()

    def update(self, other: ScheduleEntry) -> None:
        """Celery's update of an entry from a changed definition, its policy included."""
        super().update(other)
        self.policy = policy_of(other)

    def default_now(self) -> datetime:
        # (Celery's __init__ reads it for a new entry's last run: on the broker's clock too)
        self._on_broker_clock()
        now: datetime = super().default_now()
        return now

    def _on_broker_clock(self) -> None:
        sched = self.schedule
        if self.app is not None and getattr(sched, "nowfun", False) is None:
            sched.nowfun = BrokerNow(self.app)


def policy_of(entry: ScheduleEntry) -> SchedulePolicy:
    """``entry``'s policy (the default one for an entry made by Celery's own classes)."""
    found = getattr(entry, "policy", None)
    return found if isinstance(found, SchedulePolicy) else SchedulePolicy.of(None)


def marked_options(entry_name: str, options: Mapping[str, Any], slot: float) -> dict[str, Any]:
    """An entry's publish options for its run of ``slot``: the run's key in its headers.

    An ``idempotency_key`` among the entry's options is dropped: it would make every tick after
    the first a duplicate of it (the slot key is the run's identity)."""
    marked = {name: value for name, value in options.items() if name != "idempotency_key"}
    marked["headers"] = {
        **dict(options.get("headers") or {}),
        headers.KEY: slot_key(entry_name, slot),
    }
    return marked


class LedgerScheduling:
    """What both schedulers add to Celery's: each message names its entry's slot, an interval
    fires once in each window of its grid, and each entry's policy holds (policies/schedule.py:
    catch-up, overlap, jitter, start and end).

    Celery runs an interval from the moment its last run was sent and checks it again a period
    after that, so its phase drifts later by each send's latency, and polled (the fleet's
    scheduler ticks once a housekeeping pass) it fires a period plus up to a pass apart: either
    way a window is skipped now and then. Here an interval is due whenever the broker's clock
    is in a window it has not sent, and is checked again as the next window starts."""

    Entry = LedgerEntry
    app: Any
    producer: Any
    schedule: dict[str, ScheduleEntry]
    _heap: Any

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Celery's tick, after the entries declared at run time are brought in, the slots
        whose publish failed are sent again, and the buffered slots whose previous run ended
        are sent (and soon again while one waits: the scheduler would sleep until the next
        entry is due)."""
        self.refresh_entries()
        self.resend_unsent(self.producer)
        self.release_buffered(self.producer)
        delay: float = super().tick(*args, **kwargs)  # type: ignore[misc]
        waiting = self._buffered() or self._unsent()
        return min(delay, BUFFERED_CHECK_SECONDS) if waiting else delay

    def schedules_equal(self, old: Any, new: Any) -> bool:
        """Whether Celery's heap still stands for the schedule. Celery compares every entry at
        every tick, and a tick fires one entry: with a thousand entries due each second that
        was 70% of a pass (``ops/bench/schedules.py``). Here an entry's definition changes only
        where the heap is rebuilt anyway (a new holder's setup, :meth:`refresh_entries`), so
        the names are compared (an entry added or gone)."""
        if old is None or new is None:
            return old is new
        return bool(old.keys() == new.keys())

    def is_due(self, entry: ScheduleEntry) -> tuple[bool, float]:
        due, next_in = self._due(entry)
        if self._paused(entry.name):
            if due:  # a slot that falls due while its entry is paused is skipped, not kept
                self._skip(entry, "paused")
            return False, min(next_in, PAUSED_READ_SECONDS)
        if due and not self._in_range(entry):
            return False, next_in
        return due, next_in

    def _due(self, entry: ScheduleEntry) -> tuple[bool, float]:
        if not is_interval(entry):
            due: tuple[bool, float] = super().is_due(entry)  # type: ignore[misc]
            return due
        broker_now = self.app.runtime.message_time()
        window = slot_of(entry, broker_now=broker_now)
        until_next = window + window_seconds(entry) - broker_now
        return window > self._sent().get(entry.name, -math.inf), max(until_next, 0.01)

    def _in_range(self, entry: ScheduleEntry) -> bool:
        """Whether the slot ``entry`` is due for lies within its policy's start and end; one
        before the start is passed over (not counted: the entry had not begun)."""
        policy = policy_of(entry)
        if policy.start is None and policy.end is None:
            return True
        slot = self._slot(entry, self.app.runtime.message_time())
        where = in_range(policy, slot)
        if where == "before":
            self._skip(entry, None)
        return where == "within"

    def _slot(self, entry: ScheduleEntry, broker_now: float) -> float:
        try:
            return slot_of(entry, broker_now=broker_now)
        except Exception as exc:  # an app's schedule class that cannot say: a slot per second
            logger.warning("slot of %s unknown (%s): keyed by the second", entry.name, exc)
            return float(math.floor(broker_now))

    def _skip(self, entry: ScheduleEntry, reason: str | None) -> None:
        """Pass over the slot ``entry`` is due for, never sent: counted with ``reason``."""
        slot = self._slot(entry, self.app.runtime.message_time())
        if is_interval(entry):
            self._sent()[entry.name] = slot
        self.schedule[entry.name] = next(entry)
        # (Celery keeps the entry it asked about in its heap when it is not due: asked again,
        # a crontab's passed slot would be skipped again and again; the heap is rebuilt)
        self._heap = None
        if reason is not None:
            self.app.observers.schedule_skipped(entry.name, entry.task, slot, reason)

    def _paused(self, name: str) -> bool:
        """Whether an operator paused entry ``name``."""
        return name in self._controls()[0]

    def _controls(self) -> tuple[frozenset[str], dict[str, dict[str, Any]]]:
        """What operators changed at run time (the ledger's schedule controls: the paused
        entries, the definitions of the entries declared there), read at most every
        ``PAUSED_READ_SECONDS``; while the ledger is away, the last answer."""
        cache = self.__dict__.setdefault("_ledger_controls", [-math.inf, frozenset(), {}])
        now = time.monotonic()
        if now - cache[0] >= PAUSED_READ_SECONDS:
            cache[0] = now
            try:
                cache[1], cache[2] = self._read_controls()
            except LedgerError as exc:
                logger.warning("could not read the schedules' run-time changes: %s", exc)
        return cache[1], cache[2]

    def _read_controls(self) -> tuple[frozenset[str], dict[str, dict[str, Any]]]:
        return ScheduleControls(self.app.ledger).read()

    def _code_entries(self) -> Mapping[str, Any]:
        """The entries the app declares in code (this scheduler's share of them)."""
        return fleet_entries(self.app.conf.beat_schedule)

    def refresh_entries(self) -> None:
        """Bring the entries declared at run time into the schedule as they change (an entry
        of the same name in code wins); an unchanged one keeps its place in its schedule."""
        declared = self._controls()[1]
        if declared is self.__dict__.get("_ledger_merged_from"):
            return  # (the same read: Celery ticks once per entry fired)
        self.__dict__["_ledger_merged_from"] = declared
        merged: dict[str, Any] = self.__dict__.setdefault("_ledger_merged", {})
        if declared == merged:
            return
        code = self._code_entries()
        for name in merged.keys() - declared.keys():
            if name not in code:
                self.schedule.pop(name, None)
        changed = {n: d for n, d in declared.items() if merged.get(n) != d and n not in code}
        entries = stored_entries(changed, self.app.runtime.sealer)
        kept = {name: self.schedule[name] for name in entries if name in self.schedule}
        self.update_from_dict(entries)  # type: ignore[attr-defined]
        for name, old in kept.items():  # (its last run kept, as Celery's merge keeps it: a
            self.schedule[name].last_run_at = old.last_run_at  # slot due now is still sent)
        self.__dict__["_ledger_merged"] = dict(declared)
        self._heap = None  # (a changed definition of a kept name too: see schedules_equal)

    def reserve(self, entry: ScheduleEntry) -> ScheduleEntry:
        """Celery's step before it sends a due entry: here the slots it sends are chosen (the
        one due, and the missed ones its catch-up policy runs; the others are counted as
        skipped), and the entry moves on past them."""
        broker_now = self.app.runtime.message_time()
        slot = self._slot(entry, broker_now)
        policy = policy_of(entry)
        due = self._due_slots(entry, slot, broker_now, policy)
        send, skipped = catch_up(policy, due, broker_now)
        for passed in skipped:
            self.app.observers.schedule_skipped(entry.name, entry.task, passed, "missed")
        self._pending()[entry.name] = send
        if is_interval(entry):
            self._sent()[entry.name] = max(due)
        following: ScheduleEntry = next(entry)
        self.schedule[entry.name] = following
        return following

    def _due_slots(
        self, entry: ScheduleEntry, first: float, now: float, policy: SchedulePolicy
    ) -> list[float]:
        """The slots of ``entry`` due now, oldest first: ``first`` (the one Celery fires) and,
        where the policy may run missed slots, those that passed after it unfired (within the
        catch-up window: older ones pass uncounted)."""
        earliest = now - policy.catch_up_window_seconds - policy.late_after_seconds
        if is_interval(entry):
            # (an interval's due window is the latest one: those that passed between the last
            # window and it are the missed, counted even where none of them runs)
            last = self._sent().get(entry.name)
            if last is None:
                return [first]
            period = window_seconds(entry)
            start = max(last + period, earliest, first - MAX_BACKFILL * period)
            if start >= first:
                return [first]  # none passed between the last window and this one
            return [float(w) for w in _grid(start, first, period)]
        elif isinstance(entry.schedule, crontab):
            if now - first <= policy.late_after_seconds:
                return [first]  # on time: the usual case, and no later occurrence passed
            start = max(first, earliest)
        else:
            return [first]  # solar, an app's own class: the one due, as Celery fires it
        try:
            found = slots_between(entry, start, now)
        except ConfigurationError:  # more than MAX_BACKFILL in the window: the latest one
            found = []
        return found or [first]

    def apply_async(
        self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        if advance:
            self.reserve(entry)
        slots = self._pending().pop(entry.name, None)
        if slots is None:  # sent without a reserve (beat's own apply_async callers)
            slots = [slot_of(entry, broker_now=self.app.runtime.message_time())]
        result, failed = None, None
        for slot in slots:
            try:
                result = self._send_unless_overlapping(entry, slot, producer, **kwargs)
            except Exception as exc:  # the broker away: sent again at the next tick
                self._unsent().setdefault(entry.name, []).append(slot)
                failed = failed or exc
        if failed is not None:
            raise failed  # (Celery logs it: "Message Error")
        return result

    def resend_unsent(self, producer: Any = None) -> None:
        """Send again the slots whose publish failed (the broker away, its connection reset),
        while they are within their policy's ``late_after_seconds``; older ones are missed
        (counted). Without it a slot whose publish failed was lost, as with Celery's beat."""
        unsent = self._unsent()
        if not unsent or not self._due_check("unsent"):
            return
        now = self.app.runtime.message_time()
        for name, slots in list(unsent.items()):
            del unsent[name]
            entry = self.schedule.get(name)
            if entry is None:
                continue
            late_after = policy_of(entry).late_after_seconds
            for index, slot in enumerate(slots):
                if now - slot > late_after or self._paused(name):
                    reason = "paused" if self._paused(name) else "missed"
                    self.app.observers.schedule_skipped(name, entry.task, slot, reason)
                    continue
                try:
                    self._send_unless_overlapping(entry, slot, producer)
                except Exception as exc:  # still away: again at the next tick
                    unsent.setdefault(name, []).extend(slots[index:])
                    logger.warning("could not send %s's run of %s yet: %s", name, slot, exc)
                    break

    def _send_unless_overlapping(
        self, entry: ScheduleEntry, slot: float, producer: Any, **kwargs: Any
    ) -> Any:
        policy = policy_of(entry)
        if policy.overlap is not Overlap.ALLOW_ALL:
            verdict = overlap(
                policy,
                previous_running=self._running(entry),
                buffered=entry.name in self._buffered(),
            )
            if verdict == "skip":
                self.app.observers.schedule_skipped(entry.name, entry.task, slot, "overlap")
                return None
            if verdict == "buffer":
                self._buffer(entry.name, slot)
                return None
        return self._send(entry, slot, producer, **kwargs)

    def _send(self, entry: ScheduleEntry, slot: float, producer: Any, **kwargs: Any) -> Any:
        options = marked_options(entry.name, entry.options, slot)
        delay = jitter_of(policy_of(entry), entry.name, slot)
        if delay > 0:
            options["countdown"] = delay
        marked = entry.__class__(**dict(entry, options=options))
        result = super().apply_async(  # type: ignore[misc]
            marked, producer=producer, advance=False, **kwargs
        )
        self.fired(entry.name, slot)
        lag = self.app.runtime.message_time() - slot
        self.app.observers.scheduled(entry.name, entry.task, slot, lag)
        return result

    # Whether the last slots sent are written once per pass (the fleet's scheduler, whose
    # pass fires every entry due) rather than once per run (beat)
    saves_per_pass = False

    def fired(self, entry_name: str, slot: float) -> None:
        """A run of ``entry_name`` for ``slot`` was sent: kept as the entry's last slot in the
        broker (``ledger schedules list`` shows it; the fleet's next holder resumes from it)."""
        self._last_runs()[entry_name] = slot
        self._sent_at()[entry_name] = self.app.runtime.message_time()
        self._unsaved()[entry_name] = slot
        if not self.saves_per_pass:
            self.save_fired()

    def save_fired(self) -> None:
        """Write the last slots sent since the last write, in one command. (A holder that dies
        before it writes them: its successor sends those slots again, duplicates the ledger
        suppresses by their key.)"""
        unsaved = self._unsaved()
        if not unsaved:
            return
        runtime = self.app.runtime
        try:
            runtime.redis.hset(slots_key(runtime.name), mapping=dict(unsaved))
        except redis.RedisError as exc:  # the runs are sent; kept here for the next write
            logger.warning("could not keep the last slots of %s: %s", ", ".join(unsaved), exc)
            return
        unsaved.clear()

    # -- overlap: the run of the last slot sent, and the slot buffered behind it ------------------

    def _running(self, entry: ScheduleEntry) -> bool:
        """Whether the run of the last slot sent of ``entry`` has not ended (its record in
        the ledger is not final). A run whose message no worker has taken yet (no record)
        counts as running for ``late_after_seconds`` after it was sent, then as ended (a message
        lost for good must not hold the entry back forever); a ledger that is away does not
        hold a slot back."""
        previous = self._last_run(entry.name)
        if previous is None:
            return False
        try:
            record = self.app.ledger.get(entry.task, slot_key(entry.name, previous))
        except LedgerError as exc:
            logger.warning("could not read the last run of %s: %s", entry.name, exc)
            return False
        if record is None:
            sent_at = self._sent_at().get(entry.name, previous)
            waited = self.app.runtime.message_time() - sent_at
            return bool(waited <= policy_of(entry).late_after_seconds)
        return record.state not in TERMINAL

    def _last_run(self, name: str) -> float | None:
        runs = self._last_runs()
        if name not in runs:
            runtime = self.app.runtime
            try:
                runs[name] = _number(runtime.redis.hget(slots_key(runtime.name), name))
            except redis.RedisError as exc:
                logger.warning("could not read the last slot of %s: %s", name, exc)
                return None
        return runs[name]

    def _buffer(self, name: str, slot: float) -> None:
        self._buffered()[name] = slot
        runtime = self.app.runtime
        try:
            runtime.redis.hset(buffered_key(runtime.name), name, slot)
        except redis.RedisError as exc:  # kept here; a successor would not know of it
            logger.warning("could not keep the buffered slot of %s: %s", name, exc)

    def release_buffered(self, producer: Any = None) -> int:
        """Send each buffered slot whose entry's previous run has ended; how many it sent.
        (Only entries whose policy buffers ever have one: the others pay nothing. Looked at
        once every ``BUFFERED_CHECK_SECONDS``, not at every tick: each look reads the ledger.)"""
        buffered = self._buffered()
        if not buffered or not self._due_check("buffered"):
            return 0
        sent = 0
        runtime = self.app.runtime
        for name, slot in list(buffered.items()):
            entry = self.schedule.get(name)
            if entry is not None and not self._paused(name) and self._running(entry):
                continue
            try:
                if entry is not None and not self._paused(name):
                    self._send(entry, slot, producer)
                    sent += 1
                elif entry is not None:
                    self.app.observers.schedule_skipped(name, entry.task, slot, "paused")
            except Exception as exc:  # the broker away: kept, sent at a later look
                logger.warning("could not send %s's buffered run of %s yet: %s", name, slot, exc)
                continue
            del buffered[name]
            try:
                runtime.redis.hdel(buffered_key(runtime.name), name)
            except redis.RedisError as exc:  # (a successor may send it again: once by its key)
                logger.warning("could not clear the buffered slot of %s: %s", name, exc)
        return sent

    def _due_check(self, what: str) -> bool:
        """Whether ``what`` (an occasional look) is due: at most every BUFFERED_CHECK_SECONDS."""
        looks: dict[str, float] = self.__dict__.setdefault("_ledger_looks", {})
        now = self.app.runtime.message_time()  # (read locally between the broker's readings)
        if now - looks.get(what, -math.inf) < BUFFERED_CHECK_SECONDS:
            return False
        looks[what] = now
        return True

    def _buffered(self) -> dict[str, float]:
        """Each entry's buffered slot (the broker's hash, read once per scheduler)."""
        found = self.__dict__.get("_ledger_buffered")
        if found is None:
            runtime = self.app.runtime
            found = {}
            try:
                stored = runtime.redis.hgetall(buffered_key(runtime.name))
            except redis.RedisError as exc:
                logger.warning("could not read the buffered slots: %s", exc)
                return found  # (read again next time)
            for raw_name, raw_slot in stored.items():
                value = _number(raw_slot)
                if value is not None:
                    found[_text(raw_name) or ""] = value
            self.__dict__["_ledger_buffered"] = found
        return found

    def _resume(self) -> None:
        """Take up from each entry's last slot sent, kept in the broker by whichever scheduler
        sent it: a new holder of the fleet's lease, or a beat (re)started."""
        runtime = self.app.runtime
        stored = runtime.redis.hgetall(slots_key(runtime.name))
        # (what another holder sent and buffered meanwhile: read from the broker again)
        self.__dict__.pop("_ledger_buffered", None)
        self._last_runs().clear()
        for raw_name, raw_slot in stored.items():
            name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
            entry = self.schedule.get(name)
            slot = _number(raw_slot)
            self._last_runs()[name] = slot
            moment = utc_of_unix(slot)
            if entry is None or slot is None or moment is None:
                continue
            if is_interval(entry):
                self._sent()[name] = slot
            # Its last run was that slot: Celery looks at it again when the next one is due
            # (an interval's next window; a crontab's next occurrence, which fires now if it
            # fell due meanwhile), not a whole period after the takeover. A slot the last
            # holder sent already is a duplicate its key suppresses.
            self.schedule[name] = entry.__class__(**dict(entry, last_run_at=moment))
        self._heap = None  # (Celery rebuilds its heap only when an entry's definition changed)

    def _reset_to_code_and_stored(self) -> None:
        """The schedule as the app's code and the ledger declare it, from the last slots."""
        self.merge_inplace(self._code_entries())  # type: ignore[attr-defined]
        self.__dict__["_ledger_merged"] = {}
        self.__dict__.pop("_ledger_merged_from", None)
        self.refresh_entries()
        self._resume()

    def _pending(self) -> dict[str, list[float]]:
        """Each reserved entry's slots to send, until they are sent."""
        return self.__dict__.setdefault("_ledger_pending", {})  # type: ignore[no-any-return]

    def _sent(self) -> dict[str, float]:
        """Each interval entry's last window passed (sent or skipped; broker's clock)."""
        return self.__dict__.setdefault("_ledger_sent", {})  # type: ignore[no-any-return]

    def _unsent(self) -> dict[str, list[float]]:
        """Each entry's slots whose publish failed, to send again (:meth:`resend_unsent`)."""
        return self.__dict__.setdefault("_ledger_unsent", {})  # type: ignore[no-any-return]

    def _sent_at(self) -> dict[str, float]:
        """When (the broker's clock) each entry's last slot was sent by this scheduler."""
        return self.__dict__.setdefault("_ledger_sent_at", {})  # type: ignore[no-any-return]

    def _unsaved(self) -> dict[str, float]:
        """The last slots sent not yet written to the broker (:meth:`save_fired`)."""
        return self.__dict__.setdefault("_ledger_unsaved", {})  # type: ignore[no-any-return]

    def _last_runs(self) -> dict[str, float | None]:
        """Each entry's last slot sent (the broker's hash, read once per entry)."""
        return self.__dict__.setdefault("_ledger_last_runs", {})  # type: ignore[no-any-return]


class LedgerScheduler(LedgerScheduling, Scheduler):  # type: ignore[misc]
    """``celery beat``'s scheduler (``beat_scheduler``): its messages name their entry's slot,
    so any number of beats may run and a slot runs once. Nothing is kept on disk: each entry's
    last slot is kept in the broker, as the fleet's scheduler keeps it, and a beat (re)started
    resumes from it. (Celery's persistent scheduler kept entries in a shelve, whose copies
    read back after each sync lost what an entry carries beyond Celery's own fields: its
    policy, its app, its schedule's clock.)"""

    def setup_schedule(self) -> None:
        # beat's start: a mistake (a schedule that cannot run, the broker away) is one line, not
        # Celery's critical log of its traceback before ours
        with exiting_on_mistakes(self.app.settings):
            if problems := beat_problems(self.app.conf.beat_schedule):
                raise ConfigurationError("; ".join(problems))
            self._reset_to_code_and_stored()

    def _code_entries(self) -> Mapping[str, Any]:
        return dict(self.app.conf.beat_schedule or {})  # (beat fires the reconciler's too)

    def sync(self) -> None:
        """Nothing to write on disk (the last slots are in the broker)."""


class FleetScheduler(LedgerScheduling, Scheduler):  # type: ignore[misc]
    """The app's ``beat_schedule``, run in a worker's housekeeping while it holds the fleet's
    schedule lease (:meth:`tick_if_leader`). Nothing is kept on disk: each entry's last slot
    is kept in the broker, for whoever holds the lease next."""

    saves_per_pass = True

    def __init__(self, app: Any, *, ttl_seconds: float = FLEET_LEASE_SECONDS) -> None:
        runtime = app.runtime
        self._client = runtime.redis
        self._name = runtime.name
        self._lock = SweepLock(self._client, lease_key(runtime.name), ttl_seconds=ttl_seconds)
        self._token: int | None = None
        self._warned_at = -math.inf
        super().__init__(app, lazy=True)

    def setup_schedule(self) -> None:
        """Nothing until this worker holds the lease (:meth:`tick_if_leader` sets it up)."""

    def tick_if_leader(self) -> float | None:
        """Fire what is due if this worker holds (or now takes) the lease; else None."""
        if self._foreign_beat():
            return None
        token = self._lock.acquire()
        if token is None:
            self._token = None
            return None
        if token != self._token:  # newly the holder: resume from the fleet's last slots
            self._reset_to_code_and_stored()
            self._token = token
        try:
            # (Celery's tick fires one due entry per call and answers 0 while more are due)
            for _ in range(MAX_FIRED_PER_TICK):
                delay: float = self.tick()
                if delay > 0:
                    return delay
        except BaseException:
            # Celery's tick pops an entry off its heap before it fires it: an error on the
            # way would leave that entry out of the schedule for good. Rebuilt next pass.
            self._heap = None
            raise
        finally:
            self.save_fired()  # (the pass's last slots, in one write)
        return 0.0

    def stop(self, timeout: float = 0.0) -> None:
        """The worker stops: give the lease up, so another worker fires the next slots now
        rather than once the lease runs out (housekeeping's stop hook)."""
        if self._token is not None:
            self._lock.release()
            self._token = None

    def _foreign_beat(self) -> bool:
        host = self._client.get(foreign_key(self._name))
        if host is None:
            return False
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_SECONDS:
            self._warned_at = now
            logger.warning(
                "a celery beat of another scheduler class (on %s) sends this app's periodic"
                " runs, each tick a job of its own: the workers do not run the schedule while"
                " it does (or every tick would run twice)",
                host.decode() if isinstance(host, bytes) else host,
            )
        if self._token is not None:
            self._lock.release()
            self._token = None
        return True

    def sync(self) -> None:
        """Nothing to write on disk (the last slots are in the broker)."""

    def close(self) -> None:
        self.sync()


@dataclass(frozen=True)
class EntryState:
    """What ``ledger schedules list`` shows of an entry."""

    name: str
    task: str
    schedule: str
    last_slot: datetime | None
    next_due: datetime | None
    paused: dict[str, Any] | None = None  # by whom, when, why (None: not paused)
    policy: str = "default"  # what of its policy differs from the default
    origin: str = "code"  # or "ledger": declared at run time (``ledger schedules create``)


def fleet_state(app: Any) -> tuple[str | None, str | None, list[EntryState]]:
    """The fleet scheduler's holder (or None), the host of a beat of another scheduler class
    sending runs (or None), and each entry of the app's schedule with its last slot sent and
    when it is next due (reads from the broker)."""
    app.loader.import_default_modules()  # (where entries are declared with @app.periodic)
    if problems := beat_problems(app.conf.beat_schedule):
        raise ConfigurationError("; ".join(problems))
    runtime = app.runtime
    client = runtime.redis
    holder, foreign = client.get(lease_key(runtime.name)), client.get(foreign_key(runtime.name))
    stored = client.hgetall(slots_key(runtime.name))
    last = {(k.decode() if isinstance(k, bytes) else str(k)): _number(v) for k, v in stored.items()}
    controls = ScheduleControls(app.ledger)
    paused = controls.paused()
    code = fleet_entries(app.conf.beat_schedule)
    stored = {
        name: spec
        for name, spec in stored_entries(  # (shown, never sent: sealed arguments stay so)
            {name: doc["definition"] for name, doc in controls.declared().items()}
        ).items()
        if name not in code
    }
    states = []
    for name, spec in sorted({**stored, **code}.items()):
        entry = LedgerEntry(**dict(spec, name=name, app=app))
        slot = last.get(name)
        due: float | None = None
        if slot is not None:
            if is_interval(entry):
                due = slot + window_seconds(entry)
            else:
                try:
                    following = LedgerEntry(**dict(spec, name=name, app=app))
                    following.last_run_at = datetime.fromtimestamp(slot, UTC)
                    due = slot_of(following, broker_now=slot)
                except Exception:  # an app's own schedule class: shown without its next time
                    due = None
        control = paused.get(name)
        if control is not None:
            control = {k: control.get(k) for k in ("changed_by", "changed_at", "reason")}
        states.append(
            EntryState(
                name,
                entry.task,
                str(entry.schedule),
                _utc(slot),
                _utc(due),
                control,
                policy_of(entry).describe(),
                "code" if name in code else "ledger",
            )
        )
    return _text(holder), _text(foreign), states


def entry_of(app: Any, name: str, *, opened: bool = True) -> ScheduleEntry:
    """Entry ``name`` of the app's schedule, declared in code or at run time (raises
    ``ConfigurationError`` naming the others). ``opened`` False: a sensitive entry's arguments
    are left sealed (to pause or resume it, where no key is needed); else a key that cannot
    open them raises ``StoreError``."""
    entries = fleet_entries(app.conf.beat_schedule)
    if name not in entries:
        declared = ScheduleControls(app.ledger).declared()
        if isinstance((found := declared.get(name, {}).get("definition")), dict):
            try:
                stored = stored_spec(found, app.runtime.sealer if opened else None)
            except (StoreError, KeyError, TypeError, ValueError) as exc:
                raise ConfigurationError(f"schedule entry {name!r} does not read: {exc}") from None
            return LedgerEntry(**dict(stored, name=name, app=app))
        entries = {**stored_entries({n: d["definition"] for n, d in declared.items()}), **entries}
    spec: dict[str, Any] | None = entries.get(name)
    if spec is None:
        known = ", ".join(sorted(entries)) or "none"
        raise ConfigurationError(f"no schedule entry {name!r} in beat_schedule (entries: {known})")
    return LedgerEntry(**dict(spec, name=name, app=app))


def _grid(start: float, end: float, period: float) -> list[float]:
    """The windows of ``period`` on its grid from ``start`` to ``end`` (both included)."""
    first = math.ceil(start / period) * period
    return [first + period * n for n in range(int((end - first) // period) + 1)]


def slots_between(entry: ScheduleEntry, start: float, end: float) -> list[float]:
    """The slots of ``entry`` from ``start`` to ``end`` (unix seconds, both included), as its
    schedulers name them: an interval's windows on its grid, a crontab's occurrences in its
    time zone. Raises ``ConfigurationError`` for another kind of schedule (a solar event is
    known only relative to now) or for more than ``MAX_BACKFILL`` slots."""
    found: list[float] = []
    if is_interval(entry):
        period = window_seconds(entry)
        slot = math.ceil(start / period) * period
        while slot <= end:
            found.append(float(slot))
            slot += period
            if len(found) > MAX_BACKFILL:
                break
    elif isinstance(entry.schedule, crontab):
        last = datetime.fromtimestamp(start - 1, UTC)
        while len(found) <= MAX_BACKFILL:
            following = entry.__class__(**dict(entry, last_run_at=last))
            slot = slot_of(following, broker_now=start)
            if slot > end:
                break
            if not found or slot > found[-1]:
                found.append(slot)
            last = datetime.fromtimestamp(slot, UTC)
    else:
        raise ConfigurationError(
            f"{entry.name}: only interval and crontab schedules can be backfilled"
            f" ({type(entry.schedule).__name__} names its slots relative to now)"
        )
    if len(found) > MAX_BACKFILL:
        raise ConfigurationError(
            f"{entry.name}: more than {MAX_BACKFILL} slots in that range: narrow it"
        )
    return found


def send_slot(app: Any, entry: ScheduleEntry, slot: float) -> str:
    """Send the run of ``entry`` for ``slot``, as its schedulers do (keyed by the slot, so a
    slot that already ran is a duplicate the ledger suppresses); returns its message id."""
    options = marked_options(entry.name, entry.options, slot)
    task = app.tasks.get(entry.task)
    if task is not None:
        result = task.apply_async(entry.args, entry.kwargs, **options)
    else:
        result = app.send_task(entry.task, entry.args, entry.kwargs, **options)
    return str(result.id)


def _utc(value: float | None) -> datetime | None:
    return None if value is None else utc_of_unix(value)


def _text(raw: Any) -> str | None:
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.split("|")[0]


def _number(raw: Any) -> float | None:
    try:
        return float(raw.decode() if isinstance(raw, bytes) else raw)
    except (TypeError, ValueError):
        return None


__all__ = [
    "BEAT_HEADER",
    "BrokerNow",
    "EntryState",
    "FleetScheduler",
    "LedgerEntry",
    "LedgerScheduler",
    "definition_of",  # (its documented path: defined in schedule_definitions)
    "fleet_state",
    "marked_options",
    "note_foreign_beat",
    "slot_of",
]
