"""Bulk publish (``app.publish_many``, a ``group``): the decisions and the round trips, over the
in-memory ledger and a producer that records its batches.

Celery's own ``Task.apply_async`` (the parent of LedgerTask's) is replaced by a recorder that
notes whether each message went out inside the producer's batch (one pipeline) or on its own,
so the counts below are the round trips a real broker would see: one per batch, one per
message sent alone. The ledger's are its calls: ``enqueue_many`` is one bulk write (and a read
only when known jobs are unpublished), ``enqueue`` one write.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import celery.app.task
import pytest
from celery import group
from kombu.exceptions import BatchPublishError

from celery_ledger import (
    LedgerCelery,
    LedgerTask,
    LedgerUnavailable,
    PayloadError,
    Settings,
    create_app,
)
from celery_ledger.identity import derive_task_id
from celery_ledger.ledger.record import State
from celery_ledger.ledger.store import UNPUBLISHED
from tests.fakes import MemoryLedger


@dataclass
class FakeProducer:
    """kombu's producer as the bulk publish uses it: ``batch()`` buffers what is published
    inside it and sends it at the end (one pipeline), or fails there."""

    fail: BaseException | None = None
    pipelines: list[list[str]] = field(default_factory=list)
    alone: list[str] = field(default_factory=list)
    buffer: list[str] | None = None

    @contextmanager
    def batch(self, max_size: int) -> Iterator[None]:
        assert self.buffer is None, "batches do not nest here"
        self.buffer = []
        try:
            yield
        finally:
            buffered, self.buffer = self.buffer, None
        if self.fail is not None:
            raise self.fail
        self.pipelines.append(buffered)

    def send(self, task_id: str) -> None:
        (self.alone if self.buffer is None else self.buffer).append(task_id)


@dataclass
class Sent:
    task_id: str
    options: dict[str, Any]


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[Sent]:
    messages: list[Sent] = []

    def record(
        self: Any, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> object:
        assert task_id is not None
        producer = options.get("producer")
        if hasattr(producer, "send"):
            producer.send(task_id)
        messages.append(Sent(task_id, options))
        return self.AsyncResult(task_id)

    monkeypatch.setattr(celery.app.task.Task, "apply_async", record)
    return messages


@pytest.fixture
def app() -> LedgerCelery:
    settings = Settings(
        broker_url="redis://127.0.0.1:1/0",
        mongo_uri="mongodb://127.0.0.1:1/",
        max_payload_bytes=1024,
    )
    made = create_app("unit_bulk", settings=settings, set_as_current=False)
    made.runtime.ledger = MemoryLedger()  # type: ignore[assignment]
    return made


@pytest.fixture
def ledger(app: LedgerCelery) -> MemoryLedger:
    found: MemoryLedger = app.runtime.ledger  # type: ignore[assignment]
    return found


@pytest.fixture
def add(app: LedgerCelery) -> LedgerTask:
    @app.task(name="bulk.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    return add


def test_a_bulk_publish_of_250_jobs_costs_one_ledger_write_and_one_pipeline_per_100(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    # Given 250 new jobs
    producer = FakeProducer()
    # When they are published as one bulk publish
    results = app.publish_many([add.s(i, 1) for i in range(250)], producer=producer)
    # Then three bulk writes wrote their records, and three pipelines sent their messages
    assert ledger.calls == ["enqueue_many"] * 3
    assert [len(p) for p in producer.pipelines] == [100, 100, 50]
    assert producer.alone == []
    # And each result is its job's, every job queued, its message a deduplicated one (no
    # first-publish hint: its record exists)
    assert [r.id for r in results] == [
        derive_task_id("bulk.add", add.key_of((i, 1), {})) for i in range(250)
    ]
    assert sum(p for p in map(len, producer.pipelines)) == len(ledger.docs) == 250
    assert all(doc["state"] == State.QUEUED for doc in ledger.docs.values())
    assert not any(s.options.get("ledger_new") for s in sent)


def test_one_by_one_the_same_jobs_cost_a_write_and_a_message_each(
    add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    producer = FakeProducer()
    for i in range(20):
        add.apply_async((i, 1), producer=producer)
    assert ledger.calls == ["enqueue"] * 20
    assert (len(producer.alone), producer.pipelines) == (20, [])


def test_a_group_is_a_bulk_publish(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    producer = FakeProducer()
    result = group(add.s(i, 2) for i in range(150)).apply_async(producer=producer)
    assert ledger.calls == ["enqueue_many"] * 2
    assert [len(p) for p in producer.pipelines] == [100, 50]
    # Celery froze the members' ids (the group's results); each names its job in its key
    assert [r.id for r in result.results] == [s.task_id for s in sent]
    assert {d["key"] for d in ledger.docs.values()} == {add.key_of((i, 2), {}) for i in range(150)}


def test_known_jobs_are_not_sent_again_and_those_whose_publish_failed_are(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    # Given five jobs published, two of whose first publish failed
    app.publish_many([add.s(i, 3) for i in range(5)], producer=FakeProducer())
    ids = [derive_task_id("bulk.add", add.key_of((i, 3), {})) for i in range(5)]
    ledger.mark_unpublished(ids[1])
    ledger.mark_unpublished(ids[3])
    # When the same five and two new ones are published again in bulk
    producer = FakeProducer()
    app.publish_many([add.s(i, 3) for i in range(7)], producer=producer)
    # Then only the two unpublished and the two new ones are sent, in one pipeline
    [pipeline] = producer.pipelines
    assert sorted(pipeline) == sorted([ids[1], ids[3], *(s.task_id for s in sent[-2:])])
    assert len(pipeline) == 4


def test_with_the_ledger_unreachable_the_batch_is_sent_with_the_first_publish_hint(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    from tests.unit.test_task_publish import FakeUnrecorded

    app.runtime.__dict__["unrecorded"] = unrecorded = FakeUnrecorded()
    ledger.fail("enqueue_many", LedgerUnavailable("ledger unreachable: timed out"))
    producer = FakeProducer()
    app.publish_many([add.s(i, 4) for i in range(3)], producer=producer)
    # as a single publish: sent, each marked a first publish (its claim may insert the record)
    assert [len(p) for p in producer.pipelines] == [3]
    assert all(s.options.get("ledger_new") is True for s in sent)
    assert app.runtime.ledger_absence.away()
    # and each with its record kept in the broker for the reconciler to write
    assert [job.record_id for job in unrecorded.kept] == [s.task_id for s in sent]
    # and the next publishes while it is seen away write no record (one by one, at once)
    app.publish_many([add.s(9, 4)], producer=producer)
    assert ledger.calls == ["enqueue_many"] and producer.alone == [sent[-1].task_id]
    assert [job.record_id for job in unrecorded.kept] == [s.task_id for s in sent]


def test_with_the_ledger_unreachable_a_batch_no_replica_confirms_is_not_sent(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    """The batch's records kept in the broker (the ledger away) and not confirmed by a
    replica: none of its messages goes out, and the caller is told to publish again."""
    from celery_ledger import NotReplicated
    from celery_ledger.unrecorded import Unrecorded
    from tests.unit.test_unrecorded import Replicated

    client = Replicated(0)
    app.runtime.__dict__["unrecorded"] = Unrecorded(client, namespace="t", confirm_replicas=1)
    ledger.fail("enqueue_many", LedgerUnavailable("ledger unreachable: timed out"))
    producer = FakeProducer()
    with pytest.raises(NotReplicated, match=r"3 job\(s\)"):
        app.publish_many([add.s(i, 7) for i in range(3)], producer=producer)
    assert producer.pipelines == [] and producer.alone == [] and len(client.fields) == 3


def test_with_the_ledger_unreachable_a_failed_pipeline_keeps_the_records(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    from tests.unit.test_task_publish import FakeUnrecorded

    app.runtime.__dict__["unrecorded"] = unrecorded = FakeUnrecorded()
    ledger.fail("enqueue_many", LedgerUnavailable("ledger unreachable: timed out"))
    producer = FakeProducer(fail=BatchPublishError("Redis publish batch failed"))
    with pytest.raises(BatchPublishError):
        app.publish_many([add.s(i, 6) for i in range(3)], producer=producer)
    # some messages may have gone out (kombu without a batch sends one by one): the records
    # stay, as those a bulk write wrote stay (marked unpublished)
    assert len(unrecorded.kept) == 3


def test_a_failed_pipeline_leaves_its_batch_to_the_relay_and_raises(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    producer = FakeProducer(fail=BatchPublishError("Redis publish batch failed"))
    with pytest.raises(BatchPublishError):
        app.publish_many([add.s(i, 5) for i in range(4)], producer=producer)
    # Every record the batch wrote is marked unpublished in one write: the relay and the
    # reconciler publish them (a message that did reach the broker only makes a duplicate)
    assert ledger.calls == ["enqueue_many", "mark_unpublished_many"]
    assert len(ledger.docs) == 4
    assert {d["claimable_at"] for d in ledger.docs.values()} == {UNPUBLISHED}
    # and a publish tried again sends them
    retry = FakeProducer()
    app.publish_many([add.s(i, 5) for i in range(4)], producer=retry)
    assert [len(p) for p in retry.pipelines] == [4]


def test_jobs_for_later_and_other_tasks_are_published_on_their_own(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    from tests.unit.test_task_publish import FakeDelayed

    delayed = FakeDelayed()
    app.runtime.__dict__["delayed"] = delayed

    @app.task(name="bulk.plain", shared=False, dedupe_on_publish=False)
    def plain(x: int) -> int:
        return x

    producer = FakeProducer()
    app.publish_many([add.s(1, 6), add.s(2, 6).set(countdown=60), plain.s(1)], producer=producer)
    # the job for later: its own record (claimable when due), held in the delayed set
    assert sorted(ledger.calls) == ["enqueue", "enqueue_many"]
    assert len(delayed.scheduled) == 1
    # the task without dedupe: sent at once; the job of the batch: in its pipeline
    assert [len(p) for p in producer.pipelines] == [1] and len(producer.alone) == 1


def test_a_refused_call_raises_after_the_jobs_before_it_are_published(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    producer = FakeProducer()
    calls = [add.s(1, 7), add.s(2, 7), add.s("x" * 1100, 7), add.s(3, 7)]
    with pytest.raises(PayloadError):
        app.publish_many(calls, producer=producer)
    # as one by one: the two before it went out, the one after it was never tried
    assert [len(p) for p in producer.pipelines] == [2]
    assert len(ledger.docs) == 2


@pytest.mark.parametrize("item", [None, 3, "bulk.add", (1, 2), {"args": [1]}])
def test_publish_many_takes_signatures_only(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent], item: Any
) -> None:
    with pytest.raises(TypeError, match="takes signatures"):
        app.publish_many([add.s(1, 8), item], producer=FakeProducer())
    assert (ledger.calls, sent) == ([], [])  # nothing published


def test_a_signature_as_a_dict_is_published(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    producer = FakeProducer()
    [result] = app.publish_many([dict(add.s(1, 9))], producer=producer)
    assert result.id == derive_task_id("bulk.add", add.key_of((1, 9), {}))
    assert [len(p) for p in producer.pipelines] == [1]


def test_publishes_through_an_acquired_producer_outside_a_canvas_go_one_by_one(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    producer = FakeProducer()
    with app.producer_or_acquire(producer) as acquired:
        add.apply_async((1, 10), producer=acquired)
        # its record is written before apply_async returns, as always
        assert ledger.calls == ["enqueue"]
    assert (producer.alone, producer.pipelines) == ([sent[0].task_id], [])


def test_a_sensitive_jobs_message_is_sealed_in_a_bulk_publish(sent: list[Sent]) -> None:
    from celery_ledger.crypto import REDACTED, SEALED_SERIALIZER
    from tests.unit.test_task_publish import _secure_app

    secure = _secure_app("unit_bulk_sensitive")
    secure.runtime.ledger = ledger = MemoryLedger()  # type: ignore[assignment]

    @secure.task(name="vault.keep", shared=False, sensitive=True, dedupe_on_publish=True)
    def keep(card: str) -> None: ...

    producer = FakeProducer()
    secure.publish_many([keep.s("4111"), keep.s("4242")], producer=producer)
    assert ledger.calls == ["enqueue_many"] and [len(p) for p in producer.pipelines] == [2]
    assert all(s.options["serializer"] == SEALED_SERIALIZER for s in sent)
    assert all(s.options["argsrepr"] == REDACTED for s in sent)
    # the kept message (for a republish) is sealed too
    assert all("4111" not in repr(doc["message"]) for doc in ledger.docs.values())


def test_a_producer_without_batches_sends_one_by_one_and_still_writes_in_bulk(
    app: LedgerCelery, add: LedgerTask, ledger: MemoryLedger, sent: list[Sent]
) -> None:
    @dataclass
    class OldProducer:  # kombu before 5.7: no Producer.batch
        alone: list[str] = field(default_factory=list)

        def send(self, task_id: str) -> None:
            self.alone.append(task_id)

    producer = OldProducer()
    app.publish_many([add.s(i, 11) for i in range(5)], producer=producer)
    assert ledger.calls == ["enqueue_many"] and len(producer.alone) == 5
