"""Work made in the app's own transaction (the outbox): an aborted transaction leaves no job, a
committed one runs exactly once, and a committer SIGKILLed between its commit and its publish
still gets its job and its workflow run, by the workers alone."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.client_session import ClientSession

from celery_ledger import Backpressure, ConfigurationError, State
from celery_ledger.embedded.servers import app_env
from celery_ledger.embedded.stack import EmbeddedStack
from celery_ledger.identity import derive_task_id
from celery_ledger.ledger.store import EPOCH, UNPUBLISHED

from .conftest import producer_app
from .helpers import effect_count, wait_for

RECORD = "tests.integration.ledger_app.record"
STORE_CARD = "tests.integration.ledger_app.store_card"
CARD = "4111111111111111"


class Refused(Exception):
    """The app's own reason to abort its transaction."""


def world(session: ClientSession) -> Any:
    return session.client.get_database("reference_world")


def test_an_aborted_transaction_leaves_no_job(app: Any, token: str) -> None:
    record = app.tasks[RECORD]

    # Given a checkout that enqueues its job and then fails (after a retried attempt, too)
    attempts = []

    def checkout(session: ClientSession) -> None:
        attempts.append(1)
        world(session).orders.insert_one({"_id": token}, session=session)
        record.apply_async((token,), session=session)
        raise Refused("card declined")

    with pytest.raises(Refused):
        app.outbox.transaction(checkout)

    # And one whose session the app aborts by hand
    with app.ledger.client.start_session() as session:
        session.start_transaction()
        record.apply_async((f"{token}-manual",), session=session)
        session.abort_transaction()
        assert app.outbox.flush(session) == 0

    # Then there is no order, no record, nothing to relay and nothing ever runs
    records = app.ledger.collection
    for key in (token, f"{token}-manual"):
        assert records.find_one({"_id": derive_task_id(RECORD, key)}) is None
    assert app.ledger.client.reference_world.orders.find_one({"_id": token}) is None
    assert app.outbox.relay() == 0
    time.sleep(1.5)
    assert effect_count("record", token) == effect_count("record", f"{token}-manual") == 0


def test_a_committed_transaction_runs_its_job_exactly_once(app: Any, token: str) -> None:
    record = app.tasks[RECORD]

    def checkout(session: ClientSession) -> str:
        world(session).orders.insert_one({"_id": token}, session=session)
        result = record.apply_async((token,), session=session)
        # The same job twice in one transaction is one job
        assert record.apply_async((token,), session=session).id == result.id
        return str(result.id)

    # When the transaction commits (the outbox publishes after the commit)
    task_id = app.outbox.transaction(checkout)

    # Then the job runs once, and stays out of the relay's view
    assert app.AsyncResult(task_id).get(timeout=30)["token"] == token
    doc = app.ledger.find_raw(task_id)
    assert doc["state"] == State.SUCCEEDED.value and doc["attempts"] == 1
    assert "unpublished_at" not in doc
    # However often it is published again (a relay that overlaps the committer)
    assert record.apply_async((token,)).id == task_id
    assert app.outbox.relay() == 0
    time.sleep(1.0)
    assert effect_count("record", token) == 1


def test_a_committed_job_published_twice_runs_once(
    app: Any, stack: EmbeddedStack, token: str
) -> None:
    """The committer's publish and the relay's both go out (the committer's publish was late,
    or it died after it and before its mark): the copy is a suppressed duplicate."""
    from celery_ledger.ledger.message import KeptMessage

    producer = producer_app(stack, "outbox_twice", outbox_grace_seconds=0.0)
    record = producer.tasks[RECORD]
    record_id = derive_task_id(RECORD, token)
    with producer.ledger.client.start_session() as session:
        session.with_transaction(lambda s: record.apply_async((token,), session=s))
        doc = producer.ledger.find_raw(record_id)
        assert doc["claimable_at"] == UNPUBLISHED  # committed, not yet sent
        # The relay (grace 0) sends it: nothing has gone out yet. (Sent after the committer's
        # publish, the relay could find the job already claimed by a fast worker, and send
        # nothing: one copy only.)
        assert producer.outbox.relay() == 1
        # ...and the committer's own publish goes out too, whatever the relay did
        KeptMessage.from_document(doc["message"]).republish(  # type: ignore[union-attr]
            producer.runtime.publish,
            producer.runtime.sealer,
            task=RECORD,
            record_id=record_id,
            key=token,
            tier="default",
        )
        producer.outbox.discard(session)
    try:
        wait_for(lambda: effect_count("record", token) == 1, timeout=30, what="the job's run")
        time.sleep(1.5)
        assert effect_count("record", token) == 1
        final = producer.ledger.find_raw(derive_task_id(RECORD, token))
        assert final["state"] == State.SUCCEEDED.value and final["attempts"] == 1
    finally:
        producer.close()


def test_a_committed_job_no_relay_can_publish_is_recorded_dead_with_its_reason(
    app: Any, stack: EmbeddedStack, token: str
) -> None:
    producer = producer_app(stack, "outbox_unpublishable", outbox_grace_seconds=0.0)
    record = producer.tasks[RECORD]
    record_id = derive_task_id(RECORD, token)
    try:
        # Given a committed job whose kept message is gone (an operator's edit, a bad restore)
        with producer.ledger.client.start_session() as session:
            session.with_transaction(lambda s: record.apply_async((token,), session=s))
            producer.outbox.discard(session)  # its committer died before publishing
        producer.ledger.collection.update_one({"_id": record_id}, {"$unset": {"message": ""}})
        # When the relay reads it
        assert producer.outbox.relay() == 0
        # Then it is recorded dead with the reason, among the dead letters, out of the relay's
        # view (never read and logged again at every pass)
        doc = producer.ledger.find_raw(record_id)
        assert doc["state"] == State.DEAD.value and doc["death"] == "bad-arguments"
        assert doc["dead_reason"] == "outbox: no replayable message was kept"
        assert producer.dead_letters.get(record_id) is not None
        assert producer.ledger.unpublished(ids=[record_id]) == []
        assert effect_count("record", token) == 0
    finally:
        producer.close()


def test_what_a_retried_or_self_ended_transaction_leaves(app: Any, token: str) -> None:
    """A transient error retries the whole transaction: only the committed attempt's jobs run.
    A callback that aborts (or commits) the transaction itself: the ledger says what exists."""
    from pymongo.errors import OperationFailure

    record = app.tasks[RECORD]
    attempts: list[int] = []

    def retried(session: ClientSession) -> None:
        attempts.append(1)
        record.apply_async((f"{token}-attempt{len(attempts)}",), session=session)
        if len(attempts) == 1:
            raise OperationFailure(
                "write conflict", code=112, details={"errorLabels": ["TransientTransactionError"]}
            )

    app.outbox.transaction(retried)
    assert len(attempts) == 2
    assert app.AsyncResult(derive_task_id(RECORD, f"{token}-attempt2")).get(timeout=30)

    def declined(session: ClientSession) -> str:
        record.apply_async((f"{token}-declined",), session=session)
        session.abort_transaction()
        return "declined"

    def committed(session: ClientSession) -> str:
        record.apply_async((f"{token}-committed",), session=session)
        session.commit_transaction()
        return "committed"

    assert app.outbox.transaction(declined) == "declined"
    assert app.outbox.transaction(committed) == "committed"
    assert app.AsyncResult(derive_task_id(RECORD, f"{token}-committed")).get(timeout=30)
    time.sleep(1.5)
    for gone in ("attempt1", "declined"):
        assert app.ledger.find_raw(derive_task_id(RECORD, f"{token}-{gone}")) is None
        assert effect_count("record", f"{token}-{gone}") == 0
    assert effect_count("record", f"{token}-attempt2") == 1


def test_a_sensitive_job_is_sealed_in_the_transaction(app: Any, token: str) -> None:
    store_card = app.tasks[STORE_CARD]
    task_id = app.outbox.transaction(
        lambda s: str(store_card.apply_async((token, CARD), session=s).id)
    )
    assert app.AsyncResult(task_id).get(timeout=30)["last4"] == CARD[-4:]
    raw = app.ledger.collection.find_one({"_id": task_id})
    assert CARD not in repr(raw)  # the kept message and the result are sealed


def test_a_workflow_started_in_a_transaction_runs_only_if_it_commits(app: Any, token: str) -> None:
    from tests.integration.ledger_app import WORKFLOWS

    order = WORKFLOWS["order"]

    def aborted(session: ClientSession) -> None:
        order.start_with((f"{token}-aborted",), {"steps": 1}, session=session)
        raise Refused("out of stock")

    with pytest.raises(Refused):
        app.outbox.transaction(aborted)
    handle = app.outbox.transaction(
        lambda s: app.enqueue(s, order.s(f"{token}-committed", steps=1))
    )
    assert handle.result(timeout=60)
    assert handle.status().status == "completed"
    gone = order.handle(derive_task_id(order.name, f"order-{token}-aborted"))
    assert app.workflow_engine.log.get_state(gone.id) is None


def test_a_workflow_started_in_a_transaction_is_due_after_the_committers_grace(
    app: Any, token: str
) -> None:
    from tests.integration.ledger_app import WORKFLOWS

    # Given a workflow started in a transaction whose committer died before its wake
    log = app.workflow_engine.log
    with app.ledger.client.start_session() as session:
        before = log.now()
        handle = session.with_transaction(
            lambda s: WORKFLOWS["order"].start_with((token,), {"steps": 1}, session=s)
        )
        app.outbox.discard(session)
    # Then it is due for a check once the committer's grace has passed, not before: a relay
    # pass now leaves it to its committer
    due = log.get_state(handle.id)["check_at"] - before
    grace = app.settings.outbox_grace_seconds
    assert grace - 1 <= due.total_seconds() <= grace + 5
    app.outbox.relay()
    assert not log.get_state(handle.id).get("checks")
    # And a relay pass after the grace wakes it: it runs
    wait_for(
        lambda: (app.outbox.relay(), log.get_state(handle.id).get("checks"))[1],
        timeout=grace + 30,
        interval=0.5,
        what="the relay's wake",
    )
    assert handle.result(timeout=60)["done"] == ["s0-done"]


def test_what_an_outbox_job_cannot_be_is_refused_before_anything_is_written(
    app: Any, token: str
) -> None:
    record = app.tasks[RECORD]
    with app.ledger.client.start_session() as session:
        with pytest.raises(ConfigurationError, match="start one first"):
            record.apply_async((token,), session=session)  # no transaction
        session.start_transaction()
        for options in ({"countdown": 5}, {"link": record.si(f"{token}-next")}, {"expires": 60}):
            with pytest.raises(ConfigurationError, match="cannot carry"):
                record.apply_async((token,), session=session, **options)
        session.abort_transaction()
    with pytest.raises(ConfigurationError, match="ClientSession"):
        record.apply_async((token,), session="not a session")
    assert app.ledger.find_raw(derive_task_id(RECORD, token)) is None


def test_backpressure_inside_a_transaction(app: Any, stack: EmbeddedStack, token: str) -> None:
    """No worker reads this namespace's queues, so their depth is the test's to set."""
    namespace = f"ns{uuid.uuid4().hex[:6]}"
    limits = {
        "default": {"high_water": 1, "policy": "block", "block_timeout_seconds": 0.1},
        "critical": {"high_water": 1, "policy": "reject"},
    }
    producer = producer_app(stack, "outbox_pressure", queue_namespace=namespace, tier_limits=limits)
    record = producer.tasks[RECORD]
    broker = producer.runtime.redis
    for tier in ("default", "critical"):
        broker.rpush(producer.tiers.queue(tier), *[b"filler"] * 3)
    try:
        # reject: raised into the transaction, which the app aborts
        with pytest.raises(Backpressure):
            producer.outbox.transaction(
                lambda s: record.apply_async((f"{token}-c",), tier="critical", session=s)
            )
        assert producer.ledger.find_raw(derive_task_id(RECORD, f"{token}-c")) is None
        # block: never waits in the transaction; the job waits in the outbox, durable
        started = time.monotonic()
        task_id = producer.outbox.transaction(
            lambda s: str(record.apply_async((token,), session=s).id)
        )
        assert time.monotonic() - started < 5
        assert producer.ledger.find_raw(task_id)["claimable_at"] == UNPUBLISHED
        assert broker.llen(producer.tiers.queue("default")) == 3  # not published
        # ...until the tier is back under its mark: the relay sends it
        broker.delete(producer.tiers.queue("default"))
        producer.runtime.queue_depths.refresh()
        wait_for(lambda: producer.outbox.relay() == 1, timeout=20, what="the held job's relay")
        assert producer.ledger.find_raw(task_id)["claimable_at"] == EPOCH
        assert broker.llen(producer.tiers.queue("default")) == 1
    finally:
        for tier in ("default", "critical"):
            broker.delete(producer.tiers.queue(tier))
        producer.close()


OUTBOX_WORKERS = {
    # the relay alone brings the committer's work back (no reconciler runs)
    "LEDGER_RECONCILE_IN_WORKERS": "false",
    "LEDGER_OUTBOX_RELAY_IN_WORKERS": "true",
    "LEDGER_OUTBOX_RELAY_SECONDS": "0.5",
    "LEDGER_OUTBOX_GRACE_SECONDS": "1",
}


def test_a_committer_killed_right_after_its_commit_still_gets_its_work_run(
    isolated: EmbeddedStack, token: str
) -> None:
    assert isolated.ledger is not None
    isolated.start_worker(
        isolated.queues_of(), concurrency=2, name="w@127.0.0.1", env=OUTBOX_WORKERS
    )
    # Given a process that commits an order, its job and its workflow, and dies (SIGKILL)
    # before it publishes anything
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.apps.outbox_committer", token],
        env=app_env(isolated.env, OUTBOX_WORKERS),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -9 and "committed" in done.stdout, done.stderr[-2000:]
    died = time.monotonic()
    client = MongoClient(isolated.ledger.url, tz_aware=True)
    assert client.reference_world.orders.find_one({"_id": token}) is not None

    def runs() -> int:  # the isolated stack's effects
        return int(client.reference_world.effects.count_documents({"kind": "record", "key": token}))

    # Then the workers alone run the job, within seconds, once
    wait_for(lambda: runs() == 1, timeout=30, what="the relayed job")
    relayed_after = time.monotonic() - died
    # And the workflow's first wake, lost with the committer, comes from the relay (its state
    # is due for a check once the committer's grace has passed), within seconds
    producer = producer_app(isolated, "outbox_probe")
    try:
        from tests.integration.ledger_app import WORKFLOWS

        flow = WORKFLOWS["order"]
        handle = producer.workflow_handle(derive_task_id(flow.name, f"order-{token}-wf"))
        wait_for(
            lambda: (
                (s := producer.workflow_engine.log.get_state(handle.id))
                and s.get("status") == "completed"
            ),
            timeout=60,
            what="the workflow's run",
        )
        woken_after = time.monotonic() - died
        time.sleep(1.5)
        assert runs() == 1
        doc = producer.ledger.get(RECORD, token)
        assert doc is not None and doc.state is State.SUCCEEDED and doc.attempts == 1
    finally:
        producer.close()
        client.close()
    print(f"\nrelayed {relayed_after:.1f}s, workflow done {woken_after:.1f}s after the death")
    assert relayed_after < 20 and woken_after < 60


def test_a_publish_that_must_never_be_shed_is_refused_instead(
    app: Any, stack: EmbeddedStack, token: str
) -> None:
    """A change-stream trigger publishes so (its change is read again once there is room):
    on a shed tier above its mark it gets Backpressure, and no dead record is written."""
    from celery_ledger.admission import NEVER_SHED

    namespace = f"ns{uuid.uuid4().hex[:6]}"
    limits = {"bulk": {"high_water": 1, "policy": "shed"}}
    producer = producer_app(stack, "never_shed", queue_namespace=namespace, tier_limits=limits)
    record = producer.tasks[RECORD]
    broker = producer.runtime.redis
    queue = producer.tiers.queue("bulk")
    broker.rpush(queue, *[b"filler"] * 3)
    try:
        with pytest.raises(Backpressure):
            record.apply_async((token,), tier="bulk", **{NEVER_SHED: True})
        assert producer.ledger.find_raw(derive_task_id(RECORD, token)) is None
        record.apply_async((f"{token}-shed",), tier="bulk")  # the ordinary publish is shed
        shed = producer.ledger.find_raw(derive_task_id(RECORD, f"{token}-shed"))
        assert shed is not None and shed["state"] == State.DEAD.value
    finally:
        broker.delete(queue)
        producer.close()
