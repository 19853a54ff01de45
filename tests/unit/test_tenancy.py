"""Tenants: naming a job's tenant, the policies' settings, and a tenant's backpressure."""

from __future__ import annotations

from typing import Any

import pytest
from kombu.transport import redis as kombu_redis

from celery_ledger import Settings, headers
from celery_ledger.errors import Backpressure, ConfigurationError, PayloadError
from celery_ledger.fairness import PRIORITY_STEPS, TENANT_PROPERTY, TenantPolicy, check_tenant
from celery_ledger.policies.tenants import TenantGate, policy_of
from celery_ledger.tenancy import tenant_of_call


def run(customer: str, amount: int = 0) -> None: ...


def test_the_restated_names_are_the_owners() -> None:
    assert TENANT_PROPERTY == headers.TENANT
    assert tuple(kombu_redis.Channel.priority_steps) == PRIORITY_STEPS
    assert headers.TENANT in headers.PROPERTIES and headers.TENANT in headers.CARRIED


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
    assert settings.fair_queue_depth == 2


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
