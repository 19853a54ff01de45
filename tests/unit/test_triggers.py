"""The trigger engine's logic with fakes: keys, arguments, backpressure, and the watcher's
order of work (a change's job before its token; the token only by the lease holder)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pytest
from bson import Decimal128, ObjectId
from prometheus_client import CollectorRegistry
from pymongo.errors import OperationFailure

from celery_ledger import Settings, create_app
from celery_ledger.errors import Backpressure, ConfigurationError
from celery_ledger.events import Observers
from celery_ledger.health import trigger_report
from celery_ledger.ledger.trigger_store import TriggerState
from celery_ledger.observability import metrics
from celery_ledger.policies.backpressure import TierLimit
from celery_ledger.triggers import (
    MAX_KEY_CHARS,
    Room,
    Trigger,
    TriggerRunner,
    TriggerWatcher,
    argument_of,
    change_key,
    from_json,
    json_safe,
    parse_namespace,
    problem_of,
    room_for,
)

TRIGGER = Trigger("shop.on_order", "shop", "orders", match={"operationType": "insert"})


def token(n: int) -> dict[str, str]:
    return {"_data": f"{n:08x}"}


def change(n: int, kind: str = "insert") -> dict[str, Any]:
    return {"_id": token(n), "operationType": kind, "fullDocument": {"_id": n}}


# -- pure pieces ---------------------------------------------------------------------------------


def test_a_namespace_is_a_database_and_a_collection() -> None:
    assert parse_namespace("shop.orders") == ("shop", "orders")
    assert parse_namespace("shop.orders.v2") == ("shop", "orders.v2")
    for bad in ("orders", ".orders", "shop."):
        with pytest.raises(ConfigurationError):
            parse_namespace(bad)


def test_a_change_is_keyed_on_its_resume_token() -> None:
    assert change_key(change(7)) == "00000007"
    long = {"_id": {"_data": "a" * (MAX_KEY_CHARS + 1)}}
    key = change_key(long)
    assert key.startswith("sha256:") and len(key) <= MAX_KEY_CHARS
    assert key == change_key(dict(long))  # the same change, the same key
    with pytest.raises(ValueError):
        change_key({"operationType": "insert"})


def test_bson_types_travel_as_relaxed_extended_json_and_come_back() -> None:
    oid = ObjectId()
    at = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
    doc = {"_id": oid, "amount": Decimal128("12.50"), "at": at, "n": 3, "tags": ["a"]}
    safe = json_safe(doc)
    assert safe == {
        "_id": {"$oid": str(oid)},
        "amount": {"$numberDecimal": "12.50"},
        "at": {"$date": "2026-11-26T12:00:00Z"},
        "n": 3,
        "tags": ["a"],
    }
    back = from_json(safe)
    assert back["_id"] == oid and back["amount"] == Decimal128("12.50") and back["n"] == 3
    assert back["at"].replace(tzinfo=UTC) == at


def test_the_argument_is_the_document_or_the_whole_event() -> None:
    event = change(1)
    assert argument_of(event, "document") == {"_id": 1}
    assert argument_of({"_id": token(2), "operationType": "delete"}, "document") is None
    assert argument_of(event, "change")["_id"] == token(1)


def test_the_pipeline_lets_the_invalidate_event_through_a_match() -> None:
    (stage,) = TRIGGER.pipeline()
    assert stage == {
        "$match": {"$or": [{"operationType": "insert"}, {"operationType": "invalidate"}]}
    }
    assert Trigger("t", "d", "c").pipeline() == []
    assert TRIGGER.watch_options() == {"full_document": "updateLookup"}


@pytest.mark.parametrize(
    ("code", "problem"),
    [(286, "history_lost"), (136, "history_lost"), (260, "invalid_token"), (9, "invalid_token")],
)
def test_server_errors_that_end_a_stream_for_good(code: int, problem: str) -> None:
    assert problem_of(OperationFailure("no", code=code)) == problem


def test_other_errors_are_outages() -> None:
    assert problem_of(OperationFailure("busy", code=91)) is None
    assert problem_of(ConnectionError("down")) is None


LIMIT = TierLimit(high_water=10, policy="block", low_water=4)


def test_room_stops_at_the_high_water_mark_and_waits_for_the_low() -> None:
    assert room_for(9, LIMIT, engaged=False)
    assert not room_for(10, LIMIT, engaged=False)
    assert not room_for(5, LIMIT, engaged=True)
    assert room_for(4, LIMIT, engaged=True)
    assert room_for(10**9, None, engaged=True)
    assert room_for(10**9, TierLimit(high_water=None, policy="block"), engaged=False)


class FakeDepths:
    def __init__(self) -> None:
        self.depth = 0
        self.samples = 0

    def refresh(self) -> dict[str, int]:
        self.samples += 1
        return {"bulk": self.depth}


def test_room_counts_its_own_publishes_between_samples() -> None:
    # Given a tier sampled empty, and a clock that does not move (no fresh sample)
    depths = FakeDepths()
    room = Room(depths, {"bulk": LIMIT}, clock=lambda: 0.0)  # type: ignore[arg-type]
    # When the watcher publishes a burst
    published = 0
    while room.has_room("bulk"):
        room.published("bulk")
        published += 1
    # Then it stops at the mark without a second sample
    assert published == 10 and depths.samples == 1
    assert room.has_room("default")


# -- the watcher ------------------------------------------------------------------------------


class FakeStream:
    """A stream over the source's changes after ``start`` (it sees changes added later)."""

    def __init__(self, changes: list[dict[str, Any]], start: dict[str, Any] | None) -> None:
        self._changes = changes
        self.resume_token = start or token(0)
        self.alive = True
        self.closed = False

    def try_next(self) -> dict[str, Any] | None:
        after = self.resume_token["_data"]
        for nxt in self._changes:
            if nxt["_id"]["_data"] > after:
                self.resume_token = nxt["_id"]
                return nxt
        return None

    def close(self) -> None:
        self.closed = True


class FakeSource:
    """The oplog: every change ever, and streams that resume after a token."""

    def __init__(self, changes: list[dict[str, Any]]) -> None:
        self.changes = changes
        self.opened: list[dict[str, Any]] = []
        self.fail_with: Exception | None = None

    def watch(self, pipeline: list[dict[str, Any]], **options: Any) -> FakeStream:
        if self.fail_with is not None:
            raise self.fail_with
        self.opened.append(options)
        return FakeStream(self.changes, options.get("resume_after"))


class FakeStore:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {}
        self.saves: list[dict[str, Any]] = []
        self.problems: list[str] = []

    def load(self, name: str) -> TriggerState | None:
        if not self.state:
            return None
        return TriggerState.of({"_id": name, **self.state})

    def save_token(
        self, name: str, tok: Mapping[str, Any], *, fence: int, holder: str, changes: int
    ) -> bool:
        if self.state.get("fence", 0) > fence:
            return False
        self.state.update(token=dict(tok), fence=fence)
        self.saves.append(dict(tok))
        return True

    def report_problem(self, name: str, problem: str, detail: str, *, fence: int) -> bool:
        self.state.update(problem=problem, detail=detail, fence=fence)
        self.problems.append(problem)
        return True

    def highest_fence(self, name: str) -> int:
        return int(self.state.get("fence", 0))


class FakeLease:
    owner = "host:1"

    def __init__(self, fence: int | None = 1) -> None:
        self.fence = fence
        self.raised: list[int] = []

    def hold(self) -> int | None:
        return self.fence

    def release(self) -> None:
        self.fence = None

    def still_holds(self, fence: int) -> bool:
        return self.fence == fence

    def raise_floor(self, fence: int) -> None:
        self.raised.append(fence)
        self.fence = None


class FullRoom:
    def __init__(self, room: bool = True) -> None:
        self.room = room

    def has_room(self, tier: str) -> bool:
        return self.room

    def published(self, tier: str) -> None:
        pass


class Harness:
    def __init__(
        self,
        changes: int = 5,
        *,
        save_every: int = 2,
        outages: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.source = FakeSource([change(n) for n in range(1, changes + 1)])
        self.store = FakeStore()
        self.lease = FakeLease()
        self.room = FullRoom()
        self.published: list[tuple[str, bool]] = []
        self.known: set[str] = set()
        self.fail_on: str | None = None
        self.watcher = TriggerWatcher(
            TRIGGER,
            source=lambda: self.source,  # type: ignore[arg-type, return-value]
            store=self.store,  # type: ignore[arg-type]
            lease=self.lease,  # type: ignore[arg-type]
            publish=self.publish,
            room=self.room,  # type: ignore[arg-type]
            tier="bulk",
            save_every=save_every,
            slice_seconds=60.0,
            outages=outages,
        )
        self.publish_fails_with: Exception | None = None

    def publish(self, trigger: Trigger, event: Mapping[str, Any], recovering: bool) -> bool:
        key = change_key(event)
        if self.publish_fails_with is not None:
            raise self.publish_fails_with
        if key == self.fail_on:
            raise Backpressure("bulk", 11, 10)
        self.published.append((key, recovering))
        known = key in self.known
        self.known.add(key)
        return known


def test_a_token_is_stored_only_after_the_jobs_of_the_changes_before_it() -> None:
    h = Harness(changes=5, save_every=2)
    assert h.watcher.tick()
    keys = [key for key, _ in h.published]
    assert keys == [f"{n:08x}" for n in range(1, 6)]
    # every stored token is one whose change (and every change before it) was published
    assert h.store.saves[0] == token(0)  # a new trigger keeps its starting place at once
    for saved in h.store.saves[1:]:
        assert saved["_data"] in keys
    assert h.store.state["token"] == token(5)


def test_a_failed_publish_keeps_the_place_before_it_and_reads_it_again() -> None:
    # Given a publish that fails on the third change (its tier filled in between)
    h = Harness(changes=5, save_every=100)
    h.fail_on = "00000003"
    with pytest.raises(Backpressure):
        h.watcher.tick()
    # Then the place after the second change is stored, and the stream closed
    assert h.store.state["token"] == token(2)
    # When the next tick reads again from there
    h.fail_on = None
    h.watcher.tick()
    # Then the third change comes again, in recovery (its job may be known) until a new one
    assert h.published[2:] == [("00000003", True), ("00000004", False), ("00000005", False)]
    assert h.source.opened[-1]["resume_after"] == token(2)


def test_changes_read_again_after_a_takeover_are_checked_until_a_new_one() -> None:
    h = Harness(changes=4, save_every=100)
    h.store.state = {"token": token(1), "fence": 1}
    h.known = {"00000002", "00000003"}  # the dead holder published these, never saved
    h.watcher.tick()
    assert h.published == [("00000002", True), ("00000003", True), ("00000004", True)]
    h.source.changes.append(change(5))
    h.watcher.tick()
    assert h.published[-1] == ("00000005", False)


def test_a_watcher_without_the_lease_reads_nothing() -> None:
    h = Harness()
    h.lease.fence = None
    assert not h.watcher.tick()
    assert h.published == [] and h.source.opened == [] and h.store.saves == []


def test_a_watcher_fenced_out_by_a_newer_holder_stops() -> None:
    h = Harness(changes=3, save_every=1)
    h.store.state = {"token": token(0), "fence": 5}  # a newer holder wrote
    h.watcher.tick()
    assert h.store.state["token"] == token(0)  # never moved back
    assert h.lease.raised == [5]  # it still held Redis's lease: Redis lost the counter
    assert h.published == [("00000001", True)]


def test_an_invalidate_event_stops_the_trigger_until_it_is_reset() -> None:
    h = Harness(changes=2)
    h.source.changes.append(change(3, kind="invalidate"))
    h.watcher.tick()
    assert [key for key, _ in h.published] == ["00000001", "00000002"]
    assert h.store.problems == ["invalidated"]
    assert h.store.state["token"] == token(2)
    opened = len(h.source.opened)
    assert not h.watcher.tick()  # stopped: no stream opened again
    assert len(h.source.opened) == opened


def test_a_stream_the_server_closed_is_invalidated() -> None:
    h = Harness(changes=0)
    h.watcher.tick()  # opens, idle

    class Ended(FakeStream):
        def try_next(self) -> dict[str, Any] | None:
            self.alive = False
            return None

    h.source.watch = lambda pipeline, **options: Ended([], options.get("resume_after"))  # type: ignore[method-assign]
    h.watcher._reading = None  # as after a lost connection: opened again
    h.watcher.tick()
    assert h.store.problems == ["invalidated"]


def test_a_lost_history_is_stored_as_the_problem() -> None:
    h = Harness()
    h.store.state = {"token": token(1), "fence": 1}
    h.source.fail_with = OperationFailure("gone", code=286)
    assert not h.watcher.tick()
    assert h.store.problems == ["history_lost"] and h.published == []


def test_an_outage_is_raised_and_the_stream_opened_again_later() -> None:
    h = Harness()
    h.store.state = {"token": token(1), "fence": 1}
    h.source.fail_with = OperationFailure("not primary", code=10107)
    with pytest.raises(OperationFailure):
        h.watcher.tick()
    assert h.store.problems == []
    h.source.fail_with = None
    h.watcher.tick()
    assert [key for key, _ in h.published][-1] == "00000005"


def test_a_full_tier_makes_the_watcher_wait_without_reading() -> None:
    h = Harness()
    h.room.room = False
    assert not h.watcher.tick()
    assert h.published == []
    h.room.room = True
    h.watcher.tick()
    assert len(h.published) == 5


def test_stop_saves_the_place_and_gives_up_the_lease() -> None:
    h = Harness(changes=3, save_every=100)
    runner = TriggerRunner([h.watcher], run_seconds=0.0)
    h.watcher.tick()
    runner.stop()
    assert h.store.state["token"] == token(3)
    assert h.lease.fence is None
    assert not h.watcher.tick()


def test_stop_shares_its_time_among_the_watchers() -> None:
    # Given two watchers each stuck behind an outage: a stop waits all the time it is given
    now = [0.0]
    given: list[float] = []

    class Stuck:
        def stop(self, timeout: float = 5.0) -> None:
            given.append(timeout)
            now[0] += timeout

    runner = TriggerRunner([Stuck(), Stuck()], clock=lambda: now[0])  # type: ignore[list-item]
    # When the worker stops with a second to spare
    runner.stop(timeout=1.0)
    # Then the first watcher had the second, the next what was left (not a second each): the
    # leases of those that could not stop end by themselves
    assert given == [1.0, 0.0]


# -- declaration, health, metrics --------------------------------------------------------------


def app_for_tests() -> Any:
    settings = Settings(broker_url="redis://127.0.0.1:1/0", mongo_uri="mongodb://127.0.0.1:1/")
    return create_app("trig_unit", settings=settings, set_as_current=False)


def test_on_change_declares_a_deduplicating_task_and_its_trigger() -> None:
    app = app_for_tests()

    @app.on_change("shop.orders", match={"operationType": "insert"}, tier="bulk", name="t.order")
    def on_order(order: dict[str, Any]) -> None:
        pass

    trigger = app.triggers["t.order"]
    assert (trigger.database, trigger.collection, trigger.tier) == ("shop", "orders", "bulk")
    task = app.tasks["t.order"]
    assert task.dedupe_on_publish is True and app.tier_of("t.order") == "bulk"


@pytest.mark.parametrize(
    ("namespace", "options"),
    [
        ("orders", {}),
        ("shop.orders", {"argument": "doc"}),
        ("shop.orders", {"dedupe_on_publish": False}),
        ("shop.orders", {"tier": "nope"}),
        ("shop.orders", {"lease_seconds": 0.1}),
    ],
)
def test_on_change_refuses_what_cannot_work(namespace: str, options: dict[str, Any]) -> None:
    app = app_for_tests()
    with pytest.raises(ConfigurationError):
        app.on_change(namespace, name="t.bad", **options)(lambda order: None)


def test_the_health_check_is_down_while_a_trigger_is_stopped() -> None:
    watching = TriggerState("a", token(1), 1, changes=3)
    stopped = TriggerState("b", token(1), 1, problem="invalidated", detail="dropped")
    status, detail, data = trigger_report([watching, stopped], ["a", "b"])
    assert status == "down" and "b invalidated" in detail and data["a"]["status"] == "watching"
    assert trigger_report([watching], ["a", "c"])[0] == "warn"
    assert trigger_report([watching], ["a"])[0] == "ok"


def test_trigger_metrics() -> None:
    registry = CollectorRegistry()
    metrics.enable(registry)
    try:
        # (through the app's observers, as a watcher reports them)
        observers = Observers(metrics.MetricsObserver())
        observers.trigger_change("shop.on_order")
        observers.trigger_waited("shop.on_order", "bulk")
        observers.trigger_problem("shop.on_order", "shop.orders", "history_lost", "gone")
        observers.trigger_problem("shop.on_order", "shop.orders", "some text from a server", "")
    finally:
        metrics.disable()
    value = registry.get_sample_value
    assert value("celery_ledger_trigger_changes_total", {"trigger": "shop.on_order"}) == 1
    assert value("celery_ledger_trigger_waits_total", {"trigger": "shop.on_order", "tier": "bulk"})
    labels = {"trigger": "shop.on_order", "problem": "history_lost"}
    assert value("celery_ledger_trigger_problems_total", labels) == 1
    other = {"trigger": "shop.on_order", "problem": "other"}
    assert value("celery_ledger_trigger_problems_total", other) == 1


def test_a_new_holding_starts_again_from_the_stored_place() -> None:
    # Given a watcher that read up to change 2 under fence 1
    h = Harness(changes=2, save_every=100)
    h.watcher.tick()
    # When its lease ended meanwhile, another holder saved change 4, and it holds again (fence 3)
    h.source.changes += [change(3), change(4), change(5)]
    h.store.state.update(token=token(4), fence=2)
    h.lease.fence = 3
    h.watcher.tick()
    # Then it reads on from the store's place, not from its old stream's
    assert h.source.opened[-1]["resume_after"] == token(4)
    assert h.published[-1] == ("00000005", True)


@pytest.mark.parametrize("broker_up", [True, False])
def test_the_triggers_check_joins_the_others_whether_the_broker_is_up_or_not(
    monkeypatch: pytest.MonkeyPatch, broker_up: bool
) -> None:
    from types import SimpleNamespace

    from celery_ledger import health

    def broker(app: Any, timeout: float) -> Any:
        if not broker_up:
            raise ConnectionError("down")
        return "ok", "PING answered", {}

    monkeypatch.setattr(health, "_broker", broker)
    monkeypatch.setattr(health, "_ledger", lambda app, timeout: ("ok", "ok", {}))
    monkeypatch.setattr(health, "_breakers", lambda app: ("ok", "none open", {}))
    monkeypatch.setattr(health, "_triggers", lambda app, timeout: ("down", "stopped: t", {}))
    inspect = SimpleNamespace(active_queues=lambda: {"w1": [{"name": "q.default"}]})
    app = SimpleNamespace(
        tiers=SimpleNamespace(names=["default"], queue=lambda tier: f"q.{tier}"),
        control=SimpleNamespace(inspect=lambda timeout: inspect),
        triggers={"t": TRIGGER},
    )
    checks = {c.name: c.status for c in health.run_checks(app, required=(), timeout=1.0)}
    assert checks["triggers"] == "down"
    assert checks["tier default"] == ("ok" if broker_up else "skipped")
    assert ("breakers" in checks) is broker_up


def test_the_same_error_at_one_place_again_and_again_stops_the_trigger_as_stuck() -> None:
    """A change the driver cannot decode (or an event over the server's size limit) fails
    every read at its place: reported, not a lane's warning forever."""
    from bson.errors import InvalidBSON

    from celery_ledger.triggers import STUCK_AFTER_FAILURES

    h = Harness()
    h.store.state = {"token": token(1), "fence": 1}
    h.source.fail_with = InvalidBSON("year 10000 is out of range")
    for _ in range(STUCK_AFTER_FAILURES - 1):
        with pytest.raises(InvalidBSON):
            h.watcher.tick()
    assert h.store.problems == []
    with pytest.raises(InvalidBSON):
        h.watcher.tick()
    assert h.store.problems == ["stuck"] and h.published == []


def test_an_outage_however_long_is_never_stuck() -> None:
    from celery_ledger.triggers import STUCK_AFTER_FAILURES

    h = Harness()
    h.store.state = {"token": token(1), "fence": 1}
    h.source.fail_with = OperationFailure("not primary", code=10107)
    for _ in range(STUCK_AFTER_FAILURES * 2):
        with pytest.raises(OperationFailure):
            h.watcher.tick()
    assert h.store.problems == []


class BrokerAway(Exception):
    """Stands for kombu's OperationalError (the broker away past the publish's retries), which
    this layer cannot import: the worker names it as an outage of the watchers' publish."""


@pytest.mark.parametrize("named", [True, False])
def test_a_publish_outage_the_worker_names_however_long_is_never_stuck(named: bool) -> None:
    from celery_ledger.triggers import STUCK_AFTER_FAILURES

    # Given a watcher whose every publish fails at the same change with the broker away
    h = Harness(outages=(BrokerAway,) if named else ())
    h.store.state = {"token": token(1), "fence": 1}
    h.publish_fails_with = BrokerAway("[Errno 111] Connection refused")
    raised = 0
    for _ in range(STUCK_AFTER_FAILURES * 2):
        try:
            h.watcher.tick()
        except BrokerAway:
            raised += 1
    # Then it is retried for as long as it lasts, never reported stuck (unless nobody said
    # it is an outage: then it is an error that comes back at the same place, and stops it)
    if named:
        assert h.store.problems == [] and raised == STUCK_AFTER_FAILURES * 2
    else:
        assert h.store.problems == ["stuck"] and raised == STUCK_AFTER_FAILURES
