"""What a worker decides of a message it may not be able to run (celery_ledger.worker's
check_message): the consumer parks what it finds unrunnable here, the handoff takes what it
finds runnable, from the message as the transport stores it."""

from __future__ import annotations

import base64
import json
from typing import Any

from celery_ledger import Settings, create_app
from celery_ledger.worker import RUN, check_message, raw_decoder

app = create_app("handoff_checks", settings=Settings(), set_as_current=False)


@app.task(name="shop.greet", idempotency_key="{token}")
def greet(token: str, greeting: str = "hello") -> str:
    return greeting


def stored(task: str, body: Any, content_type: str = "application/json") -> dict[str, Any]:
    """A message as kombu's Redis transport keeps it in a list (and a worker parks it)."""
    return {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": content_type,
        "headers": {"task": task, "id": "m-1"},
        "properties": {"body_encoding": "base64", "delivery_tag": "t"},
    }


def check(raw: dict[str, Any]) -> Any:
    return check_message(app, raw["headers"], raw_decoder(app, raw))


def test_a_message_this_worker_can_run_is_runnable() -> None:
    assert check(stored("shop.greet", [["t-1", "hi"], {}, {}])) == RUN
    assert check(stored("shop.greet", [[], {"token": "t-1"}, {}])) == RUN


def test_what_another_release_may_run_is_parked_with_its_reason() -> None:
    verdict, why, problem = check(stored("shop.greet", [["t-1", "hi", "extra"], {}, {}]))
    assert (verdict, why) == ("park", "arguments") and "too many positional" in str(problem)
    verdict, why, _ = check(stored("shop.refund", [["t-1"], {}, {}]))
    assert (verdict, why) == ("park", "unknown-task")


def test_what_no_worker_can_run_is_refused_or_left_to_celery() -> None:
    verdict, _why, problem = check(stored("shop.greet", {"not": "a task body"}))
    assert verdict == "refuse" and problem
    # (an oversized call is the guard's to refuse, at once: never parked)
    assert check(stored("shop.greet", [["t", "hi", "x" * 2_000_000], {}, {}])) == RUN
    assert check(stored("shop.greet", [["t"], {}, {}], "application/x-unknown"))[0] == "pass"
