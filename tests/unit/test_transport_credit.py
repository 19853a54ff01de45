"""How long a drain without an event loop may wait on its sockets (``poller.poll_timeout``),
and how often its poller sweeps for unacknowledged messages while it rechecks credit."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from celery_ledger.poller import (
    CREDIT_RECHECK_SECONDS,
    RESTORE_CALL_SECONDS,
    MultiChannelPoller,
    poll_timeout,
)


@dataclass
class _QoS:
    credit: bool

    def can_consume(self) -> bool:
        return self.credit


@dataclass
class _Channel:
    credit: bool
    active_queues: set[str] = field(default_factory=lambda: {"q"})

    @property
    def qos(self) -> _QoS:
        return _QoS(self.credit)


@pytest.mark.parametrize("timeout", [2.0, 1.0, None])
def test_a_channel_with_credit_waits_as_asked(timeout: float | None) -> None:
    assert poll_timeout([_Channel(credit=True)], timeout) == timeout
    assert poll_timeout([], timeout) == timeout


@pytest.mark.parametrize(
    ("timeout", "wait"),
    [(2.0, CREDIT_RECHECK_SECONDS), (None, CREDIT_RECHECK_SECONDS), (0.001, 0.001)],
)
def test_a_consuming_channel_without_credit_rechecks_soon(
    timeout: float | None, wait: float
) -> None:
    channels = [_Channel(credit=True), _Channel(credit=False)]
    assert poll_timeout(channels, timeout) == wait


def test_a_channel_that_consumes_nothing_does_not_shorten_the_wait() -> None:
    assert poll_timeout([_Channel(credit=False, active_queues=set())], 2.0) == 2.0


@dataclass(eq=False)
class _Sweeping:
    sweeps: list[int] = field(default_factory=list)
    active_queues: set[str] = field(default_factory=lambda: {"q"})
    unacked_restore_limit: None = None
    unacked_restore_throttle: int = 10
    connection_errors: tuple[type[BaseException], ...] = ()

    @property
    def qos(self) -> _Sweeping:
        return self

    def restore_visible(self, num: object = None, interval: int = 10) -> None:
        self.sweeps.append(interval)


def test_rechecks_do_not_multiply_the_sweeps_for_unacknowledged_messages() -> None:
    # Given a poller ending a wait every few milliseconds (credit out, as above)
    poller = MultiChannelPoller()
    channel = _Sweeping()
    poller._channels = {channel}  # type: ignore[assignment]
    poller._in_protected_read = True  # as kombu's get() sets it around its wait
    for _ in range(50):
        poller.maybe_restore_messages()
    # Then kombu's sweep is asked once, not once a wait (it scans on every tenth ask)
    assert channel.sweeps == [10]
    # And again once the drains' own cadence has passed
    poller._restore_called_at -= RESTORE_CALL_SECONDS
    poller.maybe_restore_messages()
    assert channel.sweeps == [10, 10]
    # An event loop's timer (outside a drain's wait) asks at its own interval, unspaced
    poller._in_protected_read = False
    poller.maybe_restore_messages()
    poller.maybe_restore_messages()
    assert channel.sweeps == [10, 10, 10, 10]
