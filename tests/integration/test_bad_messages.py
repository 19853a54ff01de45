"""Malformed, unknown and disallowed messages never take the worker down."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import redis

from celery_ledger import State

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


def test_every_kind_of_bad_message_is_dead_lettered_with_a_reason(
    stack: Any, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import record

    broker = redis.Redis.from_url(stack.broker.url)
    unknown = raw_message(json.dumps([[1], {}, {}]).encode(), task="no.such.task")
    pickled = raw_message(
        b"\x80\x04K\x01.", task=record.name, content_type="application/x-python-serialize"
    )
    bad_body = raw_message(b"{not json", task=record.name)
    no_task_header = raw_message(json.dumps([[1], {}, {}]).encode(), task="")
    oversized = raw_message(
        json.dumps([[f"{token}-big", 0.0, "x" * 1_100_000], {}, {}]).encode(), task=record.name
    )
    bad = [
        b"\x00\xff not json at all",
        b'{"body": "trunc',
        unknown,
        pickled,
        bad_body,
        no_task_header,
        oversized,
    ]
    for payload in bad:
        broker.lpush("default", payload)

    # A good message published after the bad ones is still processed exactly once
    assert record.delay(token).get(timeout=30)["token"] == token
    assert effect_count("record", token) == 1
    assert stack.workers[0].alive()

    def reason_of(payload: bytes) -> str | None:
        raw = base64.b64encode(payload).decode()
        message_id = (
            json.loads(payload)["headers"]["id"]
            if payload.startswith(b'{"body": "') and payload.endswith(b"}")
            else None
        )
        query = {"message.original_id": message_id} if message_id else {"message.raw_base64": raw}
        doc = app.ledger.collection.find_one({"state": "dead", **query})
        return None if doc is None else doc["dead_reason"]

    expected = {
        0: "undecodable message",
        1: "undecodable message",
        2: "unknown task 'no.such.task'",
        3: "untrusted content of type pickle",
        4: "undecodable or refused content (application/json)",
        5: "unknown task ''",  # a message with an empty task header
    }
    for index, part in expected.items():
        reason = wait_for(
            lambda i=index: reason_of(bad[i]),
            timeout=20,
            what=f"dead letter for bad message {index}",
        )
        assert part in reason, (index, reason)
    big_id = json.loads(oversized)["headers"]["id"]
    big = wait_for(
        lambda: (r := app.ledger.get_by_id(big_id)) is not None and r.state is State.DEAD and r,
        what="oversized record dead",
    )
    assert "oversized message" in big.dead_reason
    assert effect_count("record", f"{token}-big") == 0


def test_untrusted_ledger_headers_and_unencodable_text_still_end_in_a_dead_letter(
    stack: Any, app: Any, token: str
) -> None:
    """Found by the hypothesis suite: odd headers and lone surrogates in kwargs."""
    from tests.integration.ledger_app import add

    broker = redis.Redis.from_url(stack.broker.url)
    weird_kwargs = raw_message(
        json.dumps([[], {"\ud807\udf3a": None}, {}]).encode(),
        task=add.name,
        headers={"ledger_tier": ["x"], "ledger_deferrals": "nan"},
    )
    message_id = json.loads(weird_kwargs)["headers"]["id"]
    broker.lpush("default", weird_kwargs)
    record = wait_for(
        lambda: (r := app.ledger.get_by_id(message_id)) is not None and r.state is State.DEAD and r,
        what="dead letter",
    )
    assert record.dead_reason.startswith("error not retryable: TypeError")
    assert record.tier == "default"
    assert stack.workers[0].alive()
