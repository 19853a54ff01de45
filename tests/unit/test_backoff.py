"""celery_ledger.policies.backoff: exponential backoff with full, decorrelated or no jitter."""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_ledger.policies.backoff import backoff_seconds
from celery_ledger.policies.retry import retry_after_seconds

# Realistic delays: a base of a microsecond up to minutes (or none), a cap up to ~4 months.
bases = st.just(0.0) | st.floats(min_value=1e-6, max_value=300.0)
caps = st.floats(min_value=0.0, max_value=1e7)
attempts = st.integers(min_value=0, max_value=200)
seeds = st.integers(min_value=0, max_value=2**32 - 1)
jitters = st.sampled_from(["full", "decorrelated", "none"])


def ceiling(attempt: int, base: float, cap: float) -> float:
    """``min(cap, base * 2**attempt)`` computed exactly (no float overflow)."""
    return float(min(Fraction(cap), Fraction(base) * 2**attempt))


@given(attempts, bases, caps, seeds)
def test_full_jitter_stays_between_zero_and_the_ceiling(
    attempt: int, base: float, cap: float, seed: int
) -> None:
    delay = backoff_seconds(attempt, base_seconds=base, cap_seconds=cap, rng=random.Random(seed))

    assert 0.0 <= delay <= ceiling(attempt, base, cap)


@given(attempts, bases, caps)
def test_no_jitter_is_exactly_the_ceiling(attempt: int, base: float, cap: float) -> None:
    delay = backoff_seconds(attempt, base_seconds=base, cap_seconds=cap, jitter="none")

    assert delay == ceiling(attempt, base, cap)


def test_no_jitter_doubles_until_the_cap() -> None:
    delays = [
        backoff_seconds(n, base_seconds=0.5, cap_seconds=10.0, jitter="none") for n in range(7)
    ]

    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


@given(attempts, bases, caps, st.floats(min_value=0.0, max_value=1e8), seeds)
def test_decorrelated_jitter_stays_between_base_and_cap(
    attempt: int, base: float, cap: float, previous: float, seed: int
) -> None:
    cap = max(cap, base)

    delay = backoff_seconds(
        attempt,
        base_seconds=base,
        cap_seconds=cap,
        jitter="decorrelated",
        previous_seconds=previous,
        rng=random.Random(seed),
    )

    assert base <= delay <= cap


@given(bases, st.floats(min_value=1.0, max_value=1e3), caps, seeds)
def test_decorrelated_jitter_grows_at_most_threefold(
    base: float, factor: float, cap: float, seed: int
) -> None:
    previous = base * factor  # a previous delay is never below base
    cap = max(cap, 3 * previous)

    delay = backoff_seconds(
        3,
        base_seconds=base,
        cap_seconds=cap,
        jitter="decorrelated",
        previous_seconds=previous,
        rng=random.Random(seed),
    )

    assert base <= delay <= 3 * previous


def test_decorrelated_jitter_without_a_previous_delay_starts_from_base() -> None:
    rng = random.Random(7)
    delays = [
        backoff_seconds(0, base_seconds=2.0, cap_seconds=100.0, jitter="decorrelated", rng=rng)
        for _ in range(200)
    ]

    assert all(2.0 <= d <= 6.0 for d in delays)


@pytest.mark.parametrize("jitter", ["full", "decorrelated", "none"])
@pytest.mark.parametrize("attempt", [63, 64, 65, 1023, 1024, 1025, 5000, 10_000])
def test_huge_attempts_never_overflow_or_exceed_the_cap(jitter: str, attempt: int) -> None:
    delay = backoff_seconds(
        attempt,
        base_seconds=1.0,
        cap_seconds=300.0,
        jitter=jitter,  # type: ignore[arg-type]
        previous_seconds=300.0,
        rng=random.Random(attempt),
    )

    assert 0.0 <= delay <= 300.0
    if jitter == "none":
        assert delay == 300.0


@given(st.integers(min_value=0, max_value=10_000), bases, caps, jitters, seeds)
def test_cap_is_never_exceeded(
    attempt: int, base: float, cap: float, jitter: str, seed: int
) -> None:
    delay = backoff_seconds(
        attempt,
        base_seconds=base,
        cap_seconds=cap,
        jitter=jitter,  # type: ignore[arg-type]
        rng=random.Random(seed),
    )

    assert delay <= cap


@pytest.mark.parametrize(
    ("attempt", "base", "cap"),
    [(-1, 1.0, 10.0), (0, -0.5, 10.0), (0, 1.0, -1.0)],
    ids=["attempt", "base", "cap"],
)
@pytest.mark.parametrize("jitter", ["full", "decorrelated", "none"])
def test_negative_inputs_are_refused(attempt: int, base: float, cap: float, jitter: str) -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        backoff_seconds(attempt, base_seconds=base, cap_seconds=cap, jitter=jitter)  # type: ignore[arg-type]


def test_full_jitter_spreads_over_the_whole_range() -> None:
    rng = random.Random(20240601)
    delays = [backoff_seconds(3, base_seconds=1.0, cap_seconds=100.0, rng=rng) for _ in range(1000)]

    # ceiling is 8 s: draws land in both the lowest and the highest quarter, and not all alike.
    assert min(delays) < 2.0
    assert max(delays) > 6.0
    assert len(set(delays)) > 900
    assert 3.0 < sum(delays) / len(delays) < 5.0


def test_same_seed_gives_the_same_delays() -> None:
    def run(seed: int) -> list[float]:
        rng = random.Random(seed)
        return [backoff_seconds(n, base_seconds=0.1, cap_seconds=30.0, rng=rng) for n in range(20)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_sub_second_base_works() -> None:
    delay = backoff_seconds(0, base_seconds=0.05, cap_seconds=1.0, rng=random.Random(1))

    assert 0.0 <= delay <= 0.05


def test_no_jitter_reaches_the_cap_even_for_a_tiny_base() -> None:
    assert backoff_seconds(100, base_seconds=1e-30, cap_seconds=1.0, jitter="none") == 1.0


@pytest.mark.parametrize("hint", [float("inf"), float("nan"), 10**400, "soon", -3])
def test_a_retry_after_hint_that_is_no_time_is_ignored_or_floored(hint: Any) -> None:
    class Throttled(ConnectionError):
        retry_after = hint

    seconds = retry_after_seconds(Throttled())
    assert seconds == (0.0 if hint == -3 else None)


class _BadFloat:
    def __float__(self) -> float:
        raise KeyError("Retry-After")


class _HeaderMissing(ConnectionError):
    @property
    def retry_after(self) -> float:  # (an HTTP error reading a header it was not given)
        raise KeyError("Retry-After")


class _HintNotAFloat(ConnectionError):
    retry_after = _BadFloat()


@pytest.mark.parametrize(
    "exc", [_HeaderMissing(), _HintNotAFloat()], ids=lambda e: type(e).__name__
)
def test_a_retry_after_hint_that_cannot_be_read_is_ignored(exc: BaseException) -> None:
    assert retry_after_seconds(exc) is None
