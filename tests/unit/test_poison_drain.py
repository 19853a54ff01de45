"""celery_ledger.deadletter: the poison drain stores every entry, even one BSON cannot hold."""

from __future__ import annotations

import base64
import json
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import bson
import pytest

from celery_ledger.deadletter import POISON_KEY, DeadLetters
from celery_ledger.errors import LedgerUnavailable


class FakeRedis:
    """The list commands the drain uses, over one in-memory list per key."""

    def __init__(self) -> None:
        self.lists: dict[str, list[bytes]] = {}

    def lpush(self, key: str, value: str | bytes) -> None:
        self.lists.setdefault(key, []).insert(
            0, value.encode() if isinstance(value, str) else value
        )

    def lindex(self, key: str, index: int) -> bytes | None:
        items = self.lists.get(key, [])
        return items[index] if -len(items) <= index < len(items) else None

    def lrem(self, key: str, count: int, value: bytes) -> None:
        items = self.lists.get(key, [])
        for position in range(len(items) - 1, -1, -1):
            if items[position] == value:
                del items[position]
                return


class FakeCollection:
    """Encodes each document as pymongo does before sending it (and so raises as it does)."""

    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}
        self.down = False

    def replace_one(self, query: dict[str, Any], doc: dict[str, Any], upsert: bool) -> None:
        if self.down:
            raise LedgerUnavailable("ledger down")
        bson.encode(doc)
        self.docs[doc["_id"]] = doc


class NoBroker:
    def producer_or_acquire(self) -> Any:
        raise ConnectionError("no broker in unit tests")  # announce logs and goes on


@pytest.fixture
def drain() -> tuple[DeadLetters, FakeRedis, FakeCollection]:
    collection = FakeCollection()
    ledger = SimpleNamespace(collection=collection, dead_retention=timedelta(days=1))
    letters = DeadLetters(NoBroker(), ledger, "redis://127.0.0.1:1/0")  # type: ignore[arg-type]
    fake = FakeRedis()
    letters._redis = fake  # type: ignore[assignment]
    return letters, fake, collection


def entry(task: str, **headers: Any) -> str:
    return json.dumps(
        {
            "queue": "default",
            "reason": f"unknown task {task!r}",
            "at": 0.0,
            "raw_base64": base64.b64encode(b"[[1], {}, {}]").decode(),
            "headers": {"task": task, "id": f"id-{task}", **headers},
            "properties": {"delivery_tag": "t"},
        }
    )


@pytest.mark.parametrize("bad", [{"x\x00y": 1}, {"x-big": 2**70}], ids=["NUL key", "huge int"])
def test_an_unstorable_entry_is_stored_sanitized_and_does_not_block(
    drain: tuple[DeadLetters, FakeRedis, FakeCollection], bad: dict[str, Any]
) -> None:
    letters, fake, collection = drain
    # Given an entry whose headers BSON refuses, with a good entry behind it
    blocker = entry("no.such.task", **bad)
    fake.lpush(POISON_KEY, blocker)
    fake.lpush(POISON_KEY, entry("other.task"))

    # When the drain runs
    assert letters.drain_poison() == 2

    # Then both are dead records and the list is empty
    assert fake.lists[POISON_KEY] == []
    first = collection.docs["poison-id-no.such.task"]
    assert first["state"] == "dead" and first["task"] == "no.such.task"
    assert "unknown task 'no.such.task'" in first["dead_reason"]
    assert "kept sanitized" in first["dead_reason"]
    # and the whole entry is kept, as base64
    assert base64.b64decode(first["message"]["entry_base64"]) == blocker.encode()
    assert first["message"]["raw_base64"] == base64.b64encode(b"[[1], {}, {}]").decode()
    assert collection.docs["poison-id-other.task"]["message"]["headers"]["task"] == "other.task"


def test_an_entry_that_is_not_json_is_kept_as_base64(
    drain: tuple[DeadLetters, FakeRedis, FakeCollection],
) -> None:
    letters, fake, collection = drain
    fake.lpush(POISON_KEY, b"\xff not an entry")

    assert letters.drain_poison() == 1

    [doc] = collection.docs.values()
    assert doc["dead_reason"].startswith("unreadable poison entry")
    assert base64.b64decode(doc["message"]["entry_base64"]) == b"\xff not an entry"


def test_a_ledger_outage_leaves_the_entry_for_the_next_tick(
    drain: tuple[DeadLetters, FakeRedis, FakeCollection],
) -> None:
    letters, fake, collection = drain
    fake.lpush(POISON_KEY, entry("no.such.task"))
    collection.down = True

    with pytest.raises(LedgerUnavailable):
        letters.drain_poison()

    assert len(fake.lists[POISON_KEY]) == 1
