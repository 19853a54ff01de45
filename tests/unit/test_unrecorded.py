"""The entries of jobs published while the ledger was away (unrecorded.py): an entry gives back
the very record the publish would have written, and an entry it did not write is refused."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
import redis

from celery_ledger.crypto import Sealer
from celery_ledger.errors import LedgerUnavailable, NotReplicated, StoreError
from celery_ledger.ledger.message import KeptMessage
from celery_ledger.ledger.store import EnqueueOutcome, QueuedJob
from celery_ledger.sentinel import SentinelSettings
from celery_ledger.signing import Signer
from celery_ledger.unrecorded import (
    UnknownSigningKey,
    Unrecorded,
    decode,
    encode,
    unrecorded_key,
)
from celery_ledger.wire import dumps, loads

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


def _b(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class OneHash:
    """Redis hashes as ``Unrecorded`` reads them (HSET, HSETNX, HGET, HEXISTS, HSCAN in one
    page, HDEL, HLEN): ``fields`` the entries', ``aside`` the one beside it."""

    def __init__(self) -> None:
        self.fields: dict[bytes, bytes] = {}
        self.aside: dict[bytes, bytes] = {}

    def _of(self, key: str) -> dict[bytes, bytes]:
        return self.aside if key.endswith(":unverified") else self.fields

    def hset(self, key: str, field: Any = None, value: Any = None, mapping: Any = None) -> None:
        found = self._of(key)
        found.update({_b(k): _b(v) for k, v in (mapping or {}).items()})
        if field is not None:
            found[_b(field)] = _b(value)

    def hsetnx(self, key: str, field: Any, value: Any) -> int:
        return int(self._of(key).setdefault(_b(field), _b(value)) == _b(value))

    def hget(self, key: str, field: Any) -> bytes | None:
        return self._of(key).get(_b(field))

    def hexists(self, key: str, field: Any) -> bool:
        return _b(field) in self._of(key)

    def hscan(self, key: str, cursor: int, count: int) -> tuple[int, dict[bytes, bytes]]:
        return 0, dict(self._of(key))

    def hdel(self, key: str, *fields: Any) -> int:
        found = self._of(key)
        return sum(found.pop(_b(f), None) is not None for f in fields)

    def hlen(self, key: str) -> int:
        return len(self._of(key))


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
    made = {"claimable_at": FOREVER}  # (a copy confirmed: none due)
    docs = [
        {"_id": "held", "copied_at": at, **made},  # still in the queue
        {"_id": "recent", "copied_at": at, **made},
        {"_id": "older", "copied_at": at.replace(hour=11), **made},  # before the window
        {"_id": "legacy", **made},  # copied by an earlier release
        {"_id": "flow", "workflow_status": "compensated", **made},  # a workflow's: no copy
        {"_id": "due", "claimable_at": at},  # its copy not made yet: due already
        # made once, and due again or being made now (a pass before this one marked it, or a
        # worker publishes it): not marked again, or two workers would publish it
        {"_id": "pending", "copied_at": at, "claimable_at": at},
        {"_id": "theirs", "copied_at": at, **made},  # another app's, sharing the ledger
        {"_id": "past-cap", "copied_at": at, **made},
    ]

    def lost(since: datetime | None, cap: int = 8) -> list[str]:
        return feed.lost(
            docs, present={"held"}, since=since, cap=cap, ours=lambda d: d["_id"] != "theirs"
        )

    # a broker that lost everything: every copy made (an earlier release's too), the cap's newest
    assert lost(None) == ["recent", "older", "legacy"]
    # a failover: only the copies made since its window began
    assert lost(at.replace(minute=0, hour=11, second=30)) == ["recent"]
    assert lost(None, cap=2) == ["recent"]


SIGNING_KEY, OTHER_KEY = "unrecorded-signing-key-" + "a" * 16, "unrecorded-other-key-" + "b" * 16


@pytest.mark.parametrize("required", [True, False], ids=["required", "rolling-out"])
def test_with_signing_keys_only_an_entry_a_producer_of_the_fleet_signed_is_written(
    required: bool,
) -> None:
    """A record written from an entry is republished, signed, by a worker if its message is
    gone: a writer to the broker must not get a task run by forging or changing an entry (even
    while signatures are not yet required of messages: no release kept unsigned entries)."""
    signer = Signer([SIGNING_KEY], required=required)
    good = encode(job("r-1"), 10.0, signer)
    back, _ = decode("r-1", good, signer)
    assert back.key == "r-1"

    unsigned = encode(job("r-1"), 10.0)
    changed = loads(good)
    changed["task"] = "t.drain_account"
    for raw in (unsigned, dumps(changed)):
        with pytest.raises(ValueError, match="not signed as this fleet signs"):
            decode("r-1", raw, signer)
    with pytest.raises(ValueError, match="not signed as this fleet signs"):
        decode("r-2", good, signer)  # a signed entry moved to another job's id
    with pytest.raises(ValueError, match="not signed as this fleet signs"):
        decode("r-1", good, signer, "other:ledger:unrecorded")  # ...or to another app's hash
    # One signed with a key this worker lacks (a deploy adding it under way) is left for a
    # worker that holds it
    newer = encode(job("r-1"), 10.0, Signer([OTHER_KEY, SIGNING_KEY]))
    with pytest.raises(UnknownSigningKey):
        decode("r-1", newer, signer)

    # A sweep writes the signed entries and drops the others
    client = OneHash()
    store = Unrecorded(client, namespace="shop", now=lambda: 10.0, signer=signer)
    store.keep([job("a"), job("b")])
    client.fields[b"forged"] = unsigned.encode()
    written: list[str] = []

    def enqueue_many(jobs: Any) -> list[EnqueueOutcome]:
        written.extend(j.record_id for j in jobs)
        return [EnqueueOutcome.NEW] * len(jobs)

    client.fields[b"newer"] = encode(job("newer"), 10.0, Signer([OTHER_KEY]), store.key).encode()
    assert store.record(enqueue_many) == 2
    assert sorted(written) == ["a", "b"]
    assert list(client.fields) == [b"newer"]


def test_an_entry_no_worker_can_verify_is_dropped_once_a_deploy_would_have_ended() -> None:
    """Signed with a key this worker lacks, an entry waits for a worker that holds it (a
    deploy adding the key); one that none verifies within the window (a made-up key id, a key
    withdrawn) is dropped, not warned about for ever; its job is left to its message."""
    signer = Signer([SIGNING_KEY])
    client, now = OneHash(), [1_000.0]
    store = Unrecorded(
        client, namespace="shop", now=lambda: now[0], signer=signer, unverified_seconds=900
    )
    for name in ("newer", "made-up"):
        client.fields[name.encode()] = encode(
            job(name), 0.0, Signer([OTHER_KEY]), store.key
        ).encode()

    def enqueue_many(jobs: Any) -> list[EnqueueOutcome]:
        return [EnqueueOutcome.NEW] * len(jobs)

    assert store.record(enqueue_many) == 0
    assert sorted(client.fields) == [b"made-up", b"newer"]  # left, and when noted aside
    now[0] += 600
    del client.fields[b"newer"]  # (a worker holding the key wrote its record meanwhile)
    assert store.record(enqueue_many) == 0
    assert list(client.fields) == [b"made-up"] and list(client.aside) == [b"made-up"]
    now[0] += 301  # past the window since it was first seen (its own times are not trusted)
    assert store.record(enqueue_many) == 0
    assert client.fields == {} and client.aside == {}


def test_a_broker_full_to_its_limit_still_lets_the_verifiable_entries_be_recorded() -> None:
    """Noting when an unverifiable entry was first seen is a write, which a broker at its
    memory limit refuses (recording needs only deletes): the entry is left, the others are
    written all the same."""

    class Full(OneHash):
        def hsetnx(self, key: str, field: Any, value: Any) -> int:
            raise redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'")

    signer = Signer([SIGNING_KEY])
    client = Full()
    store = Unrecorded(client, namespace="shop", now=lambda: 10.0, signer=signer)
    store.keep([job("a")])
    client.fields[b"newer"] = encode(job("newer"), 0.0, Signer([OTHER_KEY]), store.key).encode()
    written: list[str] = []

    def enqueue_many(jobs: Any) -> list[EnqueueOutcome]:
        written.extend(j.record_id for j in jobs)
        return [EnqueueOutcome.NEW] * len(jobs)

    assert store.record(enqueue_many) == 1
    assert written == ["a"] and list(client.fields) == [b"newer"]


class Replicated(OneHash):
    """:class:`OneHash` behind a primary whose replicas confirm ``acks`` of them (``WAIT``),
    its pipelines run on the one connection (what ``WAIT`` counts)."""

    def __init__(self, acks: int) -> None:
        super().__init__()
        self.acks = acks
        self.waits: list[tuple[Any, ...]] = []

    def pipeline(self, transaction: bool = True) -> Any:
        assert not transaction  # (WAIT is refused inside MULTI)
        client, queued = self, []

        class Pipe:
            def __enter__(self) -> Pipe:
                return self

            def __exit__(self, *exc: object) -> None:
                pass

            def hset(self, *args: Any, **kwargs: Any) -> None:
                queued.append(lambda: client.hset(*args, **kwargs))

            def execute_command(self, *args: Any) -> None:
                assert args[0] == "WAIT"
                queued.append(lambda: client.waits.append(args[1:]) or client.acks)

            def execute(self) -> list[Any]:
                return [call() for call in queued]

        return Pipe()


@pytest.mark.parametrize("acks", [0, 1, 2])
def test_a_kept_entry_goes_on_only_once_the_replicas_asked_for_hold_it(acks: int) -> None:
    """Where the broker fails over, an entry only the primary holds is lost with it: the
    publish is refused (before its message is sent) unless as many replicas as asked confirm
    it in time. The entry is written either way (the caller may publish again)."""
    client = Replicated(acks)
    store = Unrecorded(client, namespace="shop", confirm_replicas=1, confirm_seconds=2.5)
    if acks >= 1:
        assert store.keep([job("a"), job("b")])
    else:
        with pytest.raises(NotReplicated, match=r"0 of the 1 replica\(s\) asked .* 2500 ms"):
            store.keep([job("a"), job("b")])
    assert client.waits == [(1, 2500)]
    assert sorted(client.fields) == [b"a", b"b"]


@pytest.mark.parametrize("confirm", [0, 1])
def test_a_broker_that_cannot_be_asked_refuses_only_where_replicas_must_confirm(
    confirm: int,
) -> None:
    """A write or WAIT that fails (a timeout on a stalled primary, OOM): with replicas to
    confirm the publish is refused (its message may reach another primary while its record
    reaches none); with one server it goes on without the record, as before."""

    class Broken(Replicated):
        def hset(self, *args: Any, **kwargs: Any) -> None:
            raise redis.TimeoutError("Timeout reading from socket")

    store = Unrecorded(Broken(1), namespace="shop", confirm_replicas=confirm)
    if confirm:
        with pytest.raises(NotReplicated, match="could not be asked") as refused:
            store.keep([job("a")])
        assert isinstance(refused.value.__cause__, redis.TimeoutError)
        assert isinstance(refused.value, ConnectionError)  # (retried by default in a body)
    else:
        assert store.keep([job("a")]) is False


@pytest.mark.parametrize("acks", [0, 1])
def test_a_confirmation_on_a_primary_the_sentinels_replaced_is_not_one(acks: int) -> None:
    """A stalled old primary running again may still hold a replica the sentinels have not
    moved: its confirmation is lost with it. Confirmed, the sentinels are asked once whether
    they name another primary now; not confirmed, there is nothing to ask."""
    asked: list[bool] = []

    def moved() -> bool:
        asked.append(True)
        return True

    client = Replicated(acks)
    store = Unrecorded(client, namespace="shop", confirm_replicas=1, primary_moved=moved)
    reason = "another primary" if acks else "0 of the 1 replica"
    with pytest.raises(NotReplicated, match=reason):
        store.keep([job("a")])
    assert asked == [True] * acks
    calm = Unrecorded(Replicated(1), namespace="shop", confirm_replicas=1, primary_moved=bool)
    assert calm.keep([job("a")])


def test_without_replicas_to_confirm_an_entry_is_not_waited_for() -> None:
    client = Replicated(0)
    store = Unrecorded(client, namespace="shop", confirm_replicas=0)
    assert store.keep([job("a")]) and client.waits == [] and list(client.fields) == [b"a"]


@pytest.mark.parametrize(
    ("url", "asked", "confirmed"),
    [
        ("redis://127.0.0.1:6379/0", None, 0),
        ("sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380", None, 1),
        ("sentinel://127.0.0.1:26379", 0, 0),
        ("redis://127.0.0.1:6379/0", 1, 1),
        ("SENTINEL://127.0.0.1:26379", 2, 2),
    ],
)
def test_the_replicas_to_confirm_follow_the_broker_unless_set(
    url: str, asked: int | None, confirmed: int
) -> None:
    settings = SentinelSettings(broker_url=url, broker_confirm_replicas=asked)
    assert settings.replicas_to_confirm() == confirmed
