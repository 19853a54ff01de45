"""What a person reads of an unreachable ledger: the servers' errors and the timeout, not
pymongo's description of the whole topology (a screenful for a replica set, once in every line
of ``ledger health`` and in the clock's warning)."""

from __future__ import annotations

import socket

import pytest
from pymongo import MongoClient
from pymongo.errors import ServerSelectionTimeoutError

from celery_ledger.errors import NotApplied, brief
from celery_ledger.ledger.core import translate_errors


@pytest.fixture
def unreachable() -> ServerSelectionTimeoutError:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client: MongoClient[dict[str, object]] = MongoClient(
        f"mongodb://127.0.0.1:{port},127.0.0.1:{port + 1}/?replicaSet=rs",
        serverSelectionTimeoutMS=50,
        connectTimeoutMS=50,
    )
    try:
        with pytest.raises(ServerSelectionTimeoutError) as raised:
            client.admin.command("ping")
    finally:
        client.close()
    assert "Topology Description" in str(raised.value)  # (what pymongo says)
    return raised.value


def test_brief_keeps_what_failed_and_drops_the_topology(
    unreachable: ServerSelectionTimeoutError,
) -> None:
    text = brief(unreachable)
    assert "Topology Description" not in text and "ServerDescription" not in text
    assert "127.0.0.1" in text and "Timeout" in text  # which servers, and how long it waited
    assert brief(ValueError("plain")) == "plain"


def test_the_ledger_error_of_an_unreachable_server_is_brief(
    unreachable: ServerSelectionTimeoutError,
) -> None:
    with pytest.raises(NotApplied) as translated, translate_errors("ping"):
        raise unreachable
    assert str(translated.value).startswith("ledger unreachable during ping: ")
    assert "Topology Description" not in str(translated.value)
