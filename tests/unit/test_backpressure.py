"""celery_ledger.policies.backpressure: cached queue depths and per-tier high-water marks."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_ledger.errors import Backpressure as BackpressureError
from celery_ledger.errors import ConfigurationError, PublishError
from celery_ledger.policies.backpressure import BackpressureGate, QueueDepths, TierLimit
from celery_ledger.routing import TIERS


class FakePipeline:
    def __init__(self, broker: FakeBroker) -> None:
        self.broker = broker
        self.queued: list[str] = []

    def llen(self, name: str) -> None:
        self.queued.append(name)

    def get(self, name: str) -> None:
        self.queued.append(name)  # a queue's tenants' waiting count (fairness.py)

    def execute(self) -> list[int]:
        self.broker.round_trips += 1
        time.sleep(self.broker.latency)
        return [self.broker.lengths.get(name, 0) for name in self.queued]


class FakeBroker:
    """Just enough of ``redis.Redis`` for QueueDepths; counts pipelined round trips."""

    def __init__(self, latency: float = 0.0, **lengths: int) -> None:
        self.lengths = dict(lengths)
        self.round_trips = 0
        self.latency = latency

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        assert transaction is False
        return FakePipeline(self)


class FakeClock:
    """A monotonic clock that only moves when slept on; ``on_sleep`` runs after each sleep."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.on_sleep: Callable[[], None] = lambda: None

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        self.on_sleep()


def make(
    limit: TierLimit, depth: int = 0, ttl: float = 0.0, **kwargs: Any
) -> tuple[BackpressureGate, FakeBroker, FakeClock]:
    broker, clock = FakeBroker(bulk=depth), FakeClock()
    depths = QueueDepths(broker, TIERS, ttl_seconds=ttl, clock=clock)  # type: ignore[arg-type]
    gate = BackpressureGate(
        depths, {"bulk": limit}, sleep=clock.sleep, clock=clock, poll_seconds=0.1, **kwargs
    )
    return gate, broker, clock


def test_depths_are_sampled_at_most_once_per_ttl() -> None:
    broker, clock = FakeBroker(critical=3, default=7), FakeClock()
    depths = QueueDepths(broker, TIERS, ttl_seconds=1.0, clock=clock)  # type: ignore[arg-type]

    assert depths.depths() == {"critical": 3, "default": 7, "bulk": 0}
    broker.lengths["critical"] = 50
    assert [depths.depth("critical") for _ in range(1000)] == [3] * 1000
    assert broker.round_trips == 1

    clock.now += 1.0
    assert depths.depth("critical") == 50
    assert broker.round_trips == 2
    depths.refresh()
    assert broker.round_trips == 3

    with pytest.raises(KeyError):
        depths.depth("nope")
    assert QueueDepths(broker, "bulk").queues == ("bulk",)  # type: ignore[arg-type]


def test_concurrent_callers_share_one_sample() -> None:
    broker = FakeBroker(latency=0.05, bulk=4)
    depths = QueueDepths(broker, TIERS, ttl_seconds=60.0)  # type: ignore[arg-type]
    seen: list[int] = []

    def read() -> None:
        seen.extend(depths.depth("bulk") for _ in range(50))

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert seen == [4] * 400
    assert broker.round_trips == 1


def test_low_water_defaults_to_ninety_percent_and_is_validated() -> None:
    assert TierLimit(100, "reject").release_depth == 90
    assert TierLimit(100, "reject", low_water=50).release_depth == 50
    assert TierLimit(None, "reject").release_depth is None
    with pytest.raises(ConfigurationError):
        TierLimit(100, "reject", low_water=101)
    with pytest.raises(ConfigurationError):
        TierLimit(100, "drop")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        BackpressureGate(QueueDepths(FakeBroker(), ["bulk"]), {"critical": TierLimit(1, "shed")})  # type: ignore[arg-type]


def test_reject_engages_above_high_water_and_releases_at_low_water() -> None:
    gate, broker, _ = make(TierLimit(100, "reject"), depth=100)

    assert gate.check("bulk") == "publish"  # at the mark is not above it
    broker.lengths["bulk"] = 101
    with pytest.raises(BackpressureError) as raised:
        gate.check("bulk")
    assert (raised.value.tier, raised.value.depth, raised.value.high_water) == ("bulk", 101, 100)
    assert "'bulk'" in str(raised.value) and "101" in str(raised.value)
    assert isinstance(raised.value, PublishError)

    broker.lengths["bulk"] = 95  # below high water, still above low water: stays engaged
    with pytest.raises(BackpressureError):
        gate.check("bulk")
    assert gate.engaged("bulk")

    broker.lengths["bulk"] = 90
    assert gate.check("bulk") == "publish"
    assert not gate.engaged("bulk")
    broker.lengths["bulk"] = 99  # released: only above high water engages again
    assert gate.check("bulk") == "publish"


def test_work_that_can_wait_is_held_above_the_mark_and_let_go_when_nobody_can_tell() -> None:
    gate, broker, _ = make(TierLimit(100, "block"), depth=101)

    assert gate.holds("bulk") and not gate.holds("critical")  # critical has no mark
    broker.lengths["bulk"] = 95  # hysteresis, as for a publish
    assert gate.holds("bulk")
    broker.lengths["bulk"] = 90
    assert not gate.holds("bulk")

    class Away(FakeBroker):
        def pipeline(self, transaction: bool = True) -> FakePipeline:
            raise ConnectionError("broker away")

    depths = QueueDepths(Away(), TIERS, ttl_seconds=0)  # type: ignore[arg-type]
    away = BackpressureGate(depths, {"bulk": TierLimit(100, "block")})
    assert not away.holds("bulk")  # a depth nobody can read holds nothing for good


def test_shed_counts_and_calls_back_until_released() -> None:
    shed: list[str] = []
    gate, broker, _ = make(TierLimit(10, "shed", low_water=5), depth=11, on_shed=shed.append)

    assert [gate.check("bulk") for _ in range(3)] == ["shed"] * 3
    broker.lengths["bulk"] = 6
    assert gate.check("bulk") == "shed"
    broker.lengths["bulk"] = 5
    assert gate.check("bulk") == "publish"

    assert shed == ["bulk"] * 4
    assert gate.shed_counts == {"bulk": 4}


def test_block_waits_until_depth_falls_to_low_water() -> None:
    gate, broker, clock = make(TierLimit(100, "block", block_timeout_seconds=5.0), depth=150)

    def drain() -> None:
        broker.lengths["bulk"] -= 20  # 130, 110, 90

    clock.on_sleep = drain

    assert gate.check("bulk") == "publish"
    assert broker.lengths["bulk"] == 90
    assert clock.sleeps == [0.1, 0.1, 0.1]
    assert not gate.engaged("bulk")


def test_block_raises_after_the_timeout_and_samples_once_per_ttl() -> None:
    gate, broker, clock = make(
        TierLimit(100, "block", block_timeout_seconds=2.0), depth=95, ttl=1.0
    )
    broker.lengths["bulk"] = 101
    gate.depths.refresh()

    with pytest.raises(BackpressureError) as raised:
        gate.check("bulk")

    assert clock.now == pytest.approx(2.0)
    assert raised.value.depth == 101
    assert broker.round_trips <= 3  # one sample per second of waiting, not one per poll (20)
    assert gate.engaged("bulk")


def test_block_with_zero_timeout_raises_at_once() -> None:
    gate, _, clock = make(TierLimit(1, "block", block_timeout_seconds=0.0), depth=2)

    with pytest.raises(BackpressureError):
        gate.check("bulk")
    assert clock.sleeps == []


def test_unlimited_tiers_publish_without_sampling() -> None:
    gate, broker, _ = make(TierLimit(None, "reject"), depth=10**6)

    assert gate.check("bulk") == "publish"
    assert gate.check("critical") == "publish"
    assert broker.round_trips == 0


def test_the_error_pickles() -> None:
    error = pickle.loads(pickle.dumps(BackpressureError("bulk", 7, 5)))

    assert (error.tier, error.depth, error.high_water) == ("bulk", 7, 5)
    assert str(error) == str(BackpressureError("bulk", 7, 5))
