"""The replay of a workflow's code against its log (pure: the fold and the ``wf`` context)."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from celery_ledger.errors import NonDeterminism, StepFailed, WorkflowCancelled
from celery_ledger.workflow.context import Call, Signal, Suspend, WorkflowContext
from celery_ledger.workflow.history import WorkflowState, as_of, fold

NOW = 1_800_000_000.0


class Log:
    """A workflow's log being written: the events a context emits, applied as a wake does."""

    def __init__(self) -> None:
        self.state = WorkflowState(id="wf-1", workflow="shop.fulfil", key="k")
        self.state.apply(
            {"kind": "started", "seq": 0, "at": NOW, "data": {"workflow": "shop.fulfil"}}
        )
        self.events: list[dict[str, Any]] = []

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        event = {"kind": kind, "data": data, "seq": self.state.seq + 1, "at": NOW}
        self.state.apply(event)
        self.events.append(event)

    def context(self, *, now: float = NOW, signals: tuple[Signal, ...] = ()) -> WorkflowContext:
        self.events = []
        return WorkflowContext(
            self.state,
            now=now,
            signals=signals,
            call_of=lambda target, args, kwargs: Call("step", str(target), args, kwargs),
            job_id_of=lambda call, pos: f"job-{pos}",
            decode=lambda text: None if text is None else __import__("json").loads(text),
            emit=self.emit,
        )

    def complete(self, pos: int, result: str) -> None:
        self.emit("completed", {"pos": pos, "result": result})


def run(log: Log, code: Any, **options: Any) -> Any:
    context = log.context(**options)
    try:
        return code(context)
    except Suspend:
        return Suspend


def two_steps(wf: WorkflowContext) -> list[Any]:
    return [wf.run("charge", 7), wf.run("ship", 7)]


def test_a_new_step_is_recorded_and_waits_then_a_replay_returns_recorded_results() -> None:
    log = Log()
    assert run(log, two_steps) is Suspend
    assert [e["kind"] for e in log.events] == ["scheduled"]
    assert log.state.commands[0].job_id == "job-0" and log.state.commands[0].args == "[[7],{}]"
    log.complete(0, '"charged"')
    assert run(log, two_steps) is Suspend  # the second step is new
    assert [(e["kind"], e["data"]["name"]) for e in log.events] == [("scheduled", "ship")]
    log.complete(1, '"shipped"')
    assert run(log, two_steps) == ["charged", "shipped"]
    assert log.events == []  # a replay of the past records nothing


def test_a_different_step_at_a_recorded_position_is_non_determinism_naming_both() -> None:
    log = Log()
    run(log, two_steps)
    log.complete(0, '"charged"')

    def changed(wf: WorkflowContext) -> Any:
        return wf.run("refund", 7)

    context = log.context()
    with pytest.raises(NonDeterminism, match=r"recorded step 'charge'.*asks for step 'refund'"):
        changed(context)
    assert context.nondeterminism is not None  # seen even if the code swallowed the error


def test_version_gates_a_change_for_new_workflows_only() -> None:
    def gated(wf: WorkflowContext) -> Any:
        if wf.version("fast-ship", 2) == 2:
            return wf.run("fast_ship", 7)
        return wf.run("ship", 7)

    # A workflow that passed this point before the change keeps its path, no position taken
    old = Log()
    run(old, lambda wf: wf.run("ship", 7))
    old.complete(0, '"shipped"')
    assert run(old, gated) == "shipped"
    # A new one records the version and takes the new path, and replays it the same way
    new = Log()
    assert run(new, gated) is Suspend
    assert new.state.commands[0].kind == "version" and new.state.commands[0].version == 2
    new.complete(1, '"fast"')
    assert run(new, gated) == "fast"


def test_a_failed_step_raises_step_failed_which_the_code_may_catch() -> None:
    log = Log()
    run(log, two_steps)
    log.emit("step_failed", {"pos": 0, "error": "card declined"})
    with pytest.raises(StepFailed, match="card declined"):
        run(log, two_steps)

    def fallback(wf: WorkflowContext) -> Any:
        try:
            return wf.run("charge", 7)
        except StepFailed:
            return "invoice instead"

    assert run(log, fallback) == "invoice instead"


def test_gather_schedules_every_member_and_returns_when_all_are_done() -> None:
    log = Log()

    def fan_out(wf: WorkflowContext) -> Any:
        return wf.gather(["a", "b", "c"])

    assert run(log, fan_out) is Suspend
    assert sorted(c.name for c in log.state.commands.values()) == ["a", "b", "c"]
    log.complete(2, "3")
    log.complete(0, "1")
    assert run(log, fan_out) is Suspend and log.events == []
    log.complete(1, "2")
    assert run(log, fan_out) == [1, 2, 3]


def test_a_timer_waits_until_due_and_fires_once() -> None:
    log = Log()

    def sleeper(wf: WorkflowContext) -> str:
        wf.sleep(60)
        return "woke"

    context = log.context()
    with pytest.raises(Suspend):
        sleeper(context)
    assert context.waiting_until == [NOW + 60]
    assert run(log, sleeper, now=NOW + 30) is Suspend
    assert run(log, sleeper, now=NOW + 61) == "woke"
    assert [e["kind"] for e in log.events] == ["fired"]
    assert run(log, sleeper, now=NOW + 1000) == "woke" and log.events == []


def test_a_signal_is_consumed_once_by_the_first_wait_for_its_name() -> None:
    log = Log()
    first = Signal("s1", "approved", '"yes"', NOW - 5)
    second = Signal("s2", "approved", '"again"', NOW - 1)

    def waits_twice(wf: WorkflowContext) -> list[Any]:
        return [wf.wait_signal("approved"), wf.wait_signal("approved", timeout=10)]

    assert run(log, waits_twice, signals=(second, first)) == ["yes", "again"]
    assert log.state.consumed_signals == ["s1", "s2"]
    # A replay with the signals still around (not deleted yet) consumes nothing again
    assert run(log, waits_twice, signals=(first, second)) == ["yes", "again"]
    assert log.events == []


def test_a_signal_wait_times_out_to_none() -> None:
    log = Log()

    def waits(wf: WorkflowContext) -> Any:
        return wf.wait_signal("approved", timeout=10)

    assert run(log, waits) is Suspend
    assert run(log, waits, now=NOW + 11) is None
    assert [e["kind"] for e in log.events] == ["timed_out"]


def test_cancellation_is_raised_where_the_code_waits_and_again_there_on_replay() -> None:
    log = Log()
    run(log, two_steps)
    log.complete(0, '"charged"')
    log.emit("cancel_requested", {"reason": "customer", "actor": "ops"})
    with pytest.raises(WorkflowCancelled, match="customer"):
        run(log, two_steps)  # the first step is resolved: raised at the second
    assert log.state.cancel_pos == 1
    with pytest.raises(WorkflowCancelled):
        run(log, two_steps)


def charge_then_ship(wf: WorkflowContext) -> list[Any]:
    charged = wf.run("charge", 7)
    wf.compensate("refund", 7)
    return [charged, wf.run("ship", 7)]


def test_a_cancellation_waits_for_the_step_in_flight_so_its_compensation_is_registered() -> None:
    # Given a cancellation requested while the charge runs (its job runs whatever happens)
    log = Log()
    run(log, charge_then_ship)
    log.emit("cancel_requested", {"reason": "customer", "actor": "ops"})

    # Then the code is not cancelled at the charge: it waits for it
    assert run(log, charge_then_ship) is Suspend
    assert log.state.cancel_pos is None and log.events == []

    # And once the charge is done, its refund is registered before the cancellation lands
    log.complete(0, '"charged"')
    with pytest.raises(WorkflowCancelled, match="customer"):
        run(log, charge_then_ship)
    assert [c.kind for c in log.state.compensations()] == ["compensation"]
    assert log.state.cancel_pos == 2  # at the ship, never scheduled
    assert all(c.name != "ship" for c in log.state.commands.values())


def test_a_step_that_fails_under_a_pending_cancellation_ends_the_code_cancelled() -> None:
    # Given a child workflow the cancellation reached (it ends failed)
    log = Log()
    run(log, charge_then_ship)
    log.emit("cancel_requested", {"reason": "customer", "actor": "ops"})
    log.emit("step_failed", {"pos": 0, "error": "cancelled: parent cancelled"})

    # Then the code sees the cancellation, not the step's failure, and again on replay
    with pytest.raises(WorkflowCancelled):
        run(log, charge_then_ship)
    assert log.state.cancel_pos == 0
    with pytest.raises(WorkflowCancelled):
        run(log, charge_then_ship)


def test_a_step_that_failed_before_the_cancellation_is_the_codes_to_handle() -> None:
    def with_fallback(wf: WorkflowContext) -> Any:
        try:
            return wf.run("reserve", 7)
        except StepFailed:
            return wf.run("reserve_elsewhere", 7)

    # Given a step that failed, then a cancellation requested later
    log = Log()
    run(log, with_fallback)
    log.emit("step_failed", {"pos": 0, "error": "out of stock"})
    log.state.apply({"kind": "cancel_requested", "at": NOW + 5, "data": {"reason": "customer"}})

    # Then the code sees the failure (its fallback runs), and the cancellation lands at the
    # fallback's new step, which is never scheduled
    with pytest.raises(WorkflowCancelled):
        run(log, with_fallback)
    assert log.state.cancel_pos == 1
    assert [c.name for c in log.state.commands.values()] == ["reserve"]


def test_a_refused_call_takes_no_position_and_a_recorded_one_is_not_checked_again() -> None:
    from celery_ledger.errors import PayloadError

    refused: set[str] = set()

    def check(call: Call) -> None:
        if call.name in refused:
            raise PayloadError(f"{call.name} cannot take these arguments")

    def flow(wf: WorkflowContext) -> Any:
        with contextlib.suppress(PayloadError):
            wf.run("notify", 7)
        return wf.run("charge", 7)

    log = Log()
    refused.add("notify")

    def checked() -> WorkflowContext:
        return WorkflowContext(
            log.state,
            now=NOW,
            signals=(),
            call_of=lambda target, args, kwargs: Call("step", str(target), args, kwargs),
            check_call=check,
            job_id_of=lambda call, pos: f"job-{pos}",
            decode=lambda text: None if text is None else __import__("json").loads(text),
            emit=log.emit,
        )

    with pytest.raises(Suspend):
        flow(checked())
    assert [(c.pos, c.name) for c in log.state.commands.values()] == [(0, "charge")]

    # A deploy that changes charge's signature: its recorded step replays, unchecked
    log.complete(0, '"charged"')
    refused.update({"charge"})
    assert flow(checked()) == "charged"


def test_the_code_reports_how_far_it_came() -> None:
    log = Log()
    context = log.context()
    with contextlib.suppress(Suspend):
        two_steps(context)
    assert context.position == 1  # the charge (position 0) suspended it


def test_snapshots_restore_the_whole_state_and_time_travel_folds_up_to_a_moment() -> None:
    log = Log()
    run(log, two_steps)
    log.complete(0, '"charged"')
    snapshot = {"kind": "snapshot", "seq": 10, "at": NOW, "data": {"state": log.state.to_dict()}}
    restored = fold("wf-1", [snapshot])
    assert restored.commands == log.state.commands and restored.snapshot_seq == 10
    events = [
        {"kind": "started", "seq": 0, "at": datetime(2026, 1, 1, tzinfo=UTC), "data": {}},
        {"kind": "code_failed", "seq": 1, "at": datetime(2026, 1, 2, tzinfo=UTC), "data": {}},
        {
            "kind": "finished",
            "seq": 2,
            "at": datetime(2026, 1, 3, tzinfo=UTC),
            "data": {"status": "failed"},
        },
    ]
    assert as_of("wf-1", events, datetime(2026, 1, 1, 12, tzinfo=UTC)).status == "running"
    assert as_of("wf-1", events, datetime(2026, 1, 2, 12, tzinfo=UTC)).status == "compensating"
    assert fold("wf-1", events).status == "failed"


def test_a_retry_from_a_position_forgets_it_and_what_follows_under_a_new_generation() -> None:
    log = Log()
    run(log, two_steps)
    log.complete(0, '"charged"')
    run(log, two_steps)
    log.emit("step_failed", {"pos": 1, "error": "no carrier"})
    log.emit("code_failed", {"error": "no carrier"})
    log.emit("finished", {"status": "failed", "error": "no carrier"})
    log.emit("retried", {"from_pos": 1, "generation": 1, "actor": "ops"})
    assert log.state.status == "running" and log.state.generation == 1
    assert sorted(log.state.commands) == [0]
    assert run(log, two_steps) is Suspend  # the second step runs again


def test_code_that_swallows_the_suspension_issues_nothing_past_the_wait() -> None:
    log = Log()

    def careless(wf: WorkflowContext) -> Any:
        with contextlib.suppress(BaseException):  # the mistake under test
            wf.run("charge", 7)
        return wf.run("ship", 7)

    context = log.context()
    with pytest.raises(Suspend):
        careless(context)
    assert context.suspended
    assert [e["data"]["name"] for e in log.events] == ["charge"]  # "ship" was never scheduled


def test_a_republished_step_waits_longer_each_time_and_old_snapshots_still_load() -> None:
    from celery_ledger.workflow.engine import WorkflowEngine

    log = Log()
    run(log, two_steps)
    command = log.state.commands[0]
    engine = WorkflowEngine.__new__(WorkflowEngine)
    engine.check_seconds = 120.0
    waits = []
    for i in range(3):
        waits.append(engine._republish_after(command))
        log.state.apply({"kind": "republished", "seq": 10 + i, "at": NOW + i, "data": {"pos": 0}})
    assert waits == [30.0, 60.0, 120.0]
    assert (command.republished, command.scheduled_at) == (3, NOW + 2)
    engine.check_seconds = 1.0  # a short check (tests, soaks): three checks, at least 5 s
    assert engine._republish_after(replace(command, republished=0)) == 5.0
    # A snapshot written by a newer version (a field this one lacks) still loads, and one
    # written before ``republished`` existed loads with none
    state = log.state.to_dict()
    state["commands"][0]["a_later_field"] = 1
    restored = fold("wf-1", [{"kind": "snapshot", "seq": 20, "at": NOW, "data": {"state": state}}])
    assert restored.commands[0].republished == 3
    del state["commands"][0]["republished"]
    restored = fold("wf-1", [{"kind": "snapshot", "seq": 20, "at": NOW, "data": {"state": state}}])
    assert restored.commands[0].republished == 0


def test_a_resume_reads_to_the_snapshot_of_the_workflow_with_the_widest_interval() -> None:
    from celery_ledger.workflow.engine import Definition, WorkflowEngine

    definitions = {
        "a": Definition("a", two_steps),
        "b": Definition("b", two_steps, snapshot_every=1000),
    }
    engine = WorkflowEngine(
        None,  # type: ignore[arg-type]
        definitions,
        None,  # type: ignore[arg-type]
        default_tier="default",
        snapshot_every=100,
        check_seconds=60,
        max_payload_bytes=1024,
    )
    # One read reaches the latest snapshot of either: past 1,000 events, not 100
    assert engine._tail_limit() >= 1000
    assert (
        WorkflowEngine(
            None,  # type: ignore[arg-type]
            {"a": definitions["a"]},
            None,  # type: ignore[arg-type]
            default_tier="default",
            snapshot_every=100,
            check_seconds=60,
            max_payload_bytes=1024,
        )._tail_limit()
        < 1000
    )


def sensitive_context(log: Log) -> WorkflowContext:
    """A sensitive workflow's ``wf``: only the task "vault" is sensitive."""
    return WorkflowContext(
        log.state,
        now=NOW,
        signals=(),
        call_of=lambda target, args, kwargs: Call(
            "step", str(target), args, kwargs, sensitive=target == "vault"
        ),
        job_id_of=lambda call, pos: f"job-{pos}",
        decode=lambda text: text,
        emit=log.emit,
        seal=lambda text: f"sealed:{text}",
        sensitive=True,
    )


def test_a_sensitive_workflow_refuses_a_step_that_would_hold_its_data_in_clear() -> None:
    from celery_ledger.errors import ConfigurationError

    log = Log()
    with pytest.raises(Suspend):
        sensitive_context(log).run("vault", "4111")  # recorded sealed, then waited for
    assert log.state.commands[0].args == 'sealed:[["4111"],{}]'

    for command in ("run", "compensate"):
        fresh = Log()
        with pytest.raises(ConfigurationError, match="not sensitive"):
            getattr(sensitive_context(fresh), command)("notify", "4111")
        assert fresh.state.commands == {}  # nothing recorded
