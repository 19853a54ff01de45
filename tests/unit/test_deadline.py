"""Deadlines, bounded calls and hedged calls: a slow dependency does not hold the caller past its
budget, the first answer wins, errors come through, and deadlines nest."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from celery_ledger import DeadlineExceeded, bounded, deadline, hedged, remaining
from celery_ledger.errors import ConfigurationError
from celery_ledger.policies.retry import classify


def slow(seconds: float, value: Any = "slow") -> Any:
    time.sleep(seconds)
    return value


def test_a_bounded_call_stops_waiting_at_its_bound() -> None:
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="no answer within"):
        bounded(slow, 5.0, seconds=0.2)
    assert time.monotonic() - started < 2.0  # the caller is free; the call goes on elsewhere


def test_a_bounded_call_returns_its_answer_or_raises_its_error() -> None:
    assert bounded(slow, 0.01, "fast", seconds=2.0) == "fast"

    def broken() -> None:
        raise KeyError("nope")

    with pytest.raises(KeyError):
        bounded(broken, seconds=2.0)


def test_without_a_bound_a_call_is_a_plain_call_in_this_thread() -> None:
    assert remaining() is None
    assert bounded(threading.get_ident) == threading.get_ident()


def test_deadlines_nest_and_an_inner_one_never_extends_an_outer_one() -> None:
    with deadline(0.3):
        outer = remaining()
        with deadline(60):
            inner = remaining()
            assert inner is not None and outer is not None and inner <= outer
            with pytest.raises(DeadlineExceeded):
                bounded(slow, 5.0)  # bound by the outer 0.3 s
        with deadline(0.05):
            assert (remaining() or 0) <= 0.05
    assert remaining() is None


def test_a_call_made_after_the_deadline_passed_is_not_made() -> None:
    calls = []
    with deadline(0.01):
        time.sleep(0.05)
        with pytest.raises(DeadlineExceeded, match="had passed"):
            bounded(calls.append, 1)
    assert calls == []


def test_the_deadline_reaches_the_helper_thread() -> None:
    with deadline(1.0):
        seen = bounded(remaining, seconds=5.0)
    assert seen is not None and 0 < seen <= 1.0


def test_a_hedged_call_keeps_the_primary_when_it_answers_in_time() -> None:
    alternates = []
    result = hedged(lambda: "primary", lambda: alternates.append(1) or "alt", after=0.5)
    assert result == "primary" and alternates == []


def test_a_hedged_call_takes_the_alternate_when_the_primary_is_slow() -> None:
    started = time.monotonic()
    assert hedged(lambda: slow(3.0, "primary"), lambda: "alt", after=0.1) == "alt"
    assert time.monotonic() - started < 1.5


def test_a_hedged_call_starts_the_alternate_at_once_when_the_primary_fails() -> None:
    def broken() -> str:
        raise ConnectionError("down")

    started = time.monotonic()
    assert hedged(broken, lambda: "alt", after=5.0) == "alt"
    assert time.monotonic() - started < 1.0


def test_when_both_fail_the_primarys_error_is_raised() -> None:
    def primary() -> str:
        raise ConnectionError("primary down")

    def alternate() -> str:
        raise TimeoutError("alternate slow")

    with pytest.raises(ConnectionError, match="primary down"):
        hedged(primary, alternate, after=0.0)


def test_a_hedged_call_is_bounded_by_the_deadline() -> None:
    with deadline(0.2), pytest.raises(DeadlineExceeded):
        hedged(lambda: slow(3.0), lambda: slow(3.0), after=0.05)


def test_a_missed_deadline_is_retried_by_default() -> None:
    assert classify(DeadlineExceeded("no answer"))  # a TimeoutError


def test_nonsense_bounds_are_refused() -> None:
    with pytest.raises(ConfigurationError), deadline(0):
        pass
    with pytest.raises(ConfigurationError):
        bounded(slow, 0.0, seconds=-1)
    with pytest.raises(ConfigurationError):
        hedged(lambda: 1, lambda: 2, after=-0.1)
