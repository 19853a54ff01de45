"""kombu's sweep of unacknowledged messages runs only where ``LEDGER_RESTORE_UNACKED`` is on."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from celery_ledger import Settings, create_app
from celery_ledger.transport import QoS


class Swept(Exception):
    """The sweep reached the broker."""


@pytest.mark.parametrize("restore", [True, False])
def test_the_sweep_runs_only_where_restoring_is_on(restore: bool) -> None:
    def conn_or_acquire() -> Any:
        raise Swept

    channel = SimpleNamespace(
        ledger_restore_visible=restore, do_restore=False, conn_or_acquire=conn_or_acquire
    )
    qos = QoS(channel)
    if restore:  # (its timing on the broker's clock: tests/integration/test_clock_skew.py)
        with pytest.raises(Swept):
            qos.restore_visible(0, 10, 1)
    else:
        qos.restore_visible(0, 10, 1)


def test_the_setting_reaches_the_transport() -> None:
    for restore in (True, False):
        app = create_app(
            "unit_restore",
            settings=Settings(
                broker_url="redis://127.0.0.1:1/0",
                mongo_uri="mongodb://127.0.0.1:1/",
                restore_unacked=restore,
            ),
            set_as_current=False,
        )
        assert app.conf.broker_transport_options["ledger_restore_visible"] is restore


def test_a_channel_whose_transport_closed_under_it_fails_as_a_lost_connection() -> None:
    """After a lost broker connection Celery's consumer collects the connection (closing its
    transport), then closes it: the channel's close must fail as a connection error, which
    Celery ignores, never as an AttributeError from a transport without its connection
    details, which ended the worker."""
    import redis

    from celery_ledger.transport import Channel

    channel = Channel.__new__(Channel)
    channel._pool = None
    channel.connection = SimpleNamespace(client=None)  # (kombu's closed transport)
    with pytest.raises(redis.exceptions.ConnectionError), channel.conn_or_acquire():
        pass
