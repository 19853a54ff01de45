"""The entries of jobs published while the ledger was away (unrecorded.py): an entry gives back
the very record the publish would have written, and an entry it did not write is refused."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from celery_ledger.crypto import Sealer
from celery_ledger.ledger.message import KeptMessage
from celery_ledger.ledger.store import QueuedJob
from celery_ledger.unrecorded import decode, encode, unrecorded_key

KEY = "q2Kx3bX6v8n8k0yJ0mJr3m2m3m2m3m2m3m2m3m2m3m0="


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
def test_an_entry_gives_back_the_record_the_publish_would_have_written(sealed: bool) -> None:
    at = datetime(2026, 11, 29, 12, 30, 1, 250_000, tzinfo=UTC)
    message = KeptMessage.of_call(
        (1, "two", {"three": [3.0]}),
        {"when": at, "none": None},
        message_headers={"ledger_tenant": "gold", "ledger_enqueued_at": 1.5},
        sealer=Sealer([KEY]) if sealed else None,
    )
    for job in (
        QueuedJob("r-1", task="t.add", key="k-1", tier="default", message=message),
        QueuedJob(
            "r-2",
            task="t.add",
            key="k-2",
            tier="critical",
            message=message,
            objective={"objective_due_at": at, "objective_seconds": 2.5},
            claimable_at=at,
        ),
    ):
        back = decode(job.record_id, encode(job))
        assert back.arguments() | {"message": back.message.document()} == job.arguments() | {
            "message": job.message.document()
        }
        assert back.record_id == job.record_id


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"[]", b'{"task": "t"}', b'{"task": 1, "key": "k", "tier": "d", "message": {}}'],
)
def test_an_entry_it_did_not_write_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError, match="is not a job's record"):
        decode("r-x", raw)


def test_each_namespace_keeps_its_own() -> None:
    assert unrecorded_key("shop") == "shop:ledger:unrecorded"
    assert unrecorded_key("") == "ledger:unrecorded"
