"""The outbox's choices, without servers: what the relay and a committer's flush publish, hold
back or leave, over an in-memory ledger and a recording publish port."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_ledger import Settings
from celery_ledger.crypto import Sealer
from celery_ledger.errors import Backpressure, ConfigurationError, LedgerUnavailable
from celery_ledger.events import Observer, Observers
from celery_ledger.identity import derive_task_id
from celery_ledger.ledger.message import KeptMessage
from celery_ledger.ledger.record import State
from celery_ledger.ledger.store import EPOCH, UNPUBLISHED
from celery_ledger.outbox import PASS_OVER_SECONDS, WAKES_PER_PASS, Outbox
from celery_ledger.routing import TIERS, Tiers
from tests.fakes import Clock, Fault, MemoryLedger, server_clocks
from tests.fakes import Outbox as Ports

TASK = "shop.charge"
KEY = "AcKyJ2oLnrAAy_LZcIqJcLFxu0NMYeTJnp7JIrpzIs4="
OLD_KEY = "0qFzQc5xoZQhPWiz7RlXDGRcus0k650e5VRXFgPRCH8="


@dataclass
class FakeGate:
    engaged: set[str] = field(default_factory=set)
    policies: dict[str, str] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    depths: Any = None

    def engaged_now(self, tier: str) -> bool:
        return tier in self.engaged

    def holds(self, tier: str) -> bool:
        return tier in self.engaged

    def held(self, tiers: Any) -> frozenset[str]:
        return frozenset(t for t in tiers if self.holds(t))

    def policy(self, tier: str) -> str | None:
        return self.policies.get(tier, "block")


class Published(Observer):
    def __init__(self) -> None:
        self.counts: list[tuple[str, str, int]] = []

    def outbox_published(self, tier: str, by: str, count: int) -> None:
        self.counts.append((tier, by, count))


class World:
    def __init__(self) -> None:
        self.clock = Clock()
        self.ledger = MemoryLedger(clock=self.clock, lease_seconds=60)
        self.ports = Ports()
        self.gate = FakeGate()
        self.events = Published()
        self.wakes: list[tuple[str, str]] = []
        self.announced: list[str] = []  # dead letters announced (metric, Sentry, queue copy)
        self.runtime = SimpleNamespace(
            **server_clocks(self.clock),
            ledger=self.ledger,
            settings=Settings(outbox_grace_seconds=5),
            sealer=Sealer([KEY]),
            tiers=Tiers(TIERS, default="default"),
            publish=self.ports.publish,
            tier_of=lambda name: "critical" if name == TASK else None,
            gate=self.gate,
            observers=Observers(self.events),
        )
        self.outbox = Outbox(
            self.runtime,  # type: ignore[arg-type]
            publish_wake=lambda wf, tier: self.wakes.append((wf, tier)),
            workflow_states=lambda ids: [i for i in ids if not i.startswith("aborted")],
            announce_dead=self.announced.append,
            wake_due_workflows=self.wake_due,
        )
        self.checks = 0
        self.held_at_checks: list[frozenset[str]] = []

    def wake_due(self, limit: int, held: frozenset[str]) -> int:
        """The engine's wake of workflows due for a check (one started in a transaction is due
        once the committer's grace has passed)."""
        assert limit == WAKES_PER_PASS
        self.checks += 1
        self.held_at_checks.append(held)
        return 1

    def committed(self, key: str, *, tier: str = "critical", message: bool = True) -> str:
        """A job an app's transaction wrote and committed (not yet published)."""
        record_id = derive_task_id(TASK, key)
        kept = KeptMessage.of_call([7], {}, message_headers={"ledger_key": key})
        self.ledger.enqueue(record_id, task=TASK, key=key, tier=tier, message=kept)
        self.ledger.mark_unpublished(record_id)  # the outbox write's marks
        if not message:
            self.ledger.docs[record_id].pop("message")
        return record_id


@pytest.fixture
def w() -> World:
    return World()


def test_the_relay_leaves_a_commit_to_its_committer_for_the_grace_time(w: World) -> None:
    record_id = w.committed("a")
    w.clock.advance(4)
    assert w.outbox.relay() == 0 and not w.ports.tasks
    w.clock.advance(2)
    assert w.outbox.relay() == 1
    [sent] = w.ports.tasks
    assert sent.task == TASK and sent.options["task_id"] == record_id
    assert sent.options["tier"] == "critical" and sent.args == [7]
    assert w.ledger.docs[record_id]["claimable_at"] == EPOCH  # out of the relay's view
    assert w.outbox.relay() == 0  # once
    assert w.events.counts == [("critical", "relay", 1)]


def test_every_relay_pass_wakes_the_workflows_due_nothing_else_woke(w: World) -> None:
    # (a workflow started in a transaction whose committer died: a relay period, not a sweep)
    assert w.outbox.relay() == 0 and w.checks == 1
    w.committed("wf-job")
    w.clock.advance(6)
    assert w.outbox.relay() == 1 and w.checks == 2


def test_the_relay_leaves_the_workflows_of_a_tier_above_its_mark_due(w: World) -> None:
    # (a wake would add to the queue that is too deep: they are checked once it drains)
    w.gate.engaged.add("bulk")
    w.outbox.relay()
    w.gate.engaged.clear()
    w.outbox.relay()
    assert w.held_at_checks == [frozenset({"bulk"}), frozenset()]


def test_a_flush_publishes_only_what_its_transaction_committed(w: World) -> None:
    session = object.__new__(_Session)
    committed = w.committed("b")
    kept = KeptMessage.of_call([7], {}, message_headers={})
    for key in ("b", "aborted-attempt"):
        w.outbox.stage_job(
            session,  # type: ignore[arg-type]
            derive_task_id(TASK, key),
            task=TASK,
            key=key,
            tier="critical",
            message=kept,
        )
    w.outbox.stage_workflow(session, "wf-1", "default")  # type: ignore[arg-type]
    w.outbox.stage_workflow(session, "aborted-wf", "default")  # type: ignore[arg-type]
    assert w.outbox.flush(session) == 2  # type: ignore[arg-type]
    assert [p.options["task_id"] for p in w.ports.tasks] == [committed]
    assert w.wakes == [("wf-1", "default")]
    assert w.outbox.flush(session) == 0  # type: ignore[arg-type]
    assert w.events.counts == [("critical", "committer", 1)]


def test_a_flush_refuses_an_open_transaction(w: World) -> None:
    session = object.__new__(_Session)
    session.open = True
    with pytest.raises(ConfigurationError, match="after the commit"):
        w.outbox.flush(session)  # type: ignore[arg-type]


def test_a_tier_above_its_mark_holds_its_jobs_in_the_outbox(w: World) -> None:
    held, other = w.committed("c"), w.committed("d", tier="bulk")
    w.clock.advance(6)
    w.gate.engaged.add("critical")
    assert w.outbox.relay() == 1
    assert [p.options["task_id"] for p in w.ports.tasks] == [other]
    assert w.ledger.docs[held]["claimable_at"] == UNPUBLISHED  # kept, durable
    w.gate.engaged.clear()
    assert w.outbox.relay() == 1
    assert w.ledger.docs[held]["claimable_at"] == EPOCH


def test_reject_is_the_only_policy_that_refuses_inside_a_transaction(w: World) -> None:
    w.gate.engaged.add("critical")
    w.gate.limits["critical"] = SimpleNamespace(high_water=10)
    w.gate.depths = SimpleNamespace(depth=lambda tier: 12)
    for policy in ("block", "shed"):
        w.gate.policies["critical"] = policy
        w.outbox.admit("critical")  # held later, never waited for here
    w.gate.policies["critical"] = "reject"
    with pytest.raises(Backpressure):
        w.outbox.admit("critical")
    w.gate.engaged.clear()
    w.outbox.admit("critical")


def test_what_cannot_be_published_is_left_or_recorded_dead_and_the_rest_goes(w: World) -> None:
    # Given committed jobs: one with no kept message, two whose kept message is unreadable,
    # another app's, and a sound one
    bare = w.committed("e", message=False)
    broken = w.committed("e2")
    w.ledger.docs[broken]["message"] = {"raw_base64": "W25vdCBqc29u", "raw_kind": "body"}
    damaged = w.committed("e3")  # its arguments are not JSON (a damaged record)
    w.ledger.docs[damaged]["message"]["args_json"] = "[not json"
    unknown_task = derive_task_id("elsewhere.task", "f")
    kept = KeptMessage.of_call([1], {}, message_headers={})
    w.ledger.enqueue(unknown_task, task="elsewhere.task", key="f", tier="nope", message=kept)
    w.ledger.mark_unpublished(unknown_task)
    fine = w.committed("g")
    w.clock.advance(6)
    # When the relay runs
    assert w.outbox.relay() == 1
    # Then the sound one goes; the two no relay can ever publish are recorded dead with the
    # reason (out of the relay's view, among the dead letters); another app's is its relay's
    assert [p.options["task_id"] for p in w.ports.tasks] == [fine]
    for record_id, reason in (
        (bare, "no replayable message"),
        (broken, "no usable arguments"),
        (damaged, "not JSON"),
    ):
        doc = w.ledger.docs[record_id]
        assert doc["state"] == State.DEAD and doc["death"] == "bad-arguments"
        assert doc["dead_reason"].startswith("outbox: ") and reason in doc["dead_reason"]
    assert sorted(w.announced) == sorted([bare, broken, damaged])
    assert w.ledger.docs[unknown_task]["claimable_at"] == UNPUBLISHED
    assert w.outbox.relay() == 0 and len(w.ports.tasks) == 1 and len(w.announced) == 3


def test_a_committed_job_of_a_task_only_a_newer_release_has_is_published(w: World) -> None:
    # Given jobs of a task this (older) release lacks, committed by processes that died
    # before their publish: one of this app's (its record names this queue namespace), one
    # of another app's sharing the ledger, one on a tier this release does not have
    newer = "shop.refund_v2"
    kept = KeptMessage.of_call([5], {}, message_headers={})
    records = {}
    for key, fleet, tier in (
        ("a", w.runtime.tiers.namespace, "bulk"),
        ("b", "another-app", "bulk"),
        ("c", w.runtime.tiers.namespace, "overnight"),
    ):
        records[key] = derive_task_id(newer, key)
        w.ledger.fleet = fleet
        w.ledger.enqueue(records[key], task=newer, key=key, tier=tier, message=kept)
        w.ledger.mark_unpublished(records[key])
    w.clock.advance(6)
    # When this worker's relay runs
    assert w.outbox.relay() == 1
    # Then this app's job goes to its tier (the handoff takes it to a worker that has its
    # task); the others stay in the outbox for a relay that can route them
    [sent] = w.ports.tasks
    assert (sent.task, sent.args, sent.options["task_id"]) == (newer, [5], records["a"])
    assert sent.options["tier"] == "bulk"
    for key in ("b", "c"):
        assert w.ledger.docs[records[key]]["claimable_at"] == UNPUBLISHED


def test_a_record_claimed_or_published_since_the_read_is_never_recorded_dead(w: World) -> None:
    # Given a committed job with no kept message, read by the relay...
    bare = w.committed("late", message=False)
    w.clock.advance(6)
    [read] = w.ledger.unpublished(older_than_seconds=5)
    # ...then published and claimed by another process before the relay's write
    w.ledger.mark_published([bare])
    # When the relay would record it dead as read
    w.outbox._bury(read, TASK, "critical", "outbox: test", None)
    # Then nothing changes: the write applies only to the record exactly as read
    assert w.ledger.docs[bare]["state"] == State.QUEUED and not w.announced


def test_a_job_sealed_with_a_key_this_process_lacks_never_hides_the_rest(w: World) -> None:
    # Given 3 committed jobs sealed with a key rotated out of this worker, and a sound one
    old = Sealer([OLD_KEY])
    sealed = []
    for n in range(3):
        record_id = derive_task_id(TASK, f"old-{n}")
        kept = KeptMessage.of_call(["4242"], {}, message_headers={}, sealer=old)
        w.ledger.enqueue(record_id, task=TASK, key=f"old-{n}", tier="critical", message=kept)
        w.ledger.mark_unpublished(record_id)
        sealed.append(record_id)
    w.clock.advance(6)
    fine = w.committed("fine")
    w.clock.advance(6)
    # When the relay reads 2 at a time (in the records' order: 2 sealed ones first)
    assert w.outbox.relay(limit=2) == 0
    # Then the ones it cannot open are passed over, not buried (the key may come back), and
    # never fill its window: the sound one goes on the next pass
    assert w.outbox.relay(limit=2) == 1
    assert [p.options["task_id"] for p in w.ports.tasks] == [fine]
    assert all(w.ledger.docs[r]["claimable_at"] == UNPUBLISHED for r in sealed)
    # And once the key is back, after the pass-over time, they go
    w.runtime.sealer = Sealer([KEY, OLD_KEY])
    w.clock.advance(PASS_OVER_SECONDS - 1)
    assert w.outbox.relay() == 0
    w.clock.advance(2)
    assert w.outbox.relay() == 3


def test_a_broker_that_fails_midway_leaves_only_the_unsent_for_later(w: World) -> None:
    first, second = w.committed("h"), w.committed("i")
    w.clock.advance(6)
    sent: list[str] = []

    def publish_once(task: str, args: Any, kwargs: Any, **options: Any) -> None:
        if sent:
            raise ConnectionError("broker away")
        sent.append(options["task_id"])

    w.runtime.publish = publish_once
    with pytest.raises(ConnectionError):
        w.outbox.relay()
    [done] = sent
    left = second if done == first else first
    assert w.ledger.docs[done]["claimable_at"] == EPOCH
    assert w.ledger.docs[left]["claimable_at"] == UNPUBLISHED


class _Session:
    """Enough of a pymongo session for the outbox's bookkeeping (hashable, weak-referable)."""

    open = False

    @property
    def in_transaction(self) -> bool:
        return self.open


def test_records_held_back_never_hide_the_ones_that_can_go(w: World) -> None:
    held = [w.committed(f"held-{n}", tier="bulk") for n in range(600)]
    other_app = derive_task_id("elsewhere.task", "x")
    kept = KeptMessage.of_call([1], {}, message_headers={})
    w.ledger.enqueue(other_app, task="elsewhere.task", key="x", tier="critical", message=kept)
    w.ledger.mark_unpublished(other_app)  # another app's, in a tier of the same name
    due = w.committed("due")
    w.clock.advance(6)
    w.gate.engaged.add("bulk")
    assert w.outbox.relay(limit=500) == 1
    assert [p.options["task_id"] for p in w.ports.tasks] == [due]
    assert all(w.ledger.docs[r]["claimable_at"] == UNPUBLISHED for r in (*held, other_app))


ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
FIELDS = ("task", "tier", "key", "fence", "message")
MESSAGE_FIELDS = ("args_json", "kwargs_json", "headers", "raw_base64", "raw_kind", "queue")


@given(
    damage=st.lists(
        st.tuples(st.sampled_from(FIELDS + MESSAGE_FIELDS), ANY), min_size=1, max_size=4
    )
)
def test_no_value_in_a_committed_record_stops_the_relay_or_hides_the_rest(
    damage: list[tuple[str, Any]],
) -> None:
    # Given a committed record with any values in its fields and its kept message's, read
    # before a sound one
    w = World()
    damaged = w.committed("damaged")
    for name, value in damage:
        doc = w.ledger.docs[damaged]
        if name in MESSAGE_FIELDS and isinstance(doc.get("message"), dict):
            doc["message"][name] = value
        elif name in FIELDS:
            doc[name] = value
    w.clock.advance(1)
    sound = w.committed("sound")
    w.clock.advance(6)
    # When the relay runs, twice
    w.outbox.relay()
    w.outbox.relay()
    # Then it never raises, the sound job goes once, and the damaged one is published, left,
    # recorded dead or passed over: never twice, never in the way
    sent = [p.options["task_id"] for p in w.ports.tasks]
    assert sent.count(sound) == 1 and sent.count(damaged) <= 1


@pytest.mark.parametrize("applied", [False, True])
def test_a_ledger_outage_as_a_record_is_recorded_dead_loses_nothing(
    w: World, applied: bool
) -> None:
    # Given a committed job with no kept message, and the ledger failing its dead write
    # (before it applied, or after: the reply lost)
    bare = w.committed("outage", message=False)
    w.clock.advance(6)
    w.ledger.faults.append(Fault("bury", LedgerUnavailable("ledger away"), applied=applied))
    # When the relay runs through the outage, and again after it
    w.outbox.relay()
    w.outbox.relay()
    # Then the record ends dead, once, and nothing was published
    assert w.ledger.docs[bare]["state"] == State.DEAD and not w.ports.tasks
    assert w.announced == ([] if applied else [bare])  # a lost reply: housekeeping copies it
