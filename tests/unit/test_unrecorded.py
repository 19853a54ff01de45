"""The entries of jobs published while the ledger was away (unrecorded.py): an entry gives back
the very record the publish would have written, and an entry it did not write is refused."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from celery_ledger.crypto import Sealer
from celery_ledger.errors import LedgerUnavailable, StoreError
from celery_ledger.ledger.message import KeptMessage
from celery_ledger.ledger.store import EnqueueOutcome, QueuedJob
from celery_ledger.unrecorded import Unrecorded, decode, encode, unrecorded_key

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
        back, kept_at = decode(job.record_id, encode(job, 1_700_000_000.25))
        assert kept_at == 1_700_000_000.25
        assert back.arguments() | {"message": back.message.document()} == job.arguments() | {
            "message": job.message.document()
        }
        assert back.record_id == job.record_id


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        b'{"task": "t"}',
        b'{"task": 1, "key": "k", "tier": "d", "message": {}, "kept_at": 1}',
        b'{"task": "t", "key": "k", "tier": "d", "message": {}}',
        b'{"task": "t", "key": "k", "tier": "d", "message": {}, "kept_at": 1, "claimable_at": 5}',
    ],
)
def test_an_entry_it_did_not_write_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError, match="is not a job's record"):
        decode("r-x", raw)


def test_each_namespace_keeps_its_own() -> None:
    assert unrecorded_key("shop") == "shop:ledger:unrecorded"
    assert unrecorded_key("") == "ledger:unrecorded"


class OneHash:
    """A Redis hash as ``Unrecorded`` reads it (HSET, HSCAN in one page, HDEL, HLEN)."""

    def __init__(self) -> None:
        self.fields: dict[bytes, bytes] = {}

    def hset(self, key: str, mapping: dict[str, str]) -> None:
        self.fields.update({k.encode(): v.encode() for k, v in mapping.items()})

    def hscan(self, key: str, cursor: int, count: int) -> tuple[int, dict[bytes, bytes]]:
        return 0, dict(self.fields)

    def hdel(self, key: str, *fields: Any) -> int:
        gone = [f if isinstance(f, bytes) else f.encode() for f in fields]
        return sum(self.fields.pop(f, None) is not None for f in gone)

    def hlen(self, key: str) -> int:
        return len(self.fields)


def job(record_id: str) -> QueuedJob:
    message = KeptMessage.of_call((record_id,), {}, message_headers={})
    return QueuedJob(record_id, task="t.add", key=record_id, tier="default", message=message)


def test_the_sweep_writes_the_kept_records_and_drops_only_what_it_wrote_or_cannot() -> None:
    client, now = OneHash(), [1_000_000.0]
    store = Unrecorded(client, namespace="shop", now=lambda: now[0], retention_seconds=3600)
    store.keep([job("old")])
    now[0] += 3601  # kept longer ago than an ended job's record is kept: may have run already
    store.keep([job("a"), job("bad"), job("b")])
    client.fields[b"junk"] = b"{}"
    written: list[list[str]] = []

    def enqueue_many(jobs: Any) -> list[EnqueueOutcome]:
        ids = [j.record_id for j in jobs]
        if "bad" in ids:  # the ledger refuses one record: the batch fails whole
            raise StoreError("refused")
        written.append(ids)
        return [EnqueueOutcome.NEW] * len(jobs)

    assert store.record(enqueue_many) == 3
    # the batch written again one by one: the refused one dropped, the others written
    assert sorted(i for ids in written for i in ids) == ["a", "b"]
    assert store.count() == 0


def test_with_the_ledger_away_the_sweep_keeps_every_entry() -> None:
    client = OneHash()
    store = Unrecorded(client, namespace="shop", now=lambda: 5.0, retention_seconds=3600)
    store.keep([job("a"), job("b")])

    def away(jobs: Any) -> list[EnqueueOutcome]:
        raise LedgerUnavailable("ledger unreachable")

    with pytest.raises(LedgerUnavailable):
        store.record(away)
    assert store.count() == 2


# -- the dead letters' feed after a loss (dead_letter_feed.py) ---------------------------------


def test_a_lost_copy_is_one_made_since_the_loss_and_no_longer_held_of_this_app() -> None:
    from celery_ledger import dead_letter_feed as feed
    from celery_ledger.ledger.core import FOREVER

    at = datetime(2026, 11, 29, 12, tzinfo=UTC)
    docs = [
        {"_id": "held", "copied_at": at},  # still in the queue
        {"_id": "recent", "copied_at": at},
        {"_id": "older", "copied_at": at.replace(hour=11)},  # before the failover's window
        {"_id": "legacy", "claimable_at": FOREVER},  # copied by an earlier release
        {"_id": "flow", "claimable_at": FOREVER, "workflow_status": "compensated"},  # no copy
        {"_id": "due", "claimable_at": at},  # its copy not made yet: due already
        {"_id": "theirs", "copied_at": at},  # another app's, sharing the ledger
        {"_id": "past-cap", "copied_at": at},
    ]

    def lost(since: datetime | None, cap: int = 7) -> list[str]:
        return feed.lost(
            docs, present={"held"}, since=since, cap=cap, ours=lambda d: d["_id"] != "theirs"
        )

    # a broker that lost everything: every copy made (an earlier release's too), the cap's newest
    assert lost(None) == ["recent", "older", "legacy"]
    # a failover: only the copies made since its window began
    assert lost(at.replace(minute=0, hour=11, second=30)) == ["recent"]
    assert lost(None, cap=2) == ["recent"]
