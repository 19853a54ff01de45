"""A periodic entry's policy: catch-up after downtime, overlap with a run still going, jitter,
start and end. The pure decisions, then each through Celery's own tick over a moved clock."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery.schedules import crontab, schedule

from celery_ledger import headers
from celery_ledger.errors import ConfigurationError
from celery_ledger.identity import slot_key, slot_of_key
from celery_ledger.ledger.record import State
from celery_ledger.policies.schedule import (
    CatchUp,
    Overlap,
    SchedulePolicy,
    catch_up,
    in_range,
    jitter_of,
    overlap,
)

from .test_schedules import scheduler

START = 1_000_020.0  # a minute's start (unix seconds): START % 60 == 0


# -- the decisions --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "sent", "skipped"),
    [
        (CatchUp.SKIP, [990], [100, 500, 900]),
        (CatchUp.LATEST, [990], [100, 500, 900]),
        (CatchUp.ALL, [500, 900, 990], [100]),
    ],
)
def test_catch_up_runs_what_its_policy_says_of_the_missed_slots_and_always_the_one_on_time(
    policy: CatchUp, sent: list[float], skipped: list[float]
) -> None:
    chosen = SchedulePolicy(catch_up=policy, catch_up_window_seconds=600, late_after_seconds=60)
    assert catch_up(chosen, [100, 500, 900, 990], now=1000) == (sent, skipped)


@pytest.mark.parametrize(
    ("policy", "sent"), [(CatchUp.SKIP, []), (CatchUp.LATEST, [900]), (CatchUp.ALL, [500, 900])]
)
def test_with_no_slot_on_time_latest_runs_the_last_missed_one(
    policy: CatchUp, sent: list[float]
) -> None:
    chosen = SchedulePolicy(catch_up=policy, catch_up_window_seconds=600, late_after_seconds=60)
    send, skip = catch_up(chosen, [100, 500, 900], now=1000)
    assert send == sent and sorted(send + skip) == [100, 500, 900]


@pytest.mark.parametrize(
    ("policy", "running", "buffered", "verdict"),
    [
        (Overlap.ALLOW_ALL, True, False, "send"),
        (Overlap.SKIP, False, False, "send"),
        (Overlap.SKIP, True, False, "skip"),
        (Overlap.BUFFER_ONE, True, False, "buffer"),
        (Overlap.BUFFER_ONE, True, True, "skip"),
        (Overlap.BUFFER_ONE, False, True, "send"),
    ],
)
def test_overlap_verdicts(policy: Overlap, running: bool, buffered: bool, verdict: str) -> None:
    chosen = SchedulePolicy(overlap=policy)
    assert overlap(chosen, previous_running=running, buffered=buffered) == verdict


def test_jitter_is_the_same_for_a_slot_whoever_asks_and_within_its_bound() -> None:
    policy = SchedulePolicy(jitter_seconds=30)
    delays = [jitter_of(policy, "nightly", START + 60 * n) for n in range(200)]
    assert delays == [jitter_of(policy, "nightly", START + 60 * n) for n in range(200)]
    assert all(0 <= d < 30 for d in delays) and max(delays) - min(delays) > 20
    assert jitter_of(SchedulePolicy(), "nightly", START) == 0.0


def test_start_and_end_bound_the_slots() -> None:
    begin = datetime(2026, 12, 1, tzinfo=UTC)
    policy = SchedulePolicy(start=begin, end=begin + timedelta(days=1))
    assert in_range(policy, begin.timestamp() - 1) == "before"
    assert in_range(policy, begin.timestamp()) == "within"
    assert in_range(policy, begin.timestamp() + 86400) == "within"
    assert in_range(policy, begin.timestamp() + 86401) == "after"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"catch_up": "sometimes"}, "catch_up='sometimes' is not one of 'skip', 'latest', 'all'"),
        ({"overlap": "queue"}, "overlap='queue' is not one of"),
        ({"jitter_seconds": -1}, "jitter_seconds must be >= 0"),
        ({"start": datetime(2026, 1, 1)}, "start must be an aware datetime"),
        ({"jiter_seconds": 5}, "unknown jiter_seconds"),
        (
            {"start": datetime(2026, 1, 2, tzinfo=UTC), "end": datetime(2026, 1, 1, tzinfo=UTC)},
            "end must come after start",
        ),
    ],
)
def test_a_mistaken_policy_says_what_is_wrong(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match="schedule policy: " + message.replace("(", r"\(")):
        SchedulePolicy.of(given)


# -- through Celery's tick ------------------------------------------------------------------------


def slots_sent(run: Any) -> list[float]:
    return [slot_of_key(options["headers"][headers.KEY]).timestamp() for _, options in run.sent]


def run_until(run: Any, clock: dict[str, float], moment: float, step: float = 0.5) -> None:
    while clock["now"] < moment:
        run.tick()
        clock["now"] += step


@pytest.mark.parametrize("policy", list(CatchUp))
def test_a_crontab_after_ten_minutes_down_runs_what_its_catch_up_says(policy: CatchUp) -> None:
    clock = {"now": START}
    run = scheduler(clock)
    every_minute = {"task": "shop.tick", "schedule": crontab(), "policy": {"catch_up": policy}}
    run.update_from_dict({"minutely": every_minute})
    run_until(run, clock, START + 125)  # the slots of START+60 and START+120
    before = slots_sent(run)
    assert before == [START + 60, START + 120]
    clock["now"] = START + 725  # down 10 minutes: 180 ... 720 passed unfired
    run_until(run, clock, START + 790)
    after = slots_sent(run)[2:]
    missed = [START + 60 * n for n in range(3, 12)]  # 180 ... 660: more than 60 s late
    on_time = [START + 720, START + 780]
    expected = {CatchUp.SKIP: on_time, CatchUp.LATEST: on_time, CatchUp.ALL: missed + on_time}
    assert after == expected[policy]
    skipped = [slot for _, slot in run.skipped]
    assert sorted(skipped + after) == missed + on_time  # every slot either ran or was counted


def test_an_interval_catches_up_every_missed_window_within_its_window_with_all() -> None:
    clock = {"now": START + 0.3}
    run = scheduler(clock)
    every_ten = schedule(timedelta(seconds=10))
    policy = {"catch_up": "all", "catch_up_window_seconds": 100, "late_after_seconds": 5}
    run.update_from_dict({"ten": {"task": "shop.tick", "schedule": every_ten, "policy": policy}})
    run_until(run, clock, START + 21)
    assert slots_sent(run) == [START + 10, START + 20]  # (Celery: a period after it starts)
    clock["now"] = START + 300.5  # down: 30 ... 290 passed unfired
    run_until(run, clock, START + 301)
    # the windows of the last 100 s run, oldest first; the one just older is counted as
    # skipped, and older ones pass uncounted
    assert slots_sent(run)[2:] == [START + 10 * n for n in range(21, 31)]
    assert [slot for _, slot in run.skipped] == [START + 200]


def test_overlap_skip_passes_slots_while_the_previous_run_runs() -> None:
    clock = {"now": START + 0.3}
    run = scheduler(clock)
    policy = {"overlap": "skip"}
    every_two = schedule(timedelta(seconds=2))
    run.update_from_dict({"two": {"task": "shop.tick", "schedule": every_two, "policy": policy}})
    first = START + 2  # (Celery fires an interval a period after it starts)
    run_until(run, clock, first + 1)
    assert slots_sent(run) == [first]
    run.app.ledger.states[slot_key("two", first)] = State.RUNNING  # a long run
    run_until(run, clock, first + 9)
    assert slots_sent(run) == [first]
    assert [slot for _, slot in run.skipped] == [first + 2, first + 4, first + 6, first + 8]
    assert set(run.skip_reasons) == {"overlap"}
    run.app.ledger.states[slot_key("two", first)] = State.SUCCEEDED
    run_until(run, clock, first + 11)
    assert slots_sent(run) == [first, first + 10]


def test_overlap_buffer_one_runs_one_slot_when_the_previous_ends() -> None:
    clock = {"now": START + 0.3}
    run = scheduler(clock)
    policy = {"overlap": "buffer_one"}
    every_two = schedule(timedelta(seconds=2))
    run.update_from_dict({"two": {"task": "shop.tick", "schedule": every_two, "policy": policy}})
    first = START + 2
    run_until(run, clock, first + 1)
    run.app.ledger.states[slot_key("two", first)] = State.RUNNING
    run_until(run, clock, first + 7)
    # the first slot behind the run waits (kept in the broker, for a successor); later ones skip
    assert slots_sent(run) == [first]
    assert run.kept["shop:ledger:schedules:buffered"] == {"two": first + 2}
    assert [slot for _, slot in run.skipped] == [first + 4, first + 6]
    run.app.ledger.states[slot_key("two", first)] = State.DEAD
    run.app.ledger.states[slot_key("two", first + 2)] = State.RUNNING
    clock["now"] += 1.0  # (a scheduler looks at what it buffered every second)
    run.tick()
    assert slots_sent(run) == [first, first + 2]  # sent as its own slot, when the run ended
    # (and the window due meanwhile waits behind that one, now running)
    assert run.kept["shop:ledger:schedules:buffered"] == {"two": first + 8}


def test_jitter_delays_each_run_and_names_its_slot() -> None:
    clock = {"now": START + 0.3}
    run = scheduler(clock)
    policy = SchedulePolicy(jitter_seconds=1.5)
    every_two = schedule(timedelta(seconds=2))
    run.update_from_dict({"two": {"task": "shop.tick", "schedule": every_two, "policy": policy}})
    run_until(run, clock, START + 40)
    slots = slots_sent(run)
    assert slots == [START + 2 * n for n in range(1, 20)]
    delays = [options.get("countdown", 0.0) for _, options in run.sent]
    assert delays == [jitter_of(policy, "two", slot) for slot in slots]
    assert all(0 <= d < 1.5 for d in delays) and len(set(delays)) > 5


def test_start_and_end_bound_the_runs() -> None:
    clock = {"now": START + 0.3}
    run = scheduler(clock)
    policy = SchedulePolicy(
        start=datetime.fromtimestamp(START + 10, UTC), end=datetime.fromtimestamp(START + 20, UTC)
    )
    every_two = schedule(timedelta(seconds=2))
    run.update_from_dict({"two": {"task": "shop.tick", "schedule": every_two, "policy": policy}})
    run_until(run, clock, START + 40)
    assert slots_sent(run) == [START + 10 + 2 * n for n in range(6)]
    assert run.skipped == []  # (before its start and after its end: not slots it missed)


# -- entries declared at run time -----------------------------------------------------------------


def test_an_entry_declared_at_run_time_runs_every_slot_and_stops_when_deleted(
    monkeypatch: Any,
) -> None:
    import celery_ledger.schedules as schedules_module
    from celery_ledger.schedules import definition_of

    monkeypatch.setattr(schedules_module, "PAUSED_READ_SECONDS", 0.0)  # read at every tick

    clock = {"now": START + 0.3}
    run = scheduler(clock)
    every_ten = schedule(timedelta(seconds=10))
    run.update_from_dict({"code": {"task": "shop.code", "schedule": every_ten}})
    run.declared["added"] = definition_of(
        "shop.added", every=2, args=[7], policy={"jitter_seconds": 0}
    )
    run_until(run, clock, START + 10, step=0.25)
    added = [slot for name, slot, _ in run.lags if name == "added"]
    assert added == [added[0] + 2 * n for n in range(len(added))] and len(added) >= 3
    assert {name for name, _ in run.sent} == {"shop.added"}  # (the code's: 10 s from the start)
    # an unchanged declaration keeps its place (read again, not merged again)
    run.declared["added"] = dict(run.declared["added"])
    run_until(run, clock, START + 20, step=0.25)
    added = [slot for name, slot, _ in run.lags if name == "added"]
    assert added == [added[0] + 2 * n for n in range(len(added))] and len(added) >= 8
    del run.declared["added"]
    run_until(run, clock, START + 21, step=0.25)
    count = len(run.sent)
    run_until(run, clock, START + 40, step=0.25)
    after = [name for name, _ in run.sent[count:]]
    assert after and set(after) == {"shop.code"} and "added" not in run.schedule
    assert "code" in run.schedule  # (the code's entry stays)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({}, "every N seconds or a cron expression: one of them"),
        ({"every": 5, "cron": "* * * * *"}, "one of them"),
        ({"every": 0.5}, "every must be at least 1 second"),
        ({"cron": "61 * * * *"}, "cron '61 \\* \\* \\* \\*'"),
        ({"cron": "* *"}, "five fields"),
        ({"every": 5, "policy": {"overlap": "queue"}}, "overlap='queue'"),
        ({"every": 5, "policy": {"start": "tomorrow"}}, "start 'tomorrow'"),
    ],
)
def test_a_mistaken_run_time_entry_says_what_is_wrong(given: dict[str, Any], message: str) -> None:
    from celery_ledger.schedules import definition_of

    with pytest.raises(ConfigurationError, match=message):
        definition_of("shop.tick", **given)


@pytest.mark.parametrize("at", [59.0, 59.75, 60.0, 60.25, 61.0])
def test_an_entry_redefined_at_run_time_as_a_slot_falls_due_still_sends_it(
    monkeypatch: Any, at: float
) -> None:
    import celery_ledger.schedules as schedules_module
    from celery_ledger.schedules import definition_of

    monkeypatch.setattr(schedules_module, "PAUSED_READ_SECONDS", 0.0)  # read at every tick
    clock = {"now": START + 0.3}
    run = scheduler(clock)
    policy = {"jitter_seconds": 0}
    run.declared["m"] = definition_of("shop.m", cron="* * * * *", args=[1], policy=policy)
    run_until(run, clock, START + at, step=0.25)
    # When its definition changes around a minute's slot (new arguments, a resealed token)
    run.declared["m"] = definition_of("shop.m", cron="* * * * *", args=[2], policy=policy)
    run_until(run, clock, START + 125, step=0.25)
    # Then every slot is sent once, that one included
    assert slots_sent(run) == [START + 60, START + 120]


def test_a_stored_entry_that_no_longer_reads_is_left_out_not_fatal() -> None:
    from celery_ledger.schedules import definition_of, stored_entries

    good = definition_of("shop.tick", cron="5 * * * *", policy={"catch_up": "all"})
    found = stored_entries({"good": good, "bad": {**good, "cron": "nonsense"}, "worse": {}})
    assert list(found) == ["good"]
    assert found["good"]["policy"].catch_up is CatchUp.ALL


def test_a_sensitive_entrys_arguments_are_stored_sealed_and_read_with_the_keys_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from cryptography.fernet import Fernet

    from celery_ledger.crypto import REDACTED, Sealer
    from celery_ledger.schedule_definitions import (
        definition_of,
        sealed_definition,
        stored_entries,
    )

    keys = Sealer([Fernet.generate_key().decode()])
    plain = definition_of("shop.charge", every=60, args=["4111"], kwargs={"amount": 5})
    stored = sealed_definition(plain, keys)
    # Stored: no argument in clear, and no timing where a release before sealing reads it (it
    # leaves such an entry out, as one that does not read, rather than run it without them)
    assert "4111" not in repr(stored) and not {"args", "kwargs", "every", "cron"} & set(stored)
    with pytest.raises(KeyError):
        float(stored["every"])  # (what that release's reader does first)
    # Read with the keys: the arguments and timing as declared
    found = stored_entries({"charge": stored}, keys)
    assert found["charge"]["args"] == ("4111",) and found["charge"]["kwargs"] == {"amount": 5}
    assert found["charge"]["schedule"] == 60.0
    # Read to be shown (no sealer): there, its arguments the redaction marker
    assert stored_entries({"charge": stored})["charge"]["args"] == (REDACTED,)
    # With keys that do not open it: left out, said why, the others still read
    other = Sealer([Fernet.generate_key().decode()])
    with caplog.at_level(logging.WARNING, "celery_ledger"):
        assert list(stored_entries({"charge": stored, "tick": plain}, other)) == ["tick"]
    assert "cannot be opened" in caplog.text


def test_interval_windows_a_stalled_scheduler_passed_run_late_or_are_counted_as_missed() -> None:
    clock = {"now": START + 0.3}
    run = scheduler(clock)
    run.update_from_dict({"one": {"task": "shop.tick", "schedule": schedule(timedelta(seconds=1))}})
    run_until(run, clock, START + 3)
    sent = slots_sent(run)
    assert sent[-1] == START + 2
    clock["now"] += 4.0  # a pass that took 4 s (an overloaded host): 4 windows passed unfired
    run.tick()
    # within late_after_seconds (60) of due: still run, late (the lag metric says how late)
    assert slots_sent(run)[len(sent) :] == [START + n for n in range(3, 8)]
    assert run.skipped == []
    sent = slots_sent(run)
    clock["now"] += 70.0  # stalled 70 s: windows more than 60 s old are missed, and counted
    run.tick()
    now = clock["now"]
    late = slots_sent(run)[len(sent) :]
    assert late == [START + n for n in range(8, int(now - START) + 1) if now - (START + n) <= 60]
    missed = [slot for _, slot in run.skipped]
    assert missed == [START + n for n in range(8, int(now - START) + 1) if now - (START + n) > 60]
    assert set(run.skip_reasons) == {"missed"}


@pytest.mark.parametrize("outage", [20.0, 90.0], ids=["20s", "90s"])
def test_slots_whose_publish_failed_are_sent_when_the_broker_is_back(outage: float) -> None:
    clock = {"now": START + 0.3}
    run = scheduler(clock)
    run.update_from_dict({"two": {"task": "shop.tick", "schedule": schedule(timedelta(seconds=2))}})
    run_until(run, clock, START + 5)
    before = slots_sent(run)
    clock["broker_down"] = True
    down_at = clock["now"]
    run_until(run, clock, down_at + outage)
    clock["broker_down"] = False
    run_until(run, clock, down_at + outage + 3)
    now = clock["now"]
    expected = [slot for slot in range(int(START) + 2, int(now), 2)]
    sent = slots_sent(run)
    missed = [slot for _, slot in run.skipped]
    # every window once: sent (late, if the outage was shorter than late_after_seconds) or,
    # past that, counted as missed; none lost without a trace, none sent twice
    assert sorted(sent + missed) == expected[: len(sent) + len(missed)]
    assert len(sent) + len(missed) >= len(expected) - 1
    assert len(set(sent)) == len(sent) and sent[: len(before)] == before
    if outage < 60:
        assert missed == []
    else:
        assert missed and all(now - 3 - slot > 60 for slot in missed)


def test_overlap_counts_a_run_not_yet_taken_as_running_for_late_after_seconds() -> None:
    clock = {"now": START + 0.3}
    run = scheduler(clock)
    policy = {"overlap": "skip", "late_after_seconds": 10}
    every_two = schedule(timedelta(seconds=2))
    run.update_from_dict({"two": {"task": "shop.tick", "schedule": every_two, "policy": policy}})
    first = START + 2
    run_until(run, clock, first + 1)
    # no worker has taken the first run's message (no record): the next slots wait...
    run_until(run, clock, first + 9)
    assert slots_sent(run) == [first]
    # ...for late_after_seconds, then the entry goes on (a lost message holds nothing back)
    run_until(run, clock, first + 13)
    assert slots_sent(run) == [first, first + 12]  # (10 s after the first was sent)


def test_app_periodic_declares_entries_for_a_task_and_a_workflow_and_refuses_the_rest() -> None:
    from celery_ledger import Settings, create_app

    settings = Settings(broker_url="redis://127.0.0.1:1/0", mongo_uri="mongodb://127.0.0.1:1/")
    app = create_app("periodic-unit", settings=settings, set_as_current=False)

    @app.periodic(crontab(minute=5), name="rollup", overlap="skip")  # type: ignore[untyped-decorator]
    @app.task(name="unit.rollup")  # type: ignore[untyped-decorator]
    def rollup() -> None: ...

    @app.periodic(60.0, kwargs={"report": "daily"})
    @app.workflow(name="unit.flow")  # type: ignore[untyped-decorator]
    def flow(wf: Any, report: str) -> None: ...

    entries = app.conf.beat_schedule
    assert entries["rollup"]["task"] == "unit.rollup"
    assert entries["rollup"]["policy"].overlap is Overlap.SKIP
    started = entries["unit.flow"]
    assert started["task"] == "celery_ledger.workflow.start"
    assert started["args"] == ("unit.flow", [], {"report": "daily"})
    assert started["options"]["queue"] == app.tiers.queue("default")
    with pytest.raises(ConfigurationError, match=r"put it above @app\.task or @app\.workflow"):
        app.periodic(5.0)(lambda: None)
    with pytest.raises(ConfigurationError, match="overlap='queue'"):
        app.periodic(5.0, overlap="queue")


def test_a_paused_crontab_counts_each_slot_once_and_runs_none_of_them_after() -> None:
    import celery_ledger.schedules as schedules_module

    clock = {"now": START + 0.3}
    run = scheduler(clock)
    minutely = {"task": "shop.tick", "schedule": crontab(), "policy": {"catch_up": "all"}}
    run.update_from_dict({"minutely": minutely})
    run_until(run, clock, START + 61)
    assert slots_sent(run) == [START + 60]
    run.paused.add("minutely")
    run.__dict__["_ledger_controls"][0] = -1e18  # (read the controls again now)
    run_until(run, clock, START + 301)
    run.paused.clear()
    run.__dict__["_ledger_controls"][0] = -1e18
    run_until(run, clock, START + 421, step=1.0)
    skipped = [slot for _, slot in run.skipped]
    assert skipped == [START + 60 * n for n in range(2, 6)], skipped  # each once
    assert slots_sent(run) == [START + 60, START + 360, START + 420]
    assert schedules_module.PAUSED_READ_SECONDS == 2.0


def test_a_crontab_starting_later_fires_from_its_start() -> None:
    clock = {"now": START + 0.3}
    run = scheduler(clock)
    policy = SchedulePolicy(start=datetime.fromtimestamp(START + 300, UTC))
    run.update_from_dict({"m": {"task": "shop.tick", "schedule": crontab(), "policy": policy}})
    run_until(run, clock, START + 430, step=1.0)
    assert slots_sent(run) == [START + 300, START + 360, START + 420]


def test_a_new_holder_fires_an_intervals_next_window_on_time_not_a_period_later() -> None:
    window = 3600 * 278.0  # an hourly window (on the grid from the epoch)
    clock = {"now": window - 10}
    run = scheduler(clock)
    hourly = schedule(timedelta(hours=1))
    run.kept["shop:ledger:schedules:slots"] = {"hourly": window - 3600}  # the last one sent
    run.update_from_dict({"hourly": {"task": "shop.tick", "schedule": hourly}})
    run._resume()  # (what a new holder of the lease does)
    run_until(run, clock, window + 5, step=1.0)
    assert slots_sent(run) == [window]
