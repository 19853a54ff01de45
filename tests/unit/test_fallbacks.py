"""Fallbacks and latency objectives, without servers: the options and their triggers, what the
guard records when it serves one, the replacement of a degraded result, and escalation of late
jobs (over the in-memory ledger of ``tests/fakes.py``)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest

from celery_ledger import headers
from celery_ledger.errors import (
    Backpressure,
    CircuitOpen,
    ConfigurationError,
    DeadlineExceeded,
    PermanentError,
)
from celery_ledger.escalation import Escalation
from celery_ledger.guard import Verdict
from celery_ledger.identity import Identity
from celery_ledger.ledger.record import LedgerRecord, State
from celery_ledger.policies.breaker import Admission
from celery_ledger.policies.fallback import (
    Alternate,
    Call,
    Fallback,
    LastGood,
    Placeholder,
    cause_of,
)
from tests.unit.test_guard import KEY, RECORD, TASK, FakeBody, Harness, fails

PLACEHOLDER = {"charged": None, "pending": True}


class Breaker:
    """A circuit breaker stand-in: open or closed, counting the calls it lets through."""

    def __init__(self, name: str, *, open_: bool = False) -> None:
        self.name = name
        self.open = open_
        self.calls = 0

    def admit(self) -> Admission:
        if self.open:
            return Admission(False, retry_at=time.time() + 30)
        return Admission(True)

    def record_success(self, *, probe: bool = False) -> None:
        pass

    def record_failure(self, *, probe: bool = False) -> None:
        pass

    def __enter__(self) -> Breaker:
        if self.open:
            raise CircuitOpen(self.name, time.time() + 30)
        self.calls += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def job(key: str, record_id: str) -> Identity:
    return Identity(TASK, key, record_id, record_id)


def harness(*breakers: Breaker) -> Harness:
    h = Harness()
    h.runtime.breakers = {b.name: b for b in breakers}
    return h


def replacing_delivery(h: Harness) -> Any:
    """A delivery once the replacement is due: any copy of the message (the record, not the
    message, says that its claim replaces a degraded result)."""
    return h.delivery()


def degraded_run(h: Harness, fallback: Any, body: FakeBody | None = None, **changes: Any) -> Any:
    return h.run(body, breaker="gateway", fallback=Fallback.of(fallback), **changes)


# -- the vocabulary ------------------------------------------------------------------------------


def test_the_option_takes_one_option_a_list_or_a_fallback() -> None:
    assert Fallback.of(None) is None
    assert Fallback.of(Placeholder(1)) == Fallback((Placeholder(1),))
    both = Fallback.of([LastGood(), Placeholder(1)])
    assert both is not None and both.options == (LastGood(), Placeholder(1))
    assert both.remembers
    assert not Fallback((Placeholder(1),)).remembers


@pytest.mark.parametrize(
    "value",
    ["cached", {"value": 1}, 7, [], [Placeholder(1), "cached"]],
)
def test_a_wrong_fallback_is_a_configuration_error(value: Any) -> None:
    with pytest.raises(ConfigurationError):
        Fallback.of(value)


def test_unknown_triggers_and_bad_replacement_delays_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="unknown fallback triggers"):
        Fallback((Placeholder(1),), on=frozenset({"sometimes"}))
    with pytest.raises(ConfigurationError):
        Fallback((Placeholder(1),), replace_after_seconds=float("nan"))


@pytest.mark.parametrize(
    ("exc", "retryable", "retry_left", "trigger"),
    [
        (CircuitOpen("x", None), True, True, "circuit-open"),
        (DeadlineExceeded("slow"), True, True, "timeout"),
        (TimeoutError("slow"), True, False, "timeout"),
        (ConnectionError("down"), True, True, None),  # the retry budget still covers it
        (ConnectionError("down"), True, False, "retries-exhausted"),
        (PermanentError("bad card"), False, False, None),  # never hidden by a fallback
        (ValueError("bug"), False, False, None),
    ],
)
def test_which_failures_are_a_fallbacks_trigger(
    exc: BaseException, retryable: bool, retry_left: bool, trigger: str | None
) -> None:
    assert cause_of(exc, retryable=retryable, retry_left=retry_left) == trigger


def test_a_cache_key_is_the_jobs_key_a_template_or_a_function() -> None:
    positional = Call((42,), {}, {"customer": 42})
    assert LastGood().cache_key("order-7", positional) == "order-7"
    assert LastGood("report-{customer}").cache_key("k", positional) == "report-42"
    assert LastGood("report-{0}").cache_key("k", positional) == "report-42"
    assert LastGood(lambda customer: f"r{customer}").cache_key("k", positional) == "r42"
    by_name = Call((), {"customer": 9}, {"customer": 9})
    assert LastGood(lambda customer: f"r{customer}").cache_key("k", by_name) == "r9"


# -- served instead of waiting -----------------------------------------------------------------


def test_an_open_breaker_serves_the_fallback_marked_degraded_and_schedules_the_real_job() -> None:
    h = harness(Breaker("gateway", open_=True))

    verdict, body = degraded_run(h, Placeholder(PLACEHOLDER))

    assert verdict == Verdict.returns(PLACEHOLDER)
    assert body.runs == 0  # the dependency was never called
    record = LedgerRecord.model_validate(h.record)
    assert record.state is State.SUCCEEDED and record.result == PLACEHOLDER
    assert record.degraded is not None
    assert record.degraded["reason"] == "circuit-open"
    assert record.degraded["fallback"] == "placeholder"
    assert record.degraded["replace_at"] is not None
    assert ("degraded", (h.delivery().job, "circuit-open", "placeholder")) in h.recorder.events
    # the replacement: the same job as a fresh run (no retries used, no canvas), due about
    # when the breaker lets calls through again
    ((delay, sent),) = body.deferred
    assert sent["fresh"] is True
    assert 29 <= delay <= 31
    assert sent[headers.KEY] == KEY


def test_the_real_job_replaces_the_degraded_result_exactly_once() -> None:
    gateway = Breaker("gateway", open_=True)
    h = harness(gateway)
    degraded_run(h, Placeholder(PLACEHOLDER))
    real = FakeBody(work=lambda body: {"charged": 7})

    # before it is due, a delivery waits for it (not dropped as a duplicate): the degraded
    # result stands meanwhile
    verdict, early = degraded_run(h, Placeholder(PLACEHOLDER), real)
    assert verdict.kind == "ack" and real.runs == 0
    assert (
        len(early.deferred) == 1 and h.record["duplicates"] == 0
        if "duplicates" in h.record
        else True
    )

    gateway.open = False
    h.clock.advance(31)
    replacing = replacing_delivery(h)
    verdict, _ = degraded_run(h, Placeholder(PLACEHOLDER), real, delivery=replacing)
    assert verdict == Verdict.returns({"charged": 7})
    record = LedgerRecord.model_validate(h.record)
    assert record.result == {"charged": 7}
    assert record.degraded is None
    assert record.replaced_degraded is not None
    assert record.replaced_degraded["fallback"] == "placeholder"

    for _ in range(3):  # any later copy of the replacement is a suppressed duplicate
        h.clock.advance(60)
        degraded_run(h, Placeholder(PLACEHOLDER), real, delivery=replacing)
    assert real.runs == 1


def test_a_replacement_waits_while_the_breaker_is_still_open() -> None:
    h = harness(Breaker("gateway", open_=True))
    degraded_run(h, Placeholder(PLACEHOLDER))
    h.clock.advance(31)
    replacing = replacing_delivery(h)

    verdict, body = degraded_run(h, Placeholder(PLACEHOLDER), delivery=replacing)

    assert verdict.kind == "ack" and "circuit open" in verdict.reason
    assert body.runs == 0 and len(body.deferred) == 1
    assert LedgerRecord.model_validate(h.record).status == "succeeded"  # degraded still served
    assert [name for name, _ in h.recorder.events].count("degraded") == 1


def test_a_replacement_that_fails_for_good_keeps_the_degraded_result() -> None:
    gateway = Breaker("gateway", open_=True)
    h = harness(gateway)
    degraded_run(h, Placeholder(PLACEHOLDER))
    gateway.open = False
    h.clock.advance(31)
    replacing = replacing_delivery(h)

    verdict, _ = degraded_run(
        h, Placeholder(PLACEHOLDER), fails(PermanentError("card declined")), delivery=replacing
    )

    assert verdict.kind == "ack"
    record = LedgerRecord.model_validate(h.record)
    assert record.state is State.SUCCEEDED and record.result == PLACEHOLDER
    assert record.degraded is not None and "card declined" in record.degraded["replacement_failed"]
    assert record.last_error is not None and record.last_error.type.endswith("PermanentError")
    assert h.outbox.raw == []  # not dead-lettered: it has a result


def test_every_way_a_replacement_can_end_without_a_result_keeps_the_degraded_one() -> None:
    for body, changes in (
        (fails(PermanentError("declined")), {}),
        (fails(ConnectionError("down")), {}),  # its retries run out (it was degraded by them)
        (FakeBody(work=lambda body: {1, 2}), {}),  # a result JSON cannot hold
    ):
        gateway = Breaker("gateway")
        h = harness(gateway)
        first = h.delivery(retries=2, enqueued_at=time.time() - 100)
        degraded_run(h, Placeholder(PLACEHOLDER), fails(ConnectionError("down")), delivery=first)
        assert h.record["degraded"]["reason"] == "retries-exhausted"
        h.clock.advance(61)

        verdict, _ = degraded_run(
            h, Placeholder(PLACEHOLDER), body, delivery=h.delivery(retries=2), **changes
        )

        record = LedgerRecord.model_validate(h.record)
        assert record.state is State.SUCCEEDED, (body, changes, verdict)
        assert record.result == PLACEHOLDER and record.degraded is not None
        assert record.degraded["replacement_failed"]
        assert h.outbox.raw == []  # never a dead letter: it has its answer


def test_a_replacement_runs_whatever_the_first_publishs_age() -> None:
    h = harness(Breaker("gateway", open_=True))
    old = h.delivery(enqueued_at=time.time() - 100)
    degraded_run(h, Placeholder(PLACEHOLDER), delivery=old, max_age_seconds=200.0)
    h.runtime.breakers["gateway"].open = False
    h.clock.advance(31)

    verdict, body = degraded_run(
        h,
        Placeholder(PLACEHOLDER),
        delivery=h.delivery(enqueued_at=time.time() - 300),
        max_age_seconds=200.0,
    )

    assert verdict == Verdict.returns({"charged": 7}) and body.runs == 1


def test_a_replacement_runs_whatever_attempts_the_degraded_job_spent() -> None:
    h = harness(Breaker("gateway"))
    first = h.delivery(retries=2)
    degraded_run(
        h, Placeholder(PLACEHOLDER), fails(ConnectionError("down")), delivery=first, max_attempts=3
    )
    h.clock.advance(61)

    verdict, body = degraded_run(h, Placeholder(PLACEHOLDER), max_attempts=3)

    assert verdict == Verdict.returns({"charged": 7}) and body.runs == 1
    assert "degraded" not in h.record


def test_waiting_for_a_breaker_with_nothing_to_serve_costs_no_attempt() -> None:
    h = harness(Breaker("gateway", open_=True))
    for _ in range(5):
        verdict, body = degraded_run(h, [LastGood()], max_attempts=3)
        assert verdict.kind == "ack" and body.runs == 0
    assert h.record["state"] == State.QUEUED and h.record["attempts"] == 0


def test_a_timeout_serves_the_fallback_at_once_instead_of_retrying() -> None:
    h = harness(Breaker("gateway"))

    verdict, body = degraded_run(h, Placeholder(PLACEHOLDER), fails(DeadlineExceeded("slow")))

    assert verdict == Verdict.returns(PLACEHOLDER)
    assert body.retries == []
    assert h.record["degraded"]["reason"] == "timeout"
    assert h.record["degraded"]["error"] == "DeadlineExceeded"
    ((delay, _),) = body.deferred  # the real job again after replace_after_seconds
    assert 60 <= delay <= 61


def test_a_retryable_error_retries_first_and_degrades_when_the_budget_ends() -> None:
    h = harness(Breaker("gateway"))

    verdict, body = degraded_run(h, Placeholder(PLACEHOLDER), fails(ConnectionError("down")))
    assert verdict.kind == "raise" and len(body.retries) == 1  # budget left: retried

    verdict, body = degraded_run(
        h, Placeholder(PLACEHOLDER), fails(ConnectionError("down")), delivery=h.delivery(retries=2)
    )
    assert verdict == Verdict.returns(PLACEHOLDER)
    assert h.record["degraded"]["reason"] == "retries-exhausted"


class CountingBreaker(Breaker):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.outcomes: list[str] = []

    def record_success(self, *, probe: bool = False) -> None:
        self.outcomes.append("success")

    def record_failure(self, *, probe: bool = False) -> None:
        self.outcomes.append("failure")


def test_a_body_whose_own_publish_meets_an_outage_is_retried_then_dead_never_degraded() -> None:
    """The platform's own servers away or full (a child's publish refused): retried with
    backoff, never counted by the task's breaker (its dependency did nothing wrong, nor right),
    and once the budget is spent the job is dead, to be replayed, not hidden behind a fallback
    that would stand for work it never started."""
    breaker = CountingBreaker("gateway")
    h = harness(breaker)
    outage = (Backpressure,)
    refused = Backpressure("default", 1_001, 1_000)

    verdict, body = degraded_run(
        h, Placeholder(PLACEHOLDER), fails(refused), retry_on=outage, outages=outage
    )
    assert verdict.kind == "raise" and len(body.retries) == 1  # budget left: retried
    verdict, _ = degraded_run(
        h,
        Placeholder(PLACEHOLDER),
        fails(refused),
        retry_on=outage,
        outages=outage,
        delivery=h.delivery(retries=2),
    )
    assert verdict.kind == "raise"
    assert h.record["state"] == State.DEAD and "degraded" not in h.record
    assert breaker.outcomes == []
    # (the dependency's own failure still counts, and is still degraded at the budget's end)
    other = harness(breaker)  # (another job on the same breaker)
    degraded_run(other, Placeholder(PLACEHOLDER), fails(ConnectionError("down")), outages=outage)
    assert breaker.outcomes == ["failure"]


def test_a_permanent_error_is_never_hidden_by_a_fallback() -> None:
    h = harness(Breaker("gateway"))

    verdict, _ = degraded_run(h, Placeholder(PLACEHOLDER), fails(PermanentError("bad")))

    assert verdict.kind == "raise"
    assert h.record["state"] == State.DEAD and "degraded" not in h.record


def test_a_fallback_limited_to_some_triggers_ignores_the_others() -> None:
    h = harness(Breaker("gateway"))
    only_breaker = Fallback((Placeholder(1),), on=frozenset({"circuit-open"}))

    verdict, body = degraded_run(h, only_breaker, fails(DeadlineExceeded("slow")))

    assert verdict.kind == "raise" and len(body.retries) == 1


def test_without_replacement_the_degraded_result_stands_for_good() -> None:
    h = harness(Breaker("gateway", open_=True))

    _, body = degraded_run(h, Fallback((Placeholder(1),), replace=False))

    assert body.deferred == []
    assert h.record["degraded"]["replace_at"] is None
    h.clock.advance(3600)
    verdict, _ = degraded_run(h, Fallback((Placeholder(1),), replace=False))
    assert verdict.kind == "ack"  # a duplicate


# -- the options ---------------------------------------------------------------------------------


def test_the_last_good_result_for_a_cache_key_is_served() -> None:
    gateway = Breaker("gateway")
    h = harness(gateway)
    fallback = [LastGood("customer-{order}"), Placeholder(PLACEHOLDER)]
    degraded_run(h, fallback, FakeBody(work=lambda body: {"report": "v1"}), delivery=h.delivery())

    gateway.open = True
    other = h.delivery(identity=job("order-8", "r8"))
    verdict, _ = degraded_run(h, fallback, delivery=other)

    assert verdict == Verdict.returns({"report": "v1"})
    assert h.ledger.docs["r8"]["degraded"]["fallback"] == "last-good"


def test_no_last_good_result_or_one_too_old_hands_over_to_the_next_option() -> None:
    gateway = Breaker("gateway")
    h = harness(gateway)
    fallback = [LastGood(max_age_seconds=60), Placeholder(PLACEHOLDER)]
    gateway.open = True
    verdict, _ = degraded_run(h, fallback)
    assert verdict == Verdict.returns(PLACEHOLDER)  # nothing cached yet

    h.ledger.remember(TASK, "order-9", '{"report": "old"}')
    h.clock.advance(120)
    old = h.delivery(identity=job("order-9", "r9"))
    verdict, _ = degraded_run(h, fallback, delivery=old)
    assert verdict == Verdict.returns(PLACEHOLDER)


def test_an_alternate_provider_is_used_behind_its_own_breaker() -> None:
    calls: list[tuple[Any, ...]] = []

    def backup_gateway(order: int, amount: int) -> dict[str, Any]:
        calls.append((order, amount))
        return {"charged": amount, "via": "backup"}

    backup = Breaker("backup")
    h = harness(Breaker("gateway", open_=True), backup)
    fallback = [Alternate(backup_gateway, breaker="backup"), Placeholder(PLACEHOLDER)]

    verdict, _ = degraded_run(h, fallback)

    assert verdict == Verdict.returns({"charged": 100, "via": "backup"})
    assert calls == [(7, 100)] and backup.calls == 1
    assert h.record["degraded"]["fallback"] == "alternate:backup_gateway"


def test_an_alternate_whose_breaker_is_open_or_that_fails_is_skipped() -> None:
    def broken(*args: Any) -> Any:
        raise ConnectionError("backup down too")

    h = harness(Breaker("gateway", open_=True), Breaker("backup", open_=True))
    fallback = [
        Alternate(lambda *a: {"via": "backup"}, breaker="backup", name="backup"),
        Alternate(broken, name="broken"),
        Placeholder(PLACEHOLDER),
    ]

    verdict, _ = degraded_run(h, fallback)

    assert verdict == Verdict.returns(PLACEHOLDER)


def test_when_no_option_can_serve_the_job_waits_as_without_a_fallback() -> None:
    h = harness(Breaker("gateway", open_=True))

    verdict, body = degraded_run(h, [LastGood()])

    assert verdict.kind == "ack" and "circuit open" in verdict.reason
    assert body.runs == 0 and len(body.deferred) == 1
    assert h.record["state"] == State.QUEUED  # the claim was given back


def test_a_fallback_whose_value_is_not_json_is_dead_not_degraded() -> None:
    h = harness(Breaker("gateway", open_=True))

    verdict, _ = degraded_run(h, Placeholder({1, 2}))

    assert verdict.kind == "raise"
    assert h.record["state"] == State.DEAD


# -- latency objectives --------------------------------------------------------------------------


def late_harness() -> Harness:
    return harness(Breaker("gateway"))


def test_a_job_past_its_objective_is_reported_late_once() -> None:
    h = late_harness()
    # a running job whose worker is slow: claimed with a 30 s objective, then nothing
    h.ledger.claim(
        RECORD,
        task=TASK,
        key=KEY,
        tier="critical",
        owner="x",
        slo_at=h.clock() + timedelta(seconds=30),
        slo_seconds=30.0,
    )
    escalation = Escalation(h.runtime)  # type: ignore[arg-type]
    assert escalation.check() == 0
    h.clock.advance(31)

    assert escalation.check() == 1
    assert escalation.check() == 0
    late = [args for name, args in h.recorder.events if name == "late"]
    assert len(late) == 1 and late[0][0].record_id == RECORD and late[0][2] == 30.0
    assert LedgerRecord.model_validate(h.record).status == "late"


def test_a_job_that_finishes_late_is_reported_once_by_its_attempt() -> None:
    h = late_harness()
    delivery = h.delivery(enqueued_at=time.time() - 100)  # waited 100 s in the queue

    verdict, _ = h.run(delivery=delivery, slo_seconds=30.0)

    assert verdict.kind == "return"
    record = LedgerRecord.model_validate(h.record)
    assert record.late_at is not None and record.status == "succeeded"
    assert [name for name, _ in h.recorder.events].count("late") == 1
    assert Escalation(h.runtime).check() == 0  # type: ignore[arg-type]


def test_a_job_in_time_is_never_late() -> None:
    h = late_harness()
    delivery = h.delivery(enqueued_at=time.time())

    h.run(delivery=delivery, slo_seconds=30.0)
    h.clock.advance(3600)

    assert Escalation(h.runtime).check() == 0  # type: ignore[arg-type]
    assert "late" not in h.recorder.names()
    assert "slo_at" not in h.record


def test_a_dead_job_past_its_objective_is_not_reported_late() -> None:
    h = late_harness()
    delivery = h.delivery(enqueued_at=h.clock().timestamp())
    h.run(fails(PermanentError("bad")), delivery=delivery, slo_seconds=30.0)
    h.clock.advance(60)

    assert Escalation(h.runtime).check() == 0  # type: ignore[arg-type]
    assert "slo_at" not in h.record
