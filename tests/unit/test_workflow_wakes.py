"""How a workflow is woken: one wake message waiting at a time (celery_ledger.wakes), and the
workflow advanced where its step ended (LedgerCelery.wake_where_step_ended)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from celery_ledger import LedgerCelery, Settings, create_app
from celery_ledger.app import WAKE_TASK
from celery_ledger.wakes import PendingWakes
from celery_ledger.workflow.engine import NOT_HERE


class FakeRedis:
    """SET NX PX and DELETE, as the marks use them; ``down`` makes every call fail."""

    def __init__(self) -> None:
        self.keys: dict[str, int] = {}
        self.down = False

    def set(self, key: str, value: bytes, *, nx: bool, px: int) -> bool | None:
        if self.down:
            raise redis.ConnectionError("broker away")
        if nx and key in self.keys:
            return None
        self.keys[key] = px
        return True

    def delete(self, key: str) -> int:
        if self.down:
            raise redis.ConnectionError("broker away")
        return int(self.keys.pop(key, None) is not None)


@pytest.fixture
def app() -> LedgerCelery:
    settings = Settings(broker_url="redis://127.0.0.1:1/0", mongo_uri="mongodb://127.0.0.1:1/")
    return create_app("unit", settings=settings, set_as_current=False)


@pytest.fixture
def marks(app: LedgerCelery) -> FakeRedis:
    fake = FakeRedis()
    app.runtime.__dict__["pending_wakes"] = PendingWakes(fake, namespace="unit")  # type: ignore[arg-type]
    return fake


@pytest.fixture
def sent(app: LedgerCelery, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    messages: list[tuple[str, Any]] = []

    def send_task(name: str, args: Any = None, **options: Any) -> None:
        messages.append((name, args))

    monkeypatch.setattr(app, "send_task", send_task)
    return messages


def test_wakes_sent_while_one_waits_are_folded_into_it(
    app: LedgerCelery, marks: FakeRedis, sent: list[tuple[str, Any]]
) -> None:
    ports = app.workflow_ports
    results = [ports.publish_wake("wf-1", "default") for _ in range(5)]

    assert results == [True, False, False, False, False]
    assert sent == [(WAKE_TASK, ["wf-1"])]
    assert ports.publish_wake("wf-2", "default")  # another workflow's is its own
    assert marks.keys["unit:ledger:wake:wf-1"] == 60_000  # the mark ends by itself


def test_a_wake_that_starts_lets_the_next_one_through(
    app: LedgerCelery, marks: FakeRedis, sent: list[tuple[str, Any]]
) -> None:
    ports = app.workflow_ports
    ports.publish_wake("wf-1", "default")
    app.runtime.pending_wakes.started("wf-1")  # (as _run_wake does before it reads)

    assert ports.publish_wake("wf-1", "default")
    assert len(sent) == 2


def test_a_wake_for_later_is_never_folded(
    app: LedgerCelery, marks: FakeRedis, sent: list[tuple[str, Any]]
) -> None:
    scheduled: list[Any] = []
    app.runtime.__dict__["delayed"] = type(
        "Delayed", (), {"schedule": lambda self, *a, **k: scheduled.append(a)}
    )()
    app.workflow_ports.publish_wake("wf-1", "default")  # waits
    assert app.workflow_ports.publish_wake("wf-1", "default", delay=30.0)
    assert len(scheduled) == 1


def test_a_wake_whose_publish_fails_leaves_no_mark(
    app: LedgerCelery, marks: FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker away")

    monkeypatch.setattr(app, "send_task", refuse)
    with pytest.raises(ConnectionError):
        app.workflow_ports.publish_wake("wf-1", "default")
    assert marks.keys == {}  # the next wake is sent, not folded into one that never left


def test_a_wake_is_sent_unmarked_while_the_marks_cannot_be_read(
    app: LedgerCelery, marks: FakeRedis, sent: list[tuple[str, Any]]
) -> None:
    marks.down = True
    assert app.workflow_ports.publish_wake("wf-1", "default")
    assert app.workflow_ports.publish_wake("wf-1", "default")
    assert len(sent) == 2  # a duplicate wake costs a read; a missing one, a check time


def test_a_wake_message_that_cannot_clear_its_mark_goes_back(
    app: LedgerCelery, marks: FakeRedis
) -> None:
    from celery.exceptions import Reject

    marks.down = True
    with pytest.raises(Reject):
        app._run_wake("wf-1", 0, None)


class Engine:
    def __init__(self, outcome: str | Exception) -> None:
        self.outcome = outcome
        self.calls: list[tuple[str, bool]] = []

    def wake(self, workflow_id: str, *, here_only: bool = False) -> str:
        self.calls.append((workflow_id, here_only))
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


@pytest.mark.parametrize("outcome", ["suspended", "finished", "compensated", "stuck"])
def test_a_step_s_end_advances_its_workflow_in_place(
    app: LedgerCelery,
    marks: FakeRedis,
    sent: list[tuple[str, Any]],
    outcome: str,
) -> None:
    engine = Engine(outcome)
    app.__dict__["workflow_engine"] = engine
    app.workflow_ports.publish_wake("wf-1", "default")  # a wake that waits in a queue

    assert app.wake_where_step_ended("wf-1", "default") == outcome

    assert engine.calls == [("wf-1", True)]
    assert sent == [(WAKE_TASK, ["wf-1"])]  # no message more than the one already waiting
    assert marks.keys == {}  # and the next event's wake is sent, not folded


@pytest.mark.parametrize(
    "outcome",
    [NOT_HERE, "conflict", RuntimeError("ledger away")],
    ids=["another release or app", "other wakes keep winning", "a failure"],
)
def test_a_workflow_not_advanced_in_place_gets_a_wake_message(
    app: LedgerCelery, marks: FakeRedis, sent: list[tuple[str, Any]], outcome: Any
) -> None:
    app.__dict__["workflow_engine"] = Engine(outcome)

    assert app.wake_where_step_ended("wf-1", "bulk") == "wake sent"

    assert sent == [(WAKE_TASK, ["wf-1"])]


def test_a_step_s_end_never_raises_when_nothing_answers(
    app: LedgerCelery, marks: FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    app.__dict__["workflow_engine"] = Engine(RuntimeError("ledger away"))
    marks.down = True

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker away")

    monkeypatch.setattr(app, "send_task", refuse)

    assert app.wake_where_step_ended("wf-1", "default") == "not woken"


def test_an_unmarked_wake_whose_publish_fails_leaves_another_wake_s_mark(
    app: LedgerCelery, marks: FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    marks.keys["unit:ledger:wake:wf-1"] = 60_000  # another process's wake waits

    def broker_away(*args: Any, **kwargs: Any) -> bool:
        raise redis.ConnectionError("broker away")

    monkeypatch.setattr(marks, "set", broker_away)
    monkeypatch.setattr(app, "send_task", broker_away)
    with pytest.raises(redis.ConnectionError):
        app.workflow_ports.publish_wake("wf-1", "default")
    assert "unit:ledger:wake:wf-1" in marks.keys


class WakeableLog:
    """The workflow log's part the wakes after a data loss read."""

    def __init__(self, now: datetime, docs: list[dict[str, Any]]) -> None:
        self._now, self.docs = now, docs
        self.skipped: list[str] = []

    def now(self) -> datetime:
        return self._now

    def wakeable(self, *, limit: int, skip_tiers: Any = ()) -> list[dict[str, Any]]:
        self.skipped = sorted(skip_tiers)
        return self.docs[:limit]


class WakePorts:
    def __init__(self) -> None:
        self.wakes: list[tuple[str, str, float]] = []

    def publish_wake(self, workflow_id: str, tier: str, *, delay: float = 0.0) -> bool:
        self.wakes.append((workflow_id, tier, delay))
        return True


def test_after_a_data_loss_every_active_workflow_is_woken_at_its_timer_never_folded() -> None:
    from celery_ledger.workflow.after_loss import wake_all_again

    now = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    log = WakeableLog(
        now,
        [
            {"_id": "timer", "tier": "bulk", "timer_at": now + timedelta(seconds=40)},
            {"_id": "naive-timer", "timer_at": (now + timedelta(seconds=5)).replace(tzinfo=None)},
            {"_id": "timer-passed", "tier": "default", "timer_at": now - timedelta(seconds=9)},
            {"_id": "step", "tier": "critical"},
        ],
    )
    ports = WakePorts()
    engine = SimpleNamespace(log=log, ports=ports, default_tier="default")
    sent = wake_all_again(engine, {"held-tier"})  # type: ignore[arg-type]
    assert sent == 4
    assert log.skipped == ["held-tier"]
    # a wake at the timer it waits for (one now would find the timer not due, and send none
    # for it); for the others, at once: every one for later, if only by a moment (a wake for
    # now is folded into one whose mark outlived its lost message)
    assert [(w, t, round(d, 2)) for w, t, d in ports.wakes] == [
        ("timer", "bulk", 40.05),
        ("naive-timer", "default", 5.05),
        ("timer-passed", "default", 0.05),
        ("step", "critical", 0.05),
    ]
