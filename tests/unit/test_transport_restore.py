"""kombu's sweep of unacknowledged messages runs only where ``LEDGER_RESTORE_UNACKED`` is on."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from kombu.transport import redis as kombu_redis

from celery_ledger import Settings, create_app
from celery_ledger.transport import QoS


@pytest.mark.parametrize("restore", [True, False])
def test_the_sweep_runs_only_where_restoring_is_on(
    restore: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    swept: list[Any] = []
    monkeypatch.setattr(kombu_redis.QoS, "restore_visible", lambda self, *a, **k: swept.append(a))
    channel = SimpleNamespace(ledger_restore_visible=restore, do_restore=False)
    QoS(channel).restore_visible(0, 10)
    assert swept == ([(0, 10)] if restore else [])


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
