"""The outside world the soak's task bodies act on: one document per effect, counted later.

It lives on a SecantusDB server of its own (``SOAK_WORLD_URI``) that no fault touches, so an
effect either happened or not; only the platform under test is disturbed. celery-ledger's body
writes its effect in an atomic step instead: into ``soak_world.effects`` on the ledger's server,
in the transaction that records the step (the way an app keeps effects in its own MongoDB).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from pymongo import MongoClient
from pymongo.collection import Collection

_lock = threading.Lock()
_clients: dict[int, MongoClient[dict[str, Any]]] = {}


class FlakyError(ConnectionError):
    """A retryable failure of the flaky jobs (succeeds on a later attempt)."""


class DesignedFailure(ValueError):
    """The permanent failure of the jobs designed to end dead."""


def collection(name: str) -> Collection[dict[str, Any]]:
    """``soak_world.<name>`` (one client per process: pool processes are forked)."""
    pid = os.getpid()
    with _lock:
        if pid not in _clients:
            _clients[pid] = MongoClient(os.environ["SOAK_WORLD_URI"], tz_aware=True)
        return _clients[pid].get_database("soak_world").get_collection(name)


def work(
    system: str,
    key: str,
    kind: str,
    param: float,
    fence: int | None,
    act: Callable[[dict[str, Any]], None] | None = None,
    detail: dict[str, Any] | None = None,
) -> str:
    """The body both systems run: record the attempt, fail or sleep as designed, act once,
    then record its end (``ends``: with the attempt's ``at``, each run is a span; a SIGKILL
    leaves none, and the soak ends it at the kill).

    Kinds: ``quick``; ``flaky`` (fails ``param`` times, retryable); ``permanent`` (always
    fails); ``long`` (sleeps ``param`` seconds first). ``act`` writes the effect document
    (default: into ``effects`` on the world server). ``detail`` goes with the attempt's.
    """
    started = time.time()

    def note(what: str, **more: Any) -> None:
        doc = {"system": system, "key": key, "pid": os.getpid(), "fence": fence, "at": time.time()}
        doc.update(more)
        if what == "effects" and act is not None:
            act(doc)
        else:
            collection(what).insert_one(doc)

    note("attempts", **(detail or {}))
    try:
        if kind == "flaky":
            if collection("attempts").count_documents({"system": system, "key": key}) <= param:
                raise FlakyError(f"flaky failure of {key}")
        elif kind == "permanent":
            note("failures")
            raise DesignedFailure(f"designed failure of {key}")
        elif kind == "long":
            time.sleep(param)
        note("effects")
    finally:
        note("ends", started=started)
    return key
