"""The workflow engine's edges on a real ledger and broker, its wakes run in this process.

Each test's app has a ledger database and queue namespace of its own, so no session worker
wakes its workflows: the test runs every wake itself and reads what the engine wrote.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis

from celery_ledger.embedded.stack import EmbeddedStack
from celery_ledger.ledger.workflow_log import EVENT_SCHEMA, event_id

from .conftest import producer_app

CHECK_SECONDS = 1.0


@pytest.fixture
def engine_app(stack: EmbeddedStack) -> Iterator[Any]:
    run = uuid.uuid4().hex[:8]
    app = producer_app(
        stack,
        f"wf_edges_{run}",
        mongo_db=f"wf_edges_{run}",
        queue_namespace=f"wfedges{run}",
        workflow_check_seconds=CHECK_SECONDS,
    )
    app.workflow_engine.log.ensure_indexes()
    try:
        yield app
    finally:
        app.close()


def state_doc(app: Any, workflow_id: str) -> dict[str, Any]:
    doc = app.workflow_engine.log.get_state(workflow_id)
    assert doc is not None
    return dict(doc)


def aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def test_code_that_ends_before_its_recorded_commands_is_stopped_not_completed(
    engine_app: Any,
) -> None:
    code = ["v1"]

    def shipping(wf: Any, order: int) -> str:
        wf.sleep(0.01)
        if code[0] == "v1":
            wf.wait_signal("go")  # removed by the next deploy, under running workflows
        return code[0]

    flow = engine_app.workflow(shipping, name="edges.shipping", idempotency_key="{order}")
    handle = flow.start(1)
    engine = engine_app.workflow_engine
    assert engine.wake(handle.id) == "suspended"  # the timer
    time.sleep(0.05)
    assert engine.wake(handle.id) == "suspended"  # fired; the signal wait is recorded

    # When a deploy removes the wait and the workflow is resumed
    code[0] = "v2"
    assert engine.wake(handle.id) == "stuck"

    # Then it stops with a non-determinism error naming the recorded command, never "completed"
    status = handle.status()
    assert status.status == "stuck"
    assert "signal 'go' at position 1" in (status.error or "")
    assert "ends before them" in (status.error or "")


def test_a_timer_is_kept_on_the_state_so_the_reconcilers_checks_never_pass_it(
    engine_app: Any,
) -> None:
    def waits(wf: Any, order: int) -> str:
        wf.sleep(8)  # soon enough that spaced checks would pass it (16 check times at most)
        return "woke"

    flow = engine_app.workflow(waits, name="edges.waits", idempotency_key="{order}")
    handle = flow.start(2)
    engine = engine_app.workflow_engine
    assert engine.wake(handle.id) == "suspended"
    timer = next(c for c in handle.state().commands.values() if c.kind == "timer")
    until = datetime.fromtimestamp(timer.until, UTC)
    doc = state_doc(engine_app, handle.id)
    assert abs((aware(doc["timer_at"]) - until).total_seconds()) < 0.01
    latest = until + timedelta(seconds=CHECK_SECONDS + 0.01)
    assert aware(doc["check_at"]) <= latest

    # When every check finds it still (its wake lost, say), the checks space out, but the
    # next check is never later than just after the timer is due
    states = engine.log.states
    time.sleep(CHECK_SECONDS + 0.1)  # its log has been still for a check time
    for _ in range(8):
        states.update_one({"_id": handle.id}, {"$set": {"check_at": engine.log.now()}})
        engine.wake_overdue()
        assert aware(state_doc(engine_app, handle.id)["check_at"]) <= latest
    assert state_doc(engine_app, handle.id)["checks"] >= 5


def test_a_workflow_of_a_tier_above_its_mark_stays_due_and_is_woken_once_it_drains(
    engine_app: Any,
) -> None:
    # Given a workflow whose wake was lost, due for a check, its tier above its mark
    def waits(wf: Any, order: int) -> str:
        wf.sleep(60)
        return "woke"

    flow = engine_app.workflow(waits, name="edges.held", idempotency_key="{order}")
    handle = flow.start(4)
    engine = engine_app.workflow_engine
    # (its start's wake message runs here: it clears the mark that folds later wakes into it)
    assert engine_app._run_wake(handle.id, 0, None) == "suspended"
    tier = state_doc(engine_app, handle.id)["tier"]
    states = engine.log.states
    time.sleep(CHECK_SECONDS + 0.1)  # its log has been still for a check time
    due = engine.log.now()
    states.update_one({"_id": handle.id}, {"$set": {"check_at": due}})
    # When the checks run while the tier is held
    others = {t for t in engine_app.runtime.tiers.names if t != tier}
    engine.wake_overdue(held={tier})
    # Then it is neither woken nor put off: still due
    assert aware(state_doc(engine_app, handle.id)["check_at"]) == due.replace(
        microsecond=due.microsecond // 1000 * 1000
    )
    # And once the tier drains (another tier's hold changes nothing), it is woken
    assert engine.wake_overdue(held=others) >= 1
    assert aware(state_doc(engine_app, handle.id)["check_at"]) > due


def test_a_check_leaves_a_workflow_alone_while_the_step_it_waits_for_has_not_ended(
    engine_app: Any,
) -> None:
    # Given a workflow whose step waits in a queue (its queued record written at its publish)
    @engine_app.task(name="edges.slow_step", shared=False, dedupe_on_publish=True)
    def slow_step(order: int) -> str:
        return "done"

    def waits(wf: Any, order: int) -> str:
        return str(wf.run(slow_step, order))

    flow = engine_app.workflow(waits, name="edges.step_waits", idempotency_key="{order}")
    handle = flow.start(5)
    engine = engine_app.workflow_engine
    assert engine_app._run_wake(handle.id, 0, None) == "suspended"  # the step is published
    (command,) = [c for c in handle.state().commands.values() if c.kind == "step"]
    record = engine_app.ledger.find_raw(command.job_id)
    assert record is not None and record["state"] == "queued"
    states = engine.log.states
    time.sleep(CHECK_SECONDS + 0.1)  # its log has been still for a check time

    # When the checks come while the step has not ended
    for _ in range(3):
        states.update_one({"_id": handle.id}, {"$set": {"check_at": engine.log.now()}})
        # Then none wakes it (the step's end will), and the checks still space out
        assert engine.wake_overdue() == 0
    assert state_doc(engine_app, handle.id)["checks"] == 3

    # And once the step's job ended (its own wake lost, say), the next check wakes it
    engine_app.ledger.collection.update_one(
        {"_id": command.job_id}, {"$set": {"state": "succeeded", "result": '"done"'}}
    )
    states.update_one({"_id": handle.id}, {"$set": {"check_at": engine.log.now()}})
    assert engine.wake_overdue() == 1


def test_a_time_limit_that_fires_while_the_code_runs_is_not_the_workflow_s_failure(
    engine_app: Any,
) -> None:
    # Given a wake interrupted by its delivery's soft time limit while the code runs (a step
    # whose end advances its workflow in place, near the step's own limit)
    from celery.exceptions import SoftTimeLimitExceeded

    fired = [True]

    def code(wf: Any, order: int) -> str:
        if fired[0]:
            fired[0] = False
            raise SoftTimeLimitExceeded()
        return "done"

    flow = engine_app.workflow(code, name="edges.limited", idempotency_key="{order}")
    handle = flow.start(3)

    # When the wake runs, then runs again
    with pytest.raises(SoftTimeLimitExceeded):
        engine_app.workflow_engine.wake(handle.id)
    assert handle.status().status == "running"  # not failed, nothing compensated
    # Then the next wake runs the code as if the interrupted one never had
    assert engine_app.workflow_engine.wake(handle.id) == "completed"
    assert handle.status().status == "completed"


def test_a_timers_wake_that_comes_early_is_published_again_for_when_it_is_due(
    engine_app: Any,
) -> None:
    def waits(wf: Any, order: int) -> str:
        wf.sleep(20)
        return "woke"

    flow = engine_app.workflow(waits, name="edges.early", idempotency_key="{order}")
    handle = flow.start(3)
    engine = engine_app.workflow_engine
    delayed = engine_app.runtime.delayed
    assert engine.wake(handle.id) == "suspended"
    held = delayed.pending()
    assert held == 1  # the timer's wake

    # When a wake comes before the timer is due (the waking host's clock is behind)
    assert engine.wake(handle.id) == "suspended"

    # Then its wake is held again, for when the timer is due: a lost or early wake costs nothing
    assert delayed.pending() == held + 1
    broker = redis.Redis.from_url(engine_app.settings.broker_url)
    scores = [score for _, score in broker.zrange(delayed.key, 0, -1, withscores=True)]
    timer = next(c for c in handle.state().commands.values() if c.kind == "timer")
    assert all(abs(score - (timer.until + 0.05)) < 1.0 for score in scores)
    broker.close()


def test_a_log_written_by_a_newer_release_is_left_to_it(engine_app: Any) -> None:
    def waits(wf: Any, order: int) -> Any:
        return wf.wait_signal("go")

    flow = engine_app.workflow(waits, name="edges.newer", idempotency_key="{order}")
    handle = flow.start(4)
    engine = engine_app.workflow_engine
    assert engine.wake(handle.id) == "suspended"
    before = len(handle.history())
    # Given an event of a schema this release does not know (a rollback is under way)
    seq = max(e.seq for e in handle.history()) + 1
    engine.log.events.insert_one(
        {
            "_id": event_id(handle.id, seq),
            "wf": handle.id,
            "seq": seq,
            "v": EVENT_SCHEMA + 1,
            "at": engine.log.now(),
            "kind": "a_newer_kind",
            "data": {},
        }
    )
    handle.signal("go", 1)
    held = engine_app.runtime.delayed.pending()

    # Then this release's wake neither folds past it nor appends: it hands the wake back
    assert engine.wake(handle.id) == "newer schema"
    assert len(handle.history()) == before + 1  # only the newer event
    assert engine_app.runtime.delayed.pending() == held + 1
    assert state_doc(engine_app, handle.id)["status"] == "running"


@pytest.mark.parametrize("target", ["child", "step"])
def test_a_call_with_arguments_its_target_cannot_take_fails_the_code_at_the_call(
    engine_app: Any, target: str
) -> None:
    from tests.integration.ledger_app import wf_step

    def child(wf: Any, order: int) -> int:
        return order

    child_flow = engine_app.workflow(
        child, name=f"edges.child_{target}", idempotency_key="c-{order}"
    )

    def parent(wf: Any, order: int) -> str:
        try:
            if target == "child":
                wf.run(child_flow, order, colour="red")  # no such parameter
            else:
                wf.run(wf_step, f"t-{order}")  # its name is missing
        except Exception as exc:
            return f"refused: {type(exc).__name__}: {exc}"
        return "published"

    flow = engine_app.workflow(parent, name=f"edges.parent_{target}", idempotency_key="{order}")
    handle = flow.start(5)
    # The refusal is raised into the code at the call (which may handle it), never later
    # where publishing the recorded call would fail at every wake
    assert engine_app.workflow_engine.wake(handle.id) == "completed"
    result = handle.state().result or ""
    assert "refused: PayloadError" in result and "cannot take these arguments" in result
    assert not handle.state().commands  # nothing was recorded


# -- code that ends in every way: each ends the workflow with its reason ----------------------


def run_to_rest(app: Any, workflow_id: str, wakes: int = 6) -> dict[str, Any]:
    """Wake the workflow until it waits or ends; its state document."""
    engine = app.workflow_engine
    for _ in range(wakes):
        if engine.wake(workflow_id) in ("suspended", "finished", "stuck"):
            doc = state_doc(app, workflow_id)
            if doc["status"] not in ("running", "compensating"):
                return doc
    return state_doc(app, workflow_id)


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ broke")


@pytest.mark.parametrize(
    ("raised", "named"),
    [
        (SystemExit(3), "SystemExit: 3"),
        (KeyboardInterrupt(), "KeyboardInterrupt"),
        (GeneratorExit(), "GeneratorExit"),
        (Unprintable(), "Unprintable (its text could not be read)"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else "",
)
def test_code_raising_anything_fails_the_workflow_at_once_with_its_reason(
    engine_app: Any, raised: BaseException, named: str
) -> None:
    # (a BaseException was never recorded: its wake ended its pool process, again and again;
    # an unreadable error took six minutes of failing wakes to park the workflow as stuck)
    def raises(wf: Any, order: int) -> str:
        raise raised

    flow = engine_app.workflow(
        raises, name=f"edges.raises_{type(raised).__name__}", idempotency_key="{order}"
    )
    handle = flow.start(uuid.uuid4().int % 10**9)
    doc = run_to_rest(engine_app, handle.id)
    assert doc["status"] == "failed" and named in str(doc.get("error"))


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), 1e300])
def test_a_wait_that_is_no_time_fails_the_workflow_at_once(engine_app: Any, seconds: float) -> None:
    # (it waited for ever, and its status could not be read)
    def sleeps(wf: Any, order: int) -> str:
        wf.sleep(seconds)
        return "woke"

    flow = engine_app.workflow(sleeps, name="edges.no_time", idempotency_key="{order}")
    handle = flow.start(uuid.uuid4().int % 10**9)
    doc = run_to_rest(engine_app, handle.id)
    assert doc["status"] == "failed" and "PayloadError" in str(doc.get("error"))
    assert handle.status().status == "failed"


@pytest.mark.parametrize("goes_on", [True, False], ids=["then-new-work", "then-returns"])
def test_code_that_catches_its_cancellation_still_ends_cancelled(
    engine_app: Any, goes_on: bool
) -> None:
    # (an ``except Exception`` around a wait swallowed it: the workflow went on, started new
    # steps and completed, its compensations never run)
    def swallows(wf: Any, order: int) -> str:
        try:
            wf.wait_signal("go")
        except Exception:  # the wait's error handled as the code thinks best
            logging.getLogger(__name__).info("no signal")
        if goes_on:
            wf.sleep(1)  # new work after the cancellation: never started
        return "completed anyway"

    flow = engine_app.workflow(
        swallows, name=f"edges.swallows_{goes_on}", idempotency_key="{order}"
    )
    handle = flow.start(uuid.uuid4().int % 10**9)
    assert engine_app.workflow_engine.wake(handle.id) == "suspended"
    handle.cancel("the customer changed their mind")
    doc = run_to_rest(engine_app, handle.id)
    assert doc["status"] == "cancelled"
    assert not [c for c in handle.state().commands.values() if c.kind == "timer"]


def test_a_stuck_workflow_refuses_a_cancellation_saying_why(engine_app: Any) -> None:
    # (it was accepted and never applied: a stuck workflow's code does not run)
    from celery_ledger.errors import WorkflowError

    def waits(wf: Any, order: int) -> str:
        wf.sleep(60)
        return "woke"

    flow = engine_app.workflow(waits, name="edges.stuck_cancel", idempotency_key="{order}")
    handle = flow.start(uuid.uuid4().int % 10**9)
    assert engine_app.workflow_engine.wake(handle.id) == "suspended"
    engine_app.workflow_engine.mark_stuck(handle.id, "code changed under it")
    assert state_doc(engine_app, handle.id)["status"] == "stuck"
    with pytest.raises(WorkflowError, match="stuck"):
        handle.cancel("give up")
