"""celery_ledger.pressure: the Throttle's hysteresis, and the module-level convenience."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from celery_ledger import pressure
from celery_ledger.errors import ConfigurationError
from celery_ledger.policies.throttle import Throttle, ThrottleRule


class FakePressure:
    def __init__(self) -> None:
        self.p95: float | None = None
        self.calls = 0

    def p95_ms(self) -> float | None:
        self.calls += 1
        return self.p95


class FakeDepths:
    queues = ("critical", "default", "bulk")

    def __init__(self) -> None:
        self.critical = 0
        self.calls = 0

    def depth(self, queue: str) -> int:
        assert queue == "critical"
        self.calls += 1
        return self.critical


def make(rule: ThrottleRule | None = None) -> tuple[Throttle, FakePressure, FakeDepths]:
    latency, depths = FakePressure(), FakeDepths()
    throttle = Throttle(latency, depths, rule or ThrottleRule(), interval_seconds=0.0)  # type: ignore[arg-type]
    return throttle, latency, depths


def test_latency_engages_above_threshold_and_releases_at_the_resume_ratio() -> None:
    throttle, latency, _ = make()

    latency.p95 = 500.0
    assert not throttle.should_throttle()
    assert throttle.reason() is None

    latency.p95 = 812.0
    assert throttle.should_throttle()
    assert throttle.reason() == "foreground p95 812ms > 500ms"

    latency.p95 = 400.0  # below the threshold, above 70% of it: held
    assert throttle.should_throttle()
    assert throttle.reason() == "foreground p95 400ms > resume 350ms"

    latency.p95 = 350.0
    assert not throttle.should_throttle()
    assert throttle.reason() is None

    latency.p95 = 400.0  # released: only the threshold engages again
    assert not throttle.should_throttle()


def test_critical_backlog_engages_and_releases() -> None:
    throttle, _, depths = make()

    depths.critical = 340
    assert throttle.should_throttle()
    assert throttle.reason() == "critical backlog 340 > 100"

    depths.critical = 71
    assert throttle.should_throttle()
    depths.critical = 70
    assert not throttle.should_throttle()


def test_release_needs_both_signals_low() -> None:
    throttle, latency, depths = make()

    latency.p95, depths.critical = 900.0, 500
    assert throttle.should_throttle()
    assert throttle.reason() == "foreground p95 900ms > 500ms; critical backlog 500 > 100"

    latency.p95 = 10.0  # latency recovered, backlog still above the resume level
    depths.critical = 80
    assert throttle.should_throttle()
    assert throttle.reason() == "critical backlog 80 > resume 70"

    depths.critical = 0
    assert not throttle.should_throttle()


def test_no_samples_and_disabled_signals_do_not_throttle() -> None:
    throttle, latency, depths = make(ThrottleRule(latency_threshold_ms=None, critical_backlog=None))
    depths.critical = 10**6
    latency.p95 = 10**6

    assert not throttle.should_throttle()
    assert latency.calls == depths.calls == 0

    throttle, latency, _ = make()
    assert latency.p95 is None
    assert not throttle.should_throttle()


def test_decision_is_reused_within_the_interval() -> None:
    latency, depths, now = FakePressure(), FakeDepths(), [0.0]
    throttle = Throttle(
        latency,  # type: ignore[arg-type]
        depths,  # type: ignore[arg-type]
        ThrottleRule(),
        interval_seconds=1.0,
        clock=lambda: now[0],
    )
    latency.p95 = 900.0

    assert all(throttle.should_throttle() for _ in range(100))
    latency.p95 = 0.0
    assert throttle.should_throttle()
    assert latency.calls == 1

    now[0] = 1.0
    assert not throttle.should_throttle()
    assert latency.calls == 2


def test_rule_and_queue_are_validated() -> None:
    with pytest.raises(ConfigurationError):
        ThrottleRule(resume_ratio=0.0)
    with pytest.raises(ConfigurationError):
        ThrottleRule(critical_backlog=-1)
    with pytest.raises(ConfigurationError):
        Throttle(FakePressure(), FakeDepths(), ThrottleRule(), critical_queue="vip")  # type: ignore[arg-type]


@pytest.fixture
def unconfigured(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(pressure, "_default", None)
    monkeypatch.delenv("LEDGER_BROKER_URL", raising=False)
    yield
    if pressure._default is not None:
        pressure._default.close()


@pytest.mark.usefixtures("unconfigured")
def test_report_latency_needs_configure_or_the_broker_url() -> None:
    with pytest.raises(ConfigurationError, match="LEDGER_BROKER_URL"):
        pressure.report_latency(12.0)


@pytest.mark.usefixtures("unconfigured")
def test_report_latency_logs_broker_errors_instead_of_raising(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LEDGER_BROKER_URL", "redis://127.0.0.1:1/0")  # nothing listens there

    with caplog.at_level(logging.WARNING, logger="celery_ledger.pressure"):
        pressure.report_latency(12.0)  # no broker round trip: buffered
        pressure.report_latency(13.0)
        assert pressure._default is not None
        for _ in range(2):  # what the flusher thread does each second
            pressure._default.flush_quietly()
            pressure.report_latency(14.0)

    assert [r.message.startswith("cannot report latency") for r in caplog.records] == [True]
    with pytest.raises(ValueError):
        pressure.report_latency(float("nan"))
