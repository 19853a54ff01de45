"""Sensitive tasks: arguments and results are encrypted at rest and never logged."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ledger import State
from celery_ledger.crypto import REDACTED

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


def test_a_sensitive_jobs_checkpoint_and_step_results_are_sealed_and_resume(
    app: Any, token: str
) -> None:
    from bson import BSON

    from tests.integration.ledger_app import sensitive_progress

    from .helpers import effect_count

    # Given a job whose checkpoint, step and atomic step hold the card, failing once after them
    result = sensitive_progress.delay(token, CARD)

    # Then the second attempt resumed from them, and each step ran once
    assert result.get(timeout=60) == {"resumed": True, "vault": True, "receipt": True}
    assert effect_count("sensitive-attempt", token) == 2
    assert effect_count("vault", token) == 1
    assert effect_count("sensitive-charge", token) == 1
    # And the stored record holds no plaintext of the card, in any field, in its raw bytes
    raw = app.ledger.collection.find_one({"_id": result.id})
    assert CARD.encode() not in BSON.encode(raw)
    assert raw["checkpoint"].startswith("fernet:")
    assert all(step["result"].startswith("fernet:") for step in raw["steps"].values())


def test_a_sensitive_tasks_events_carry_no_result_exception_text_or_traceback(
    tmp_path: Any, stack: Any, token: str
) -> None:
    """What Flower and ``celery events`` receive, captured from the broker by a real event
    receiver beside a worker that sends task events."""
    import threading

    from .conftest import make_isolated_stack, producer_app
    from .helpers import shared_task

    running = make_isolated_stack(tmp_path)
    received: list[dict[str, Any]] = []
    try:
        running.start_worker(
            running.queues_of(), concurrency=1, name="events@127.0.0.1", extra_args=("-E",)
        )
        producer = producer_app(running, "events_probe")
        receivers: list[Any] = []

        def listen() -> None:
            with producer.connection_for_read() as connection:
                receiver = producer.events.Receiver(connection, handlers={"*": received.append})
                receivers.append(receiver)
                receiver.capture(limit=None, timeout=None, wakeup=True)  # until should_stop

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        time.sleep(1.0)  # the receiver's queue is bound before the jobs run
        task = "tests.integration.ledger_app."
        stored = shared_task(producer, task + "store_card").delay(token, CARD)
        rejected = shared_task(producer, task + "reject_card").delay(f"{token}-r", CARD)
        resumed = shared_task(producer, task + "sensitive_progress").delay(f"{token}-p", CARD)
        plain = shared_task(producer, task + "echo").delay(f"{token}-echo")
        # and a publisher that does not know the task as sensitive (plain Celery, by name),
        # which writes the arguments' text in the message (argsrepr)
        foreign = Celery("foreign", broker=running.broker.url, set_as_current=False)
        queue = producer.tiers.queue(producer.tier_of(task + "store_card"))
        by_name = foreign.send_task(task + "store_card", (f"{token}-f", CARD), queue=queue)
        foreign.close()
        assert stored.get(timeout=60)["last4"] == "1111"
        with pytest.raises(Exception, match=r"PermanentError|redacted|declined"):
            rejected.get(timeout=60)
        assert resumed.get(timeout=60)["resumed"]
        assert plain.get(timeout=60) == [[f"{token}-echo"], {}]
        wait_for(
            lambda: (
                {"task-succeeded", "task-failed", "task-retried"}
                <= {
                    e["type"]
                    for e in received
                    if e.get("uuid") in (stored.id, rejected.id, resumed.id)
                }
                and any(
                    e.get("uuid") == plain.id and e["type"] == "task-succeeded" for e in received
                )
                and {"task-received", "task-succeeded"}
                <= {e["type"] for e in received if e.get("uuid") == by_name.id}
            ),
            what="the jobs' events",
        )
        receivers[0].should_stop = True
        listener.join(10)
        producer.close()
    finally:
        running.stop()

    # Then no event of a sensitive job holds the card; their exception types remain
    sensitive = (stored.id, rejected.id, resumed.id, by_name.id)
    ours = [e for e in received if e.get("uuid") in sensitive]
    assert ours and not any(CARD in json.dumps(e, default=str) for e in ours)
    (arrived,) = [e for e in ours if e["uuid"] == by_name.id and e["type"] == "task-received"]
    assert arrived["args"] == arrived["kwargs"] == REDACTED
    failed = next(e for e in ours if e["type"] == "task-failed")
    assert failed["exception"] == f"PermanentError({REDACTED!r})"
    assert failed["traceback"] == REDACTED
    # (a task that is not sensitive keeps its result in its events)
    echoed = next(
        e for e in received if e.get("uuid") == plain.id and e["type"] == "task-succeeded"
    )
    assert f"{token}-echo" in echoed["result"]


def test_a_sensitive_job_logged_under_a_shadow_name_logs_no_value(
    stack: Any, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import reject_card, store_card

    # Given a caller that names each job for its logs (Celery's ``shadow``), a name the app does
    # not know as sensitive, when one succeeds and one fails with the card in its error
    shadow = f"billing.innocent-{token}"
    result = store_card.apply_async((token, CARD), shadow=shadow)
    assert result.get(timeout=30)["last4"] == "1111"
    with pytest.raises(Exception, match=r"PermanentError|declined|redacted"):
        reject_card.apply_async((f"{token}-r", CARD), shadow=shadow).get(timeout=30)
    # Then the worker logged both under that name, with no card in any line
    log = stack.workers[0].log_path
    wait_for(lambda: log.read_text().count(shadow) >= 2, what="both outcomes logged")
    assert CARD not in log.read_text()


def test_a_sensitive_job_that_ignores_or_rejects_itself_keeps_no_card(
    stack: Any, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import refuse_card

    # When one job ends with Ignore and another with Reject, both naming the card
    refuse_card.delay(f"{token}-i", CARD, "ignore")
    refuse_card.delay(f"{token}-r", CARD, "reject")
    wait_for(
        lambda: (
            (i := app.ledger.get(refuse_card.name, f"{token}-i")) is not None
            and i.state is State.SUCCEEDED
            and (r := app.ledger.get(refuse_card.name, f"{token}-r")) is not None
            and r.state is State.DEAD
        ),
        what="ignored and rejected",
    )
    # Then their records say how they ended, without the card
    ignored = app.ledger.find_raw(app.ledger.get(refuse_card.name, f"{token}-i").id)
    rejected = app.ledger.find_raw(app.ledger.get(refuse_card.name, f"{token}-r").id)
    assert ignored["outcome"] == "ignored" and ignored["note"] == REDACTED
    assert rejected["dead_reason"] == f"rejected by the task: {REDACTED}"
    assert CARD not in json.dumps([ignored, rejected], default=str)
    # nor does the dead letter's copy on the broker (its headers included), nor the log
    broker = redis.Redis.from_url(stack.broker.url)

    def copies() -> list[str]:  # each whole message, and its body decoded
        raw = [m.decode() for m in broker.lrange(app.tiers.dead_letter_queue, 0, -1)]
        return [m + base64.b64decode(json.loads(m)["body"]).decode() for m in raw]

    wait_for(lambda: any(rejected["_id"] in m for m in copies()), what="dead-letter copy")
    assert not any(CARD in m for m in copies())
    assert CARD not in stack.workers[0].log_path.read_text()
