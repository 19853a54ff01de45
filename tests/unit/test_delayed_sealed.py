"""The delayed publisher with a sensitive task's sealed entry: opened and published, or, when
no key here opens it, kept as a poison message once, never retried in a loop."""

from __future__ import annotations

from typing import Any

from cryptography.fernet import Fernet
from kombu.utils.json import dumps

from celery_ledger.crypto import Sealer
from celery_ledger.delayed import DelayedPublisher


class _Due:
    """The sorted set's hand-out, in memory: each entry handed out until it is done."""

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        self.entries = {dumps(e).encode(): e for e in entries}
        self.handed = 0

    def take_due(self, *, limit: int = 100) -> list[tuple[bytes, dict[str, Any]]]:
        self.handed += 1
        return list(self.entries.items())[:limit] if self.handed == 1 else []

    def done(self, member: bytes) -> None:
        del self.entries[member]

    def push_back(self, member: bytes, envelope: dict[str, Any]) -> None:
        raise AssertionError("no raw entries here")

    def entry_problem(self, envelope: dict[str, Any]) -> str | None:
        return None  # unsigned here (tests/unit/test_delayed_signed.py checks signatures)


KEY = Fernet.generate_key().decode()
OPTIONS = {"task_id": "id-1", "queue": "app.default", "headers": {"ledger_key": "k"}}


def _entry(sealer: Sealer) -> dict[str, Any]:
    sealed = sealer.seal(dumps([[7, "4111111111111111"], {"cvv": "123"}, {}]))
    return {"id": "e1", "task": "shop.charge", "options": OPTIONS, "sealed": sealed}


def test_a_sealed_entry_is_opened_and_published_with_its_arguments() -> None:
    due = _Due([_entry(Sealer([KEY]))])
    sent: list[tuple[Any, ...]] = []
    publisher = DelayedPublisher(
        due,  # type: ignore[arg-type]
        lambda *call: sent.append(call),
        sealer=Sealer([Fernet.generate_key().decode(), KEY]),  # rotated: old key still listed
        keep_unopenable=lambda *kept: None,
    )
    assert publisher.publish_due() == 1
    assert sent == [("shop.charge", [7, "4111111111111111"], {"cvv": "123"}, OPTIONS)]
    assert not due.entries


def test_an_entry_no_key_opens_is_kept_with_its_reason_and_leaves_the_set() -> None:
    entry = _entry(Sealer([KEY]))
    due = _Due([entry])
    kept: list[tuple[Any, ...]] = []
    publisher = DelayedPublisher(
        due,  # type: ignore[arg-type]
        lambda *call: (_ for _ in ()).throw(AssertionError("published")),
        sealer=Sealer([Fernet.generate_key().decode()]),
        keep_unopenable=lambda *args: kept.append(args),
    )
    assert publisher.publish_due() == 1
    ((task, options, sealed, reason),) = kept
    assert (task, options, sealed) == ("shop.charge", OPTIONS, entry["sealed"])
    assert "cannot be opened with LEDGER_ENCRYPTION_KEYS" in reason
    assert not due.entries  # done: not handed out again


def test_without_a_keeper_an_unopenable_entry_stays_for_its_lease() -> None:
    due = _Due([_entry(Sealer([KEY]))])
    publisher = DelayedPublisher(due, lambda *call: None)  # type: ignore[arg-type]
    assert publisher.publish_due() == 0
    assert len(due.entries) == 1
