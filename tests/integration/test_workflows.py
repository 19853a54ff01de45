"""Durable workflows on real servers and real workers: every step's effect once, whatever dies.

The workflows are declared in ``ledger_app`` (the workers' app). Effects are counted in the
reference world's ``effects`` collection; the log and state are read through the handle.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from celery_ledger import State
from celery_ledger.embedded.stack import EmbeddedStack
from celery_ledger.errors import WorkflowError, WorkflowFailed

from .conftest import make_isolated_stack, producer_app
from .helpers import wait_for

STEP = "wf_step"


_clients: dict[str, MongoClient[dict[str, Any]]] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _clients:
        _clients.popitem()[1].close()


def world_of(stack: EmbeddedStack) -> Any:
    assert stack.ledger is not None
    url = stack.ledger.url
    if url not in _clients:
        _clients[url] = MongoClient(url, tz_aware=True)
    return _clients[url].get_database("reference_world")


def step_effects(stack: EmbeddedStack, token: str, kind: str = STEP) -> Counter[str]:
    world = world_of(stack)
    found = world.effects.find({"kind": kind, "key": {"$regex": f"^{token}:"}})
    return Counter(str(d["key"]).split(":", 1)[1] for d in found)


def workflows_of(target: Any) -> dict[str, Any]:
    from tests.integration.ledger_app import declare_workflows

    return declare_workflows(target)


def test_a_workflow_runs_every_step_once_and_returns_its_result(
    stack: EmbeddedStack, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["order"].start(token, steps=3)
    result = handle.result(timeout=60)
    assert result == {
        "done": ["s0-done", "s1-done", "s2-done"],
        "parts": ["g0-done", "g1-done"],
        "signal": None,
    }
    assert step_effects(stack, token) == Counter({"s0": 1, "s1": 1, "s2": 1, "g0": 1, "g1": 1})
    # AsyncResult works as for any job; starting the same key again is the same workflow
    assert app.AsyncResult(handle.id).get(timeout=5) == result
    again = WORKFLOWS["order"].start(token, steps=3)
    assert again.id == handle.id and again.result(timeout=5) == result
    status = handle.status()
    assert status.status == "completed" and status.steps_done == 5
    kinds = [event.kind for event in handle.history()]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert all(event.worker and event.fence >= -1 for event in handle.history())
    record = app.ledger.get_by_id(handle.id)
    assert record is not None and record.state is State.SUCCEEDED
    time.sleep(0.5)
    assert step_effects(stack, token) == Counter({"s0": 1, "s1": 1, "s2": 1, "g0": 1, "g1": 1})


def test_a_step_that_fails_for_good_runs_every_compensation_once_newest_first(
    stack: EmbeddedStack, token: str
) -> None:
    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["order"].start(token, steps=3, fail_at_end=True)
    with pytest.raises(WorkflowFailed, match="compensated"):
        handle.result(timeout=60)
    status = handle.status()
    assert status.status == "compensated"
    assert "refused last" in (status.error or "")
    assert step_effects(stack, token) == Counter({"s0": 1, "s1": 1, "s2": 1, "g0": 1, "g1": 1})
    assert step_effects(stack, token, "wf_undo") == Counter({"s0": 1, "s1": 1, "s2": 1})
    world = world_of(stack)
    undone = [
        d["key"]
        for d in world.effects.find({"kind": "wf_undo", "key": {"$regex": f"^{token}:"}}).sort(
            "at", 1
        )
    ]
    assert undone == [f"{token}:s2", f"{token}:s1", f"{token}:s0"]
    assert_sequential_log(handle)
    kinds = [e.kind for e in handle.history()]
    assert kinds.count("compensation_scheduled") == 3 and kinds.count("compensation_completed") == 3


def test_signals_sent_before_and_after_the_wait_are_each_delivered_once(
    stack: EmbeddedStack, token: str
) -> None:
    from tests.integration.ledger_app import WORKFLOWS

    # Before: the signal arrives while the workflow is still on its first step
    early = WORKFLOWS["order"].start(f"{token}-early", steps=1, pause=1.0, signal="approved")
    assert early.signal("approved", {"by": "early"}, signal_id="sig-1")
    assert not early.signal("approved", {"by": "again"}, signal_id="sig-1")  # same id: once
    assert early.result(timeout=60)["signal"] == {"by": "early"}
    # After: the workflow waits, and nothing else wakes it
    late = WORKFLOWS["order"].start(f"{token}-late", steps=1, signal="approved")
    wait_for(lambda: late.status().waiting == ["signal approved"], timeout=30, what="the wait")
    late.signal("approved", "yes")
    assert late.signal("approved", "a second one, never waited for")  # kept beside the first
    assert late.result(timeout=60)["signal"] == "yes"
    received = [e for e in late.history() if e.kind == "signal"]
    assert len(received) == 1 and received[0].data["payload"] == '"yes"'
    # A wait with a timeout returns None once it passes
    timed = WORKFLOWS["order"].start(f"{token}-timeout", steps=1, signal="x", signal_timeout=1)
    assert timed.result(timeout=60)["signal"] is None
    # A finished workflow takes no more signals
    with pytest.raises(WorkflowError, match="completed"):
        late.signal("approved", "too late")


def test_cancelling_a_waiting_workflow_runs_its_compensations(
    stack: EmbeddedStack, token: str
) -> None:
    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["order"].start(token, steps=2, signal="never")
    wait_for(lambda: handle.status().waiting == ["signal never"], timeout=30, what="the wait")
    handle.cancel("customer changed their mind")
    with pytest.raises(WorkflowFailed, match="cancelled"):
        handle.result(timeout=60)
    assert handle.status().status == "cancelled"
    assert step_effects(stack, token, "wf_undo") == Counter({"s0": 1, "s1": 1})
    assert step_effects(stack, token) == Counter({"s0": 1, "s1": 1})  # nothing after the wait


def test_cancelling_during_a_step_compensates_that_step_once_it_ends(
    stack: EmbeddedStack, token: str
) -> None:
    from tests.integration.ledger_app import WORKFLOWS

    # Given a workflow whose first step is running (its job runs whatever the workflow does)
    handle = WORKFLOWS["order"].start(token, steps=2, pause=3)
    wait_for(
        lambda: step_effects(stack, token) == Counter() and handle.status().steps_pending,
        timeout=30,
        what="the step",
    )
    handle.cancel("customer changed their mind")

    # Then the step ends, its compensation is registered and runs, and nothing else starts
    with pytest.raises(WorkflowFailed, match="cancelled"):
        handle.result(timeout=60)
    assert handle.status().status == "cancelled"
    assert step_effects(stack, token) == Counter({"s0": 1})
    assert step_effects(stack, token, "wf_undo") == Counter({"s0": 1})


def test_a_child_workflow_runs_as_a_step_and_starting_twice_at_once_is_one_workflow(
    stack: EmbeddedStack, app: Any, token: str
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.ledger_app import WORKFLOWS

    with ThreadPoolExecutor(4) as pool:
        handles = list(pool.map(lambda _: WORKFLOWS["parent"].start(token), range(4)))
    assert len({h.id for h in handles}) == 1
    first, child = handles[0].result(timeout=90)
    assert first == "parent-done"
    assert child == {"done": ["s0-done"], "parts": ["g0-done", "g1-done"], "signal": None}
    assert step_effects(stack, token) == Counter({"parent": 1})
    assert step_effects(stack, f"{token}-child") == Counter({"s0": 1, "g0": 1, "g1": 1})
    assert app.workflow_engine.log.listing(limit=1000)  # both are listed
    started = [e for e in handles[0].history() if e.kind == "started"]
    assert len(started) == 1


def test_time_travel_rebuilds_the_state_at_an_earlier_moment(
    stack: EmbeddedStack, token: str
) -> None:
    from datetime import UTC, datetime

    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["order"].start(token, steps=1, signal="go")
    wait_for(lambda: handle.status().waiting == ["signal go"], timeout=30, what="the wait")
    waiting_at = datetime.now(UTC)
    time.sleep(0.2)
    handle.signal("go", 1)
    handle.result(timeout=60)
    assert handle.state().status == "completed"
    earlier = handle.state(waiting_at)
    assert earlier.status == "running"
    assert [c.status for c in earlier.commands.values() if c.kind == "signal"] == ["scheduled"]


def test_a_sensitive_steps_arguments_and_result_stay_sealed_in_the_log(
    stack: EmbeddedStack, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["card"].start(token, "9876")
    assert handle.result(timeout=60) == "9876"
    raw = list(app.workflow_engine.log.events.find({"wf": handle.id}))
    assert raw and "4111-1111" not in repr(raw)  # the card number, sealed with the app's keys
    assert any(
        "4111-1111" in app.sealer.open(e["data"]["args"]) for e in raw if e["kind"] == "scheduled"
    )


def test_a_sensitive_workflow_keeps_its_arguments_signals_result_and_errors_sealed(
    stack: EmbeddedStack, app: Any, token: str
) -> None:
    from bson import BSON

    from tests.integration.ledger_app import WORKFLOWS

    card, pin = f"5500-{uuid.uuid4().hex}", f"pin-{uuid.uuid4().hex}"
    # Given a sensitive workflow that completes, and one whose code fails with the card in its
    # exception's message, each sent the pin as a signal
    done = WORKFLOWS["vault"].start(token, card)
    failing = WORKFLOWS["vault"].start(f"{token}-fails", card, fail=True)
    for handle in (done, failing):
        handle.signal("pin", pin)

    # Then the owner reads the result as returned, and the failure by its type
    expected = {"last4": card[-4:], "card": card, "pin": pin}
    assert done.result(timeout=60) == expected
    assert done.status().result == expected
    with pytest.raises(WorkflowFailed):
        failing.result(timeout=60)
    error = str(failing.status().error)
    assert "ValueError" in error and card not in error and pin not in error

    # And no document of the ledger's database holds the card or the pin in clear: the
    # workflows' states, events and signals, the step's job, the audit trail of the signals
    database = app.ledger.collection.database
    held = b"".join(
        BSON.encode(doc)
        for name in database.list_collection_names()
        for doc in database[name].find()
    )
    assert done.id.encode() in held and failing.id.encode() in held
    assert card.encode() not in held and pin.encode() not in held


# -- crashes and deploys (a stack of their own) ---------------------------------------------

HEALING = {
    "LEDGER_LEASE_SECONDS": "3",
    "LEDGER_RECONCILE_EVERY_SECONDS": "1",
    "LEDGER_RECONCILE_LEASE_GRACE_SECONDS": "1",
    "LEDGER_RECONCILE_IN_WORKERS": "true",
    "LEDGER_WORKFLOW_CHECK_SECONDS": "3",
}


@pytest.fixture
def isolated(tmp_path: Path, stack: Any) -> Any:
    running = make_isolated_stack(tmp_path)
    try:
        yield running
    finally:
        # Its client is closed while the server still answers: closing it later waits out
        # the server selection (30 s) to end its sessions.
        assert running.ledger is not None
        client = _clients.pop(running.ledger.url, None)
        if client is not None:
            client.close()
        running.stop()


def start_worker(isolated: EmbeddedStack, name: str, code: str = "v1") -> Any:
    return isolated.start_worker(
        isolated.queues_of(),
        concurrency=2,
        name=f"{name}@127.0.0.1",
        env={**HEALING, "WORKFLOW_CODE": code},
    )


def test_a_workflow_whose_worker_is_killed_after_each_step_runs_every_step_once(
    isolated: EmbeddedStack,
) -> None:
    producer = producer_app(isolated, "wf_crash_producer", workflow_check_seconds=3)
    flows = workflows_of(producer)
    token = f"crash-{uuid.uuid4().hex[:8]}"
    world = world_of(isolated)

    def reached(name: str) -> int:
        return step_effects(isolated, token, "wf_reached")[name]

    def open_gate(name: str) -> None:
        world.effects.insert_one({"kind": "wf_gate", "key": f"{token}:{name}"})

    # Given a workflow whose every step waits at a gate the test opens (pass_gate)
    worker = start_worker(isolated, "w1")
    steps = 4
    names = [f"s{i}" for i in range(steps)] + ["g0", "g1"]
    handle = flows["order"].start(token, steps=steps, gated=True)
    for i in range(steps):
        # (a step cut off at its gate by the last kill reaches it again on the new worker)
        times = 1 if i == 0 else 2
        wait_for(lambda i=i, n=times: reached(f"s{i}") >= n, timeout=90, what=f"s{i} at its gate")
        open_gate(f"s{i}")
        wait_for(lambda i=i: step_effects(isolated, token)[f"s{i}"] >= 1, what=f"step {i}")
        # When the whole worker (main process and pool) is killed after each step, while the
        # next step waits at its gate: killed mid-workflow, with no step's effect in flight
        # (an effect cut off between itself and its completion record would run again, as
        # the README says; a kill left to timing could land there)
        wait_for(lambda i=i: reached(names[i + 1]) >= 1, timeout=90, what=f"{names[i + 1]}")
        worker.kill()
        worker = start_worker(isolated, f"w{i + 2}")
    for name in ("g0", "g1"):
        open_gate(name)
    # Then the workflow finishes, each step's effect happened once: a completed step is never
    # run again, and each step cut off at its gate ran again on a live worker
    result = handle.result(timeout=120)
    assert result["done"] == [f"s{i}-done" for i in range(steps)]
    effects = step_effects(isolated, token)
    assert effects == Counter({**{f"s{i}": 1 for i in range(steps)}, "g0": 1, "g1": 1})
    assert reached("g0") >= 2  # (s1 to s3: waited for above)
    assert step_effects(isolated, token, "wf_undo") == Counter()
    assert_sequential_log(handle)
    producer.close()


def test_a_timer_survives_a_worker_restart(isolated: EmbeddedStack) -> None:
    producer = producer_app(isolated, "wf_timer_producer", workflow_check_seconds=3)
    flows = workflows_of(producer)
    token = f"timer-{uuid.uuid4().hex[:8]}"
    worker = start_worker(isolated, "t1")
    handle = flows["order"].start(token, steps=1, sleep=4)
    wait_for(
        lambda: handle.status().waiting[:1] and "timer" in handle.status().waiting[0],
        timeout=30,
        what="the timer",
    )
    worker.kill()  # nothing holds the timer in memory: it is in the delayed set
    time.sleep(5)
    start_worker(isolated, "t2")
    result = handle.result(timeout=60)
    assert result["done"] == ["s0-done"]
    fired = [e for e in handle.history() if e.kind == "fired"]
    started = [
        e for e in handle.history() if e.kind == "scheduled" and e.data.get("kind") == "timer"
    ]
    assert len(fired) == 1 and fired[0].at.timestamp() >= started[0].data["until"] - 0.01
    assert step_effects(isolated, token) == Counter({"s0": 1, "g0": 1, "g1": 1})
    producer.close()


def test_a_changed_step_is_detected_and_a_versioned_change_keeps_old_workflows_running(
    isolated: EmbeddedStack,
) -> None:
    producer = producer_app(isolated, "wf_deploy_producer", workflow_check_seconds=3)
    flows = workflows_of(producer)
    run = uuid.uuid4().hex[:8]
    worker = start_worker(isolated, "v1")
    # Three workflows started on the original code, each waiting for "go" after its first step
    old = {name: flows["deploy"].start(f"{name}-{run}") for name in ("changed", "gated", "kept")}
    for handle in old.values():
        wait_for(lambda h=handle: h.status().waiting == ["signal go"], timeout=30, what="the wait")
    worker.stop()
    # The change behind wf.version: old workflows keep the old path, new ones take the new,
    # and an old one the reconciler's checks replay meanwhile ("kept") keeps waiting
    worker = start_worker(isolated, "gated", code="gated")
    new = flows["deploy"].start(f"new-{run}")
    wait_for(lambda: new.status().waiting == ["signal go"], timeout=30, what="the new wait")
    for handle in (old["gated"], new):
        handle.signal("go")
    assert old["gated"].result(timeout=60) == "v1"
    assert new.result(timeout=60) == "v2"
    assert step_effects(isolated, f"gated-{run}") == Counter({"first": 1, "second": 1})
    assert step_effects(isolated, f"new-{run}") == Counter({"first-v2": 1, "second": 1})
    kept = old["kept"].status()
    assert (kept.status, kept.waiting) == ("running", ["signal go"])
    worker.stop()
    # A deploy that swaps the first step without a version gate: every old workflow it
    # replays stops, the signalled one and the one only the reconciler's check replays alike,
    # and none runs the new step
    worker = start_worker(isolated, "changed", code="changed")
    old["changed"].signal("go")
    for name in ("changed", "kept"):
        wait_for(lambda n=name: old[n].status().status == "stuck", timeout=30, what="stuck")
        error = old[name].status().error or ""
        assert error.startswith("NonDeterminism: "), error  # its type, as the README promises
        assert "position 0" in error and "wf_step" in error and "wf_undo" in error
        stuck = [e for e in old[name].history() if e.kind == "stuck"]
        assert [e.data["error"] for e in stuck] == [error]
        assert step_effects(isolated, f"{name}-{run}") == Counter({"first": 1})
    worker.stop()
    # An operator's retry after the fix is deployed resumes them where they were (audited)
    worker = start_worker(isolated, "fixed", code="gated")
    for name in ("changed", "kept"):
        old[name].retry()
    old["kept"].signal("go")
    for name in ("changed", "kept"):
        assert old[name].result(timeout=60) == "v1"
        assert step_effects(isolated, f"{name}-{run}") == Counter({"first": 1, "second": 1})
    audit = producer.ledger.audit_entries(limit=50)
    retried = {a["target"] for a in audit if a["action"] == "workflow retry"}
    assert {old["changed"].id, old["kept"].id} <= retried
    producer.close()


def test_a_workflow_whose_messages_are_all_lost_is_finished_by_the_reconciler(
    isolated: EmbeddedStack,
) -> None:
    import redis

    producer = producer_app(isolated, "wf_lost_producer", workflow_check_seconds=2)
    flows = workflows_of(producer)
    token = f"lost-{uuid.uuid4().hex[:8]}"
    handle = flows["order"].start(token, steps=2)  # no worker yet: its wake waits in a queue
    assert producer.workflow_engine.wake(handle.id) == "suspended"  # step 0 is published
    assert isolated.broker is not None
    with redis.Redis.from_url(isolated.broker.url) as broker:
        broker.flushdb()  # the wake's and the step's messages are lost
    start_worker(isolated, "r1")
    result = handle.result(timeout=90)
    assert result["done"] == ["s0-done", "s1-done"]
    assert step_effects(isolated, token) == Counter({"s0": 1, "s1": 1, "g0": 1, "g1": 1})
    producer.close()


def test_a_workflow_behind_a_backlog_has_one_wake_and_one_message_per_step_waiting(
    isolated: EmbeddedStack,
) -> None:
    # Given a workflow whose first step waits in a queue no worker drains yet (a backlog), in
    # an app that writes a job's record at its publish
    import json

    import redis

    from celery_ledger.app import WAKE_TASK
    from tests.integration.conftest import NAMESPACE

    producer = producer_app(
        isolated, "wf_backlog", workflow_check_seconds=1, dedupe_on_publish=True
    )
    flows = workflows_of(producer)
    handle = flows["order"].start(f"backlog-{uuid.uuid4().hex[:8]}", steps=2)
    engine = producer.workflow_engine
    queue = f"{NAMESPACE}.default"
    assert isolated.broker is not None
    broker = redis.Redis.from_url(isolated.broker.url)

    def waiting() -> Counter[str]:
        found: Counter[str] = Counter()
        for raw in broker.lrange(queue, 0, -1):
            message_headers = json.loads(raw)["headers"]
            found[str(message_headers.get("ledger_key") or message_headers["task"])] += 1
        return found

    # When every source of wakes sends one again and again (its steps' outcomes, signals, the
    # reconciler's and the relay's checks of a workflow that does not move)
    for _ in range(10):
        producer.workflow_ports.publish_wake(handle.id, "default")
        engine.log.check_by(handle.id, engine.log.now(), checks=0)
        engine.wake_overdue()
    # Then one wake waits for it
    assert waiting()[WAKE_TASK] == 1

    # When that wake runs (step 0 is published) and the workflow is woken and checked for
    # minutes of the engine's time while its step still waits (far past any republish time)
    assert producer._run_wake(handle.id, 0, None) == "suspended"
    started = time.time()
    for minutes in range(1, 30):
        engine.clock = lambda minutes=minutes: started + 60 * minutes
        assert engine.wake(handle.id) == "suspended"
        producer.workflow_ports.publish_wake(handle.id, "default")
    # Then the step waits once, as a queued record, and one more wake waits (sent after the
    # first one started, which folds every later one)
    found = waiting()
    steps = {key: n for key, n in found.items() if key.startswith("wf:")}
    assert list(steps.values()) == [1], found
    (step_key,) = steps
    record = producer.ledger.collection.find_one({"key": step_key})
    assert record is not None and record["state"] == "queued"
    assert found[WAKE_TASK] == 2
    broker.close()
    producer.close()


def test_a_step_s_end_advances_its_workflow_without_a_wake_message(
    isolated: EmbeddedStack,
) -> None:
    # Given a worker, and a workflow of five steps (three in turn, then two at once)
    worker = start_worker(isolated, "inplace")
    producer = producer_app(isolated, "wf_inplace_producer")
    token = f"inplace-{uuid.uuid4().hex[:8]}"
    handle = workflows_of(producer)["order"].start(token, steps=3)

    # When it runs to its end
    result = handle.result(timeout=60)

    # Then each step's end advanced it where the step ran: the wake messages the worker ran are
    # its start's and at most one check's, not one more per step
    assert result["done"] == ["s0-done", "s1-done", "s2-done"]
    assert step_effects(isolated, token) == Counter({"s0": 1, "s1": 1, "s2": 1, "g0": 1, "g1": 1})
    ran = worker.log_path.read_text().count("celery_ledger.workflow.wake[")
    assert 1 <= ran // 2 <= 2, ran  # (each is logged as received, then as succeeded)
    producer.close()


def test_cancelling_a_parent_cancels_the_child_it_waits_on(
    stack: EmbeddedStack, app: Any, token: str
) -> None:
    from celery_ledger.identity import derive_task_id
    from tests.integration.ledger_app import WORKFLOWS

    parent = WORKFLOWS["nesting"].start(token)
    child_id = derive_task_id(WORKFLOWS["order"].name, f"{parent.id}:0:0")
    child = app.workflow_handle(child_id)
    wait_for(
        lambda: (
            app.workflow_engine.log.get_state(child_id) is not None
            and child.status().waiting == ["signal never"]
        ),
        timeout=30,
        what="the child's wait",
    )
    parent.cancel("no longer needed")
    with pytest.raises(WorkflowFailed, match="cancelled"):
        parent.result(timeout=60)
    with pytest.raises(WorkflowFailed, match="cancelled"):
        child.result(timeout=60)
    assert step_effects(stack, f"{token}-nested", "wf_undo") == Counter({"s0": 1})


def assert_sequential_log(handle: Any) -> None:
    """The log is one history: contiguous sequence numbers, each position scheduled once and
    resolved at most once."""
    events = handle.app.workflow_engine.log.all_events(handle.id)
    assert [e["seq"] for e in events] == list(range(len(events)))
    scheduled = Counter(e["data"]["pos"] for e in events if e["kind"] == "scheduled")
    resolved = Counter(
        e["data"]["pos"]
        for e in events
        if e["kind"] in ("completed", "step_failed", "fired", "signal", "timed_out")
    )
    assert max(scheduled.values(), default=1) == 1 and max(resolved.values(), default=1) == 1


def test_concurrent_wakes_of_one_workflow_decide_each_command_once(
    stack: EmbeddedStack, app: Any, token: str
) -> None:
    import threading

    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["order"].start(token, steps=4, pause=0.05)
    stop = threading.Event()
    outcomes: Counter[str] = Counter()

    def waker() -> None:  # wakes from this process, racing the workers' own
        while not stop.is_set():
            outcomes[app.workflow_engine.wake(handle.id)] += 1

    log = app.workflow_engine.log
    append = log.append
    collisions: list[int] = []

    def counted(workflow_id: str, after: int, events: Any, *, worker: str) -> int:
        landed = append(workflow_id, after, events, worker=worker)
        if landed < len(events):
            collisions.append(after)
        return landed

    log.append = counted  # this process's appends are counted (the workers' are not)
    threads = [threading.Thread(target=waker) for _ in range(6)]
    for thread in threads:
        thread.start()
    try:
        result = handle.result(timeout=90)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        log.append = append
    assert collisions, "no two wakes collided: the test did not exercise the log's fence"
    assert result["done"] == [f"s{i}-done" for i in range(4)]
    assert step_effects(stack, token) == Counter(
        {"s0": 1, "s1": 1, "s2": 1, "s3": 1, "g0": 1, "g1": 1}
    )
    assert_sequential_log(handle)
    assert outcomes["finished"] >= 1, outcomes


def test_a_wake_stranded_by_a_dead_worker_is_put_back_by_the_reconciler(
    stack: EmbeddedStack, app: Any, token: str
) -> None:
    import json

    import redis

    from tests.integration.conftest import NAMESPACE
    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["order"].start(token, steps=1, signal="go")
    wait_for(lambda: handle.status().waiting == ["signal go"], timeout=30, what="the wait")
    # The signal is kept, but its wake was taken by a worker that died before acknowledging it
    handle.app.workflow_engine.log.add_signal(
        handle.id,
        "sig-stranded",
        {"name": "go", "payload": '"late"', "sent_at": app.ledger.now(), "actor": "test"},
        limit=10,
    )
    queue = f"{NAMESPACE}.default"
    assert stack.broker is not None
    with redis.Redis.from_url(stack.broker.url) as broker:
        # The wake's message as kombu keeps an unacknowledged one, delivered 2 minutes ago
        body = app.amqp.as_task_v2(f"wake-{token}", "celery_ledger.workflow.wake", args=[handle.id])
        message = {
            "body": __import__("base64").b64encode(json.dumps(body.body).encode()).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": body.headers,
            "properties": {
                "body_encoding": "base64",
                "delivery_tag": f"tag-{token}",
                "delivery_info": {"exchange": "", "routing_key": queue},
                "delivery_mode": 2,
                "priority": 0,
            },
        }
        broker.hset(f"{NAMESPACE}.unacked", f"tag-{token}", json.dumps([message, "", queue]))
        broker.zadd(f"{NAMESPACE}.unacked_index", {f"tag-{token}": time.time() - 120})
        report = app.reconciler.sweep()
        assert report.wakes_restored >= 1  # (a worker takes it at once: it is unacked again)
    assert handle.result(timeout=30)["signal"] == "late"


def test_a_compensation_that_fails_for_good_leaves_the_workflow_dead_with_both_reasons(
    stack: EmbeddedStack, token: str
) -> None:
    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["undo_fails"].start(token)
    with pytest.raises(WorkflowFailed, match="dead"):
        handle.result(timeout=60)
    status = handle.status()
    assert status.status == "dead"
    assert "refused c" in (status.error or "") and "refused undo-b" in (status.error or "")
    # The newest compensation ran and died; the one before it never ran
    assert step_effects(stack, token, "wf_refuse") == Counter({"c": 1, "undo-b": 1})
    assert step_effects(stack, token, "wf_undo") == Counter()
    assert_sequential_log(handle)


def test_an_operator_retries_a_failed_workflow_from_its_failed_step(
    stack: EmbeddedStack, app: Any, token: str
) -> None:
    from tasks.effects import record_effect
    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["fixable"].start(token)
    with pytest.raises(WorkflowFailed, match="failed"):
        handle.result(timeout=60)
    assert handle.status().status == "failed"
    record_effect("fixed", token)  # the outside problem is fixed
    handle.retry()  # from its first failed step, under a new generation
    assert handle.result(timeout=60) == ["before-done", "fixed"]
    assert step_effects(stack, token) == Counter({"before": 1})  # not run again
    assert step_effects(stack, token, "wf_try") == Counter({"fixable": 2})
    retried = [e for e in handle.history() if e.kind == "retried"]
    assert len(retried) == 1 and retried[0].data["from_pos"] == 1
    assert any(a["action"] == "workflow retry" for a in app.ledger.audit_entries(limit=20))


def test_bad_input_is_refused_at_start_or_fails_the_workflow_with_a_clear_reason(
    stack: EmbeddedStack, app: Any, token: str
) -> None:
    from celery_ledger.errors import PayloadError
    from tests.integration.ledger_app import WORKFLOWS

    order = WORKFLOWS["order"]
    with pytest.raises(PayloadError, match="cannot take these arguments"):
        order.start(token, no_such_option=1)
    with pytest.raises(PayloadError, match="not JSON"):
        order.start(token, signal={1, 2})
    with pytest.raises(PayloadError, match="limit"):
        order.start(token, signal="x" * 2_000_000)
    with pytest.raises(WorkflowError, match="is a workflow"):
        order(token)
    # A result JSON cannot hold fails the workflow, with the reason
    handle = WORKFLOWS["set_result"].start(token)
    with pytest.raises(WorkflowFailed, match="not JSON"):
        handle.result(timeout=60)
    assert handle.status().status == "failed"


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ([], {}),
        ([None], {}),
        ([7], {}),
        (["x" * 5000], {}),
        ([["a", "list"]], {}),
        (["not-a-workflow-id"], {}),
        (["not-a-workflow-id"], {"recover": "yes", "attempt": -3}),
        (["not-a-workflow-id"], {"attempt": 10**30}),
        (["not-a-workflow-id"], {"unexpected": 1}),
        (["a", "b", "c", "d"], {}),
    ],
)
def test_malformed_wake_messages_never_end_a_worker(
    stack: EmbeddedStack, app: Any, token: str, args: list[Any], kwargs: dict[str, Any]
) -> None:
    from tests.integration.conftest import NAMESPACE
    from tests.integration.ledger_app import WORKFLOWS

    app.send_task("celery_ledger.workflow.wake", args, kwargs, queue=f"{NAMESPACE}.default")
    # The worker goes on (the watchdog fails the test if it died) and runs workflows
    handle = WORKFLOWS["order"].start(token, steps=1)
    assert handle.result(timeout=60)["done"] == ["s0-done"]
