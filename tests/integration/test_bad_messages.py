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
    properties: dict[str, Any] | None = None,
) -> bytes:
    """A message as kombu's Redis transport stores it in a queue's list (``headers`` and
    ``properties`` are laid over the usual ones)."""
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
                "delivery_info": {"exchange": "", "routing_key": "ledger_tests.default"},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
                **(properties or {}),
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
        broker.lpush(app.tiers.queue("default"), payload)

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
        if message_id:  # the message's id finds its job's record (an alias of it), or a
            # poison record that keeps its headers (a message naming no usable task)
            doc = app.ledger.resolve(message_id) or app.ledger.collection.find_one(
                {"state": "dead", "message.headers.id": message_id}
            )
        else:
            doc = app.ledger.collection.find_one({"state": "dead", "message.raw_base64": raw})
        return None if doc is None or doc.get("state") != "dead" else doc["dead_reason"]

    expected = {
        0: "undecodable message",
        1: "undecodable message",
        3: "untrusted content of type pickle",
        4: "undecodable or refused content (application/json)",
        5: "unknown task '': not a task name",  # a message with an empty task header
    }
    for index, part in expected.items():
        reason = wait_for(
            lambda i=index: reason_of(bad[i]),
            timeout=20,
            what=f"dead letter for bad message {index}",
        )
        assert part in reason, (index, reason)
    # A task no worker here knows waits for one that does (a rolling deploy): it is put off,
    # exactly as it was sent, not dead on first sight (dead after the window: test_deploys.py)
    unknown_id = json.loads(unknown)["headers"]["id"]
    wait_for(
        lambda: any(
            unknown_id in member.decode()
            for member in broker.zrange(app.runtime.delayed.key, 0, -1)
        ),
        what="the unknown task's message held for later",
    )
    assert app.ledger.resolve(unknown_id) is None
    # Its parking is this test's to end: left on the shared stack it would turn the health
    # check down (test_operations.py) once it has waited half its window
    parking = app.runtime.parking
    mine = wait_for(
        lambda: [p for p in parking.all() if p.raw["headers"]["id"] == unknown_id],
        what="the unknown task's message parked",
    )
    for entry in mine:
        assert parking.release(entry.id, unknown_id)
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
    from tests.integration.ledger_app import explode

    broker = redis.Redis.from_url(stack.broker.url)
    # Ledger headers of the wrong types: refused before Celery reads the message, with a reason
    odd_headers = raw_message(
        json.dumps([[1, 2], {}, {}]).encode(),
        task=explode.name,
        headers={"ledger_tier": ["x"], "ledger_deferrals": "nan"},
    )
    # Text no BSON encoder takes, in the arguments: the task fails, and its record keeps why
    weird_kwargs = raw_message(
        json.dumps([[], {"\ud807\udf3a": None}, {}]).encode(), task=explode.name
    )
    for item in (odd_headers, weird_kwargs):
        broker.lpush(app.tiers.queue("default"), item)

    odd_id = json.loads(odd_headers)["headers"]["id"]
    poison = wait_for(  # the message's id finds the dead record of its job (an alias)
        lambda: (r := app.ledger.get_by_id(odd_id)) is not None and r,
        what="dead letter of the odd headers",
    )
    assert poison.state is State.DEAD
    assert "header 'ledger_tier' is of type list, not a string" in poison.dead_reason

    message_id = json.loads(weird_kwargs)["headers"]["id"]
    record = wait_for(
        lambda: (r := app.ledger.get_by_id(message_id)) is not None and r.state is State.DEAD and r,
        what="dead letter",
    )
    assert record.dead_reason.startswith("error not retryable: TypeError")
    assert record.tier == "default"
    assert stack.workers[0].alive()
