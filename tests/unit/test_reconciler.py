"""The reconciler's choices, without servers: what it restores, republishes, leaves alone or
skips, over an in-memory ledger and a fake view of the broker."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from celery_ledger import Settings
from celery_ledger import reconciler as reconciler_module
from celery_ledger.broker import (
    Continuity,
    CopiesOwed,
    Stranded,
    Unacked,
    Watch,
    WatchState,
    data_lost,
)
from celery_ledger.crypto import Sealer
from celery_ledger.errors import StoreError
from celery_ledger.identity import derive_task_id
from celery_ledger.ledger.message import KeptMessage
from celery_ledger.ledger.record import State
from celery_ledger.reconciler import Reconciler
from celery_ledger.routing import TIERS, Tiers
from tests.fakes import Clock, MemoryLedger, Outbox, server_clocks

TASK = "shop.charge"
WAKE = "celery_ledger.workflow.wake"
NEWER = "shop.refund_v2"  # a task only a newer release of the app has
OLD_KEY = "AcKyJ2oLnrAAy_LZcIqJcLFxu0NMYeTJnp7JIrpzIs4="
NEW_KEY = "0qFzQc5xoZQhPWiz7RlXDGRcus0k650e5VRXFgPRCH8="


@dataclass
class FakeBroker:
    unacked_messages: dict[str, Unacked] = field(default_factory=dict)
    waiting_ids: set[str] = field(default_factory=set)
    restored: list[str] = field(default_factory=list)
    taken: list[Stranded] = field(default_factory=list)  # unacknowledged, by time taken
    queued_messages: int = 0  # in the queues and the delayed set
    marker: Continuity | None = field(default_factory=lambda: Continuity("m1", None, False))
    owed: CopiesOwed | None = None  # the dead letters' copies owed (noted in the broker)
    notes: int = 0
    holding: bool = False  # (a note held: paid again at each sweep until it is not)
    watching: bool = False  # (a watch after a failover noted, not lapsed yet)
    watch_end: datetime | None = None  # (its end's note, with its since: not seen to yet)
    watch_noted: list[tuple[float, datetime]] = field(default_factory=list)
    refuse_notes: bool = False

    def stranded(self, *, older_than_seconds: float, limit: int) -> list[Stranded]:
        return list(self.taken)[:limit]

    def unacked(self) -> dict[str, Unacked]:
        return dict(self.unacked_messages)

    def waiting(self) -> set[str]:
        return set(self.waiting_ids)

    def restore(self, message: Unacked) -> bool:
        self.restored.append(message.tag)
        return True

    def depth(self) -> int:
        return self.queued_messages

    def continuity(self) -> Continuity | None:
        return self.marker

    def owe_copies(self, since: datetime | None, hold_seconds: float) -> None:
        if self.owed is not None:
            since = CopiesOwed.wider(self.owed.since, since)
        self.notes += 1  # (each note its own token, as the broker's)
        self.owed = CopiesOwed(since, f"{since}|{self.notes}", held=self.holding)

    def copies_owed(self) -> CopiesOwed | None:
        return self.owed

    def copies_paid(self, owed: CopiesOwed) -> None:
        if self.owed == owed:
            self.owed = None

    def watch_after_failover(self, seconds: float, since: datetime) -> None:
        if self.refuse_notes:
            raise ConnectionError("the broker refuses")
        self.watch_noted.append((seconds, since))
        self.watching, self.watch_end = True, since

    def watch(self) -> WatchState:
        if self.watch_end is None:
            return WatchState(Watch.NONE)
        return WatchState(Watch.WATCHING if self.watching else Watch.ENDED, self.watch_end)

    def watch_done(self) -> None:
        self.watch_end = None


@dataclass
class FakeGate:
    """Backpressure: the tiers above their mark."""

    engaged: set[str] = field(default_factory=set)

    def holds(self, tier: str) -> bool:
        return tier in self.engaged

    def held(self, tiers: Any) -> frozenset[str]:
        return frozenset(t for t in tiers if t in self.engaged)


@dataclass
class FakeLock:
    held: bool = True

    def acquire(self) -> int | None:
        return 7 if self.held else None


class World:
    def __init__(self) -> None:
        self.clock = Clock()
        self.ledger = MemoryLedger(clock=self.clock, lease_seconds=60)
        self.broker = FakeBroker()
        self.outbox = Outbox()
        self.lock = FakeLock()
        self.sealer = Sealer([NEW_KEY])
        self.gate = FakeGate()
        self.declared: list[int] = []
        # the broker's view between the missing-message look's two reads
        self.between_looks: Any = None
        self.runtime = SimpleNamespace(
            **server_clocks(self.clock, lambda: self.clock().timestamp()),
            ledger=self.ledger,
            settings=Settings(reconcile_lease_grace_seconds=10, reconcile_stale_after_seconds=900),
            sealer=self.sealer,
            tiers=Tiers(TIERS, default="default"),
            publish=self.outbox.publish,
            tier_of=lambda name: "critical" if name == TASK else None,
            gate=self.gate,
        )
        self.reconciler = Reconciler(
            self.runtime,  # type: ignore[arg-type]
            self.broker,
            self.lock,  # type: ignore[arg-type]
            idempotent_tasks=(WAKE,),
            declare_queues=lambda: self.declared.append(1),
            sleep=self.sleep,
            monotonic=lambda: self.clock().timestamp(),
        )

    def sleep(self, seconds: float) -> None:
        self.clock.advance(seconds)
        if self.between_looks is not None:
            self.between_looks()

    def queued_job(self, key: str) -> str:
        """A job published with dedupe on publish: its record is queued before its message."""
        record_id = derive_task_id(TASK, key)
        message = KeptMessage.of_call([7], {}, message_headers={"ledger_key": key})
        self.ledger.enqueue(record_id, task=TASK, key=key, tier="critical", message=message)
        return record_id

    def taken(self, tag: str, *, record_id: str | None, task: str = TASK, ago: float) -> None:
        """A message a worker took ``ago`` seconds ago and has not acknowledged."""
        since = self.clock().timestamp() - ago
        self.broker.taken.append(Stranded(Unacked(tag, "critical", b"{}"), task, record_id, since))

    def running_job(self, key: str, **headers: Any) -> str:
        """A job claimed by a worker that then died (no heartbeat: the lease runs out)."""
        record_id = derive_task_id(TASK, key)
        message = KeptMessage.of_call(
            [7], {}, message_headers={"ledger_key": key, "ledger_enqueued_at": 5.0, **headers}
        )
        self.ledger.claim(
            record_id, task=TASK, key=key, tier="critical", owner="dead:1", message=message
        )
        return record_id


@pytest.fixture
def world() -> World:
    return World()


def test_a_dead_workers_job_is_restored_from_the_unacked_set(world: World) -> None:
    record_id = world.running_job("k1")
    world.broker.unacked_messages[record_id] = Unacked("tag-1", "critical", b"{}")
    world.clock.advance(60 + 11)

    report = world.reconciler.sweep()

    assert report.expired_leases == 1 and report.restored_from_broker == 1
    assert world.broker.restored == ["tag-1"] and world.outbox.tasks == []


def test_a_job_whose_message_is_gone_is_republished_with_its_headers(world: World) -> None:
    record_id = world.running_job("k1", retries=2)
    world.clock.advance(71)

    report = world.reconciler.sweep()

    assert report.republished == 1
    [sent] = world.outbox.tasks
    assert (sent.task, sent.args, sent.kwargs) == (TASK, [7], {})
    assert sent.options["task_id"] == record_id and sent.options["tier"] == "critical"
    # the job keeps its age and its retry budget
    assert sent.options["headers"]["ledger_enqueued_at"] == 5.0
    assert sent.options["retries"] == 2
    # and a second sweep does not publish it again (the record was marked)
    assert world.reconciler.sweep().republished == 0


def test_a_job_whose_lease_is_live_or_within_grace_is_left_alone(world: World) -> None:
    world.running_job("k1")
    world.clock.advance(65)  # past the lease, within the grace

    assert world.reconciler.sweep().expired_leases == 0


def test_a_stale_job_whose_message_still_waits_is_left_alone(world: World) -> None:
    record_id = derive_task_id(TASK, "k2")
    world.ledger.enqueue(
        record_id,
        task=TASK,
        key="k2",
        tier="critical",
        message=KeptMessage.of_call([1], {}, message_headers={}),
    )
    world.broker.waiting_ids.add(record_id)
    world.clock.advance(901)

    report = world.reconciler.sweep()

    assert report.stale_queued == 1 and report.still_waiting == 1
    assert world.outbox.tasks == []


def test_a_job_whose_first_publish_failed_is_published_on_the_next_sweep(world: World) -> None:
    record_id = derive_task_id(TASK, "k3")
    world.ledger.enqueue(
        record_id,
        task=TASK,
        key="k3",
        tier="critical",
        message=KeptMessage.of_call([1], {}, message_headers={}),
    )
    world.ledger.mark_unpublished(record_id)
    world.clock.advance(1)  # not 900 s: at once

    report = world.reconciler.sweep()

    assert report.republished == 1 and world.outbox.tasks[0].options["task_id"] == record_id


@pytest.mark.parametrize("tier", ["critical", "bulk"])
def test_a_job_never_published_waits_in_the_outbox_while_its_tier_is_above_its_mark(
    world: World, tier: str
) -> None:
    # Given jobs never published (enqueued in an app's transaction, or their publish failed),
    # one enqueued to a tier above its mark, long past the stale time
    held, free = derive_task_id(TASK, "held"), derive_task_id(TASK, "free")
    for record_id, key, to in ((held, "held", tier), (free, "free", "default")):
        message = KeptMessage.of_call([1], {}, message_headers={"ledger_key": key})
        world.ledger.enqueue(record_id, task=TASK, key=key, tier=to, message=message)
        world.ledger.mark_unpublished(record_id)
    world.gate.engaged.add(tier)
    world.clock.advance(901)

    # When the reconciler sweeps
    report = world.reconciler.sweep()

    # Then only the other tier's job is published: the held one stays in the outbox, still in
    # the relay's view, nothing past the mark
    assert report.held == 1 and report.republished == 1
    assert [t.options["task_id"] for t in world.outbox.tasks] == [free]
    assert [d["_id"] for d in world.ledger.unpublished()] == [held]
    # And it leaves the sweep's view for the stale time (the relay publishes it under the mark)
    world.gate.engaged.clear()
    report = world.reconciler.sweep()
    assert report.held == 0 and report.republished == 0
    world.clock.advance(901)  # still never published, the hold over: the backstop sends it
    world.outbox.tasks.clear()
    world.reconciler.sweep()  # (and the other job's copy again: nothing claimed it)
    assert {t.options["task_id"]: t.options["tier"] for t in world.outbox.tasks}[held] == tier


def test_jobs_left_to_the_outbox_never_fill_the_sweeps_window(world: World) -> None:
    # Given never-published jobs the reconciler leaves to the relay (2 of a held tier, 2
    # sealed with a key it lacks), then a queued job whose message was lost, all stale
    old = Sealer([OLD_KEY])
    for n in range(4):
        key = f"left-{n}"
        message = KeptMessage.of_call(
            [1], {}, message_headers={"ledger_key": key}, sealer=old if n >= 2 else None
        )
        tier = "bulk" if n < 2 else "critical"
        world.ledger.enqueue(
            derive_task_id(TASK, key), task=TASK, key=key, tier=tier, message=message
        )
        world.ledger.mark_unpublished(derive_task_id(TASK, key))
    world.clock.advance(1)
    lost = derive_task_id(TASK, "lost")
    message = KeptMessage.of_call([2], {}, message_headers={"ledger_key": "lost"})
    world.ledger.enqueue(lost, task=TASK, key="lost", tier="critical", message=message)
    world.gate.engaged.add("bulk")
    world.clock.advance(901)
    # When the reconciler sweeps 2 records at a time
    sweeps = [world.reconciler.sweep(limit=2) for _ in range(3)]
    # Then each job left to the relay is read once, and the lost job comes back
    assert sum(r.held for r in sweeps) == 2 and sum(r.failed for r in sweeps) == 2
    assert [t.options["task_id"] for t in world.outbox.tasks] == [lost]
    assert len(world.ledger.unpublished()) == 4  # still the relay's


def test_a_record_that_cannot_be_opened_is_counted_and_the_sweep_goes_on(world: World) -> None:
    # Given a sensitive job sealed with a key since rotated out, and a healthy one
    sealed = KeptMessage.of_call(
        ["4242"], {}, message_headers={"ledger_key": "k-old"}, sealer=Sealer([OLD_KEY])
    )
    world.ledger.claim(
        derive_task_id(TASK, "k-old"),
        task=TASK,
        key="k-old",
        tier="critical",
        owner="dead:1",
        message=sealed,
    )
    world.running_job("k-ok")
    world.clock.advance(71)

    report = world.reconciler.sweep()

    assert report.failed == 1 and report.republished == 1


def test_a_never_published_job_it_cannot_open_stays_in_the_outbox(world: World) -> None:
    # Given a job whose first publish failed, sealed with a key this process lacks
    record_id = derive_task_id(TASK, "k-sealed")
    sealed = KeptMessage.of_call(["4242"], {}, message_headers={}, sealer=Sealer([OLD_KEY]))
    world.ledger.enqueue(record_id, task=TASK, key="k-sealed", tier="critical", message=sealed)
    world.ledger.mark_unpublished(record_id)
    world.clock.advance(1)
    # When the reconciler sweeps
    report = world.reconciler.sweep()
    # Then it is counted as failed and left where the outbox relay (and the health check)
    # see it, for when the key is back
    assert report.failed == 1 and report.republished == 0 and not world.outbox.tasks
    assert [d["_id"] for d in world.ledger.unpublished()] == [record_id]


def test_records_it_cannot_handle_are_set_aside_and_never_hide_the_rest(world: World) -> None:
    # Given stale queued records it cannot handle (a damaged kept message; another app's job
    # never published), then a queued job whose message was lost
    damaged, foreign, lost = (derive_task_id(TASK, k) for k in ("damaged", "foreign", "lost"))
    for record_id, key in ((damaged, "damaged"), (lost, "lost")):
        message = KeptMessage.of_call([1], {}, message_headers={"ledger_key": key})
        world.ledger.enqueue(record_id, task=TASK, key=key, tier="critical", message=message)
        world.clock.advance(1)
    world.ledger.docs[damaged]["message"]["headers"] = 5  # not a mapping: reading it raises
    foreign = derive_task_id("elsewhere.task", "foreign")
    message = KeptMessage.of_call([1], {}, message_headers={})
    world.ledger.enqueue(foreign, task="elsewhere.task", key="f", tier="critical", message=message)
    world.ledger.mark_unpublished(foreign)
    world.clock.advance(901)
    # When the reconciler sweeps one record at a time
    sweeps = [world.reconciler.sweep(limit=1) for _ in range(3)]
    # Then each is read once and set aside, and the lost job comes back
    assert sum(r.failed for r in sweeps) == 1 and sum(len(r.skipped) for r in sweeps) == 1
    assert [t.options["task_id"] for t in world.outbox.tasks] == [lost]
    # And another app's never-published job stays in the outbox, for its own relay
    assert [d["_id"] for d in world.ledger.unpublished()] == [foreign]


def test_a_job_of_a_task_not_registered_here_is_skipped(world: World) -> None:
    record_id = derive_task_id("other.task", "k")
    world.ledger.claim(
        record_id,
        task="other.task",
        key="k",
        tier="default",
        owner="dead:1",
        message=KeptMessage.of_call([], {}, message_headers={}),
    )
    world.clock.advance(71)

    report = world.reconciler.sweep()

    assert report.skipped == [record_id] and world.outbox.tasks == []
    assert world.ledger.docs[record_id]["state"] == State.RUNNING


def newer_release_job(world: World, key: str, *, fleet: str | None) -> str:
    """A job of a task this release lacks, claimed by a worker of ``fleet`` that then died
    (a newer release's task in a rolling deploy, from this fleet when ``fleet`` is its own)."""
    record_id = derive_task_id(NEWER, key)
    world.ledger.fleet = fleet
    world.ledger.claim(
        record_id,
        task=NEWER,
        key=key,
        tier="bulk",
        owner="dead:1",
        message=KeptMessage.of_call([3], {"n": 1}, message_headers={"ledger_key": key}),
    )
    world.ledger.fleet = None
    return record_id


def test_a_job_of_a_task_only_a_newer_release_has_is_brought_back_to_its_tier(
    world: World,
) -> None:
    # Given a job of this fleet (its record names this app's queue namespace) whose task this
    # release lacks, its new worker dead holding it, its message gone
    ours = newer_release_job(world, "k1", fleet=world.runtime.tiers.namespace)
    # and the same of another app sharing the ledger, and of a record of before fleets
    theirs = newer_release_job(world, "k2", fleet="another-app")
    unnamed = newer_release_job(world, "k3", fleet=None)
    world.clock.advance(71)
    # When this (older) worker sweeps
    report = world.reconciler.sweep()
    # Then this fleet's job is published again to the tier it was on (the handoff takes it to
    # a worker that has its task); the others are left to their own app's sweeps
    [sent] = world.outbox.tasks
    assert (sent.task, sent.args, sent.kwargs) == (NEWER, [3], {"n": 1})
    assert sent.options["task_id"] == ours and sent.options["tier"] == "bulk"
    assert report.republished == 1 and sorted(report.skipped) == sorted([theirs, unnamed])


def test_a_message_of_a_newer_releases_task_whose_taker_died_is_put_back(world: World) -> None:
    # Given messages of a task this release lacks, taken long ago by workers that died before
    # their claim: one of this fleet's jobs, one of another app's, one with no record here
    ours, theirs, unknown = (derive_task_id(NEWER, key) for key in ("k1", "k2", "k3"))
    for record_id, fleet in ((ours, world.runtime.tiers.namespace), (theirs, "another-app")):
        world.ledger.fleet = fleet
        world.ledger.enqueue(
            record_id,
            task=NEWER,
            key=record_id,
            tier="bulk",
            message=KeptMessage.of_call([], {}, message_headers={}),
        )
    for tag, record_id in (("ours", ours), ("theirs", theirs), ("unknown", unknown)):
        world.taken(tag, record_id=record_id, task=NEWER, ago=999)
    # When this worker sweeps
    world.reconciler.sweep()
    # Then only this fleet's is put back on its queue
    assert world.broker.restored == ["ours"]


def test_a_dry_run_changes_nothing(world: World) -> None:
    world.running_job("k1")
    world.clock.advance(71)

    report = world.reconciler.sweep(dry_run=True)

    assert report.expired_leases == 1 and world.outbox.tasks == []


def test_only_the_holder_of_the_sweep_lock_sweeps(world: World) -> None:
    world.running_job("k1")
    world.clock.advance(71)
    world.lock.held = False

    assert world.reconciler.sweep_if_leader() is None
    assert world.outbox.tasks == []
    world.lock.held = True
    report = world.reconciler.sweep_if_leader()
    assert report is not None and report.republished == 1


def test_a_ledger_error_reading_candidates_fails_the_sweep_loudly(world: World) -> None:
    world.ledger.fail("expired_leases", StoreError("down"))
    with pytest.raises(StoreError):
        world.reconciler.sweep()


def test_records_nothing_can_bring_back_never_hide_the_ones_it_can(world: World) -> None:
    # Given more records it cannot republish (a task this app does not have) than one sweep reads
    for n in range(3):
        record_id = derive_task_id("gone.task", f"k{n}")
        world.ledger.claim(record_id, task="gone.task", key=f"k{n}", tier="bulk", owner="dead:1")
    brought_back = world.running_job("order-7")
    world.clock.advance(75)
    # Then they are skipped once and rotate out of view, and the next sweep finds the job
    first = world.reconciler.sweep(limit=3)
    assert len(first.skipped) == 3 and first.republished == 0
    second = world.reconciler.sweep(limit=3)
    assert second.republished == 1
    assert [p.options["task_id"] for p in world.outbox.tasks] == [brought_back]


# -- messages a worker took and holds without a live claim ------------------------------------
# The lease is 60 s and the grace 10 s: a message held 70 s without a live claim is stranded.


def test_a_message_taken_by_a_worker_that_died_before_its_claim_is_put_back(
    world: World,
) -> None:
    world.taken("no-claim", record_id=derive_task_id(TASK, "k1"), ago=71)
    world.taken("just-taken", record_id=derive_task_id(TASK, "k2"), ago=30)
    report = world.reconciler.sweep()
    assert world.broker.restored == ["no-claim"] and report.stranded_restored == 1


def test_a_running_jobs_message_is_left_while_its_lease_is_live(world: World) -> None:
    # (a long job's message stays unacknowledged for its whole run, heartbeats renew the lease)
    record_id = world.running_job("long")
    world.clock.advance(50)
    world.ledger.heartbeat(record_id, world.ledger.docs[record_id]["fence"], 60)
    world.clock.advance(50)
    world.taken("long", record_id=record_id, ago=100)
    report = world.reconciler.sweep()
    assert world.broker.restored == [] and report.stranded_restored == 0


def test_a_dead_holders_message_is_put_back_once_by_the_expired_leases_part(
    world: World,
) -> None:
    record_id = world.running_job("dead")
    world.clock.advance(71)
    world.broker.unacked_messages[record_id] = Unacked("dead", "critical", b"{}")
    world.taken("dead", record_id=record_id, ago=71)
    report = world.reconciler.sweep()
    assert world.broker.restored == ["dead"]
    assert report.restored_from_broker == 1 and report.stranded_restored == 0


def test_a_released_jobs_message_that_never_went_back_is_put_back(world: World) -> None:
    # (a warm shutdown released the claim; the main process died before its requeue)
    record_id = world.running_job("released")
    fence = world.ledger.docs[record_id]["fence"]
    world.ledger.release(record_id, fence, op="shutdown")
    world.clock.advance(80)
    world.taken("released", record_id=record_id, ago=80)
    report = world.reconciler.sweep()
    assert world.broker.restored == ["released"] and report.stranded_restored == 1
    assert world.ledger.docs[record_id]["state"] == State.QUEUED.value  # the claim's, later


def test_plain_tasks_and_unkeyed_messages_are_left_to_kombu(world: World) -> None:
    # (a plain Celery task may run for an hour and is not idempotent: its messages carry no
    # job key, so the broker names no record for them; a ledger task's message without its
    # key may be keyed by its arguments: its record id is not known here either; a task this
    # app does not have is another app's)
    world.taken("plain", record_id=None, task="other.task", ago=999)
    world.taken("unkeyed", record_id=None, ago=999)
    world.taken(
        "elsewhere", record_id=derive_task_id("other.task", "k"), task="other.task", ago=999
    )
    world.reconciler.sweep()
    assert world.broker.restored == []


def test_a_wake_is_put_back_after_a_minute(world: World) -> None:
    world.taken("old-wake", record_id=None, task=WAKE, ago=61)
    world.taken("new-wake", record_id=None, task=WAKE, ago=10)
    report = world.reconciler.sweep()
    assert world.broker.restored == ["old-wake"] and report.wakes_restored == 1


def test_a_dry_run_puts_nothing_back(world: World) -> None:
    world.taken("no-claim", record_id=derive_task_id(TASK, "k1"), ago=999)
    world.reconciler.sweep(dry_run=True)
    assert world.broker.restored == []


# -- jobs whose message is nowhere in the broker -------------------------------------------------


def test_a_queued_job_whose_message_is_nowhere_is_republished_after_the_short_wait(
    world: World,
) -> None:
    # Given a job whose record was written at publish, and whose message a worker popped and
    # died with before booking it (in no queue, not delayed, not taken)
    record_id = world.queued_job("lost")
    published_at = world.clock().timestamp()
    # When the reconciler sweeps every 3 s (it looks for missing jobs once every 30 s)
    found_at = None
    for _ in range(40):
        world.clock.advance(3)
        if world.reconciler.sweep().missing:
            found_at = world.clock().timestamp()
            break
    # Then within a minute (twice the wait, not the stale time of 900 s), and not before the
    # job was quiet for the wait, it is published again, once
    assert found_at is not None and 30 <= found_at - published_at <= 63
    assert [t.options["task_id"] for t in world.outbox.tasks] == [record_id]
    # and the sweeps after it leave its new copy, waiting in its queue, alone
    world.broker.waiting_ids.add(record_id)
    for _ in range(40):
        world.clock.advance(3)
        world.reconciler.sweep()
    assert len(world.outbox.tasks) == 1


def test_a_look_the_broker_fails_keeps_what_it_read_for_the_next(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given more quiet jobs than a look gathers (2 here), the newest of them lost
    monkeypatch.setattr(reconciler_module, "MISSING_PER_SWEEP", 2)
    ids = []
    for n in range(6):
        ids.append(world.queued_job(f"job-{n}"))
        world.clock.advance(1)
    world.broker.waiting_ids.update(ids[:-1])
    world.clock.advance(31)
    # When the broker fails the look that read the lost one
    calls = {"n": 0}
    waiting = world.broker.waiting

    def failing() -> set[str]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("broker away")
        return waiting()

    monkeypatch.setattr(world.broker, "waiting", failing)
    assert world.reconciler.sweep().missing == 0
    # Then the next look (its round gone on to older jobs) looks at it again, and brings it back
    world.clock.advance(31)
    assert world.reconciler.sweep().missing == 1
    assert [t.options["task_id"] for t in world.outbox.tasks] == [ids[-1]]


def test_another_apps_quiet_job_is_passed_over_unread(world: World) -> None:
    # Given another app's queued job in the shared ledger (a task this app does not have, and
    # another fleet's record), whose message is in none of this app's queues
    key = "theirs"
    record_id = derive_task_id("other.app.task", key)
    message = KeptMessage.of_call([1], {}, message_headers={"ledger_key": key})
    world.ledger.enqueue(
        record_id, task="other.app.task", key=key, tier="critical", message=message
    )
    world.ledger.docs[record_id]["fleet"] = "another-namespace"
    read: list[str] = []
    reading = world.ledger.records
    world.ledger.records = lambda ids: read.extend(ids) or reading(ids)  # type: ignore[method-assign]
    # When the reconciler looks for missing messages
    for _ in range(25):
        world.clock.advance(3)
        world.reconciler.sweep()
    # Then it is neither republished nor even read whole
    assert world.outbox.tasks == [] and record_id not in read


@pytest.mark.parametrize("where", ["waiting", "taken"])
def test_a_job_whose_message_is_in_the_broker_is_left_alone(world: World, where: str) -> None:
    record_id = world.queued_job("slow")
    if where == "waiting":
        world.broker.waiting_ids.add(record_id)
    else:
        world.broker.unacked_messages[record_id] = Unacked("t1", "critical", b"{}")
    world.clock.advance(120)
    report = world.reconciler.sweep()
    assert report.missing == 0 and world.outbox.tasks == [] and world.broker.restored == []


def test_a_message_seen_in_the_second_look_is_not_copied(world: World) -> None:
    # A message between two places at the first look (popped, not booked yet) is booked by the
    # second, a second later
    record_id = world.queued_job("moving")
    world.clock.advance(60)
    world.between_looks = lambda: world.broker.unacked_messages.update(
        {record_id: Unacked("t2", "critical", b"{}")}
    )
    report = world.reconciler.sweep()
    assert report.missing == 0 and world.outbox.tasks == []


def test_deep_queues_are_not_read_for_missing_messages_until_the_stale_time(
    world: World,
) -> None:
    world.queued_job("deep")
    world.broker.queued_messages = 20_001
    world.clock.advance(60)
    assert world.reconciler.sweep().missing == 0 and world.outbox.tasks == []
    world.clock.advance(900)
    report = world.reconciler.sweep()  # the stale part's, as before
    assert report.stale_queued == 1 and report.republished == 1


def test_a_broker_that_lost_its_data_has_its_jobs_back_at_once_whatever_the_depth(
    world: World,
) -> None:
    # Given a sweep that saw the broker's marker, and a job published 3 s ago
    world.reconciler.sweep()
    record_id = world.queued_job("wiped")
    world.clock.advance(3)
    world.broker.queued_messages = 50_000
    # When the broker comes back without its data (its marker written anew by this look)
    world.broker.marker = Continuity("m2", None, True)
    report = world.reconciler.sweep()
    # Then it says so, declares the queues again and publishes the job again, not 30 s later
    assert report.broker_data_lost is not None and "marker" in report.broker_data_lost
    assert world.declared == [1]
    assert report.missing == 1 and [t.options["task_id"] for t in world.outbox.tasks] == [record_id]
    # and the next sweep is an ordinary one
    world.broker.marker = Continuity("m2", None, False)
    assert world.reconciler.sweep().broker_data_lost is None and world.declared == [1]


def test_a_broker_that_lost_its_data_has_every_active_workflow_woken_at_once_and_after_the_watch(
    world: World,
) -> None:
    # Given a reconciler that wakes the workflows again after a data loss, a tier held
    asked: list[frozenset[str]] = []
    world.reconciler._wake_workflows_after_loss = lambda held: asked.append(held) or 3
    world.gate.engaged.add("bulk")
    world.broker.marker = Continuity("m1", "h1:1", False)
    world.reconciler.sweep()  # (its first look: the marker was there)
    assert asked == []
    # When the broker's primary moves (a failover: the new one may lack the last writes)
    world.broker.marker = Continuity("m1", "h2:1", False)
    report = world.reconciler.sweep()
    # Then the workflows are woken again, their held tiers' left to their checks
    assert report.workflows_rewoken == 3 and asked == [frozenset({"bulk"})]
    # and the next sweeps within the watch after it wake none
    assert world.reconciler.sweep().workflows_rewoken == 0 and len(asked) == 1
    assert world.reconciler.sweep().workflows_rewoken == 0 and len(asked) == 1
    # And the first sweep after the watch (any process's) wakes them once more: a wake an old
    # primary took meanwhile, then dropped, is only in the broker; none after that
    world.broker.watching = False
    assert world.reconciler.sweep().workflows_rewoken == 3 and len(asked) == 2
    assert world.reconciler.sweep().workflows_rewoken == 0 and len(asked) == 2


@pytest.mark.parametrize(
    ("loss", "window"),
    [
        (Continuity("m2", None, True), None),  # its marker gone: a wipe, a restart empty
        (Continuity("m2", "h1:1", False), None),  # its marker changed
        (Continuity("m1", "h2:1", False), 30 * 3 + 30.0),  # a failover: the last writes only
    ],
    ids=["marker-missing", "marker-changed", "failover"],
)
def test_the_dead_letters_copies_a_broker_lost_are_copied_again_once(
    world: World, loss: Continuity, window: float | None
) -> None:
    # Given a reconciler that copies dead letters again after a loss, and a broker seen whole
    asked: list[Any] = []
    failing = [True]

    def copy_again(since: Any) -> int:
        asked.append(since)
        if failing[0]:
            raise ConnectionError("ledger away")
        return 4

    world.reconciler._copy_dead_letters_again = copy_again
    world.broker.marker = Continuity("m1", "h1:1", False)
    world.reconciler.sweep()
    assert asked == []
    # When it loses data, and the first try fails
    world.broker.marker = loss
    now = world.ledger.now()
    assert world.reconciler.sweep().failed == 1
    # Then the next sweep tries again, for every copy (all lost) or the last ones (a failover)
    failing[0] = False
    world.broker.marker = Continuity(loss.marker, loss.primary, False)
    assert world.reconciler.sweep().dead_letters_copied_again == 4
    expected = None if window is None else now - timedelta(seconds=window)
    assert asked == [expected, expected]
    # and none after that
    assert world.reconciler.sweep().dead_letters_copied_again == 0 and len(asked) == 2


def test_the_copies_a_loss_took_are_made_by_the_next_sweeper_if_the_lock_moves_first(
    world: World,
) -> None:
    """The loss is noticed once (by the sweep that compares the marker); the copies it owes
    must not stay in that process's memory: the sweep lock may move before they are made."""
    asked: list[tuple[str, Any]] = []

    def copier(name: str, fails: bool) -> Any:
        def copy_again(since: Any) -> int:
            asked.append((name, since))
            if fails:
                raise ConnectionError("ledger away")
            return 3

        return copy_again

    world.reconciler._copy_dead_letters_again = copier("first", fails=True)
    world.broker.marker = Continuity("m1", "h1:1", False)
    world.reconciler.sweep()
    # Given a failover the first sweeper notices, whose copies it fails to make
    world.broker.marker = Continuity("m1", "h2:1", False)
    noticed = world.ledger.now()
    assert world.reconciler.sweep().failed == 1
    # When the lock moves to another worker (the first one stops), which never saw the loss
    heir = Reconciler(
        world.runtime,  # type: ignore[arg-type]
        world.broker,
        world.lock,  # type: ignore[arg-type]
        copy_dead_letters_again=copier("heir", fails=False),
        sleep=world.sleep,
        monotonic=lambda: world.clock().timestamp(),
    )
    # Then its first sweep makes them, for the failover's window, and no sweep after it does
    assert heir.sweep().dead_letters_copied_again == 3
    window = timedelta(seconds=30 * 3 + 30.0)
    assert asked == [("first", noticed - window), ("heir", noticed - window)]
    assert heir.sweep().dead_letters_copied_again == 0 and len(asked) == 2
    assert world.broker.owed is None
    # ...nor the first worker when the lock comes back to it (paid once: a consumer would see
    # each copy again)
    world.reconciler._copy_dead_letters_again = copier("first", fails=False)
    assert world.reconciler.sweep().dead_letters_copied_again == 0 and len(asked) == 2
    # and a wipe noticed later owes every copy, whatever an earlier loss owed
    heir._copy_dead_letters_again = copier("heir", fails=True)
    world.broker.marker = Continuity("m1", "h3:1", False)
    heir.sweep()
    world.broker.marker = Continuity("m9", "h3:1", False)
    heir.sweep()
    assert world.broker.owed is not None and world.broker.owed.since is None


def test_copies_a_failovers_old_primary_took_after_the_notice_are_made_while_the_note_holds(
    world: World,
) -> None:
    """A stopped old primary, continued, takes writes from clients still connected to it until
    the sentinels make it a replica, which drops them: copies made after the fleet noticed the
    failover (seen in the failover soak: 4 copies made 2 s after the notice, lost). The note is
    held for a while, and each sweep makes again what is missing, until the hold lapses."""
    asked: list[Any] = []

    def copy_again(since: Any) -> int:
        asked.append(since)
        return 1

    world.reconciler._copy_dead_letters_again = copy_again
    world.broker.marker = Continuity("m1", "h1:1", False)
    world.reconciler.sweep()
    # Given a failover noticed, the note held
    world.broker.holding = True
    world.broker.marker = Continuity("m1", "h2:1", False)
    noticed = world.ledger.now()
    assert world.reconciler.sweep().dead_letters_copied_again == 1
    # When the next sweeps come while it holds: each makes again what is missing since then
    assert world.reconciler.sweep().dead_letters_copied_again == 1
    assert world.reconciler.sweep().dead_letters_copied_again == 1
    window = timedelta(seconds=30 * 3 + 30.0)
    assert asked == [noticed - window] * 3
    # Then once the hold lapsed, the next sweep pays it off, and none after that looks again
    owed = world.broker.owed
    assert owed is not None
    world.broker.owed = dataclasses.replace(owed, held=False)
    assert world.reconciler.sweep().dead_letters_copied_again == 1
    assert world.broker.owed is None
    assert world.reconciler.sweep().dead_letters_copied_again == 0 and len(asked) == 4


WATCH_SECONDS = 30.0 + 2 * 30  # (the margin, and two sweeps of 30 s)


def notice_a_failover(world: World) -> None:
    world.broker.marker = Continuity("m1", "h1:1", False)
    world.reconciler.sweep()
    world.broker.marker = Continuity("m1", "h2:1", False)
    assert world.reconciler.sweep().broker_data_lost is not None


def test_a_job_a_failovers_old_primary_dropped_after_the_notice_is_back_at_the_next_look(
    world: World,
) -> None:
    """The jobs' side of the held copies: a job published to the old primary after the fleet
    noticed the failover (a client's connection to it waited through its stall) is dropped when
    the sentinels make it a replica. Its record is queued, its message nowhere: the looks of the
    watch find it at once, not once every 30 s."""
    # Given a failover noticed (the watch noted in the broker, for every sweeper, with the
    # records to look at: those touched since the copies' window before the notice)
    notice_a_failover(world)
    [(seconds, since)] = world.broker.watch_noted
    # (the loss's look since paused between its reads: the clock moved a little)
    assert seconds == WATCH_SECONDS
    assert abs(since - (world.ledger.now() - timedelta(seconds=120))) < timedelta(seconds=1)
    # When a job published after the notice loses its message a few seconds later
    world.clock.advance(3)
    record_id = world.queued_job("late")
    world.clock.advance(3)
    # Then the next sweep, an ordinary one but within the watch, publishes it again at once
    report = world.reconciler.sweep()
    assert report.broker_data_lost is None and report.missing == 1
    assert [t.options["task_id"] for t in world.outbox.tasks] == [record_id]


def test_the_watchs_looks_are_few_read_the_recent_records_and_spare_deep_queues(
    world: World,
) -> None:
    notice_a_failover(world)
    # A job lost a moment after the notice is looked for at most once every few seconds...
    world.clock.advance(1)
    lost = world.queued_job("a")
    world.clock.advance(2.5)
    looked = []
    for _ in range(7):
        looked.append(world.reconciler.sweep().missing)
        if looked[-1]:
            world.broker.waiting_ids.add(lost)  # (its new copy waits in its queue)
        world.clock.advance(1)
    assert looked == [0, 0, 1, 0, 0, 0, 0]  # (the notice's look was 3.5 s before the first)
    # ...only among the records touched since its window (an old quiet one waits its turn)
    world.clock.advance(10)
    old = world.queued_job("old")
    world.ledger.docs[old]["updated_at"] -= timedelta(seconds=600)
    world.clock.advance(6)
    assert world.reconciler.sweep().missing == 0
    # ...and not while the queues are deep (their read is the look's cost)
    world.queued_job("deep")
    world.broker.queued_messages = 20_001
    world.clock.advance(6)
    assert world.reconciler.sweep().missing == 0


def test_the_watchs_end_looks_once_more_wakes_the_workflows_and_is_seen_to_once(
    world: World,
) -> None:
    asked: list[frozenset[str]] = []
    world.reconciler._wake_workflows_after_loss = lambda held: asked.append(held) or 3
    notice_a_failover(world)
    assert len(asked) == 1  # (the notice's own wake)
    # Given a job lost just before the watch lapsed
    world.clock.advance(10)
    world.reconciler.sweep()
    world.clock.advance(1)
    record_id = world.queued_job("just before")
    world.clock.advance(3)
    world.broker.watching = False
    # When its end fails to wake the workflows, the next sweep sees to the end again
    world.reconciler._wake_workflows_after_loss = lambda held: 1 / 0
    report = world.reconciler.sweep()
    assert report.failed == 1 and world.broker.watch_end is not None
    assert report.missing == 1 and [t.options["task_id"] for t in world.outbox.tasks] == [record_id]
    world.broker.waiting_ids.add(record_id)  # (its new copy waits in its queue)
    # Then the next sweep wakes them, and forgets the end; none after it does
    world.reconciler._wake_workflows_after_loss = lambda held: asked.append(held) or 3
    assert world.reconciler.sweep().workflows_rewoken == 3 and world.broker.watch_end is None
    assert world.reconciler.sweep().workflows_rewoken == 0 and len(asked) == 2
    # And after it, the looks are the ordinary ones again (a job missing now waits its wait)
    world.clock.advance(40)
    world.queued_job("later")
    world.clock.advance(3)
    assert world.reconciler.sweep().missing == 0


def test_the_watch_is_the_fleets_and_this_processs_own_while_the_broker_refuses_it(
    world: World,
) -> None:
    # Given a watch another process noted (this one never saw the failover)
    world.broker.watching, world.broker.watch_end = True, world.ledger.now()
    world.clock.advance(1)
    record_id = world.queued_job("late")
    world.clock.advance(3)
    # Then this process's sweep looks at once too
    assert world.reconciler.sweep().missing == 1
    assert [t.options["task_id"] for t in world.outbox.tasks] == [record_id]
    # And a process whose note the broker refused watches for its own part...
    other = World()
    other.broker.refuse_notes = True
    notice_a_failover(other)
    other.clock.advance(3)
    late = other.queued_job("late")
    other.clock.advance(3)
    assert other.reconciler.sweep().missing == 1
    assert [t.options["task_id"] for t in other.outbox.tasks] == [late]
    # ...and notes it in the broker once it takes it, for the time left
    other.broker.refuse_notes = False
    other.clock.advance(30)
    other.reconciler.sweep()
    [(left, _)] = other.broker.watch_noted
    assert 0 < left < WATCH_SECONDS and other.broker.watching


def test_a_watch_this_process_kept_ends_as_the_fleets_unless_outlived_by_far(
    world: World,
) -> None:
    asked: list[frozenset[str]] = []
    world.reconciler._wake_workflows_after_loss = lambda held: asked.append(held) or 3
    world.broker.refuse_notes = True
    notice_a_failover(world)
    world.clock.advance(WATCH_SECONDS + 1)
    assert world.reconciler.sweep().workflows_rewoken == 3 and len(asked) == 2
    assert world.reconciler.sweep().workflows_rewoken == 0
    # (one it swept no more for long after, the lock elsewhere: dropped, no one woken)
    world.broker.marker = Continuity("m1", "h3:1", False)
    world.reconciler.sweep()
    world.clock.advance(WATCH_SECONDS + 2 * 30 + 1)
    assert world.reconciler.sweep().workflows_rewoken == 0 and len(asked) == 3


def test_a_wipe_is_watched_as_well(world: World) -> None:
    """(A new primary whose replication had not begun lacks the marker too: read as a wipe,
    while its old primary may run again.)"""
    world.reconciler.sweep()
    world.broker.marker = Continuity("m2", None, True)
    assert world.reconciler.sweep().broker_data_lost is not None
    assert [seconds for seconds, _ in world.broker.watch_noted] == [WATCH_SECONDS]


def test_a_failure_to_wake_the_workflows_again_never_stops_the_sweep(world: World) -> None:
    def fail(held: frozenset[str]) -> int:
        raise ConnectionError("broker away")

    world.reconciler._wake_workflows_after_loss = fail
    world.reconciler.sweep()
    record_id = world.queued_job("wiped")
    world.clock.advance(3)
    world.broker.marker = Continuity("m2", None, True)
    report = world.reconciler.sweep()
    assert report.failed == 1 and report.missing == 1
    assert [t.options["task_id"] for t in world.outbox.tasks] == [record_id]


def test_a_job_another_app_published_is_never_touched_by_this_ones_look(world: World) -> None:
    record_id = derive_task_id("other.task", "k")
    world.ledger.enqueue(
        record_id,
        task="other.task",
        key="k",
        tier="default",
        message=KeptMessage.of_call([], {}, message_headers={"ledger_key": "k"}),
    )
    before = dict(world.ledger.docs[record_id])
    world.clock.advance(60)
    report = world.reconciler.sweep()
    assert report.missing == 0 and report.skipped == [] and world.outbox.tasks == []
    assert world.ledger.docs[record_id]["updated_at"] == before["updated_at"]


@pytest.mark.parametrize(
    ("before", "now", "lost"),
    [
        (None, Continuity("a", None, False), None),
        (None, Continuity("a", None, True), "missing"),
        (Continuity("a", None, False), Continuity("a", None, False), None),
        (Continuity("a", None, False), Continuity("b", None, False), "changed"),
        (Continuity("a", "h1:1", False), Continuity("a", "h2:1", False), "failover"),
        (Continuity("a", "h1:1", False), Continuity("a", None, False), None),
        # a process's first look (the sweep lock just moved to it): the fleet's last look's
        (None, Continuity("a", "h2:1", False, seen_primary="h1:1"), "failover"),
        (None, Continuity("a", "h2:1", False, seen_primary="h2:1"), None),
        (None, Continuity("a", "h2:1", False, seen_primary=None), None),
        # (its own previous look comes first: the fleet's record is the same look's, or later)
        (Continuity("a", "h2:1", False), Continuity("a", "h2:1", False, "h1:1"), None),
    ],
)
def test_what_says_the_broker_lost_data(
    before: Continuity | None, now: Continuity, lost: str | None
) -> None:
    why = data_lost(before, now)
    assert (why is None) if lost is None else (why is not None and lost in why)


def test_the_look_after_a_second_loss_starts_at_the_newest_wherever_the_watchs_round_stood(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconciler_module, "MISSING_PER_SWEEP", 20)  # (jobs a look gathers)
    notice_a_failover(world)
    # Given 60 jobs touched within the watch, their messages waiting in their queue, and a
    # look of the watch that read the newest 20 of them (its round stopped there)
    older = []
    for n in range(60):
        world.clock.advance(0.01)
        older.append(world.queued_job(f"old-{n}"))
    world.broker.waiting_ids.update(older)
    world.clock.advance(6)
    world.reconciler.sweep()
    # When a second failover loses a job published since
    world.clock.advance(1)
    fresh = world.queued_job("fresh")
    world.clock.advance(3)
    world.broker.marker = Continuity("m1", "h3:1", False)
    report = world.reconciler.sweep()
    # Then its look starts at the newest job, not where the watch's round stood
    assert report.broker_data_lost is not None
    assert [t.options["task_id"] for t in world.outbox.tasks] == [fresh]
