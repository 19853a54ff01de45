"""A periodic run's identity: (schedule entry, slot), the same whichever scheduler fires it and
whenever it gets to it; never a hash of the entry's arguments."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab, schedule, solar
from cryptography.fernet import Fernet

from celery_ledger import headers
from celery_ledger.crypto import Sealer
from celery_ledger.events import Observer, Observers
from celery_ledger.identity import slot_key, slot_of_key
from celery_ledger.schedules import fleet_entries, marked_options, slot_of

# (a run-time entry of a sensitive task reads with these keys)
SEALER = Sealer([Fernet.generate_key().decode()])

APP = Celery("schedules-unit", set_as_current=False)
APP.conf.update(enable_utc=True, timezone="UTC")


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def entry(sched: Any, last_run_at: datetime, name: str = "nightly") -> ScheduleEntry:
    return ScheduleEntry(
        name=name, task="shop.report", schedule=sched, last_run_at=last_run_at, app=APP
    )


def fixed(now: datetime) -> Any:
    return lambda: now


# -- intervals: a window on the broker's clock -----------------------------------------------


def test_an_interval_slot_is_its_window_whatever_the_schedulers_phase() -> None:
    # Two schedulers with different phases (Celery's intervals run from each one's last run)
    # fire within the same 10 s window: one slot, so one job
    early = entry(schedule(timedelta(seconds=10)), at("2026-11-28T10:00:01"))
    late = entry(schedule(timedelta(seconds=10)), at("2026-11-28T10:00:07"))
    window = at("2026-11-28T10:00:10").timestamp()

    assert slot_of(early, broker_now=window + 1.2) == window
    assert slot_of(late, broker_now=window + 9.9) == window
    assert slot_of(late, broker_now=window + 10.0) == window + 10


def test_one_scheduler_never_fires_two_runs_into_one_window() -> None:
    # Celery fires an interval no sooner than its period after the last run: each run has a
    # window of its own, even as the phase drifts with the scheduler's tick
    sched = schedule(timedelta(seconds=10))
    fired, slots = 1_000_000.37, []
    for drift in (0.0, 0.01, 0.4, 0.02, 0.6, 0.05):
        slots.append(slot_of(entry(sched, at("2026-11-28T10:00:00")), broker_now=fired))
        fired += 10 + drift
    assert len(set(slots)) == len(slots)


def test_sub_second_intervals_have_a_slot_per_second() -> None:
    quick = entry(schedule(0.25), at("2026-11-28T10:00:00"))
    assert slot_of(quick, broker_now=1_000_000.9) == 1_000_000.0


# -- crontab and solar: the occurrence the entry was due for ---------------------------------


def test_a_crontab_slot_is_the_occurrence_due_whenever_the_scheduler_gets_to_it() -> None:
    due = at("2026-11-28T10:05:00")
    for now in (due + timedelta(milliseconds=300), due + timedelta(seconds=40)):
        every_five = crontab(minute="*/5", nowfun=fixed(now), app=APP)
        # whatever the last run was since the previous occurrence (beat's own phase)
        for last in ("2026-11-28T10:00:00", "2026-11-28T10:00:03", "2026-11-28T10:04:59"):
            assert slot_of(entry(every_five, at(last)), broker_now=0.0) == due.timestamp()


def test_a_crontab_slot_after_downtime_is_the_first_occurrence_missed() -> None:
    # Beat down from 10:02 to 10:17: it fires once, for 10:05 (a successor that ran 10:05
    # already makes it a duplicate; Celery's beat does not fire every missed occurrence)
    now = at("2026-11-28T10:17:12")
    every_five = crontab(minute="*/5", nowfun=fixed(now), app=APP)
    assert slot_of(entry(every_five, at("2026-11-28T10:02:00")), broker_now=0.0) == (
        at("2026-11-28T10:05:00").timestamp()
    )


def test_a_crontab_in_a_time_zone_names_its_slot_in_utc() -> None:
    app = Celery("schedules-tz", set_as_current=False)
    app.conf.update(enable_utc=True, timezone="Europe/Berlin")
    now = at("2026-11-28T01:30:02")  # 02:30 in Berlin (winter time, UTC+1)
    daily = crontab(hour=2, minute=30, nowfun=fixed(now), app=app)
    run = ScheduleEntry(
        name="daily", task="t", schedule=daily, last_run_at=at("2026-11-27T01:30:05"), app=app
    )
    assert slot_of(run, broker_now=0.0) == at("2026-11-28T01:30:00").timestamp()


def test_a_solar_slot_is_the_event_due() -> None:
    now = at("2026-06-21T12:00:00")
    noon = solar("solar_noon", 52.52, 13.40, nowfun=fixed(now), app=APP)  # Berlin
    first = slot_of(entry(noon, at("2026-06-20T12:00:00")), broker_now=0.0)
    again = slot_of(entry(noon, at("2026-06-20T13:30:00")), broker_now=0.0)

    assert first == again  # the same event, whichever phase the scheduler had
    assert at("2026-06-21T10:00:00").timestamp() < first <= now.timestamp()
    assert first == int(first)


# -- the run's identity --------------------------------------------------------------------------


def test_a_run_is_named_by_its_entry_and_slot_never_by_its_arguments() -> None:
    slot = at("2026-11-28T10:05:00").timestamp()
    options = {"queue": "q", "idempotency_key": "report", "headers": {"x-team": "shop"}}
    marked = marked_options("nightly", options, slot)

    assert marked["headers"] == {
        "x-team": "shop",
        headers.KEY: "schedule:nightly@2026-11-28T10:05:00Z",
    }
    # and the body reads its slot back from its key (no header of its own: an earlier
    # release's worker refuses an unknown ledger_ header)
    assert slot_of_key(marked["headers"][headers.KEY]) == at("2026-11-28T10:05:00")
    # an entry's own key would make every tick after the first its duplicate: dropped
    assert "idempotency_key" not in marked and marked["queue"] == "q"
    assert options["headers"] == {"x-team": "shop"}  # the entry itself is left as it was
    assert slot_key("nightly", slot) != slot_key("nightly", slot + 300)
    assert slot_key("nightly", slot) != slot_key("weekly", slot)


@pytest.mark.parametrize(
    ("schedule_", "expected"),
    [
        ({}, {}),
        (None, {}),
        (
            {
                "celery-ledger-reconcile": {"task": "celery_ledger.reconcile", "schedule": 30},
                "nightly": {"task": "shop.report", "schedule": 60},
            },
            {"nightly": {"task": "shop.report", "schedule": 60}},
        ),
    ],
)
def test_the_fleet_fires_every_entry_but_the_reconcilers(
    schedule_: dict[str, Any] | None, expected: dict[str, Any]
) -> None:
    # (the workers run the reconciler in their housekeeping already)
    assert fleet_entries(schedule_) == expected


# -- firing: every window once, through Celery's own tick ------------------------------------------


def scheduler(clock: dict[str, float]) -> Any:
    """A scheduler of celery-ledger's over a clock the test moves; sends are recorded."""
    from types import SimpleNamespace

    from celery.beat import Scheduler

    from celery_ledger.schedules import LedgerScheduling

    class Recording(LedgerScheduling, Scheduler):  # type: ignore[misc]
        def send_task(self, name: str, *args: Any, **options: Any) -> None:
            if clock.get("broker_down"):
                raise ConnectionError("the broker is away")
            clock["now"] += clock.get("send_seconds", 0.0)  # a publish takes its time
            self.sent.append((name, options))

        def _read_controls(self) -> tuple[frozenset[str], dict[str, Any]]:
            # the ledger's controls, as the test sets them
            return frozenset(self.paused), dict(self.declared)

    app = Celery("schedules-fire", set_as_current=False)
    app.conf.update(enable_utc=True, timezone="UTC")
    lags: list[tuple[str, float, float]] = []
    kept: dict[str, dict[str, float]] = {}

    skipped: list[tuple[str, float]] = []
    reasons: list[str] = []

    class Lags(Observer):
        def scheduled(self, schedule: str, task: str, slot: float, lag_seconds: float) -> None:
            lags.append((schedule, slot, lag_seconds))

        def schedule_skipped(self, schedule: str, task: str, slot: float, reason: str) -> None:
            skipped.append((schedule, slot))
            reasons.append(reason)

    class Hashes:  # the broker's hashes (each entry's last slot, and its buffered one)
        def hset(
            self,
            key: str,
            field: str | None = None,
            value: float | None = None,
            mapping: dict[str, float] | None = None,
        ) -> None:
            kept.setdefault(key, {}).update(mapping or {field: value})

        def hget(self, key: str, field: str) -> float | None:
            return kept.get(key, {}).get(field)

        def hgetall(self, key: str) -> dict[str, float]:
            return dict(kept.get(key, {}))

        def hdel(self, key: str, field: str) -> None:
            kept.get(key, {}).pop(field, None)

    class Records:  # the ledger's records of the runs, by (task, key): what the test says
        def __init__(self) -> None:
            self.states: dict[str, Any] = {}

        def get(self, task: str, key: str) -> Any:
            state = self.states.get(key)
            return None if state is None else SimpleNamespace(state=state)

    app.observers = Observers(Lags())  # type: ignore[attr-defined]
    app.runtime = SimpleNamespace(  # type: ignore[attr-defined]
        name="shop", redis=Hashes(), message_time=lambda: clock["now"], sealer=SEALER
    )
    app.ledger = Records()  # type: ignore[attr-defined]
    app.now = lambda: datetime.fromtimestamp(clock["now"], UTC)  # type: ignore[method-assign]
    found = Recording(app, lazy=True)
    found.__dict__["producer"] = None  # (no broker here: sends are recorded)
    found.sent, found.lags, found.kept, found.skipped = [], lags, kept, skipped
    found.paused, found.declared = set(), {}
    found.skip_reasons = reasons
    return found


@pytest.mark.parametrize(
    ("poll", "send_seconds"),
    [(1.0, 0.03), (1.3, 0.0), (0.05, 0.025), (0.5, 0.4)],
    ids=["fleet-pass", "slow-pass", "beat-like", "slow-publish"],
)
def test_an_interval_fires_once_in_every_window_through_celerys_tick(
    poll: float, send_seconds: float
) -> None:
    # Celery runs an interval a period after its last send and checks it a period later: its
    # phase drifts by each send's latency and, polled, it skips windows. Here: every window
    # once, whatever the polling and the publish's time.
    start = 1_000_000.0
    clock = {"now": start + 0.3, "send_seconds": send_seconds}
    run = scheduler(clock)
    every_two = schedule(
        timedelta(seconds=2), nowfun=lambda: datetime.fromtimestamp(clock["now"], UTC)
    )
    run.update_from_dict({"tick": {"task": "shop.tick", "schedule": every_two}})
    while clock["now"] < start + 600:
        run.tick()  # (the fleet's pass, or beat's loop: Celery's own tick either way)
        clock["now"] += poll
    slots = [slot_of_key(options["headers"][headers.KEY]).timestamp() for _, options in run.sent]
    first = slots[0]
    assert slots == [first + 2 * n for n in range(len(slots))], "a window skipped or repeated"
    assert first <= start + 2 + 2 and len(slots) >= 295
    # each sent within a poll (and a publish or two) of its slot, and seen by the observers
    # (the lag metric); the first one 0.3 s into its window, when the scheduler started
    bound = poll + 2 * send_seconds + 0.31
    assert [slot for _, slot, _ in run.lags] == slots
    assert all(name == "tick" and 0 <= lag < bound for name, _, lag in run.lags)
    # and the last slot sent is kept in the broker (for the next holder, and `schedules list`)
    assert run.kept == {"shop:ledger:schedules:slots": {"tick": slots[-1]}}


@pytest.mark.parametrize("host_offset", [-3600, -40, 40, 3600], ids=["-1h", "-40s", "+40s", "+1h"])
def test_a_crontab_fires_each_occurrence_on_the_brokers_clock_whatever_the_hosts(
    host_offset: float,
) -> None:
    # A scheduler on a host whose clock is off: Celery judges a crontab on ``app.now()`` (the
    # host's), which would fire every run early (fast host) or late (slow). Each occurrence
    # fires when it is due on the broker's clock, named by that occurrence.
    start = 1_000_020.0
    clock = {"now": start}
    run = scheduler(clock)
    run.app.now = lambda: datetime.fromtimestamp(clock["now"] + host_offset, UTC)
    run.update_from_dict({"minutely": {"task": "shop.tick", "schedule": crontab()}})
    while clock["now"] < start + 600:
        run.tick()
        clock["now"] += 0.5
    slots = [slot for _, slot, _ in run.lags]
    assert slots == [slots[0] + 60 * n for n in range(len(slots))] and len(slots) >= 9
    assert all(slot % 60 == 0 for slot in slots)
    assert all(0 <= lag < 1.0 for _, _, lag in run.lags), run.lags


# -- crontab slots: the occurrence itself, whatever the clock's reading ----------------------------


def test_a_crontab_slot_is_the_occurrence_to_the_microsecond_clock() -> None:
    # (read twice, a real clock made "now + time left" land a second early, then floored)
    for micro in (1, 300, 999_999):
        now = at("2026-11-28T10:05:00") + timedelta(microseconds=micro)
        every_five = crontab(minute="*/5", nowfun=fixed(now), app=APP)
        run = entry(every_five, at("2026-11-28T10:00:00"))
        assert slot_of(run, broker_now=0.0) == at("2026-11-28T10:05:00").timestamp()


@pytest.mark.parametrize(
    "now", ["2026-03-29T00:30:00.2", "2026-03-29T01:10:00", "2026-03-29T05:00:00"]
)
def test_a_crontab_slot_across_the_spring_dst_change_is_one_instant(now: str) -> None:
    # Berlin's clocks go from 02:00 to 03:00 on 2026-03-29; 01:30 local is 00:30 UTC (CET).
    # Whether the scheduler gets to it on time or late (a restart, a takeover), one slot.
    app = Celery("schedules-dst", set_as_current=False)
    app.conf.update(enable_utc=True, timezone="Europe/Berlin")
    daily = crontab(hour=1, minute=30, nowfun=fixed(at(now)), app=app)
    run = ScheduleEntry(
        name="daily", task="t", schedule=daily, last_run_at=at("2026-03-28T00:30:05"), app=app
    )
    assert slot_of(run, broker_now=0.0) == at("2026-03-29T00:30:00").timestamp()


def test_only_a_periodic_runs_key_names_a_slot() -> None:
    assert slot_of_key(slot_key("a@b", 1.8e9)) == datetime.fromtimestamp(1.8e9, UTC)
    for key in ("order-7", "schedule:x", "schedule:x@2026-11-28", "h:abc", None, 7):
        assert slot_of_key(key) is None


def test_a_paused_entry_skips_its_slots_and_resumes_at_the_next(monkeypatch: Any) -> None:
    import celery_ledger.schedules as schedules_module

    monkeypatch.setattr(schedules_module, "PAUSED_READ_SECONDS", 0.0)  # read at every check
    start = 1_000_000.0
    clock = {"now": start + 0.3}
    run = scheduler(clock)
    every_two = schedule(
        timedelta(seconds=2), nowfun=lambda: datetime.fromtimestamp(clock["now"], UTC)
    )
    run.update_from_dict({"tick": {"task": "shop.tick", "schedule": every_two}})

    def until(moment: float) -> None:
        while clock["now"] < moment:
            run.tick()
            clock["now"] += 0.5

    until(start + 10)
    run.paused.add("tick")
    until(start + 30)
    run.paused.clear()
    until(start + 40)
    slots = [slot_of_key(options["headers"][headers.KEY]).timestamp() for _, options in run.sent]
    skipped = [slot for _, slot in run.skipped]
    # every window either ran once or was skipped (paused), none both, none late after it
    every = sorted(slots + skipped)
    assert every == [every[0] + 2 * n for n in range(len(every))] and every[0] <= start + 4
    assert skipped and all(start + 10 <= slot < start + 32 for slot in skipped)
    assert not [slot for slot in slots if start + 12 <= slot < start + 30]
    assert max(slots) >= start + 38  # resumed: its windows run again, from the next


def test_backfill_slots_are_those_its_schedulers_name() -> None:
    from celery_ledger.errors import ConfigurationError
    from celery_ledger.schedules import slots_between

    every_ten = entry(schedule(timedelta(seconds=10)), at("2026-11-28T10:00:00"))
    start = at("2026-11-28T10:00:05").timestamp()
    assert slots_between(every_ten, start, start + 30) == [start + 5, start + 15, start + 25]
    hourly = entry(crontab(minute=5, app=APP), at("2026-11-28T00:00:00"))
    found = slots_between(
        hourly, at("2026-11-28T10:05:00").timestamp(), at("2026-11-28T13:04:59").timestamp()
    )
    assert found == [at(f"2026-11-28T{h}:05:00").timestamp() for h in (10, 11, 12)]
    with pytest.raises(ConfigurationError, match="only interval and crontab"):
        slots_between(entry(solar("sunrise", 52.5, 13.4, app=APP), at("2026-11-28T00:00:00")), 0, 1)
    with pytest.raises(ConfigurationError, match="narrow it"):
        slots_between(every_ten, 0, 10 * 20_000)


def test_backfill_slots_of_a_daily_crontab_across_the_autumn_dst_change_are_one_a_day() -> None:
    # Berlin's clocks go back from 03:00 to 02:00 on 2026-10-25: 02:30 local happens twice,
    # and the daily 02:30 job has one slot that day, as every other day
    app = Celery("schedules-dst-backfill", set_as_current=False)
    app.conf.update(enable_utc=True, timezone="Europe/Berlin")
    from celery_ledger.schedules import slots_between

    daily = ScheduleEntry(
        name="daily",
        task="t",
        schedule=crontab(hour=2, minute=30, app=app),
        last_run_at=at("2026-10-20T00:00:00"),
        app=app,
    )
    found = slots_between(
        daily, at("2026-10-23T00:00:00").timestamp(), at("2026-10-27T00:00:00").timestamp()
    )
    assert len(found) == 4, [datetime.fromtimestamp(s, UTC) for s in found]
