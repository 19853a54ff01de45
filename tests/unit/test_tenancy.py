"""Tenants: naming a job's tenant, the policies' settings, and a tenant's backpressure."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kombu.transport import redis as kombu_redis

from celery_ledger import Settings, create_app, headers
from celery_ledger.errors import Backpressure, ConfigurationError, PayloadError
from celery_ledger.fair_scripts import SCRIPT
from celery_ledger.fairness import (
    OTHER_TENANTS,
    PRIORITY_STEPS,
    TENANT_PROPERTY,
    TenantPolicy,
    TenantShare,
    check_tenant,
    top_shares,
)
from celery_ledger.guard import Verdict
from celery_ledger.policies.rate_limit import first_wait
from celery_ledger.policies.tenants import TenantGate, TenantRates, leave_slot, policy_of
from celery_ledger.tenancy import Feeder, tenant_of_call, tenant_slot_of


def run(customer: str, amount: int = 0) -> None: ...


def test_the_restated_names_are_the_owners() -> None:
    assert TENANT_PROPERTY == headers.TENANT
    assert tuple(kombu_redis.Channel.priority_steps) == PRIORITY_STEPS
    assert headers.TENANT in headers.PROPERTIES and headers.TENANT in headers.CARRIED
    # the dispatch script reads a queued message's tenant by that name
    assert f"props['{TENANT_PROPERTY}'] == tenant" in SCRIPT


@pytest.mark.parametrize(
    ("spec", "given", "expected"),
    [
        (None, None, None),
        ("{customer}", None, "acme"),
        (lambda customer, amount=0: f"{customer}-eu", None, "acme-eu"),
        ("{customer}", "override", "override"),  # the call's own wins
        (None, "given", "given"),
    ],
)
def test_a_calls_tenant(spec: Any, given: Any, expected: str | None) -> None:
    found = tenant_of_call(
        spec, task_name="t", run=run, args=("acme",), kwargs={"amount": 3}, given=given
    )
    assert found == expected


@pytest.mark.parametrize(
    ("spec", "given", "error"),
    [
        ("{nope}", None, ConfigurationError),
        (42, None, ConfigurationError),
        (lambda: "x", None, PayloadError),
        (lambda customer, amount: 7, None, PayloadError),
        (None, "", PayloadError),
        (None, "*", PayloadError),
        (None, "x" * 129, PayloadError),
        (None, "line\nbreak", PayloadError),
        (None, 5, PayloadError),
    ],
)
def test_a_tenant_that_cannot_be_is_refused_naming_the_task(
    spec: Any, given: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match="tenant"):
        tenant_of_call(spec, task_name="t", run=run, args=("acme",), kwargs={}, given=given)


def test_tenant_names() -> None:
    assert check_tenant("acme-42 eu") == "acme-42 eu"
    for bad in ("", "*", "\x00", "a" * 129, None, 3):
        with pytest.raises(ValueError):
            check_tenant(bad)


def test_policies_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "LEDGER_TENANTS", '{"acme": {"weight": 3, "concurrency": 5}, "*": {"max_waiting": 100}}'
    )
    settings = Settings()
    assert settings.tenants == {
        "acme": TenantPolicy(weight=3, concurrency=5),
        "*": TenantPolicy(max_waiting=100),
    }
    assert policy_of(settings.tenants, "acme").weight == 3
    assert policy_of(settings.tenants, "other") == TenantPolicy(max_waiting=100)
    assert policy_of({}, "other") == TenantPolicy()
    assert settings.fair_queue_depth == 0  # (off until set)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ({"acme": {"weight": 0}}, "weight"),
        ({"acme": {"weight": 1.5}}, "weight"),
        ({"acme": {"concurrency": 0}}, "concurrency"),
        ({"acme": {"max_waiting": -1}}, "max_waiting"),
        ({"acme": {"wieght": 2}}, "unknown option wieght"),
        ({"*bad\n": {}}, "printable"),
        ({"acme": 3}, "expected a JSON object"),
        ({"acme": {"rate_per_second": 0}}, "rate_per_second"),
        ({"acme": {"rate_per_second": "fast"}}, "rate_per_second"),
        ({"acme": {"rate_per_second": float("nan")}}, "rate_per_second"),
        ({"acme": {"rate_per_second": True}}, "rate_per_second"),
        ({"acme": {"burst": 5}}, "burst"),
        ({"acme": {"rate_per_second": 1, "burst": 0}}, "burst"),
    ],
)
def test_bad_policies_are_refused_naming_the_tenant(value: Any, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        Settings(tenants=value)


class FakeLanes:
    def __init__(self, waiting: int) -> None:
        self.count = waiting
        self.reads = 0

    def waiting_of(self, queue: str, tenant: str) -> int:
        self.reads += 1
        return self.count


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def gate(waiting: int, **policies: TenantPolicy) -> tuple[TenantGate, FakeLanes, Clock]:
    lanes, clock = FakeLanes(waiting), Clock()
    made = TenantGate(lanes, policies, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    return made, lanes, clock


def test_a_tenant_under_its_mark_publishes_and_one_without_a_mark_is_not_read() -> None:
    made, lanes, _ = gate(4, acme=TenantPolicy(max_waiting=5))
    assert made.check("default", "q", "acme", policy="reject", block_seconds=1)
    assert made.check("default", "q", "other", policy="reject", block_seconds=1)
    assert lanes.reads == 1


@pytest.mark.parametrize("policy", ["reject", "block"])
def test_a_tenant_at_its_mark_is_refused(policy: str) -> None:
    made, _, clock = gate(5, acme=TenantPolicy(max_waiting=5))
    with pytest.raises(Backpressure, match="tenant 'acme'"):
        made.check("default", "q", "acme", policy=policy, block_seconds=2)
    assert clock.now >= (2 if policy == "block" else 0)


def test_a_blocked_publish_goes_once_the_tenant_drains() -> None:
    made, lanes, clock = gate(5, acme=TenantPolicy(max_waiting=5))

    def drained(seconds: float) -> None:
        clock.now += seconds
        lanes.count = 0

    made._sleep = drained
    assert made.check("default", "q", "acme", policy="block", block_seconds=2)


def test_a_shed_tier_sheds_only_that_tenant() -> None:
    made, _, _ = gate(9, **{"*": TenantPolicy(max_waiting=5)})
    assert made.check("default", "q", "flood", policy="shed", block_seconds=1) is False


def test_the_count_is_read_once_a_second() -> None:
    made, lanes, clock = gate(1, acme=TenantPolicy(max_waiting=5))
    for _ in range(100):
        made.check("default", "q", "acme", policy="reject", block_seconds=1)
    assert lanes.reads == 1
    clock.now += 1.0
    made.check("default", "q", "acme", policy="reject", block_seconds=1)
    assert lanes.reads == 2


def test_each_refusal_is_reported_once_with_its_policy_and_a_drained_block_is_not() -> None:
    # Given a gate whose refusals are recorded, and a tenant at its mark
    refused: list[tuple[str, str, str]] = []
    made, lanes, clock = gate(5, acme=TenantPolicy(max_waiting=5))
    made._on_refused = lambda *event: refused.append(event)
    # When its publishes are shed, rejected, and blocked past the timeout
    assert made.check("bulk", "q", "acme", policy="shed", block_seconds=1) is False
    for policy in ("reject", "block"):
        with pytest.raises(Backpressure):
            made.check("default", "q", "acme", policy=policy, block_seconds=1)
    # Then each is reported with its tier and policy
    assert refused == [("bulk", "acme", "shed"), ("default", "acme", "reject"),
                       ("default", "acme", "block")]  # fmt: skip
    # And a blocked publish that goes once the tenant drains is no refusal
    lanes.count = 0
    clock.now += 1.0
    assert made.check("default", "q", "acme", policy="block", block_seconds=1)
    assert len(refused) == 3


@given(
    waiting=st.dictionaries(st.sampled_from("abcdefghij"), st.integers(0, 50), max_size=10),
    running=st.dictionaries(st.sampled_from("abcdefghij"), st.integers(0, 5), max_size=10),
    top=st.integers(0, 12),
)
def test_the_top_tenants_and_other_keep_every_job_in_at_most_top_plus_one_rows(
    waiting: dict[str, int], running: dict[str, int], top: int
) -> None:
    rows = top_shares(waiting, running, top=top)
    # at most top + 1 rows, "other" only last, and nothing lost or counted twice
    assert len(rows) <= top + 1
    assert [r.tenant for r in rows].count(OTHER_TENANTS) <= 1
    assert all(r.tenant != OTHER_TENANTS for r in rows[:-1])
    assert sum(r.waiting for r in rows) == sum(waiting.values())
    assert sum(r.running for r in rows) == sum(running.values())
    assert sum(r.tenants for r in rows) == len(set(waiting) | set(running))
    # the named ones are the most waiting: none left in "other" waits more than any of them
    named = [r for r in rows if r.tenant != OTHER_TENANTS]
    rest = (set(waiting) | set(running)) - {r.tenant for r in named}
    if named and rest:
        assert max(waiting.get(t, 0) for t in rest) <= min(r.waiting for r in named)


def test_the_top_tenants_by_waiting_then_running_then_name() -> None:
    waiting = {"flood": 900, "calm": 3, "idle": 0, "other": 50, "z": 3}
    running = {"capped": 4, "idle": 1}
    rows = top_shares(waiting, running, top=3)
    # a tenant named "other" is summed with the rest, never shown as if it were them
    assert rows == [
        TenantShare("flood", 900, 0),
        TenantShare("calm", 3, 0),
        TenantShare("z", 3, 0),
        TenantShare(OTHER_TENANTS, 50, 5, tenants=3),
    ]
    assert top_shares({"a": 1}, {}, top=3) == [TenantShare("a", 1, 0)]  # no rest: no "other"
    assert top_shares({}, {}, top=3) == []


def test_a_deliverys_unusable_tenant_is_ignored_not_fatal() -> None:
    def request(tenant: Any) -> Any:
        properties = {"ledger_tenant": tenant, "delivery_tag": "tag-1"}
        return SimpleNamespace(
            id="j", properties=properties, delivery_info={"routing_key": "app.default"}
        )

    slot = tenant_slot_of(request("acme"))
    assert slot is not None and (slot.tenant, slot.queue, slot.tag) == (
        "acme",
        "app.default",
        "tag-1",
    )
    for bad in ("*", "", "x" * 129, "a\nb", 5):
        assert tenant_slot_of(request(bad)) is None  # (run as no tenant's; its retry publishes)


def test_a_deliverys_end_frees_its_slot_unless_that_delivery_started_without_it() -> None:
    app = create_app(
        "unit",
        settings=Settings(
            broker_url="redis://127.0.0.1:1/0",
            mongo_uri="mongodb://127.0.0.1:1/",
            tenants={"acme": {"concurrency": 1}},
        ),
        set_as_current=False,
    )

    @app.task(shared=False, name="unit.job")  # type: ignore[untyped-decorator]
    def job(x: int) -> None:
        pass

    freed: list[tuple[str, str, str]] = []
    fair = SimpleNamespace(release=lambda *slot: freed.append(slot))
    runtime = SimpleNamespace(settings=app.settings, tiers=app.tiers, fair=fair)
    feeder = Feeder(runtime, queues=lambda: [])

    class Guard:  # (the guard's part: a delivery refused, or a copy of a running one)
        without_slot = False

        def run(self, delivery: Any, *_: Any, **__: Any) -> Verdict:
            if self.without_slot:
                leave_slot(delivery.tenant_slot)
            return Verdict("return", 1)

    guard = app.__dict__["guard"] = Guard()  # (a cached property: the instance's own)

    def delivered(*, started_without_its_slot: bool) -> None:
        guard.without_slot = started_without_its_slot
        job.push_request(
            id="m-1",
            retries=0,
            called_directly=False,
            properties={"ledger_tenant": "acme", "delivery_tag": "tag-1"},
            delivery_info={"routing_key": "unit.default"},
        )
        try:
            assert job(1) == 1  # a pool's call of the task (LedgerTask.__call__)
            feeder.released(sender=job)  # Celery's task_postrun, the request still pushed
        finally:
            job.pop_request()

    delivered(started_without_its_slot=True)
    assert freed == []
    delivered(started_without_its_slot=False)
    assert freed == [("unit.default", "acme", "tag-1")]


class Bucket:
    def __init__(self, name: str, wait: float | Exception) -> None:
        self.name, self.wait, self.taken = name, wait, 0

    def try_acquire(self) -> float:
        if isinstance(self.wait, Exception):
            raise self.wait
        self.taken += 1
        return self.wait


def test_a_jobs_buckets_are_asked_in_turn_and_the_first_to_say_wait_says_so() -> None:
    import redis

    tenant, task = Bucket("tenant:acme", 0.0), Bucket("api", 0.4)
    assert first_wait(tenant, task) == (0.4, "api")  # type: ignore[arg-type]
    assert (tenant.taken, task.taken) == (1, 1)
    tenant.wait = 1.5
    assert first_wait(tenant, task) == (1.5, "tenant:acme")  # type: ignore[arg-type]
    assert task.taken == 1  # (the task's token is not taken for a job the tenant defers)
    assert first_wait(None, None) == (0.0, "")
    down = Bucket("tenant:acme", redis.ConnectionError("down"))
    assert first_wait(down, None) == (0.0, "")  # (fail open: a rate never stops the fleet)


def test_each_tenant_has_its_own_bucket_at_its_policys_rate() -> None:
    import redis

    client = redis.Redis()  # (never connected: a bucket is made, not used, here)
    rates = TenantRates(
        client,
        {"acme": TenantPolicy(rate_per_second=2.5), "*": TenantPolicy(rate_per_second=10, burst=4)},
        namespace="shop",
    )
    acme, one, other = rates.bucket("acme"), rates.bucket("one"), rates.bucket("two")
    assert acme is not None and (acme.rate_per_second, acme.burst) == (2.5, 3)  # (rounded up)
    assert one is not None and other is not None and one.key != other.key  # each its own
    assert (one.rate_per_second, one.burst) == (10, 4)
    assert acme.key == "celery_ledger:rate:shop:tenant:acme"
    assert rates.bucket("acme") is acme
    unlimited = TenantRates(client, {"acme": TenantPolicy(weight=2)}, namespace="shop")
    assert unlimited.bucket("acme") is None
