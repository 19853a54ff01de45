"""The guard's decisions, without servers: every claim outcome, every outcome of an attempt,
and every way its ledger writes can fail, over an in-memory ledger (``tests/fakes.py``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded

from celery_ledger import Settings
from celery_ledger.clock import Reading
from celery_ledger.crypto import Sealer
from celery_ledger.deadletter import DeadLetters
from celery_ledger.errors import (
    CircuitOpen,
    DeadlineExceeded,
    Interrupted,
    LeaseLost,
    LedgerUnavailable,
    NotApplied,
    PayloadError,
    PermanentError,
    RetryNotPublished,
    StoreError,
)
from celery_ledger.events import EVENTS, Job, Observer, Observers
from celery_ledger.guard import Delivery, Guard, Replaced, TaskPolicy, Verdict
from celery_ledger.identity import Identity, derive_task_id
from celery_ledger.ledger.record import State
from celery_ledger.policies.fallback import Fallback, Placeholder
from celery_ledger.policies.retry import RetryPolicy
from celery_ledger.policies.tenants import TenantSlot, release_slot
from celery_ledger.routing import TIERS, Tiers
from tests.fakes import Clock, MemoryLedger, MemoryRedis, Outbox, server_clocks

TASK = "shop.charge"
KEY = "order-7"
RECORD = derive_task_id(TASK, KEY)
FERNET_KEYS = ["0qFzQc5xoZQhPWiz7RlXDGRcus0k650e5VRXFgPRCH8="]


class Recorder(Observer):
    """Every event, in order, as (name, args)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, tuple[Any, ...]]] = []

    def __getattribute__(self, name: str) -> Any:
        if name in EVENTS:
            return lambda *args: self.events.append((name, args))
        return super().__getattribute__(name)

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


@dataclass
class FakeBody:
    """The Celery adapter's side of an attempt, recording what the guard asks of it."""

    work: Callable[[FakeBody], Any] = lambda body: {"charged": 7}
    defer_error: BaseException | None = None
    retry_error: BaseException | None = None
    runs: int = 0
    deferred: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    retries: list[tuple[BaseException, float, dict[str, Any]]] = field(default_factory=list)
    retired: list[tuple[str, list[str]]] = field(default_factory=list)
    execution: Any = None

    def start(self, execution: Any) -> None:
        self.execution = execution

    def run(self) -> Any:
        self.runs += 1
        return self.work(self)

    def defer(
        self,
        delay_seconds: float,
        message_headers: dict[str, Any],
        *,
        fresh: bool = False,
        handed_back: int = 0,
    ) -> None:
        if self.defer_error is not None:
            raise self.defer_error
        if fresh:  # recorded with the headers, for the tests to see
            message_headers = {**message_headers, "fresh": True}
        if handed_back:  # the copy's property, recorded with the headers likewise
            message_headers = {**message_headers, "handed_back": handed_back}
        self.deferred.append((delay_seconds, message_headers))

    def retry(
        self, exc: BaseException, delay_seconds: float, message_headers: dict[str, Any]
    ) -> BaseException:
        if self.retry_error is not None:
            raise self.retry_error
        self.retries.append((exc, delay_seconds, message_headers))
        return Retry(exc=exc, when=delay_seconds)

    def on_retire(self, reason: str, artefacts: list[str]) -> None:
        self.retired.append((reason, artefacts))

    def named_arguments(self) -> dict[str, Any]:
        return {"order": 7, "amount": 100}


class Harness:
    """A guard over an in-memory ledger, a fake clock and recording ports."""

    def __init__(self, **settings: Any) -> None:
        self.clock = Clock()
        self.ledger = MemoryLedger(clock=self.clock, lease_seconds=60, max_deliveries=3)
        self.recorder = Recorder()
        self.outbox = Outbox()
        self.settings = Settings(encryption_keys=FERNET_KEYS, busy_recheck_seconds=5.0, **settings)
        self.runtime = SimpleNamespace(
            **server_clocks(self.clock),
            name="unit",
            ledger=self.ledger,
            settings=self.settings,
            observers=Observers(self.recorder),
            sealer=Sealer(FERNET_KEYS),
            tiers=Tiers(TIERS, default="default"),
            breakers={},
            rate_limits={},
            redis=MemoryRedis(),
            publish=self.outbox.publish,
            tier_of=lambda name: "default" if name == TASK else None,
        )
        self.dead_letters = DeadLetters(self.runtime, self.outbox.publish_raw)  # type: ignore[arg-type]
        self.guard = Guard(
            self.runtime,  # type: ignore[arg-type]
            self.dead_letters,
            sleep=self.clock.advance,
            monotonic=lambda: self.clock().timestamp(),
        )

    def delivery(self, **changes: Any) -> Delivery:
        fields: dict[str, Any] = {
            "identity": Identity(TASK, KEY, RECORD, RECORD),
            "tier": "critical",
            "owner": "host:1",
            "args": (7, 100),
            "kwargs": {},
            "headers": {"ledger_key": KEY, "ledger_tier": "critical", "ledger_enqueued_at": 1.0},
        }
        fields.update(changes)
        return Delivery(**fields)

    def policy(self, **changes: Any) -> TaskPolicy:
        fields: dict[str, Any] = {
            "name": TASK,
            "retry_policy": RetryPolicy(max_retries=2, base_seconds=1.0, cap_seconds=4.0),
            "lease_seconds": 60.0,
            "heartbeat_seconds": 0,  # no heartbeat thread in unit tests
        }
        fields.update(changes)
        return TaskPolicy(**fields)

    def run(self, body: FakeBody | None = None, **changes: Any) -> tuple[Verdict, FakeBody]:
        body = body or FakeBody()
        delivery = changes.pop("delivery", None) or self.delivery()
        return self.guard.run(delivery, self.policy(**changes), body), body

    @property
    def record(self) -> dict[str, Any]:
        return self.ledger.docs[RECORD]


@pytest.fixture
def h() -> Harness:
    return Harness()


def fails(exc: BaseException) -> FakeBody:
    def work(body: FakeBody) -> Any:
        raise exc

    return FakeBody(work=work)


# -- claim outcomes --------------------------------------------------------------------------------


def test_a_new_job_runs_once_and_its_result_is_recorded(h: Harness) -> None:
    verdict, body = h.run()

    assert verdict == Verdict.returns({"charged": 7})
    assert body.runs == 1
    assert h.record["state"] == State.SUCCEEDED
    assert json.loads(h.record["result"]) == {"charged": 7}
    assert h.recorder.names() == ["claimed", "succeeded"]
    # and the message is kept on the record (for the reconciler), with its ledger headers
    assert h.record["message"]["headers"]["ledger_enqueued_at"] == 1.0


def test_a_duplicate_is_acknowledged_without_running(h: Harness) -> None:
    h.run()
    verdict, body = h.run()

    assert verdict.kind == "ack" and body.runs == 0
    assert h.record["duplicates"] == 1
    assert h.recorder.names()[-1] == "duplicate"


def test_a_duplicate_with_a_chain_returns_the_stored_result(h: Harness) -> None:
    h.run()
    verdict, body = h.run(delivery=h.delivery(wants_result=True))

    assert verdict == Verdict.returns({"charged": 7}) and body.runs == 0


def test_a_delivery_of_a_dead_job_is_dropped_and_runs_nothing(h: Harness) -> None:
    h.run(fails(PermanentError("declined")))
    verdict, body = h.run()

    assert verdict == Verdict.ack("delivery of a dead job") and body.runs == 0


def test_a_live_lease_puts_the_delivery_off_until_it_ends(h: Harness) -> None:
    h.ledger.claim(RECORD, task=TASK, key=KEY, tier="critical", owner="other:9")
    verdict, body = h.run()

    assert verdict.kind == "ack" and body.runs == 0
    [(delay, message_headers)] = body.deferred
    assert 0 < delay <= h.settings.busy_recheck_seconds + 1  # re-check within the recheck time
    assert message_headers["ledger_deferrals"] == 1
    assert h.recorder.names() == ["deferred"]


class Lanes:
    """Fair dispatch's side of a tenant's slot: what ``admit`` answers, what ends free."""

    def __init__(self, admits: bool | Exception) -> None:
        self.admits = admits
        self.asked: list[tuple[str, str, str, float]] = []
        self.released: list[str] = []

    def admit(self, queue: str, tenant: str, job_id: str, lease_seconds: float) -> bool:
        self.asked.append((queue, tenant, job_id, lease_seconds))
        if isinstance(self.admits, Exception):
            raise self.admits
        return self.admits

    def release(self, queue: str, tenant: str, job_id: str) -> int:
        self.released.append(job_id)
        return 0


def acme_slot() -> TenantSlot:
    """A delivery's slot of tenant ``acme`` (one per delivery: it notes what that one did)."""
    return TenantSlot("acme", "app.default", "tag-1")


def capped(admits: bool | Exception) -> tuple[Harness, Lanes]:
    """A harness whose tenant ``acme`` may run one body at once; its lanes answer ``admits``."""
    h = Harness(tenants={"acme": {"concurrency": 1}})
    lanes = Lanes(admits)
    h.runtime.fair = lanes
    h.runtime.tenant_rates = SimpleNamespace(bucket=lambda tenant: None)
    return h, lanes


def ended(h: Harness, lanes: Lanes, slot: TenantSlot) -> list[str]:
    """What the delivery's end (Celery's task_postrun) freed."""
    release_slot(lanes, h.settings.tenants, slot)  # type: ignore[arg-type]
    return lanes.released


def test_a_tenant_at_its_limit_where_a_body_starts_puts_it_off_unclaimed() -> None:
    h, lanes = capped(False)
    slot = acme_slot()
    verdict, body = h.run(delivery=h.delivery(tenant_slot=slot))

    assert verdict.kind == "ack" and body.runs == 0 and RECORD not in h.ledger.docs
    [(delay, _)] = body.deferred
    assert 0.5 * h.settings.busy_recheck_seconds <= delay <= h.settings.busy_recheck_seconds
    [(_, (_, reason, _))] = [e for e in h.recorder.events if e[0] == "deferred"]
    assert reason == "tenant at its concurrency limit (acme)"
    assert lanes.asked == [("app.default", "acme", "tag-1", 60.0)]  # (the task's lease)
    # and its end frees nothing (it held no slot); a later delivery of the tag's does
    assert ended(h, lanes, slot) == [] and ended(h, lanes, acme_slot()) == ["tag-1"]


def test_a_tenants_admitted_body_runs_and_frees_its_slot_at_its_end() -> None:
    h, lanes = capped(True)
    slot = acme_slot()
    _, body = h.run(delivery=h.delivery(tenant_slot=slot))

    assert body.runs == 1 and h.record["state"] == State.SUCCEEDED
    assert ended(h, lanes, slot) == ["tag-1"]


def test_a_delivery_whose_job_another_delivery_runs_leaves_that_ones_slot() -> None:
    # (a copy of the message that came back while its body runs: the same delivery tag)
    h, lanes = capped(True)
    h.ledger.claim(RECORD, task=TASK, key=KEY, tier="critical", owner="other:9")
    running, copy = acme_slot(), acme_slot()
    _, body = h.run(delivery=h.delivery(tenant_slot=copy))

    assert body.runs == 0 and len(body.deferred) == 1
    # The running delivery of the same tag, in the same process (a threads pool), ending
    # first frees its own; the copy's end, later, frees nothing
    assert ended(h, lanes, running) == ["tag-1"]
    assert ended(h, lanes, copy) == ["tag-1"]


def test_a_broker_that_does_not_answer_does_not_hold_a_tenants_body_back() -> None:
    h, lanes = capped(redis.ConnectionError("refused"))
    _, body = h.run(delivery=h.delivery(tenant_slot=acme_slot()))

    assert body.runs == 1 and lanes.asked


def test_a_tenant_without_a_limit_is_not_asked_about() -> None:
    h, lanes = capped(False)
    _, body = h.run(delivery=h.delivery(tenant_slot=TenantSlot("free", "app.default", "t")))

    assert body.runs == 1 and lanes.asked == []


@pytest.mark.parametrize(
    ("changes", "first"),
    [
        ({"new": True}, True),
        ({}, False),  # no property: another producer, or a record written at publish
        ({"new": True, "retries": 1}, False),  # a retry's copy
        ({"new": True, "deferrals": 1}, False),  # a deferral's copy
        ({"new": True, "redelivered": True}, False),  # restored after its worker died
    ],
)
def test_only_a_first_publish_without_a_record_claims_by_insert(
    h: Harness, changes: dict[str, Any], first: bool
) -> None:
    delivery = h.delivery(**changes)
    asked: list[bool] = []
    claim = h.ledger.claim

    def spy(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs["new"])
        return claim(*args, **kwargs)

    h.ledger.claim = spy  # type: ignore[method-assign]
    _verdict, body = h.run(delivery=delivery)

    assert delivery.first_publish is first and asked == [first]
    assert body.runs == 1 and h.record["state"] == State.SUCCEEDED


def test_a_claim_that_made_the_record_skips_the_read_for_a_degraded_result(h: Harness) -> None:
    # A task with a fallback reads its claimed record (is this a degraded result's
    # replacement?) unless its claim made the record: nothing can be on it yet.
    reads: list[str] = []
    find_raw = h.ledger.find_raw

    def spy(record_id: str) -> Any:
        reads.append(record_id)
        return find_raw(record_id)

    h.ledger.find_raw = spy  # type: ignore[method-assign]
    fallback = Fallback.of(Placeholder(1))
    h.run(fails(ConnectionError("gateway timeout")), fallback=fallback)  # made: no read
    assert reads == []
    h.clock.advance(10)
    h.run(delivery=h.delivery(retries=1), fallback=fallback)  # the retry's claim: one read
    assert reads == [RECORD] and h.record["state"] == State.SUCCEEDED


def test_the_ledger_unreachable_at_the_claim_defers_with_backoff(h: Harness) -> None:
    h.ledger.fail("claim", LedgerUnavailable("down"))
    verdict, body = h.run(delivery=h.delivery(deferrals=3))

    assert verdict.kind == "ack" and body.runs == 0
    [(delay, message_headers)] = body.deferred
    assert 0.2 <= delay <= h.settings.unavailable_backoff_cap_seconds
    assert message_headers["ledger_deferrals"] == 4
    assert h.recorder.names() == ["ledger_unavailable", "deferred"]


def test_a_deferral_that_cannot_be_published_requeues_after_a_pause(h: Harness) -> None:
    h.ledger.fail("claim", LedgerUnavailable("down"), times=5)
    for _ in range(5):
        before = h.clock()
        verdict, body = h.run(FakeBody(defer_error=ConnectionError("broker down")))

        assert verdict.kind == "requeue" and body.runs == 0
        # each requeue is held first: a deferral that keeps failing is no hot loop
        assert (h.clock() - before).total_seconds() >= 0.5


def test_a_claim_whose_reply_was_lost_defers_and_the_lease_bounds_the_wait(h: Harness) -> None:
    # The claim applied but its reply was lost (or its write concern was not confirmed)
    h.ledger.fail("claim", LedgerUnavailable("write concern"), applied=True)
    verdict, body = h.run()
    assert verdict.kind == "ack" and body.runs == 0 and body.deferred
    # A redelivery finds the lease live, then takes over once it ends
    assert h.run()[0].kind == "ack"
    h.clock.advance(61)
    verdict, body = h.run()
    assert verdict.kind == "return" and body.runs == 1


def test_a_job_whose_worker_was_lost_every_time_is_poison(h: Harness) -> None:
    for _ in range(3):  # claimed, then the worker dies (no outcome): the lease runs out
        h.ledger.claim(RECORD, task=TASK, key=KEY, tier="critical", owner="lost:1")
        h.clock.advance(61)
    verdict, body = h.run()

    assert verdict.kind == "ack" and body.runs == 0
    assert h.record["state"] == State.DEAD and h.record["death"] == "poison"
    assert "delivered 3 times" in h.record["dead_reason"]
    # announced once: the queue copy and the observers
    [(queue, letter, _)] = h.outbox.raw
    assert queue == "dead_letter" and letter["record_id"] == RECORD
    assert h.recorder.names() == ["dead"]


def test_the_attempts_budget_retires_a_job(h: Harness) -> None:
    h.run(fails(ConnectionError("timeout")), max_attempts=1)
    _verdict, body = h.run(max_attempts=1)

    assert body.runs == 0
    assert h.record["death"] == "retired"
    assert "attempts budget exhausted" in h.record["dead_reason"]


def test_an_identity_conflict_is_kept_as_a_dead_letter_and_the_record_is_untouched(
    h: Harness,
) -> None:
    h.ledger.docs[RECORD] = {"_id": RECORD, "task": "other.task", "key": "x", "state": "queued"}
    verdict, body = h.run()

    assert verdict.kind == "ack" and body.runs == 0
    assert h.ledger.docs[RECORD] == {
        "_id": RECORD,
        "task": "other.task",
        "key": "x",
        "state": "queued",
    }
    [conflict] = [d for _id, d in h.ledger.docs.items() if _id.startswith("conflict-")]
    assert conflict["state"] == State.DEAD and "identity conflict" in conflict["dead_reason"]


def test_an_alias_message_runs_its_job_and_finds_it_by_its_own_id(h: Harness) -> None:
    delivery = h.delivery(identity=Identity(TASK, KEY, RECORD, "frozen-by-a-chain"))
    verdict, _ = h.run(delivery=delivery)

    assert verdict.kind == "return"
    assert h.ledger.resolve("frozen-by-a-chain")["_id"] == RECORD  # type: ignore[index]


# -- outcomes of an attempt ------------------------------------------------------------------------


def test_a_retryable_error_retries_with_backoff_and_records_the_attempt(h: Harness) -> None:
    verdict, body = h.run(fails(ConnectionError("gateway timeout")))

    [(_exc, delay, message_headers)] = body.retries
    assert isinstance(verdict.value, Retry)
    assert 0 <= delay <= 1.0  # full jitter over base 1 s
    assert message_headers["ledger_previous_delay"] == delay
    record = h.record
    assert record["state"] == State.RETRYING
    assert record["errors"][-1]["action"] == "retry"
    # the kept message continues the retry budget if the reconciler republishes it
    assert record["message"]["headers"]["retries"] == 1
    assert h.recorder.names() == ["claimed", "retried"]


def test_retries_exhausted_dead_letter_with_the_kept_message(h: Harness) -> None:
    exc = ConnectionError("gateway timeout")
    verdict, body = h.run(fails(exc), delivery=h.delivery(retries=2))

    assert verdict == Verdict.raises(exc) and body.retries == []
    assert h.record["state"] == State.DEAD and h.record["death"] == "failed"
    assert h.record["dead_reason"] == "retries exhausted after 2 retries"
    assert h.record["message"]["args_json"] == "[7, 100]"
    assert h.recorder.names() == ["claimed", "dead"]


def test_fail_on_wins_over_retry_on(h: Harness) -> None:
    class Declined(ValueError):
        pass

    _verdict, body = h.run(fails(Declined("no")), retry_on=(ValueError,), fail_on=(Declined,))

    assert body.retries == [] and h.record["dead_reason"].startswith("permanent error")


def test_a_retry_that_cannot_be_published_hands_the_message_back(h: Harness) -> None:
    body = fails(ConnectionError("timeout"))
    body.retry_error = RetryNotPublished("broker down")
    verdict, _ = h.run(body)

    # Not dropped: the claim is released and this delivery is requeued (it runs as the retry)
    assert verdict.kind == "requeue"
    assert h.record["state"] == State.QUEUED


def test_a_retry_the_body_asked_for_is_recorded(h: Harness) -> None:
    # (self.retry() raises Retry with the signature it published)
    retry = Retry(exc=ConnectionError("later"), when=3, sig=SimpleNamespace())
    verdict, _ = h.run(fails(retry))

    assert verdict == Verdict.raises(retry)
    assert h.record["state"] == State.RETRYING
    assert h.record["errors"][-1]["planned_delay_seconds"] == 3


def test_a_retry_raised_by_hand_published_nothing_and_is_a_dead_letter(h: Harness) -> None:
    verdict, body = h.run(fails(Retry(exc=ConnectionError("later"), when=3)))

    assert h.record["state"] == State.DEAD and body.runs == 1
    assert "call self.retry(...)" in h.record["dead_reason"]
    assert isinstance(verdict.value, PermanentError)


class SystemExitsOnItsOwn(BaseException):
    pass


@pytest.mark.parametrize(
    "exc",
    [SystemExit(1), SystemExit(0), KeyboardInterrupt(), GeneratorExit(), SystemExitsOnItsOwn()],
    ids=lambda e: type(e).__name__,
)
def test_a_base_exception_from_the_body_is_a_dead_letter_never_retried(
    h: Harness, exc: BaseException
) -> None:
    verdict, body = h.run(fails(exc))

    assert h.record["state"] == State.DEAD and body.retries == []
    assert "which is not an Exception: not retried" in h.record["dead_reason"]
    assert type(exc).__qualname__ in h.record["dead_reason"]
    # Celery is handed an Exception: a BaseException raised into it ends a solo worker
    assert isinstance(verdict.value, PermanentError)


def test_a_greenlet_ended_by_its_pool_is_not_the_jobs_fault() -> None:
    greenlet = pytest.importorskip("greenlet")
    h = Harness()
    with pytest.raises(greenlet.GreenletExit):
        h.run(fails(greenlet.GreenletExit()))
    assert h.record["state"] == State.RUNNING  # its lease ends; its message comes back


def test_a_pool_process_terminated_by_a_cold_stop_is_not_the_jobs_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (billiard's terminate handler raises SystemExit in the pool process: the job goes back
    # with its message, as a killed process's, never dead)
    import billiard.common

    monkeypatch.setattr(billiard.common, "_should_have_exited", [True])
    h = Harness()
    with pytest.raises(SystemExit):
        h.run(fails(SystemExit(-15)))
    assert h.record["state"] == State.RUNNING


def test_a_body_in_a_main_process_stopping_cold_is_not_the_jobs_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (a solo pool runs bodies in the main thread, where Celery's cold stop raises)
    from celery.exceptions import WorkerTerminate
    from celery.worker import state

    monkeypatch.setattr(state, "should_terminate", 1)
    h = Harness()
    with pytest.raises(WorkerTerminate):
        h.run(fails(WorkerTerminate(1)))
    assert h.record["state"] == State.RUNNING


def test_a_bodys_own_exit_during_a_warm_stop_is_still_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (a warm stop raises nothing into a body: its sys.exit() is the body's, never retried)
    from celery.worker import state

    monkeypatch.setattr(state, "should_stop", 0)
    h = Harness()
    verdict, _ = h.run(fails(SystemExit(1)))
    assert h.record["state"] == State.DEAD and isinstance(verdict.value, PermanentError)


def test_a_green_pools_hard_time_limit_is_the_pools() -> None:
    gevent = pytest.importorskip("gevent")
    h = Harness()
    with pytest.raises(gevent.Timeout):
        h.run(fails(gevent.Timeout(2)))
    assert h.record["state"] == State.RUNNING  # the worker retires it as the time limit


class Unprintable(ConnectionError):
    def __str__(self) -> str:
        raise RuntimeError("__str__ broke")


class Unrepresentable(Exception):
    def __repr__(self) -> str:
        raise RuntimeError("__repr__ broke")

    __str__ = __repr__


@pytest.mark.parametrize("exc", [Unprintable(), Unrepresentable()], ids=lambda e: type(e).__name__)
def test_an_error_whose_text_cannot_be_read_is_a_dead_letter_naming_its_type(
    h: Harness, exc: Exception
) -> None:
    verdict, body = h.run(fails(exc))

    assert h.record["state"] == State.DEAD and body.retries == [] and body.runs == 1
    assert type(exc).__qualname__ in h.record["dead_reason"]
    assert "its text could not be read" in h.record["dead_reason"]
    assert isinstance(verdict.value, PermanentError)


def test_a_result_nested_past_the_stack_is_a_dead_letter(h: Harness) -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    _verdict, body = h.run(FakeBody(work=lambda _: deep))

    assert h.record["state"] == State.DEAD and body.runs == 1
    assert h.record["dead_reason"].startswith("result not JSON")


def test_a_retry_that_can_never_be_published_is_a_dead_letter_not_a_requeue(h: Harness) -> None:
    body = fails(ConnectionError("timeout"))
    body.retry_error = PermanentError("retry not publishable: eta='soon' is not a date")
    verdict, _ = h.run(body)

    assert verdict.kind == "raise" and h.record["state"] == State.DEAD
    assert h.record["dead_reason"] == "retry not publishable: eta='soon' is not a date"


def test_a_soft_time_limit_raised_by_hand_says_so(h: Harness) -> None:
    h.run(fails(SoftTimeLimitExceeded()))
    assert h.record["dead_reason"] == (
        "time limit exceeded (soft: SoftTimeLimitExceeded raised by the body)"
    )


def test_a_ledger_outage_inside_the_body_defers_and_never_kills(h: Harness) -> None:
    # A checkpoint during a replica-set election
    verdict, body = h.run(fails(LedgerUnavailable("election")))

    assert verdict.kind == "ack" and body.deferred  # comes back later
    assert h.record["state"] == State.QUEUED  # released: the next delivery claims at once
    assert "ledger_unavailable" in h.recorder.names()
    assert "dead" not in h.recorder.names()


def test_a_lost_lease_inside_the_body_stops_this_holder(h: Harness) -> None:
    verdict, _ = h.run(fails(LeaseLost(RECORD, 1)))

    assert verdict == Verdict.ack("lease lost")
    assert h.recorder.names() == ["claimed", "lease_lost"]


def test_ignore_from_the_body_ends_the_job_with_its_reason(h: Harness) -> None:
    verdict, _ = h.run(fails(Ignore("handled elsewhere")))

    assert verdict.kind == "ack"
    assert h.record["state"] == State.SUCCEEDED and h.record["outcome"] == "ignored"
    assert h.record["note"] == "handled elsewhere"
    # terminal: the reconciler never republishes it, a copy is a duplicate
    assert h.run()[1].runs == 0


def test_reject_without_requeue_is_a_replayable_dead_letter(h: Harness) -> None:
    verdict, _ = h.run(fails(Reject("bad order", requeue=False)))

    assert verdict.kind == "ack"
    assert h.record["death"] == "rejected" and h.record["message"]["args_json"] == "[7, 100]"


def test_reject_with_requeue_hands_the_message_back(h: Harness) -> None:
    verdict, _ = h.run(fails(Reject("not now", requeue=True)))

    assert verdict.kind == "requeue" and h.record["state"] == State.QUEUED


class UnreadableReason:
    def __str__(self) -> str:
        raise RuntimeError("__str__ broke")

    __repr__ = __str__


@pytest.mark.parametrize("requeue", [False, True], ids=["dead", "requeued"])
def test_a_reject_whose_reason_cannot_be_read_still_ends_as_the_task_asked(
    h: Harness, requeue: bool
) -> None:
    verdict, _ = h.run(fails(Reject(UnreadableReason(), requeue=requeue)))

    if requeue:
        assert verdict.kind == "requeue" and h.record["state"] == State.QUEUED
    else:
        assert verdict.kind == "ack" and h.record["death"] == "rejected"
        assert "UnreadableReason (its text could not be read)" in h.record["dead_reason"]


def test_an_ignore_whose_reason_cannot_be_read_still_ends_the_job(h: Harness) -> None:
    verdict, _ = h.run(fails(Ignore(UnreadableReason())))

    assert verdict.kind == "ack" and h.record["outcome"] == "ignored"
    assert h.record["note"] == "Ignore (its text could not be read)"


def test_a_replaced_job_ends_naming_its_replacement(h: Harness) -> None:
    verdict, _ = h.run(fails(Replaced("replacement-id")))

    assert verdict.kind == "ack"
    assert h.record["outcome"] == "replaced" and h.record["replaced_by"] == "replacement-id"


def test_a_warm_shutdown_releases_the_claim_and_requeues(h: Harness) -> None:
    verdict, _ = h.run(fails(Interrupted("shutting down")))

    assert verdict.kind == "requeue" and h.record["state"] == State.QUEUED


def test_an_open_breaker_inside_the_body_releases_and_defers(h: Harness) -> None:
    verdict, body = h.run(fails(CircuitOpen("crm", retry_at=None)))

    assert verdict.kind == "ack" and body.deferred and h.record["state"] == State.QUEUED


def test_the_soft_time_limit_retires_the_job_and_cleans_up(h: Harness) -> None:
    def work(body: FakeBody) -> Any:
        body.execution.register_artefact("/tmp/part-1")
        raise SoftTimeLimitExceeded()

    verdict, body = h.run(FakeBody(work=work), soft_time_limit=1.0)

    assert isinstance(verdict.value, SoftTimeLimitExceeded)
    assert h.record["death"] == "retired"
    assert body.retired == [("time limit exceeded (soft, 1.0s)", ["/tmp/part-1"])]


def test_a_message_past_its_max_age_is_retired_without_running(h: Harness) -> None:
    _verdict, body = h.run(max_age_seconds=60, delivery=h.delivery(enqueued_at=1.0))

    assert body.runs == 0 and h.record["death"] == "retired"
    assert h.record["dead_reason"].startswith("expired: enqueued")


def test_a_result_that_is_not_json_kills_the_job_once(h: Harness) -> None:
    verdict, body = h.run(FakeBody(work=lambda body: {1, 2}))

    assert isinstance(verdict.value, PermanentError) and body.runs == 1
    assert h.record["dead_reason"].startswith("result not JSON")


def test_an_oversized_result_is_refused_before_the_effect_can_repeat() -> None:
    h = Harness(max_result_bytes=1024)
    _verdict, body = h.run(FakeBody(work=lambda body: "x" * 2000))

    assert body.runs == 1 and h.record["state"] == State.DEAD
    assert h.record["dead_reason"].startswith("result too large")
    assert h.run()[1].runs == 0  # a redelivery does not run it again


def test_oversized_arguments_are_dead_before_any_claim_with_their_message() -> None:
    h = Harness(max_payload_bytes=1024)
    identity = Identity(TASK, KEY, RECORD, "message-1")
    verdict, body = h.run(delivery=h.delivery(args=("x" * 2000,), identity=identity))

    assert isinstance(verdict.value, PermanentError) and body.runs == 0
    assert "claim" not in h.ledger.calls
    assert h.record["state"] == State.DEAD and h.record["fence"] == 0
    assert h.record["dead_reason"].startswith("oversized message")
    assert h.record["message"]["args_json"]  # replayable once the limit is raised
    assert h.ledger.resolve("message-1")["_id"] == RECORD  # found by the message's own id
    assert h.recorder.names() == ["dead"]


def test_oversized_arguments_the_ledger_cannot_keep_are_dead_without_them() -> None:
    h = Harness(max_payload_bytes=1024)
    h.ledger.fail("bury", StoreError("document too large"))
    verdict, body = h.run(delivery=h.delivery(args=("x" * 2000,)))

    assert isinstance(verdict.value, PermanentError) and body.runs == 0
    assert h.record["state"] == State.DEAD and "message" not in h.record


def test_a_claim_the_ledger_refuses_for_good_is_a_dead_letter_not_a_lost_job(h: Harness) -> None:
    h.ledger.fail("claim", StoreError("invalid document"))
    verdict, body = h.run()

    assert isinstance(verdict.value, PermanentError) and body.runs == 0
    assert h.record["state"] == State.DEAD
    assert h.record["dead_reason"].startswith("the ledger refused the claim")


def test_a_deferral_that_can_never_be_published_is_dead_not_requeued_for_ever(h: Harness) -> None:
    # Given a delivery that must be put off (a live lease) whose copy cannot be published as
    # it is: requeued, it would come straight back, for ever
    h.ledger.claim(RECORD, task=TASK, key=KEY, tier="critical", owner="other:9")
    verdict, body = h.run(FakeBody(defer_error=PayloadError("not JSON-serialisable: bytes")))

    assert isinstance(verdict.value, PermanentError) and body.runs == 0
    assert h.ledger.docs[RECORD]["state"] == State.RUNNING  # the live job is only noted
    assert h.ledger.docs[RECORD]["quarantined"] == 1


def test_a_sensitive_job_keeps_no_plaintext_when_it_dies(h: Harness) -> None:
    _verdict, _ = h.run(
        fails(PermanentError("card 4242 declined")),
        sensitive=True,
        delivery=h.delivery(args=("4242424242424242",)),
    )
    text = json.dumps(h.record, default=str)
    assert "4242424242424242" not in text and "declined" not in text
    # Not even the last digits, anywhere but in the random hex the record also holds (its id,
    # operation ids, the traceback's digest: "4242" turns up there by chance, a CI run found).
    random_hex = {"_id", "ops", "traceback_digest"}

    def without_random_hex(value: object) -> object:
        if isinstance(value, dict):
            return {k: without_random_hex(v) for k, v in value.items() if k not in random_hex}
        if isinstance(value, list):
            return [without_random_hex(v) for v in value]
        return value

    assert "4242" not in json.dumps(without_random_hex(h.record), default=str)
    assert h.record["dead_reason"] == "permanent error: PermanentError"


# -- persistence failures --------------------------------------------------------------------------


def test_a_completion_retried_through_an_outage_succeeds_once(h: Harness) -> None:
    h.ledger.fail("complete", LedgerUnavailable("blip"), times=2)
    verdict, body = h.run()

    assert verdict.kind == "return" and body.runs == 1
    assert h.record["state"] == State.SUCCEEDED


def uses_a_lost_atomic_step(body: FakeBody) -> Any:
    # The attempt relied on atomic step "charge", which the record no longer has (a server
    # acknowledged its commit, then lost it)
    body.execution.used_atomic("charge")
    return "charged"


def skips_an_optional_step(body: FakeBody) -> Any:
    def enrich() -> Any:
        raise ConnectionRefusedError("enrichment service refused")

    return body.execution.step("enrich", optional=True, default="none").run(enrich)


def test_a_skipped_optional_step_is_an_event_and_the_job_succeeds(h: Harness) -> None:
    verdict, _ = h.run(FakeBody(work=skips_an_optional_step))

    assert verdict.kind == "return" and verdict.value == "none"
    assert h.record["state"] == State.SUCCEEDED
    assert h.record["steps"]["enrich"]["skipped"] == "dependency down: ConnectionRefusedError"
    [(job, step, reason)] = [args for name, args in h.recorder.events if name == "step_skipped"]
    assert (job.task, step, reason) == (TASK, "enrich", "dependency down: ConnectionRefusedError")


def test_a_success_without_the_atomic_step_it_used_runs_the_job_again(h: Harness) -> None:
    verdict, body = h.run(FakeBody(work=uses_a_lost_atomic_step))

    assert verdict.kind == "ack" and body.deferred  # comes back, and runs again
    assert h.record["state"] == State.QUEUED  # released: not succeeded, not dead
    assert "result" not in h.record
    assert h.recorder.names() == ["claimed", "commit_lost", "deferred"]

    # and the next attempt, whose step is recorded, succeeds
    def records_its_step(body: FakeBody) -> Any:
        h.ledger.save_step(RECORD, body.execution.fence, "charge", '"c"')
        return uses_a_lost_atomic_step(body)

    verdict, _ = h.run(FakeBody(work=records_its_step))
    assert verdict == Verdict.returns("charged") and h.record["state"] == State.SUCCEEDED


def test_a_completion_whose_reply_was_lost_is_recognised_as_its_own(h: Harness) -> None:
    # The write applied, its reply was lost, and the repeat finds the record no longer running
    h.ledger.fail("complete", LedgerUnavailable("reply lost"), applied=True)
    verdict, _ = h.run(FakeBody(work=lambda body: "done"))

    assert verdict == Verdict.returns("done")  # not a lost lease: the chain still fires
    assert h.recorder.names() == ["claimed", "succeeded"]


def test_a_retry_record_whose_reply_was_lost_still_retries(h: Harness) -> None:
    h.ledger.fail("record_retry", LedgerUnavailable("reply lost"), applied=True)
    verdict, _ = h.run(fails(ConnectionError("timeout")))

    assert isinstance(verdict.value, Retry)  # not acknowledged as a lost lease


def test_a_death_whose_reply_was_lost_is_still_announced(h: Harness) -> None:
    h.ledger.fail("bury", LedgerUnavailable("reply lost"), applied=True)
    h.run(fails(PermanentError("declined")))

    assert h.record["state"] == State.DEAD and len(h.outbox.raw) == 1


def test_an_outage_past_most_of_the_lease_hands_the_message_back_counted(h: Harness) -> None:
    h.ledger.fail("complete", LedgerUnavailable("down"), times=1000)
    verdict, body = h.run()

    # Put off while the ledger recovers (the ledger decides again on the copy's delivery); the
    # copy says this delivery was handed back alive: its claim still counts on the record.
    assert verdict.kind == "ack" and "completion failed" in verdict.reason
    [(_, copy)] = body.deferred
    assert copy["handed_back"] == 1 and copy["ledger_deferrals"] == 1
    assert h.record["state"] == State.RUNNING and h.record["inflight"] == 1


@pytest.mark.parametrize("offset", [0.0, 3e-6, 0.123457])
def test_an_outage_hands_the_message_back_once_most_of_the_lease_is_spent_not_later(
    h: Harness, offset: float
) -> None:
    # Backoff pauses grow (0.25, 0.45, 0.85, 1.65 s, ...): one that outlasted the deadline
    # handed the message back seconds after the lease, holding the worker's process that long.
    # (The offsets: a clock that rounds, as this one does to microseconds, must not keep the
    # last pause from being the last)
    h.clock.advance(offset)
    h.ledger.fail("complete", LedgerUnavailable("down"), times=1000)
    started = h.clock().timestamp()
    verdict, _ = h.run(lease_seconds=3.0)

    assert verdict.kind == "ack" and "completion failed" in verdict.reason
    assert 3.0 * 0.8 - 1e-3 <= h.clock().timestamp() - started <= 3.0 * 0.8 + 1e-3


@pytest.mark.parametrize(
    "failing", ["complete", "release", "claim-reply"], ids=["outcome", "release", "claim"]
)
def test_deliveries_handed_back_in_an_outage_are_not_lost_workers(h: Harness, failing: str) -> None:
    # Each delivery claims the job, then cannot record how it ended (the ledger is away for
    # longer than most of the lease): handed back alive, more times than the poison limit (3).
    delivery = h.delivery()
    for _ in range(5):
        if failing == "complete":
            h.ledger.fail("complete", LedgerUnavailable("down"), times=1000)
            body = FakeBody()
        elif failing == "release":  # inside the body, and the release fails too
            h.ledger.fail("release", LedgerUnavailable("down"), times=1000)
            body = fails(LedgerUnavailable("checkpoint failed"))
        else:  # the claim applied and its reply was lost
            h.ledger.fail("claim", LedgerUnavailable("reply lost"), applied=True)
            body = FakeBody()
        verdict, _ = h.run(body, delivery=delivery)
        h.ledger.faults.clear()
        [(_, copy)] = body.deferred
        assert verdict.kind == "ack" and h.record["state"] == State.RUNNING
        delivery = h.delivery(handed_back=copy["handed_back"], deferrals=copy["ledger_deferrals"])
        h.clock.advance(61)  # the unreleased claim's lease runs out
    assert h.record["inflight"] == 5 and delivery.handed_back == 5

    verdict, body = h.run(FakeBody(), delivery=delivery)

    assert verdict == Verdict.returns({"charged": 7}) and h.record["state"] == State.SUCCEEDED


def test_a_release_the_ledger_recorded_starts_the_count_again(h: Harness) -> None:
    # The ledger answers the release (it clears the record's count of deliveries without an
    # outcome): the copy's count of those handed back alive starts again from 0
    verdict, body = h.run(
        fails(LedgerUnavailable("checkpoint failed")), delivery=h.delivery(handed_back=3)
    )

    [(_, copy)] = body.deferred
    assert verdict.kind == "ack" and "handed_back" not in copy
    assert h.record["state"] == State.QUEUED and h.record["inflight"] == 0


def test_a_claim_never_sent_is_not_counted_as_handed_back(h: Harness) -> None:
    # No server could be selected: the claim did not apply, and the copy says nothing more
    h.ledger.fail("claim", NotApplied("no server"))
    verdict, body = h.run(delivery=h.delivery(handed_back=2))

    [(_, copy)] = body.deferred
    assert verdict.kind == "ack" and copy["handed_back"] == 2


def test_a_lost_worker_still_counts_after_deliveries_handed_back(h: Harness) -> None:
    # Two deliveries handed back alive, then three whose worker was lost: poison at the third.
    for _ in range(5):
        h.ledger.claim(RECORD, task=TASK, key=KEY, tier="critical", owner="w:1")
        h.clock.advance(61)
    verdict, body = h.run(delivery=h.delivery(handed_back=2))

    assert verdict.kind == "ack" and body.runs == 0
    assert h.record["state"] == State.DEAD and h.record["death"] == "poison"
    assert "delivered 3 times" in h.record["dead_reason"]


def test_an_outcome_the_ledger_refuses_for_good_ends_the_job_dead(h: Harness) -> None:
    h.ledger.fail("complete", StoreError("document too large"))
    verdict, _body = h.run()

    assert isinstance(verdict.value, PermanentError)
    assert h.record["state"] == State.DEAD
    assert "refused the completion" in h.record["dead_reason"]
    assert h.run()[1].runs == 0  # never run again for it


def test_a_holder_whose_lease_was_taken_over_cannot_overwrite_the_new_holder(h: Harness) -> None:
    def slow(body: FakeBody) -> Any:
        # While this body runs past its lease, another delivery takes over
        h.clock.advance(61)
        h.ledger.claim(RECORD, task=TASK, key=KEY, tier="critical", owner="other:2")
        return "stale"

    verdict, _ = h.run(FakeBody(work=slow))

    assert verdict == Verdict.ack("lease lost")
    assert h.record["state"] == State.RUNNING and h.record["lease_owner"] == "other:2"


# -- retiring a killed body (hard time limit) ------------------------------------------------------


def test_a_hard_limit_retires_only_the_holder_that_was_killed(h: Harness) -> None:
    identity = Identity(TASK, KEY, RECORD, RECORD)
    h.ledger.claim(RECORD, task=TASK, key=KEY, tier="critical", owner="host:1")
    h.clock.advance(61)  # the lease ran out and a newer claim took over
    h.ledger.claim(RECORD, task=TASK, key=KEY, tier="critical", owner="host:2")
    cleaned: list[str] = []

    retired = h.guard.retire_held(
        identity, owner="host:1", reason="hard", on_retire=lambda r, a: cleaned.append(r)
    )

    assert retired is False and cleaned == []
    assert h.record["state"] == State.RUNNING and h.record["lease_owner"] == "host:2"
    assert h.guard.retire_held(
        identity, owner="host:2", reason="hard", on_retire=lambda r, a: cleaned.append(r)
    )
    assert h.record["death"] == "retired" and cleaned == ["hard"]


# -- every documented event is emitted -------------------------------------------------------------


def test_every_documented_event_is_emitted_by_the_platform() -> None:
    seen: set[str] = set()
    for scenario in (
        lambda h: h.run(),
        lambda h: (h.run(), h.run()),
        lambda h: h.run(fails(ConnectionError("x"))),
        lambda h: h.run(fails(PermanentError("x"))),
        lambda h: h.run(fails(LeaseLost(RECORD, 1))),
        lambda h: h.run(fails(LedgerUnavailable("x"))),
        lambda h: h.run(FakeBody(work=uses_a_lost_atomic_step)),
        lambda h: h.run(FakeBody(work=skips_an_optional_step)),
        lambda h: h.run(fails(DeadlineExceeded("x")), fallback=Fallback.of(Placeholder(1))),
        lambda h: h.run(delivery=h.delivery(enqueued_at=time.time() - 100), slo_seconds=1.0),
    ):
        harness = Harness()
        scenario(harness)
        seen |= set(harness.recorder.names())
    # breakers, backpressure and the throttle report through the same observers
    observers = Observers(recorder := Recorder())
    observers.breaker("payments", "closed", "open")
    observers.shed("bulk")
    # (and a tenant's gate: tests/unit/test_tenancy.py sees the gate's refusals)
    observers.tenant_refused("bulk", "acme", "shed")
    observers.throttle("bulk", True, "backlog")
    # workflows report there too (tests/integration/test_workflow_model.py sees the engine's)
    observers.workflow_step("shop.fulfil", "payments.charge", 0.5, True)
    observers.workflow_ended("shop.fulfil", "completed")
    # and the outbox (tests/unit/test_outbox.py sees the relay's and a committer's)
    observers.outbox_published("critical", "relay", 1)
    # and the servers' clocks (tests/unit/test_clock.py reads them)
    observers.clock_read(Reading("ledger", 1.0, 1.0, 0.0, 0.001))
    # and the schedulers (tests/unit/test_schedules.py sees their sends)
    observers.scheduled("hourly-rollup", "shop.rollup", 1.8e9, 0.4)
    observers.schedule_skipped("hourly-rollup", "shop.rollup", 1.8e9, "paused")
    # and the triggers' watchers (tests/unit/test_triggers.py sees a watcher's)
    observers.trigger_change("shop.on_order")
    observers.trigger_waited("shop.on_order", "bulk")
    observers.trigger_problem("shop.on_order", "shop.orders", "history_lost", "gone")
    seen |= set(recorder.names())
    assert seen == set(EVENTS)


def test_an_observer_that_fails_never_fails_the_job(h: Harness) -> None:
    class Broken(Observer):
        def claimed(self, job: Job, fence: int) -> None:
            raise RuntimeError("observer bug")

    h.runtime.observers.add(Broken())
    verdict, _ = h.run()
    assert verdict.kind == "return" and h.record["state"] == State.SUCCEEDED


def test_a_soft_time_limit_during_the_completion_write_still_completes(h: Harness) -> None:
    # The soft limit's signal strikes inside the completion write, after it applied
    h.ledger.fail("complete", SoftTimeLimitExceeded(), applied=True)
    verdict, body = h.run()

    assert verdict == Verdict.returns({"charged": 7}) and body.runs == 1
    assert h.record["state"] == State.SUCCEEDED


def test_a_retry_of_an_error_whose_text_cannot_be_read_is_recorded(h: Harness) -> None:
    # (self.retry(exc=...) hands the guard the error as the Retry's, not as the body's raise)
    retry = Retry(exc=Unprintable(), when=3, sig=SimpleNamespace())
    h.run(fails(retry))

    assert h.record["state"] == State.RETRYING
    assert h.record["errors"][-1]["message"] == "(its text could not be read)"
