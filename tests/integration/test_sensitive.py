"""Sensitive tasks: arguments and results are encrypted at rest and never logged."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import redis

from celery_ledger import State

from .helpers import wait_for

CARD = "4111111111111111"


def test_results_and_arguments_are_sealed_in_the_ledger(app: Any, token: str) -> None:
    from tests.integration.ledger_app import store_card

    result = store_card.delay(token, CARD)
    assert result.get(timeout=30) == {"last4": "1111", "echo": CARD}  # the owner reads it
    raw = app.ledger.collection.find_one({"_id": result.id})
    assert CARD not in json.dumps(raw, default=str)  # the raw document holds no plaintext
    assert raw["result"].startswith("fernet:")
    assert raw["message"]["args_json"].startswith("fernet:")
    assert app.ledger.get(store_card.name, token).result["last4"] == "1111"


def test_a_dead_sensitive_job_keeps_no_plaintext_anywhere(stack: Any, app: Any, token: str) -> None:
    from tests.integration.ledger_app import reject_card

    with pytest.raises(Exception, match=r"PermanentError|declined|redacted"):
        reject_card.delay(token, CARD).get(timeout=30)
    record = app.ledger.get(reject_card.name, token)
    assert record.state is State.DEAD
    raw = app.ledger.collection.find_one({"_id": record.id})
    assert CARD not in json.dumps(raw, default=str)
    assert raw["dead_reason"] == "permanent error: PermanentError"
    broker = redis.Redis.from_url(stack.broker.url)

    def copies() -> list[str]:
        return [
            base64.b64decode(json.loads(m)["body"]).decode()
            for m in broker.lrange(app.tiers.dead_letter_queue, 0, -1)
        ]

    wait_for(lambda: any(record.id in body for body in copies()), what="dead-letter copy")
    assert not any(CARD in body for body in copies())
    assert CARD not in stack.workers[0].log_path.read_text()

    # Replay opens the sealed arguments to republish them
    doc = app.dead_letters.get(token, task=reject_card.name)
    assert app.dead_letters.replay(doc, actor="test").replayed
    wait_for(
        lambda: (
            app.ledger.get(reject_card.name, token).state is State.DEAD
            and app.ledger.find_raw(record.id).get("replays") == 1
        ),
        what="replayed and dead",
    )
