"""Delayed entries carry their scheduler's signature, checked before a worker publishes them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kombu.utils.json import dumps, loads

from celery_ledger.delayed import DelayedDeliveries
from celery_ledger.signing import Signer

KEY = "delayed-signing-key-0123456789abcdef0123"


def held(signer: Signer | None) -> DelayedDeliveries:
    # The client connects lazily: signing and checking never reach the server.
    return DelayedDeliveries("redis://127.0.0.1:1/0", signer=signer)


def entry(deliveries: DelayedDeliveries) -> dict[str, Any]:
    """An entry as the set holds it (signed by ``deliveries``), read back as a worker does."""
    envelope: dict[str, Any] = {
        "id": "e1",
        "task": "shop.charge",
        "options": {"task_id": "id-1", "queue": "app.default", "headers": {"ledger_key": "k"}},
        "args": [7, 10.5],
        "kwargs": {"currency": "EUR"},
    }
    deliveries._sign(envelope)
    parsed: dict[str, Any] = loads(dumps(envelope))
    return parsed


@pytest.mark.parametrize(
    "change",
    [
        lambda e: e.update(args=[7, 1000.0]),
        lambda e: e.update(task="shop.refund"),
        lambda e: e["options"].update(task_id="id-2"),
        lambda e: e["options"]["headers"].update(ledger_key="other"),
        lambda e: e.update(kwargs={}),
        lambda e: e.update(sig=e["sig"][:-1] + "0"),
    ],
)
def test_any_change_to_a_signed_entry_is_refused(change: Any) -> None:
    deliveries = held(Signer([KEY], required=False))
    found = entry(deliveries)
    assert deliveries.entry_problem(found) is None
    change(found)
    assert "bad message signature" in (deliveries.entry_problem(found) or "")


def test_an_unsigned_entry_is_refused_only_where_signatures_are_required() -> None:
    unsigned = entry(held(None))
    assert "sig" not in unsigned
    problem = held(Signer([KEY], required=True)).entry_problem(unsigned)
    assert problem is not None and problem.startswith("delayed entry: unsigned message")
    assert held(Signer([KEY], required=False)).entry_problem(unsigned) is None  # a rollout
    assert held(None).entry_problem(unsigned) is None


def test_a_key_no_worker_lists_is_refused() -> None:
    found = entry(held(Signer(["another-key-0123456789abcdef0123456789"])))
    assert "not listed" in (held(Signer([KEY])).entry_problem(json.loads(dumps(found))) or "")


def test_unreadable_members_are_kept_as_dead_letters_and_never_hold_back_the_rest() -> None:
    from celery_ledger.delayed import DelayedPublisher

    good = {"id": "g", "task": "shop.ship", "options": {}, "args": [7], "kwargs": {}}
    batch: dict[bytes, Any] = {
        b"not json": None,
        b"[1, 2]": [1, 2],
        b'{"task": "shop.ship"}': {"task": "shop.ship"},
        b'{"raw": {}}': {"raw": {}},
        dumps(good).encode(): good,
    }

    class Due:
        handed = 0

        def take_due(self) -> list[tuple[bytes, Any]]:
            self.handed += 1
            return list(batch.items()) if self.handed == 1 else []

        def done(self, member: bytes) -> None:
            del batch[member]

        def entry_problem(self, envelope: dict[str, Any]) -> str | None:
            return None

    sent: list[Any] = []
    kept: list[tuple[str, str]] = []
    publisher = DelayedPublisher(
        Due(),  # type: ignore[arg-type]
        lambda *call: sent.append(call),
        keep_unopenable=lambda task, options, raw, reason: kept.append((raw, reason)),
    )
    assert publisher.publish_due() == 5
    assert sent == [("shop.ship", [7], {}, {})]
    assert batch == {}  # every member left the set: none comes back to block a batch
    assert len(kept) == 4 and all("unreadable delayed entry" in reason for _, reason in kept)
    assert {raw for raw, _ in kept} == {
        "not json",
        "[1, 2]",
        '{"task": "shop.ship"}',
        '{"raw": {}}',
    }
