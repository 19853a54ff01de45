"""Malformed, unknown and disallowed messages never take the worker down."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import redis

from celery_ledger.transport import POISON_KEY

from .helpers import effect_count, wait_for


def raw_message(
    body: bytes,
    *,
    task: str,
    content_type: str = "application/json",
    headers: dict[str, Any] | None = None,
) -> bytes:
    """A message as kombu's Redis transport stores it in a queue's list."""
    task_id = str(uuid.uuid4())
    return json.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": content_type,
            "headers": {
                "lang": "py",
                "task": task,
                "id": task_id,
                "root_id": task_id,
                "argsrepr": "",
                "kwargsrepr": "",
                **(headers or {}),
            },
            "properties": {
                "correlation_id": task_id,
                "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": "default"},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
    ).encode()


def test_garbage_unknown_and_pickled_messages_leave_the_worker_consuming(
    stack: Any, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import record

    broker = redis.Redis.from_url(stack.broker.url)
    bad = [
        b"\x00\xff not json at all",
        b'{"body": "trunc',
        raw_message(json.dumps([[1], {}, {}]).encode(), task="no.such.task"),
        raw_message(
            b"\x80\x04K\x01.", task=record.name, content_type="application/x-python-serialize"
        ),
        raw_message(b"{not json", task=record.name),
    ]
    for payload in bad:
        broker.lpush("default", payload)

    # A good message published after the bad ones is still processed exactly once
    assert record.delay(token).get(timeout=30)["token"] == token
    assert effect_count("record", token) == 1
    worker = stack.workers[0]
    assert worker.alive()
    wait_for(lambda: broker.llen("default") == 0, what="bad messages consumed")
    # The two undecodable items are kept with their reason, not lost
    poison = [json.loads(entry) for entry in broker.lrange(POISON_KEY, 0, -1)]
    assert {base64.b64decode(p["raw_base64"]) for p in poison} >= set(bad[:2])
    assert all(p["reason"].startswith("undecodable message") for p in poison)
