"""Where the reference app's fake outside world records what happened (to count effects).

A real app would call a payment gateway or a mail provider; the demo and the tests need to
see each effect, so the fakes write one document per effect into MongoDB.
"""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime
from typing import Any

from pymongo import MongoClient
from pymongo.client_session import ClientSession
from pymongo.collection import Collection

_lock = threading.Lock()
_clients: dict[int, MongoClient[dict[str, Any]]] = {}


def effects() -> Collection[dict[str, Any]]:
    """The ``effects`` collection (one client per process: pool processes are forked)."""
    pid = os.getpid()
    with _lock:
        if pid not in _clients:
            uri = os.environ.get("LEDGER_MONGO_URI", "mongodb://127.0.0.1:27017/")
            _clients[pid] = MongoClient(uri, tz_aware=True)
        return _clients[pid].get_database("reference_world").get_collection("effects")


def close_clients() -> None:
    """Close this process's client (tests call it at the end of a session)."""
    with _lock:
        client = _clients.pop(os.getpid(), None)
    if client is not None:
        client.close()


def record_effect_in(session: ClientSession, kind: str, key: str, **details: Any) -> None:
    """Record an effect inside ``session``'s transaction (an atomic step: see LedgerTask.step).

    The session belongs to the ledger's client, so the write goes through that client; the
    ``reference_world`` database lives on the ledger's deployment.
    """
    world = session.client.get_database("reference_world").get_collection("effects")
    world.insert_one(
        {"kind": kind, "key": key, "at": datetime.now(UTC), "pid": os.getpid(), **details},
        session=session,
    )


def record_effect(kind: str, key: str, **details: Any) -> None:
    effects().insert_one(
        {"kind": kind, "key": key, "at": datetime.now(UTC), "pid": os.getpid(), **details}
    )
