"""Metrics: platform events, signals and ledger commands update prometheus-client metrics."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from celery_ledger import Job, Settings, create_app
from celery_ledger.fairness import top_shares
from celery_ledger.handoff import Parked
from celery_ledger.headers import SENT_AT
from celery_ledger.ledger.dead import DeadLetter
from celery_ledger.observability import ledger_listeners, metrics, stamp_sent_at
from celery_ledger.observability.exporter import MetricsStep, StateCollector
from celery_ledger.observability.metrics import MetricsObserver
from celery_ledger.policies.breaker import BreakerState

TASK = "billing.charge"


def job(record_id: str, tier: str | None = "critical") -> Job:
    return Job(TASK, tier, record_id, "k")


def letter(record_id: str, death: str, tier: str | None = "default") -> DeadLetter:
    return DeadLetter(record_id, TASK, "k", tier, "boom", death, "f", "t", None, [], "now")


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    registry = CollectorRegistry()
    metrics.enable(registry)
    yield registry
    metrics.disable()


@pytest.fixture
def app() -> Any:
    app = create_app("metrics_tests", settings=Settings(metrics_port=9808), set_as_current=False)

    @app.task(name=TASK, shared=False)  # type: ignore[untyped-decorator]
    def charge() -> None:
        """The task the events below are about (labels name only registered tasks)."""

    return app


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_metrics_are_wired_only_when_a_port_is_set(app: Any) -> None:
    # Given an app with LEDGER_METRICS_PORT, and one without
    plain = create_app("plain", settings=Settings(), set_as_current=False)
    # Then only the first has the exporter step and the ledger latency listener
    assert MetricsStep in app.steps["worker"]
    assert MetricsStep not in plain.steps["worker"]
    assert ledger_listeners(app.settings) == [metrics.LEDGER_COMMANDS]
    assert ledger_listeners(plain.settings) == []


def test_task_events_update_counters_and_durations(app: Any, registry: CollectorRegistry) -> None:
    # When a job runs, fails once, runs again and succeeds, and a duplicate is suppressed
    events = app.observers
    events.claimed(job("r1"), 1)
    events.retried(job("r1"), 1.0, ValueError())
    events.claimed(job("r1"), 2)
    events.succeeded(job("r1"), 0.2)
    events.duplicate(job("r1"))
    events.deferred(job("r2"), "circuit open", 1.0)
    events.lease_lost(job("r3"), 3)
    events.dead(job("r4", tier=None), letter("r4", "failed", tier=None))
    events.breaker("payments", BreakerState.CLOSED.value, BreakerState.OPEN.value)
    events.throttle("bulk", True, "critical backlog")
    events.shed("bulk")
    events.ledger_unavailable(job("r5"), "claim")

    # Then each has its counter, labelled by task and tier
    labels = {"task": TASK, "tier": "critical"}
    assert value(registry, "celery_ledger_tasks_started_total", **labels) == 2
    assert value(registry, "celery_ledger_tasks_retried_total", **labels) == 1
    assert value(registry, "celery_ledger_tasks_succeeded_total", **labels) == 1
    assert value(registry, "celery_ledger_duplicates_suppressed_total", **labels) == 1
    deferred = {**labels, "reason": "circuit open"}
    assert value(registry, "celery_ledger_tasks_deferred_total", **deferred) == 1
    assert value(registry, "celery_ledger_lease_lost_total", **labels) == 1
    assert value(registry, "celery_ledger_tasks_dead_total", task=TASK, tier="unknown") == 1
    transition = {"breaker": "payments", "to": "open"}
    assert value(registry, "celery_ledger_breaker_transitions_total", **transition) == 1
    assert value(registry, "celery_ledger_throttle_engaged", queue="bulk") == 1
    assert value(registry, "celery_ledger_publishes_shed_total", tier="bulk") == 1
    assert value(registry, "celery_ledger_ledger_unavailable_total", where="claim") == 1
    # And durations by outcome: the failed attempt and the successful one
    for outcome, total in (("retried", 1), ("succeeded", 1)):
        count = value(
            registry, "celery_ledger_task_duration_seconds_count", **labels, outcome=outcome
        )
        assert count == total, outcome
    succeeded = {**labels, "outcome": "succeeded"}
    assert value(registry, "celery_ledger_task_duration_seconds_sum", **succeeded) == 0.2


def test_poison_dead_letters_are_counted_by_queue(app: Any, registry: CollectorRegistry) -> None:
    app.observers.dead(job("p"), letter("p", "poison"))
    app.observers.dead(job("u"), letter("u", "unknown-task"))
    app.observers.dead(job("f"), letter("f", "failed"))  # reached a body: dead, not poison
    assert value(registry, "celery_ledger_poison_messages_total", queue="default") == 2
    assert value(registry, "celery_ledger_tasks_dead_total", task=TASK, tier="critical") == 3


def test_queue_wait_is_measured_from_the_published_header(registry: CollectorRegistry) -> None:
    # Given a message stamped at publish 2 seconds ago
    headers: dict[str, Any] = {}
    stamp_sent_at(headers=headers)
    headers[SENT_AT] -= 2.0
    request = SimpleNamespace(headers=headers, ledger_tier="bulk")
    # When its delivery starts
    metrics.observe_queue_wait(sender=SimpleNamespace(name=TASK, request=request, tier=None))
    # Then it waited about 2 seconds
    labels = {"task": TASK, "tier": "bulk"}
    assert value(registry, "celery_ledger_queue_wait_seconds_count", **labels) == 1
    assert 2.0 <= value(registry, "celery_ledger_queue_wait_seconds_sum", **labels) < 3.0


def test_ledger_commands_are_timed_by_name(registry: CollectorRegistry) -> None:
    listener = metrics.LEDGER_COMMANDS
    listener.succeeded(SimpleNamespace(command_name="update", duration_micros=1500))
    listener.failed(SimpleNamespace(command_name="find", duration_micros=300))
    assert value(registry, "celery_ledger_ledger_command_seconds_count", command="update") == 1
    assert value(registry, "celery_ledger_ledger_command_seconds_sum", command="update") == 0.0015
    assert value(registry, "celery_ledger_ledger_command_failures_total", command="find") == 1


def test_a_broken_metric_never_raises(
    app: Any, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a metric that fails
    active = metrics.active()
    assert active is not None
    active.started = None  # type: ignore[assignment]
    # When an event and a signal reach it, twice
    metrics._last_warning = 0.0
    with caplog.at_level(logging.WARNING, "celery_ledger.metrics"):
        for _ in range(2):
            app.observers.claimed(job("r"), 1)
            metrics.observe_queue_wait(sender=object())
    # Then nothing raised, and the failure was logged once (rate-limited to one a minute)
    assert len([r for r in caplog.records if "metrics:" in r.getMessage()]) == 1


def test_nothing_is_recorded_while_disabled(app: Any, registry: CollectorRegistry) -> None:
    # Given metrics that were enabled, then disabled
    metrics.disable()
    # When an event happens
    app.observers.claimed(job("r"), 1)
    # Then nothing was counted (and nothing raised)
    labels = {"task": TASK, "tier": "critical"}
    assert value(registry, "celery_ledger_tasks_started_total", **labels) == 0
    # while the same event counts once enabled again
    metrics.enable(registry=CollectorRegistry())
    app.observers.claimed(job("r"), 1)
    active = metrics.active()
    assert active is not None
    assert active.started.labels(TASK, "critical")._value.get() == 1


def test_scrape_time_gauges_and_a_broker_outage() -> None:
    # Given an app whose broker answers and whose ledger does not
    parked = [
        Parked("1", "q", {"headers": {"task": "a"}}, "arguments", 960.0),
        Parked("2", "q", {"headers": {"task": "a"}}, "arguments", 990.0),
        Parked("3", "q", {"headers": {"task": "b"}}, "no-key", None),
    ]
    status = SimpleNamespace(name="payments", state=BreakerState.OPEN)
    app = SimpleNamespace(
        queue_depths=SimpleNamespace(depths=lambda: {"critical": 3, "dead_letter": 1}),
        delayed=SimpleNamespace(pending=lambda: 4),
        breakers=SimpleNamespace(statuses=lambda: [status]),
        ledger=SimpleNamespace(count_dead=None),  # calling it fails
        parking=SimpleNamespace(all=lambda: parked),
        unrecorded=SimpleNamespace(count=lambda: 7),
        message_time=lambda: 1_000.0,
        fair=None,  # fair dispatch off: no tenants' gauges
    )
    registry = CollectorRegistry()
    registry.register(StateCollector(app, ["critical", "default"]))
    # Then the broker's state is exported and the ledger is reported down
    assert value(registry, "celery_ledger_queue_depth", queue="critical") == 3
    assert value(registry, "celery_ledger_delayed_deliveries") == 4
    assert value(registry, "celery_ledger_unrecorded_jobs") == 7
    assert value(registry, "celery_ledger_breaker_state", breaker="payments") == 2
    assert value(registry, "celery_ledger_worker_consuming", queue="default") == 1
    assert value(registry, "celery_ledger_dependency_up", dependency="broker") == 1
    assert value(registry, "celery_ledger_dependency_up", dependency="ledger") == 0
    assert registry.get_sample_value("celery_ledger_dead_letters") is None
    # And the messages parked for a worker that can run them, by reason and task
    assert value(registry, "celery_ledger_parked_messages", reason="arguments", task="a") == 2
    assert value(registry, "celery_ledger_parked_messages", reason="no-key", task="b") == 1
    assert value(registry, "celery_ledger_parked_oldest_seconds") == 40.0


def test_workflows_by_state_and_their_steps_are_exported(registry: CollectorRegistry) -> None:
    # Given a ledger with workflows in several states
    runtime = SimpleNamespace(
        queue_depths=SimpleNamespace(depths=lambda: {}),
        delayed=SimpleNamespace(pending=lambda: 0),
        breakers=SimpleNamespace(statuses=lambda: []),
        ledger=SimpleNamespace(count_dead=lambda: 0),
        parking=SimpleNamespace(all=lambda: []),
        unrecorded=SimpleNamespace(count=lambda: 0),
        message_time=lambda: 0.0,
        fair=None,
    )
    counts = {"running": 4, "stuck": 1, "completed": 10}
    scraped = CollectorRegistry()
    scraped.register(StateCollector(runtime, [], lambda: counts))
    # Then each state is a series, the active ones even at zero
    assert value(scraped, "celery_ledger_workflows", state="running") == 4
    assert value(scraped, "celery_ledger_workflows", state="stuck") == 1
    assert value(scraped, "celery_ledger_workflows", state="compensating") == 0
    assert value(scraped, "celery_ledger_workflows", state="completed") == 10
    # And the engine's events are counted
    observer = MetricsObserver()
    observer.workflow_step("shop.fulfil", "payments.charge", 1.5, True)
    observer.workflow_ended("shop.fulfil", "compensated")
    # a skipped optional step: its reason's category, never its text
    job = Job("unknown.task", "bulk", "r-9", "k")
    observer.step_skipped(job, "enrich", "dependency down: circuit 'crm' open")
    observer.step_skipped(job, "enrich", "time budget: 1.0s left, the step needs 30s")
    skipped = {"task": "unregistered", "tier": "bulk", "step": "enrich"}
    for reason in ("dependency down", "time budget"):
        assert value(registry, "celery_ledger_steps_skipped_total", **skipped, reason=reason) == 1
    step = {"workflow": "shop.fulfil", "outcome": "succeeded"}
    assert value(registry, "celery_ledger_workflow_step_seconds_count", **step) == 1
    assert value(registry, "celery_ledger_workflow_step_seconds_sum", **step) == 1.5
    ended = {"workflow": "shop.fulfil", "status": "compensated"}
    assert value(registry, "celery_ledger_workflows_ended_total", **ended) == 1


def test_scrapes_within_the_cache_time_read_the_broker_and_the_ledger_once() -> None:
    # Given a collector whose reads are counted, and a clock the test moves
    reads: list[str] = []
    now = [100.0]

    def counted(what: str, result: Any) -> Any:
        return lambda: reads.append(what) or result

    runtime = SimpleNamespace(
        queue_depths=SimpleNamespace(depths=counted("depths", {"critical": 2})),
        delayed=SimpleNamespace(pending=counted("delayed", 1)),
        breakers=SimpleNamespace(statuses=counted("breakers", [])),
        ledger=SimpleNamespace(count_dead=counted("dead", 5)),
        parking=SimpleNamespace(all=counted("parked", [])),
        unrecorded=SimpleNamespace(count=counted("unrecorded", 0)),
        message_time=lambda: 0.0,
        tiers=SimpleNamespace(names=("critical",), queue=lambda tier: f"ns.{tier}"),
        fair=SimpleNamespace(shares=lambda queue, top: counted("tenants", [])()),
    )
    registry = CollectorRegistry()
    collector = StateCollector(
        runtime, [], counted("workflows", {}), cache_seconds=10, clock=lambda: now[0]
    )
    registry.register(collector)
    reads.clear()
    now[0] += 10  # the registration's read is stale now

    # When it is scraped ten times within the cache time
    for _ in range(10):
        assert value(registry, "celery_ledger_dead_letters") == 5
        now[0] += 0.5
    # Then each backend was read once
    assert sorted(reads) == [
        "breakers", "dead", "delayed", "depths", "parked", "tenants", "unrecorded", "workflows"
    ]  # fmt: skip

    # And the next scrape after the cache time reads again
    now[0] += 10
    assert value(registry, "celery_ledger_queue_depth", queue="critical") == 2
    assert len(reads) == 16


def _call(app: Any, authorization: str | None) -> tuple[str, bytes]:
    environ: dict[str, Any] = {"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "QUERY_STRING": ""}
    if authorization is not None:
        environ["HTTP_AUTHORIZATION"] = authorization
    status: list[str] = []
    body = b"".join(app(environ, lambda s, headers: status.append(s)))
    return status[0], body


def test_the_metrics_endpoint_asks_for_its_credentials_when_set() -> None:
    import base64

    from prometheus_client import Counter

    from celery_ledger.observability.exporter import metrics_app

    registry = CollectorRegistry()
    Counter("probe_total", "a probe", registry=registry).inc()
    guarded = metrics_app(registry, "scraper:pa55:word")

    def basic(credentials: str) -> str:
        return "Basic " + base64.b64encode(credentials.encode()).decode()

    for refused in (
        None,
        "",
        basic("scraper:wrong"),
        basic("scraper:pa55:word2"),
        "Bearer " + base64.b64encode(b"scraper:pa55:word").decode(),
        "Basic not-base64!",
    ):
        status, body = _call(guarded, refused)
        assert status.startswith("401") and b"probe_total" not in body
    status, body = _call(guarded, basic("scraper:pa55:word"))
    assert status.startswith("200") and b"probe_total 1.0" in body
    # Unset: served as prometheus-client serves it
    assert _call(metrics_app(registry, None), None)[0].startswith("200")


def test_the_metrics_endpoint_is_loopback_unless_told_and_its_auth_is_checked() -> None:
    assert Settings().metrics_address == "127.0.0.1"
    for bad in ("user", "user:", ":password"):
        with pytest.raises(ValueError, match="user:password"):
            Settings(metrics_auth=bad)


def test_labels_never_come_from_message_content(app: Any, registry: CollectorRegistry) -> None:
    # Given events about jobs whose task and tier a message named (poison, a forged header)
    for i in range(50):
        app.observers.dead(
            Job(f"forged.task.{i}", f"tier-{i}", f"r{i}", "k"),
            letter(f"r{i}", "unknown-task", tier=f"queue-{i}"),
        )
        app.observers.claimed(Job(TASK, f"tier-{i}", f"c{i}", "k"), 1)
    # Then they share one series each: no label value came from the messages
    assert (
        value(registry, "celery_ledger_tasks_dead_total", task="unregistered", tier="unknown") == 50
    )
    assert value(registry, "celery_ledger_poison_messages_total", queue="unknown") == 50
    assert value(registry, "celery_ledger_tasks_started_total", task=TASK, tier="unknown") == 50
    names = {
        sample.labels.get("task")
        for family in registry.collect()
        for sample in family.samples
        if "task" in sample.labels
    }
    assert names <= {TASK, "unregistered"}


def test_each_tiers_top_tenants_are_gauged_and_the_rest_summed_as_other() -> None:
    # Given two tiers' lanes: twelve tenants waiting on default, a capped one running on bulk
    waiting = {"default": {f"t{n:02}": 100 - n for n in range(12)}, "bulk": {}}
    running = {"default": {"t00": 2}, "bulk": {"capped": 3}}
    queues = {"ns.default": "default", "ns.bulk": "bulk"}

    def shares(queue: str, *, top: int) -> list[Any]:
        tier = queues[queue]
        return top_shares(waiting[tier], running[tier], top=top)

    runtime = SimpleNamespace(
        queue_depths=SimpleNamespace(depths=lambda: {}),
        delayed=SimpleNamespace(pending=lambda: 0),
        breakers=SimpleNamespace(statuses=lambda: []),
        ledger=SimpleNamespace(count_dead=lambda: 0),
        parking=SimpleNamespace(all=lambda: []),
        unrecorded=SimpleNamespace(count=lambda: 0),
        message_time=lambda: 0.0,
        tiers=SimpleNamespace(names=("default", "bulk"), queue=lambda tier: f"ns.{tier}"),
        fair=SimpleNamespace(shares=shares),
    )
    # When it is scraped with the ten most waiting named
    registry = CollectorRegistry()
    registry.register(StateCollector(runtime, [], tenants_top=10))
    samples = [
        s
        for family in registry.collect()
        if family.name == "celery_ledger_tenant_waiting"
        for s in family.samples
    ]
    # Then eleven series on default: the ten most waiting, and the last two summed as other
    named = {s.labels["tenant"]: s.value for s in samples if s.labels["tier"] == "default"}
    assert len(named) == 11 and named["t00"] == 100 and named["t09"] == 91
    assert named["other"] == 90 + 89  # t10 and t11
    assert value(registry, "celery_ledger_tenant_running", tier="default", tenant="t00") == 2
    # and the capped tenant's slots on bulk, with nothing waiting
    assert value(registry, "celery_ledger_tenant_running", tier="bulk", tenant="capped") == 3
    assert value(registry, "celery_ledger_tenant_waiting", tier="bulk", tenant="capped") == 0
    assert value(registry, "celery_ledger_dependency_up", dependency="broker") == 1

    # And lanes that cannot be read leave the other gauges and the broker's state alone
    runtime.fair = SimpleNamespace(shares=None)  # calling it fails
    broken = CollectorRegistry()
    broken.register(StateCollector(runtime, []))
    assert broken.get_sample_value("celery_ledger_tenant_waiting", {"tier": "default",
                                   "tenant": "t00"}) is None  # fmt: skip
    assert value(broken, "celery_ledger_dependency_up", dependency="broker") == 1


def test_tenant_refusals_are_counted_by_a_named_tenant_or_other(
    registry: CollectorRegistry,
) -> None:
    # Given an observer of an app whose LEDGER_TENANTS names acme
    observer = MetricsObserver(named_tenants=frozenset({"acme", "*"}))
    # When acme's publishes and unnamed tenants' are refused
    observer.tenant_refused("bulk", "acme", "shed")
    observer.tenant_refused("bulk", "acme", "shed")
    observer.tenant_refused("default", "flood-4711", "reject")
    observer.tenant_refused("default", "flood-4712", "block")
    observer.tenant_refused("nowhere", "acme", "whatever the text")
    # Then acme has its own label, the others are "other", tiers and policies stay bounded
    counted = "celery_ledger_tenant_refusals_total"
    assert value(registry, counted, tier="bulk", tenant="acme", policy="shed") == 2
    assert value(registry, counted, tier="default", tenant="other", policy="reject") == 1
    assert value(registry, counted, tier="default", tenant="other", policy="block") == 1
    assert value(registry, counted, tier="unknown", tenant="acme", policy="other") == 1
    tenants = {
        s.labels["tenant"]
        for family in registry.collect()
        if family.name == "celery_ledger_tenant_refusals"
        for s in family.samples
    }
    assert tenants == {"acme", "other"}
