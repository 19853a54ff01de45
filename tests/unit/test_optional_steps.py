"""Optional steps: skipped and recorded as skipped, not failed, when their dependency is down or
the attempt's time budget is short; a step that is wrong still fails; the skip is for good."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from celery_ledger.errors import CircuitOpen, ConfigurationError
from celery_ledger.progress import Execution
from tests.fakes import MemoryLedger

RECORD = "r-1"


def attempt(ledger: MemoryLedger, *, time_limit: float | None = None) -> Execution:
    claim = ledger.claim(RECORD, task="t", key="k", tier="default", owner="w")
    heartbeat: Any = SimpleNamespace(lost=False, shutdown_requested=False)
    return Execution(ledger, RECORD, claim.fence, heartbeat, 60.0, time_limit=time_limit)


def release(ledger: MemoryLedger, execution: Execution) -> None:
    """End the attempt without an outcome (a retry), so that the next one can claim."""
    ledger.docs[RECORD]["claimable_at"] = ledger.now()


def down() -> Any:
    raise CircuitOpen("enrichment", None)


@pytest.mark.parametrize(
    "failure",
    [CircuitOpen("enrichment", None), ConnectionRefusedError("refused"), TimeoutError("slow")],
)
def test_an_optional_step_whose_dependency_is_down_is_skipped_and_recorded(
    failure: BaseException,
) -> None:
    ledger = MemoryLedger()
    execution = attempt(ledger)

    def call() -> Any:
        raise failure

    result = execution.step("enrich", optional=True, default={"score": None}).run(call)

    assert result == {"score": None}
    saved = ledger.find_raw(RECORD)["steps"]["enrich"]  # type: ignore[index]
    assert saved["skipped"].startswith("dependency down")
    assert "refused" not in saved["skipped"] and "slow" not in saved["skipped"]  # no error text


def test_a_skipped_step_stays_skipped_for_the_job() -> None:
    ledger = MemoryLedger()
    first = attempt(ledger)
    first.step("enrich", optional=True, default=0).run(down)
    release(ledger, first)

    # A later attempt (a retry, a replay) gets the default; the dependency is not called
    later = attempt(ledger)
    called = []
    step = later.step("enrich", optional=True, default=0)
    assert step.run(lambda: called.append(1) or 5) == 0
    assert called == [] and step.skipped.startswith("dependency down")


def test_a_step_that_is_wrong_still_fails_the_job() -> None:
    ledger = MemoryLedger()
    execution = attempt(ledger)

    def wrong() -> Any:
        raise ValueError("bad data")

    with pytest.raises(ValueError, match="bad data"):
        execution.step("enrich", optional=True).run(wrong)
    assert "enrich" not in (ledger.find_raw(RECORD) or {}).get("steps", {})


def test_a_required_step_whose_dependency_is_down_fails_as_before() -> None:
    execution = attempt(MemoryLedger())
    with pytest.raises(CircuitOpen):
        execution.step("charge").run(down)


def test_an_optional_step_is_skipped_when_the_time_budget_is_short() -> None:
    ledger = MemoryLedger()
    execution = attempt(ledger, time_limit=5.0)
    called = []

    result = execution.step("report", optional=True, needs_seconds=30, default="later").run(
        lambda: called.append(1) or "full"
    )

    assert result == "later" and called == []
    assert "time budget" in ledger.find_raw(RECORD)["steps"]["report"]["skipped"]  # type: ignore[index]
    # with time enough it runs
    roomy = Execution(ledger, RECORD, execution.fence, execution.heartbeat, 60.0, time_limit=60)
    assert roomy.step("other", optional=True, needs_seconds=30).run(lambda: "ran") == "ran"


def test_a_with_block_skips_on_a_dependency_error_and_the_job_goes_on() -> None:
    ledger = MemoryLedger()
    execution = attempt(ledger)
    with execution.step("notify", optional=True, skip_on=(KeyError,)) as step:
        raise KeyError("mail service")
    assert step.skipped == "dependency down: KeyError"
    assert ledger.find_raw(RECORD)["steps"]["notify"]["skipped"]  # type: ignore[index]


def test_options_that_make_no_sense_are_refused() -> None:
    execution = attempt(MemoryLedger())
    with pytest.raises(ConfigurationError):
        execution.step("x", needs_seconds=3)  # not optional
    with pytest.raises(ConfigurationError), execution.step("y", optional=True, needs_seconds=3):
        pass  # a with block cannot be skipped before it runs


def test_remaining_seconds_counts_down_from_the_soft_time_limit() -> None:
    execution = attempt(MemoryLedger(), time_limit=10.0)
    left = execution.remaining_seconds()
    assert left is not None and 9.0 < left <= 10.0
    time.sleep(0.01)
    assert execution.remaining_seconds() < left  # type: ignore[operator]
    assert attempt(MemoryLedger()).remaining_seconds() is None


def test_a_with_block_step_is_a_span_of_its_own_ended_with_its_outcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from contextlib import contextmanager

    from celery_ledger import tracecontext

    spans: list[tuple[str, str]] = []

    @contextmanager
    def span(name: str, attributes: Any) -> Any:
        try:
            yield None
        except BaseException as exc:
            spans.append((name, type(exc).__name__))
            raise
        spans.append((name, "ok"))

    monkeypatch.setattr(tracecontext.HOOKS, "span", span)
    execution = attempt(MemoryLedger())

    with execution.step("reserve") as step:
        step.result = "r-1"
    with execution.step("enrich", optional=True, default=0):
        down()
    with pytest.raises(ValueError), execution.step("charge"):
        raise ValueError("bug")

    assert spans == [("step reserve", "ok"), ("step enrich", "ok"), ("step charge", "ValueError")]


@pytest.mark.parametrize("kind", ["block", "run"])
def test_the_platforms_own_outage_fails_the_attempt_and_never_skips_the_step(kind: str) -> None:
    """A publish the broker refused during a failover (NotReplicated, a ConnectionError) or a
    full tier passes in seconds: skipping the step for it would lose its effect for good."""
    from celery_ledger.errors import Backpressure, NotReplicated
    from celery_ledger.publish_checks import PUBLISH_OUTAGES

    ledger = MemoryLedger()
    claim = ledger.claim(RECORD, task="t", key="k", tier="default", owner="w")
    heartbeat: Any = SimpleNamespace(lost=False, shutdown_requested=False)
    execution = Execution(ledger, RECORD, claim.fence, heartbeat, 60.0, outages=PUBLISH_OUTAGES)
    for refused in (NotReplicated("1 of 1 replicas did not confirm"), Backpressure("bulk", 11, 10)):

        def notify(refused: Exception = refused) -> Any:
            raise refused  # (a child's delay() inside the step)

        step = execution.step("notify", optional=True, default=None)
        with pytest.raises(type(refused)):
            if kind == "run":
                step.run(notify)
            else:
                with step:
                    notify()
        assert "notify" not in (ledger.find_raw(RECORD) or {}).get("steps", {})

    # (a step that names it in skip_on still skips for it: the task's author chose so)
    def refused_again() -> Any:
        raise NotReplicated("again")

    named = execution.step("notify", optional=True, skip_on=(NotReplicated,))
    assert named.run(refused_again) is None
    assert ledger.find_raw(RECORD)["steps"]["notify"]["skipped"]  # type: ignore[index]
