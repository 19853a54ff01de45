"""Exactly-once effects through real workers: duplicates, concurrency, crashes, results."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
from celery import states

from celery_ledger import PayloadError, State
from celery_ledger.identity import derive_task_id

from .helpers import effect_count, wait_for


def test_same_key_delivered_twice_runs_the_body_once(
    app: Any, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.integration.ledger_app import record

    # Given the same logical job delivered twice (published twice without dedupe on publish,
    # which would skip the second: a redelivery, a producer with it off)
    monkeypatch.setattr(record, "dedupe_on_publish", False)
    first = record.delay(token)
    second = record.delay(token)

    # Then both publishes carry the id derived from (task name, key)
    assert first.id == second.id == derive_task_id(record.name, token)
    assert first.get(timeout=30)["token"] == token
    # and the second delivery is suppressed: one effect, one duplicate counted in the ledger
    wait_for(lambda: app.ledger.get(record.name, token).duplicates == 1, what="duplicate")
    assert effect_count("record", token) == 1
    assert app.ledger.get(record.name, token).attempts == 1


def test_twenty_concurrent_deliveries_of_one_key_run_the_body_once(
    app: Any, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.integration.ledger_app import record

    # Given 20 deliveries of one key published at once (dedupe on publish off: each is sent),
    # the body taking a second
    monkeypatch.setattr(record, "dedupe_on_publish", False)
    threads = [threading.Thread(target=record.apply_async, args=((token, 1.0),)) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # Then one delivery runs it; the 19 others wait for the lease, then are suppressed
    wait_for(
        lambda: (
            app.ledger.get(record.name, token) is not None
            and app.ledger.get(record.name, token).duplicates == 19
        ),
        timeout=60,
        what="19 suppressed duplicates",
    )
    record_after = app.ledger.get(record.name, token)
    assert record_after.state is State.SUCCEEDED
    assert record_after.attempts == 1
    assert effect_count("record", token) == 1


def test_a_default_producer_sends_a_known_job_once(app: Any, token: str) -> None:
    from tests.integration.ledger_app import record

    # Given dedupe on publish (the default): the second publish of a known key is skipped
    first = record.delay(token)
    second = record.delay(token)
    assert first.id == second.id
    assert first.get(timeout=30)["token"] == token
    # Then one delivery, one attempt, no duplicate to suppress
    record_after = app.ledger.get(record.name, token)
    assert record_after.attempts == 1 and record_after.duplicates == 0
    assert effect_count("record", token) == 1


def test_worker_killed_mid_task_completes_once_after_the_lease_expires(
    app: Any, token: str
) -> None:
    from tests.integration.ledger_app import record

    # Given a task in the middle of its body (before its effect)
    result = record.delay(token, 2.0)
    running = wait_for(
        lambda: (
            (r := app.ledger.get(record.name, token)) is not None and r.state is State.RUNNING and r
        ),
        what="task running",
    )
    pid = int(running.lease_owner.rsplit(":", 1)[1])

    # When its pool process is killed with SIGKILL
    os.kill(pid, signal.SIGKILL)

    # Then the message comes back, waits out the dead holder's lease, and runs once more
    assert result.get(timeout=60)["token"] == token
    final = app.ledger.get(record.name, token)
    assert final.state is State.SUCCEEDED
    assert final.attempts == 2
    assert final.fence > running.fence
    assert effect_count("record", token) == 1


def test_async_result_reads_results_and_failures_from_the_ledger(app: Any, token: str) -> None:
    from tests.integration.ledger_app import boom, record

    ok = record.delay(token)
    assert ok.get(timeout=30) == {"token": token, "pid": ok.result["pid"]}
    assert ok.state == states.SUCCESS

    failed = boom.delay(token)
    with pytest.raises(Exception, match=f"boom {token}"):
        failed.get(timeout=30)
    assert failed.state == states.FAILURE
    dead = app.ledger.get(boom.name, token)
    assert dead.state is State.DEAD
    assert dead.last_error is not None
    assert dead.last_error.type == "builtins.ValueError"
    assert dead.last_error.traceback_digest
    assert dead.last_error.worker.startswith("main@127.0.0.1:")


def test_flaky_task_retries_and_has_one_effect(app: Any, token: str) -> None:
    from tests.integration.ledger_app import flaky

    # Given a task that fails twice with a retryable error
    result = flaky.delay(token, 2)

    # Then it succeeds on its third attempt, with one effect and two errors recorded
    assert result.get(timeout=60) == "ok after 2 failures"
    final = app.ledger.get(flaky.name, token)
    assert final.state is State.SUCCEEDED
    assert final.attempts == 3
    assert [e.type for e in final.errors] == ["tests.integration.ledger_app.FlakyError"] * 2
    assert effect_count("flaky", token) == 1


def test_arguments_that_are_not_json_fail_at_publish(app: Any, token: str) -> None:
    from tests.integration.ledger_app import record

    with pytest.raises(PayloadError, match="not JSON-serialisable"):
        record.delay(token, object())
    with pytest.raises(PayloadError, match="LEDGER_MAX_PAYLOAD_BYTES"):
        record.delay("x" * 2_000_000)
    assert app.ledger.get(record.name, token) is None


def test_a_result_that_is_not_json_kills_the_job_with_a_clear_error(app: Any, token: str) -> None:
    from tests.integration.ledger_app import returns_a_set

    with pytest.raises(Exception, match="JSON cannot hold"):
        returns_a_set.delay(token).get(timeout=30)
    assert app.ledger.get(returns_a_set.name, token).state is State.DEAD
