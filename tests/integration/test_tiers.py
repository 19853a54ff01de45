"""Tiers: routing precedence, backpressure policies, bulk throttling, shared rate limits."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from pymongo import MongoClient

from celery_ledger import Backpressure, Settings, State, create_app
from celery_ledger.embedded.servers import ServerProcess, start_valkey
from celery_ledger.embedded.stack import EmbeddedStack
from celery_ledger.pressure import Pressure
from tasks.effects import effects

from .conftest import make_isolated_stack, producer_app
from .helpers import effect_count, shared_task, wait_for


@pytest.fixture
def lonely_broker(tmp_path: Path) -> Iterator[ServerProcess]:
    """A broker no worker consumes from: published messages stay where they land."""
    server = start_valkey(tmp_path / "valkey")
    try:
        yield server
    finally:
        server.stop()


def producer(broker: ServerProcess, stack: Any, **settings: Any) -> Any:
    app = create_app(
        f"producer-{uuid.uuid4().hex[:6]}",
        settings=Settings(
            broker_url=broker.url, mongo_uri=stack.ledger.url, mongo_db="tiers_tests", **settings
        ),
        set_as_current=False,
    )
    return app


def test_routing_precedence_call_then_rule_then_task_then_default(
    lonely_broker: ServerProcess, stack: Any
) -> None:
    # (dedupe on publish off: the same call is published twice, to two tiers)
    app = producer(
        lonely_broker, stack, routing_rules={"reports.*": "bulk"}, dedupe_on_publish=False
    )

    @app.task(name="reports.daily", tier="critical", shared=False)
    def daily() -> None: ...

    @app.task(name="mail.send", tier="critical", shared=False)
    def send() -> None: ...

    @app.task(name="misc.job", shared=False)
    def misc() -> None: ...

    broker = redis.Redis.from_url(lonely_broker.url)
    daily.apply_async(tier="default")  # call option beats the rule
    daily.delay()  # rule beats the task option
    send.delay()  # task option
    misc.delay()  # default tier
    assert {q: broker.llen(app.tiers.queue(q)) for q in ("critical", "default", "bulk")} == {
        "critical": 1,
        "default": 2,
        "bulk": 1,
    }


@pytest.mark.parametrize("policy", ["reject", "block", "shed"])
def test_backpressure_engages_above_the_mark_and_releases_below(
    lonely_broker: ServerProcess, stack: Any, policy: str
) -> None:
    app = producer(
        lonely_broker,
        stack,
        tier_limits={
            "default": {
                "high_water": 5,
                "low_water": 3,
                "policy": policy,
                "block_timeout_seconds": 1.0,
            }
        },
    )
    app.runtime.queue_depths.ttl_seconds = 0.0  # sample every publish, to see the exact mark

    @app.task(name=f"bp.{policy}", shared=False)
    def job(n: int) -> int:
        return n

    broker = redis.Redis.from_url(lonely_broker.url)
    queue = app.tiers.queue("default")
    for n in range(6):  # up to and over the mark: 6 > 5 engages
        job.delay(n)
    assert broker.llen(queue) == 6

    # Above the mark
    if policy == "reject":
        with pytest.raises(Backpressure, match="depth 6, high water 5"):
            job.delay(100)
    elif policy == "block":
        started = time.monotonic()
        with pytest.raises(Backpressure):
            job.delay(100)
        assert time.monotonic() - started >= 1.0
        # and a blocked producer goes through as soon as consumers drain below the low mark
        threading.Timer(0.3, lambda: [broker.rpop(queue) for _ in range(4)]).start()
        job.delay(101)
        assert broker.llen(queue) == 3
        return
    else:
        result = job.delay(100)
        record = app.ledger.get_by_id(result.id)
        assert record is not None and record.state is State.DEAD
        assert record.dead_reason.startswith("shed: tier default above its high-water mark")
        assert app.runtime.gate.shed_counts["default"] == 1
    assert broker.llen(queue) == 6

    # Between the marks it stays engaged (hysteresis); below the low mark it releases
    broker.rpop(queue)
    broker.rpop(queue)  # depth 4: above low water 3
    if policy == "reject":
        with pytest.raises(Backpressure):
            job.delay(102)
    broker.rpop(queue)  # depth 3: released
    job.delay(103)
    assert broker.llen(queue) == 4


@pytest.fixture
def throttled_stack(tmp_path: Path, stack: Any) -> Iterator[EmbeddedStack]:
    running = make_isolated_stack(tmp_path)
    try:
        running.start_worker(
            running.queues_of("bulk"),
            concurrency=2,
            name="bulk-throttle@127.0.0.1",
            env={
                "LEDGER_THROTTLE_CHECK_SECONDS": "0.2",
                "LEDGER_PRESSURE_WINDOW_SECONDS": "2",
                "LEDGER_THROTTLE_LATENCY_MS": "500",
            },
        )
        yield running
    finally:
        running.stop()


def test_bulk_throttles_under_foreground_latency_and_resumes_without_loss(
    throttled_stack: EmbeddedStack,
) -> None:
    assert throttled_stack.broker is not None
    app = producer_app(throttled_stack, "throttle-producer")  # the test app's queues

    bulk_item = shared_task(app, "tests.integration.ledger_app.bulk_item")

    pressure = Pressure(redis.Redis.from_url(throttled_stack.broker.url), window_seconds=2)
    # (enough that a loaded machine's slower throttle cannot see the bulk work all done first:
    # 150 were, once, on a machine half as fast as the last)
    tokens = [f"thr-{uuid.uuid4().hex[:8]}-{i}" for i in range(600)]
    results = [bulk_item.delay(t) for t in tokens]
    effects = MongoClient(throttled_stack.ledger.url).reference_world.effects

    def done() -> int:
        return effects.count_documents({"kind": "bulk", "key": {"$in": tokens}})

    wait_for(lambda: done() >= 10, what="bulk work under way")
    # When the foreground reports a slow p95, bulk consumption pauses
    stop = threading.Event()

    def report_slow() -> None:
        while not stop.is_set():
            pressure.report_latency(2000)
            time.sleep(0.05)

    reporter = threading.Thread(target=report_slow, daemon=True)
    reporter.start()
    log = throttled_stack.workers[0].log_path
    wait_for(
        lambda: "throttling ledger_tests.bulk" in log.read_text(),
        timeout=10,
        what="throttle engaged",
    )
    time.sleep(1.0)  # let reserved (prefetched) messages finish
    paused_at = done()
    time.sleep(1.5)
    assert done() == paused_at < len(tokens)
    # Then, once latency is back under the resume mark (old samples age out), it resumes
    stop.set()
    reporter.join()
    for _ in range(20):
        pressure.report_latency(10)
    wait_for(
        lambda: "resuming ledger_tests.bulk" in log.read_text(),
        timeout=15,
        what="throttle released",
    )
    for result in results:
        result.get(timeout=60)
    # Every bulk message ran exactly once across the cycle
    counts = [effects.count_documents({"kind": "bulk", "key": t}) for t in tokens]
    assert counts == [1] * len(tokens)


def test_a_shared_rate_limit_holds_across_worker_processes(app: Any) -> None:
    from tests.integration.ledger_app import rate_limited

    # A batch proves the bucket shared only if its jobs ran in two processes or more; which
    # process takes a job is the pool's choice (on a loaded machine one may take them all),
    # so a batch that ran in one is followed by another, each held to the limit
    pids: set[int] = set()
    for _ in range(3):
        token = uuid.uuid4().hex[:8]
        tokens = [f"{token}-{i}" for i in range(14)]
        started = time.monotonic()
        for result in [rate_limited.delay(t) for t in tokens]:
            result.get(timeout=60)
        elapsed = time.monotonic() - started
        # 4 per second with a burst of 2, whatever the number of processes: >= (14 - 2) / 4 s
        assert elapsed >= 2.7
        records = [app.ledger.get(rate_limited.name, t) for t in tokens]
        assert {r.state for r in records} == {State.SUCCEEDED}
        assert all(effect_count("limited", t) == 1 for t in tokens)
        pids = {d["pid"] for d in effects().find({"kind": "limited", "key": {"$in": tokens}})}
        if len(pids) >= 2:
            break
    assert len(pids) >= 2  # the bucket is shared, not per process
