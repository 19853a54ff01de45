"""The handoff's store (celery_ledger.handoff) on a real valkey: a parked message is taken by
one worker at a time, never lost on the way, and done only once its copy is received."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import redis

from celery_ledger import handoff
from celery_ledger.delayed import DelayedDeliveries, DelayedPublisher
from celery_ledger.embedded.servers import ServerProcess
from celery_ledger.handoff import Handoff, Parked, Parking


@pytest.fixture
def parking(client: redis.Redis) -> Parking:
    namespace = f"ns{uuid.uuid4().hex[:8]}"
    return Parking(
        client, delayed_key=f"{namespace}:ledger:delayed", key=handoff.parked_key(namespace)
    )


def message(task: str, queue: str = "q.default") -> dict[str, Any]:
    """A message as kombu's Redis transport stores it (what a worker parks)."""
    return {
        "body": "W1tdLCB7fSwge31d",
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"task": task, "id": uuid.uuid4().hex},
        "properties": {
            "body_encoding": "base64",
            "delivery_tag": "t-1",
            "delivery_info": {"exchange": "", "routing_key": queue},
        },
    }


def park(parking: Parking, task: str, *, due_in: float = 60.0, why: str = "unknown-task") -> str:
    now = time.time()
    return parking.park("q.default", message(task), due_at=now + due_in, why=why, since=now)


def inbox_items(client: redis.Redis, inbox: str) -> list[dict[str, Any]]:
    return [json.loads(item) for item in client.lrange(inbox, 0, -1)]


def test_a_parked_message_is_taken_by_one_worker_only(
    client: redis.Redis, parking: Parking
) -> None:
    parked_id = park(parking, "shop.new")
    (entry,) = parking.sample()
    assert (entry.id, entry.why, entry.queue) == (parked_id, "unknown-task", "q.default")
    # Two workers that can run it look at once: one takes it into its inbox
    assert parking.take(entry, f"{parking.key}.inbox.a") is True
    assert parking.take(entry, f"{parking.key}.inbox.b") is False
    (copy,) = inbox_items(client, f"{parking.key}.inbox.a")
    assert client.llen(f"{parking.key}.inbox.b") == 0
    # The copy names its entry, has a delivery tag of its own and keeps its original queue
    assert copy["properties"]["ledger_parked"] == parked_id
    assert copy["properties"]["delivery_tag"] != "t-1"
    assert copy["properties"]["delivery_info"]["routing_key"] == "q.default"
    assert copy["headers"] == entry.raw["headers"]
    # Still parked (and still in the delayed set) until the copy is received
    assert parking.count() == 1
    assert client.zcard(parking.delayed_key) == 1
    # Only the copy of that very message ends the entry (the property naming it is unsigned)
    assert parking.release(parked_id, "another-message") is False
    assert parking.count() == 1 and client.zcard(parking.delayed_key) == 1
    message_id = entry.raw["headers"]["id"]
    assert parking.release(parked_id, message_id) is True
    assert parking.count() == 0 and client.zcard(parking.delayed_key) == 0
    assert parking.release(parked_id, message_id) is False  # a second receipt changes nothing


def test_a_taker_that_dies_before_its_receipt_leaves_it_parked_for_another(
    client: redis.Redis, parking: Parking, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handoff, "TAKE_LEASE_SECONDS", 0.5)
    park(parking, "shop.new", due_in=0.1)
    (entry,) = parking.sample()
    assert parking.take(entry, f"{parking.key}.inbox.dead") is True
    # Its return to the queue waits out the take's lease, not only its own backoff
    assert client.zscore(parking.delayed_key, client.zrange(parking.delayed_key, 0, 0)[0]) > (
        time.time() + 0.2
    )
    time.sleep(0.7)  # the taker never received its copy: its lease ended
    assert parking.take(entry, f"{parking.key}.inbox.alive") is True
    assert len(inbox_items(client, f"{parking.key}.inbox.alive")) == 1


def test_an_entry_that_went_back_to_its_queue_is_no_longer_parked(
    valkey: ServerProcess, client: redis.Redis, parking: Parking
) -> None:
    park(parking, "shop.new", due_in=0.0)
    (entry,) = parking.sample()
    # Its backoff is over: the delayed publisher puts it back on its queue, in one step out of
    # the delayed set and the index
    deliveries = DelayedDeliveries(valkey.url, key=parking.delayed_key, parked_key=parking.key)
    assert DelayedPublisher(deliveries, lambda *_: None).publish_due() == 1
    assert parking.count() == 0 and client.zcard(parking.delayed_key) == 0
    assert json.loads(client.lpop("q.default"))["headers"] == entry.raw["headers"]
    assert parking.take(entry, f"{parking.key}.inbox.a") is False
    assert client.llen(f"{parking.key}.inbox.a") == 0
    # An index entry whose message left the set some other way is cleaned up at a take
    park(parking, "shop.new")
    (entry,) = parking.sample()
    client.delete(parking.delayed_key)
    assert parking.take(entry, f"{parking.key}.inbox.a") is False
    assert parking.count() == 0


def test_a_look_takes_what_it_can_run_and_asks_once_about_the_rest(
    client: redis.Redis, parking: Parking
) -> None:
    for task in ("shop.new", "shop.other", "shop.other"):
        park(parking, task)
    asked: list[str] = []

    def not_runnable(entry: Parked) -> str | None:
        asked.append(entry.id)
        return None if entry.raw["headers"]["task"] == "shop.new" else "unknown task here"

    look = Handoff(parking, f"{parking.key}.inbox.w", not_runnable)
    assert look.look() == 1
    assert look.look() == 0
    assert len(asked) == 3  # each entry checked once, not at every look
    (copy,) = inbox_items(client, f"{parking.key}.inbox.w")
    assert copy["headers"]["task"] == "shop.new"
    held = Handoff(parking, f"{parking.key}.inbox.h", lambda _entry: None, held=lambda _entry: True)
    assert held.look() == 0  # not a tier it serves now: not taken, asked again next time


def test_a_busy_worker_takes_only_what_it_has_room_for(
    client: redis.Redis, parking: Parking
) -> None:
    for _ in range(3):
        park(parking, "shop.new")
    room = [0]
    look = Handoff(parking, f"{parking.key}.inbox.b", lambda _entry: None, room=lambda: room[0])
    assert look.look() == 0  # busy: left to an idle worker
    room[0] = 2
    assert look.look() == 2
    assert client.llen(f"{parking.key}.inbox.b") == 2


def test_the_tally_counts_by_reason_and_task_and_ages_the_oldest(parking: Parking) -> None:
    park(parking, "shop.new")
    park(parking, "shop.new", why="arguments")
    park(parking, "shop.new", why="arguments")
    counts, oldest = handoff.tally(parking.all(), now=time.time() + 30)
    assert counts == {("unknown-task", "shop.new"): 1, ("arguments", "shop.new"): 2}
    assert 29 <= oldest <= 32
