"""What a worker says about the jobs it holds (``inspect active/reserved/scheduled``,
``query_task``, Flower's worker page) shows no argument of a sensitive task.

Those replies are lists the worker pushes on the broker, so the broker's append-only file
keeps what they held: the card of a running job must reach neither the asker nor the AOF.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet

from celery_ledger.crypto import REDACTED
from celery_ledger.embedded.flower import start_flower

from .apps.held_cards import NAMESPACE, register
from .conftest import producer_app
from .helpers import wait_for
from .watchdog import WATCH, WatchedStack

MODULE = "tests.integration.apps.held_cards"
WORKER = "held@127.0.0.1"


@pytest.fixture
def held_stack(tmp_path: Path) -> Iterator[tuple[WatchedStack, str]]:
    """Servers of their own (their AOF is this test's alone) and the key that seals the card."""
    key = Fernet.generate_key().decode()
    running = WatchedStack(MODULE, tmp_path / "stack", auth=True, queue_namespace=NAMESPACE)
    running.extra_env.update(
        {"LEDGER_ENCRYPTION_KEYS": json.dumps([key]), "LEDGER_MONGO_DB": "ledger_tests"}
    )
    try:
        running.start_servers()
        WATCH.watch(running)
        yield running, key
    finally:
        WATCH.unwatch(running)
        running.stop()


def _tasks_in(reply: dict[str, Any] | None, task_id: str) -> list[dict[str, Any]]:
    """The entries about ``task_id`` in an inspect reply ({worker: [info, ...]})."""
    return [info for infos in (reply or {}).values() for info in infos if info["id"] == task_id]


def test_no_inspect_reply_nor_the_broker_holds_a_running_sensitive_jobs_arguments(
    held_stack: tuple[WatchedStack, str], tmp_path: Path
) -> None:
    running, key = held_stack
    running.start_worker(running.queues_of(), concurrency=1, name=WORKER)
    flower = start_flower(MODULE, tmp_path / "flower", env=running.env)
    producer = producer_app(running, "held_probe", queue_namespace=NAMESPACE, encryption_keys=[key])
    hold = register(producer)
    card = f"4000{secrets.randbelow(10**12):012d}"
    auth = "Basic " + base64.b64encode(f"{flower.user}:{flower.password}".encode()).decode()

    def flower_worker_page() -> str:
        # What Flower's page of one worker asks for: its active, reserved, scheduled jobs
        path = f"/api/workers?refresh=1&workername={WORKER}"
        request = urllib.request.Request(flower.url + path, headers={"Authorization": auth})
        with urllib.request.urlopen(request, timeout=30) as response:
            return str(response.read().decode())

    try:
        # Given a sensitive job that holds the card (a keyword) while it runs
        result = hold.apply_async(
            (f"held-{uuid.uuid4().hex[:12]}",), {"card_number": card, "seconds": 12.0}
        )
        inspect = producer.control.inspect(destination=[WORKER], timeout=5)
        active = wait_for(
            lambda: (reply := inspect.active()) and _tasks_in(reply, result.id) and reply,
            timeout=30,
            what="the job running",
        )
        # When the worker is asked what it runs, in every way Flower and the CLI ask
        queried = inspect.query_task(result.id)
        replies = {
            "active": active,
            "query_task": queried,
            "reserved": inspect.reserved(),
            "scheduled": inspect.scheduled(),
            "flower": flower_worker_page(),
        }
        still_running = not result.ready()

        # Then the job is shown, by name and id, with the redaction marker for its arguments
        (shown,) = _tasks_in(active, result.id)
        assert shown["name"] == hold.name
        assert (shown["args"], shown["kwargs"]) == (REDACTED, REDACTED)
        (state, about) = queried[WORKER][result.id]
        assert state == "active" and about["kwargs"] == REDACTED
        assert result.id in replies["flower"] and REDACTED in replies["flower"]
        # And no reply holds the card
        assert still_running, "the job ended before it was inspected: hold it longer"
        assert card not in json.dumps(replies, default=str)
        # (the owner still gets its result)
        assert result.get(timeout=60) == card[-4:]
    finally:
        producer.close()
        flower.stop()

    # And the broker's append-only file, which kept the replies' lists, holds no trace of it
    time.sleep(1.5)  # appendfsync everysec
    assert running.broker is not None
    aof = b"".join(path.read_bytes() for path in running.broker.data_dir.rglob("*.aof"))
    # kombu's Redis transport keeps each message's body in base64
    bodies = [base64.b64decode(body) for body in re.findall(rb'"body": "([A-Za-z0-9+/=]*)"', aof)]
    replies_kept = [body for body in bodies if f'"id": "{result.id}"'.encode() in body]
    assert replies_kept  # the inspect replies about the job are there, readable
    assert not any(card.encode() in text for text in (aof, *bodies))
