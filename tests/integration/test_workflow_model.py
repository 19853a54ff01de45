"""A model-based test of durable workflows: the real engine and log on SecantusDB, every way a
wake can die, every message lost or repeated.

Hypothesis draws workflow programs (steps, fan-outs, compensations, timers, signal waits, a
failure at the end) and drives them through :class:`WorkflowEngine` over the real
:class:`WorkflowLog`; only the broker (wake and step messages), the step workers (they record a
job's outcome in the real ledger collection, once per job, as a claim does) and the clock are
modelled. Between steps it loses messages, repeats them, runs wakes that die before their
append, after it, or halfway through their effects, wakes workflows from the reconciler, sends
signals and cancels.

Checked after every step: each log is one sequential history (contiguous sequence numbers,
every position scheduled once and resolved at most once); a step's job is the only job of its
position (so no step can run twice under two keys); a compensation runs only after the code
failed, newest first. At the end the faults stop and the world runs on: every workflow ends in
the status its program and the operator's actions call for, with the result its code computes,
every step of a completed workflow run exactly once, and every compensation of a compensated or
cancelled one exactly once.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_ledger.errors import PermanentError, WorkflowError
from celery_ledger.events import Observer
from celery_ledger.ledger import Ledger
from celery_ledger.ledger.store import utcnow
from celery_ledger.ledger.workflow_log import WorkflowLog
from celery_ledger.wakes import HOLD_SECONDS
from celery_ledger.workflow.context import Call
from celery_ledger.workflow.engine import Definition, WorkflowEngine
from celery_ledger.workflow.history import TERMINAL, fold
from tests.conftest import examples
from tests.fakes import Clock

FLOW = "model.flow"
CHECK_SECONDS = 60.0
_run = itertools.count()

# A program is a list of commands the workflow's code runs in order:
#   ["run", task]  ["gather", n]  ["compensate", task]  ["sleep", seconds]
#   ["wait", signal, timeout]  ["fail"]
commands = st.one_of(
    st.tuples(st.just("run"), st.sampled_from(["charge", "reserve", "ship"])),
    st.tuples(st.just("gather"), st.integers(1, 3)),
    st.tuples(st.just("compensate"), st.sampled_from(["refund", "release"])),
    st.tuples(st.just("sleep"), st.sampled_from([0, 30, 300])),
    st.tuples(st.just("wait"), st.sampled_from(["go", "stop"]), st.sampled_from([None, 120])),
)
programs = st.tuples(st.lists(commands, min_size=1, max_size=6), st.booleans()).map(
    lambda drawn: [list(c) for c in drawn[0]] + ([["fail"]] if drawn[1] else [])
)


def flow(wf: Any, program: list[list[Any]]) -> list[Any]:
    results: list[Any] = []
    for command in program:
        kind = command[0]
        if kind == "run":
            results.append(wf.run(command[1], len(results)))
        elif kind == "gather":
            results.append(wf.gather([f"part{i}" for i in range(command[1])]))
        elif kind == "compensate":
            wf.compensate(command[1], len(results))
        elif kind == "sleep":
            wf.sleep(command[1])
        elif kind == "wait":
            results.append(wf.wait_signal(command[1], timeout=command[2]))
        elif kind == "fail":
            raise PermanentError("the program fails here")
    return results


class Seen(Observer):
    """The engine's events for observers, counted."""

    def __init__(self) -> None:
        self.ended: Counter[str] = Counter()
        self.steps = 0

    def workflow_step(self, workflow: str, step: str, seconds: float, ok: bool) -> None:
        assert seconds >= 0
        self.steps += 1

    def workflow_ended(self, workflow: str, status: str) -> None:
        self.ended[status] += 1


class Died(Exception):
    """The process running a wake died here (a SIGKILL, in the model)."""


@dataclass
class Broker:
    """The messages in flight: wakes (workflow ids) and steps (job id, task name)."""

    wakes: list[str] = field(default_factory=list)
    steps: list[tuple[str, str]] = field(default_factory=list)
    held: list[tuple[float, str]] = field(default_factory=list)  # delayed wakes: (due, id)

    def release_due(self, now: float) -> None:
        """The delayed set: wakes whose time came go to the queue."""
        due = [(at, wake) for at, wake in self.held if at <= now]
        self.held = [(at, wake) for at, wake in self.held if at > now]
        self.wakes += [wake for _, wake in sorted(due)]


class Ports:
    """The engine's ports: messages go to the model's broker; a crash can be armed."""

    def __init__(self, broker: Broker, clock: Any) -> None:
        self.broker = broker
        self.clock = clock
        self.die_after: int | None = None  # publishes before this wake's process dies
        self.marks: dict[str, float] = {}  # workflows with a wake sent: until when it holds

    def _publish(self) -> None:
        if self.die_after is not None:
            if self.die_after <= 0:
                raise Died("died during the wake's effects")
            self.die_after -= 1

    def call_of(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        return Call("step", str(target), tuple(args), dict(kwargs))

    def check_arguments(self, call: Call) -> None:
        pass  # the model's steps take any arguments

    def publish_step(
        self, call: Call, *, job_id: str, key: str, workflow_id: str, workflow_tier: str
    ) -> None:
        self._publish()
        self.broker.steps.append((job_id, call.name))

    def publish_wake(self, workflow_id: str, tier: str, *, delay: float = 0.0) -> bool:
        self._publish()
        now = self.clock().timestamp()
        if delay > 0:  # held until due, as the delayed set holds it
            self.broker.held.append((now + delay, workflow_id))
            return True
        # Folded into the wake that waits, while its mark holds (celery_ledger.wakes)
        if self.marks.get(workflow_id, float("-inf")) > now:
            SEEN["wake folded"] += 1
            return False
        self.marks[workflow_id] = now + HOLD_SECONDS
        self.broker.wakes.append(workflow_id)
        return True


class DyingLog(WorkflowLog):
    """The real log; an append can be armed to die before it is sent or after it applied."""

    die: str | None = None

    def append(self, workflow_id: str, after: int, events: Any, *, worker: str) -> int:
        if self.die == "before append":
            raise Died("died before the append")
        landed = super().append(workflow_id, after, events, worker=worker)
        if self.die == "after append":
            raise Died("died after the append")
        return landed


@dataclass
class Started:
    id: str
    program: list[list[Any]]
    cancelled: bool = False
    signals: Counter[str] = field(default_factory=Counter)


SEEN: Counter[str] = Counter()


class WorkflowModel(RuleBasedStateMachine):
    ledger_url: str  # set by the test

    def __init__(self) -> None:
        super().__init__()
        run = next(_run)
        self.clock = Clock(utcnow())
        self.ledger = Ledger(
            uri=self.ledger_url,
            database="workflow_model_tests",
            collection=f"wf_model_{run}",
            clock=self.clock,
        )
        self.log = DyingLog(self.ledger, retention_seconds=3600)
        self.log.ensure_indexes()
        self.broker = Broker()
        self.ports = Ports(self.broker, self.clock)
        self.engine = WorkflowEngine(
            self.log,
            {FLOW: Definition(FLOW, flow, snapshot_every=10)},
            self.ports,
            default_tier="default",
            snapshot_every=10,
            check_seconds=CHECK_SECONDS,
            max_payload_bytes=100_000,
            observers=(seen := Seen()),
            clock=lambda: self.clock().timestamp(),
        )
        self.seen = seen
        self.workflows: list[Started] = []
        self.effects: Counter[str] = Counter()  # by job id
        self.job_of: dict[tuple[str, int, int], str] = {}  # (workflow, generation, pos) -> job

    def teardown(self) -> None:
        try:
            self.settle()
        finally:
            database = self.ledger.collection.database
            for name in ("", "_workflows", "_workflow_events"):
                database.drop_collection(f"{self.ledger.collection_name}{name}")
            self.ledger.close()

    # -- the world ---------------------------------------------------------------------------

    def run_wake(self, workflow_id: str, death: str | None) -> None:
        self.log.die = death if death in ("before append", "after append") else None
        self.ports.die_after = 0 if death == "during effects" else None
        self.ports.marks.pop(workflow_id, None)  # a wake clears its mark before it reads
        try:
            self.engine.wake(workflow_id)
        except Died:
            SEEN[f"wake died {death}"] += 1

        finally:
            self.log.die = None
            self.ports.die_after = None

    def run_step(self, job_id: str, task: str) -> None:
        """A step's delivery: the ledger runs a job once; its completion wakes the workflow."""
        records = self.ledger.collection
        if records.find_one({"_id": job_id, "state": {"$in": ["succeeded", "dead"]}}):
            SEEN["step delivered again"] += 1
        else:
            self.effects[job_id] += 1
            if task in ("refuse",):
                fields = {"state": "dead", "dead_reason": "refused"}
            else:
                fields = {"state": "succeeded", "result": json.dumps(task)}
            records.update_one({"_id": job_id}, {"$set": fields}, upsert=True)
        workflow = self.workflow_of_job(job_id)
        if workflow is not None:
            self.ports.publish_wake(workflow, "default")

    def workflow_of_job(self, job_id: str) -> str | None:
        for (workflow, _, _), job in self.job_of.items():
            if job == job_id:
                return workflow
        return None

    # -- rules -------------------------------------------------------------------------------

    @rule(program=programs)
    def start(self, program: list[list[Any]]) -> None:
        key = f"wf-{len(self.workflows)}"
        workflow_id, created = self.engine.start(
            self.engine.definitions[FLOW], (program,), {}, key=key
        )
        assert created
        self.workflows.append(Started(workflow_id, program))

    @precondition(lambda self: self.broker.wakes)
    @rule(
        data=st.data(),
        death=st.sampled_from(
            [None, None, None, "before append", "after append", "during effects"]
        ),
    )
    def deliver_wake(self, data: st.DataObject, death: str | None) -> None:
        index = data.draw(st.integers(0, len(self.broker.wakes) - 1))
        workflow_id = self.broker.wakes.pop(index)
        SEEN[f"wake delivered ({death or 'it lives'})"] += 1
        self.run_wake(workflow_id, death)

    @precondition(lambda self: self.broker.steps)
    @rule(data=st.data(), lose_wake=st.booleans(), twice=st.booleans())
    def deliver_step(self, data: st.DataObject, lose_wake: bool, twice: bool) -> None:
        job_id, task = self.broker.steps.pop(data.draw(st.integers(0, len(self.broker.steps) - 1)))
        before = len(self.broker.wakes)
        self.run_step(job_id, task)
        if twice:  # redelivered (a worker died before its acknowledgement)
            self.run_step(job_id, task)
        if lose_wake and len(self.broker.wakes) > before:
            self.broker.wakes.pop()
            SEEN["completion wake lost"] += 1

    @precondition(lambda self: self.broker.wakes or self.broker.steps)
    @rule(data=st.data(), which=st.sampled_from(["wake", "step"]), repeat=st.booleans())
    def lose_or_repeat_a_message(self, data: st.DataObject, which: str, repeat: bool) -> None:
        queue: list[Any] = self.broker.wakes if which == "wake" else self.broker.steps
        if not queue:
            return
        index = data.draw(st.integers(0, len(queue) - 1))
        if repeat:
            queue.append(queue[index])
        else:
            queue.pop(index)
        SEEN[f"{which} {'repeated' if repeat else 'lost'}"] += 1

    @rule(seconds=st.sampled_from([1, 40, 200]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.broker.release_due(self.clock().timestamp())

    @rule()
    def reconcile(self) -> None:
        woken = self.engine.wake_overdue()
        SEEN["reconciler woke"] += woken > 0

    @precondition(lambda self: self.workflows)
    @rule(data=st.data(), name=st.sampled_from(["go", "stop"]))
    def signal(self, data: st.DataObject, name: str) -> None:
        workflow = data.draw(st.sampled_from(self.workflows))
        try:
            self.engine.signal(
                workflow.id, name, "payload", signal_id=f"s{next(_run)}", actor="model", limit=100
            )
        except WorkflowError:
            return  # ended
        workflow.signals[name] += 1

    @precondition(lambda self: self.workflows)
    @rule(data=st.data(), now=st.integers(0, 5))
    def cancel(self, data: st.DataObject, now: int) -> None:
        if now:  # an operator's cancel is rare next to the traffic
            return
        workflow = data.draw(st.sampled_from(self.workflows))
        try:
            self.engine.cancel(workflow.id, reason="model", actor="model")
        except WorkflowError:
            return
        workflow.cancelled = True
        SEEN["cancelled"] += 1

    # -- what must hold --------------------------------------------------------------------------

    @invariant()
    def each_log_is_one_history(self) -> None:
        for workflow in self.workflows:
            events = self.log.all_events(workflow.id)
            assert [e["seq"] for e in events] == list(range(len(events)))
            generation = 0
            scheduled: Counter[tuple[int, int]] = Counter()
            resolved: Counter[tuple[int, int]] = Counter()
            compensations: list[int] = []
            for event in events:
                data = event.get("data") or {}
                if event["kind"] == "retried" and data.get("from_pos") is not None:
                    generation = int(data["generation"])
                if event["kind"] == "scheduled":
                    scheduled[(generation, data["pos"])] += 1
                    if data.get("job_id"):
                        known = self.job_of.setdefault(
                            (workflow.id, generation, data["pos"]), data["job_id"]
                        )
                        assert known == data["job_id"], "two jobs for one step"
                if event["kind"] in ("completed", "step_failed", "fired", "signal", "timed_out"):
                    resolved[(generation, data["pos"])] += 1
                if event["kind"] == "compensation_scheduled":
                    compensations.append(data["pos"])
            assert max(scheduled.values(), default=1) == 1, scheduled
            assert max(resolved.values(), default=1) == 1, resolved
            assert compensations == sorted(compensations, reverse=True)
            assert len(set(compensations)) == len(compensations)

    @invariant()
    def a_job_runs_once(self) -> None:
        assert max(self.effects.values(), default=1) == 1

    # -- the end ---------------------------------------------------------------------------------

    def settle(self) -> None:
        """No more faults: messages flow, time passes, signals come, the reconciler sweeps."""
        for round_ in range(50):
            for workflow in self.workflows:  # whatever it still waits for comes
                for name in ("go", "stop"):
                    with contextlib.suppress(WorkflowError):
                        self.engine.signal(
                            workflow.id,
                            name,
                            "late",
                            signal_id=f"end-{name}-{round_}",
                            actor="model",
                            limit=1000,
                        )
            while self.broker.wakes or self.broker.steps:
                while self.broker.steps:
                    self.run_step(*self.broker.steps.pop(0))
                if self.broker.wakes:
                    self.run_wake(self.broker.wakes.pop(0), None)
            states = {w.id: fold(w.id, self.log.all_events(w.id)) for w in self.workflows}
            if all(state.finished for state in states.values()):
                break
            self.clock.advance(CHECK_SECONDS + 1)
            self.broker.release_due(self.clock().timestamp())
            self.engine.wake_overdue()
        for workflow in self.workflows:
            state = fold(workflow.id, self.log.all_events(workflow.id))
            assert state.status in TERMINAL, f"{workflow.id} ended {state.status}: {workflow}"
            SEEN[f"ended: {state.status}"] += 1
            self.check_end(workflow, state)
        ended = Counter(fold(w.id, self.log.all_events(w.id)).status for w in self.workflows)
        assert self.seen.ended == ended  # one workflow_ended per workflow, with its status

    def check_end(self, workflow: Started, state: Any) -> None:
        program = workflow.program
        fails = program and program[-1] == ["fail"]
        registered = [c for c in state.commands.values() if c.kind == "compensation"]
        if state.status == "completed":
            assert not fails
            for command in state.commands.values():
                if command.kind == "step":
                    assert self.effects[command.job_id] == 1
            assert state.result is not None
            assert len(json.loads(state.result)) == sum(
                1 for c in program if c[0] in ("run", "gather", "wait")
            )
        elif state.status in ("compensated", "cancelled"):
            assert fails or workflow.cancelled
            assert state.status != "cancelled" or workflow.cancelled
            for command in registered:
                assert command.run_status == "done"
                assert self.effects[str(command.run_job_id)] == 1
        elif state.status == "failed":
            assert (fails or workflow.cancelled) and not registered
        else:
            pytest.fail(f"unexpected end {state.status}: {state.error}")
        record = self.ledger.collection.find_one({"_id": workflow.id})
        assert record is not None and record.get("workflow_status") == state.status


@pytest.mark.props
# About a minute alone; a loaded machine's parallel suite once took it past the default 300 s
# (CPU, not waiting: every step is a ledger round trip and a fold of the workflow's history)
@pytest.mark.timeout(900)
def test_workflows_keep_their_promises_whatever_dies(stack: Any) -> None:
    WorkflowModel.ledger_url = stack.ledger.url
    SEEN.clear()
    run_state_machine_as_test(
        WorkflowModel,
        settings=settings(max_examples=examples(50), stateful_step_count=40),
    )
    print("\n".join(f"{count:6d}  {what}" for what, count in sorted(SEEN.items())))
    for what in (
        "wake died before append",
        "wake died after append",
        "wake died during effects",
        "step delivered again",
        "ended: completed",
        "ended: compensated",
    ):
        assert SEEN[what] > 0, f"never exercised: {what}"
