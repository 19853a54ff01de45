"""How long a drain without an event loop may wait on its sockets (``transport.poll_timeout``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from celery_ledger.transport import CREDIT_RECHECK_SECONDS, poll_timeout


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
