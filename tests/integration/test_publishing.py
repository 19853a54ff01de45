"""Publishing: dedupe at publish, canvas, results by id, delayed retries held in Redis."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from celery import chain, group

from celery_ledger import State
from celery_ledger.identity import derive_task_id

from .helpers import effect_count, wait_for


def test_dedupe_on_publish_does_not_publish_a_known_key(app: Any, token: str) -> None:
    from tests.integration.ledger_app import record_deduped

    first = record_deduped.delay(token)
    assert first.get(timeout=30) == token
    second = record_deduped.delay(token)  # the ledger already knows the key: not published
    assert second.id == first.id
    time.sleep(1.0)
    record = app.ledger.get(record_deduped.name, token)
    assert (record.state, record.attempts, record.duplicates) == (State.SUCCEEDED, 1, 0)
    assert effect_count("deduped", token) == 1


def test_async_result_by_derived_id_finds_the_result(app: Any, token: str) -> None:
    from tests.integration.ledger_app import record

    record.delay(token).get(timeout=30)
    found = app.AsyncResult(derive_task_id(record.name, token))
    assert found.get(timeout=5)["token"] == token


def test_chain_and_group_of_ledger_tasks(app: Any) -> None:
    from tests.integration.ledger_app import add

    base = int(time.time() * 1000) % 1_000_000
    assert chain(add.s(base, 1), add.s(2), add.s(3)).apply_async().get(timeout=30) == base + 6
    assert [effect_count("add", step) for step in (f"{base}+1", f"{base + 1}+2")] == [1, 1]
    # A canvas signature is frozen with its own task id, which is its ledger identity
    other = base + 500
    assert group(add.s(other, i) for i in range(3)).apply_async().get(timeout=30) == [
        other,
        other + 1,
        other + 2,
    ]
    assert all(effect_count("add", f"{other}+{i}") == 1 for i in range(3))


def test_a_chord_of_ledger_tasks_and_a_sensitive_header_needs_a_sensitive_body(
    app: Any, token: str
) -> None:
    from celery import chord

    from celery_ledger.errors import ConfigurationError
    from tests.integration.ledger_app import add, echo, store_card

    base = int(time.time() * 1000) % 1_000_000 + 2_000_000
    # A chord: its body runs once, with every header result, in order
    result = chord([add.s(base, i) for i in range(3)], echo.s("all")).apply_async()
    assert result.get(timeout=60) == [[[base, base + 1, base + 2], "all"], {}]
    assert all(effect_count("add", f"{base}+{i}") == 1 for i in range(3))

    # A sensitive header member's result would reach a plain body in clear: refused before
    # anything is published (its unlock task included), so nothing waits for it
    with redis.Redis.from_url(app.settings.broker_url) as broker:
        before = {q: broker.llen(q) for q in app.tiers.queues}
        with pytest.raises(ConfigurationError, match="sensitive"):
            chord([store_card.s(token, "4111"), add.s(base, 9)], echo.s()).apply_async()
        assert {q: broker.llen(q) for q in app.tiers.queues} == before
    assert effect_count("card", token) == 0


def test_a_delayed_retry_waits_in_redis_not_in_worker_memory(
    stack: Any, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import slow_retry

    result = slow_retry.delay(token)
    delayed = redis.Redis.from_url(stack.broker.url)

    # While the retry is pending it is an entry of the delayed set, not an ETA message a
    # worker holds (the worker has nothing scheduled or reserved).
    def held() -> bool:
        members = delayed.zrange(app.runtime.delayed.key, 0, -1)
        return any(result.id in member.decode() for member in members)

    wait_for(held, what="retry held in Redis")
    # (the worker records the retry just after it parked it: the record follows)
    wait_for(
        lambda: app.ledger.get(slow_retry.name, token).state is State.RETRYING,
        what="retry recorded",
    )
    inspector = app.control.inspect(destination=[stack.workers[0].name], timeout=2)
    assert not any((inspector.scheduled() or {}).values())
    assert result.get(timeout=30) == "retried"
    assert effect_count("attempt", token) == 2
    assert not held()


def test_a_countdown_from_a_producer_app_of_another_name_is_run_by_the_namespaces_workers(
    stack: Any, token: str
) -> None:
    """A web app named differently from the workers' app, publishing to their queues
    (LEDGER_QUEUE_NAMESPACE), holds its countdowns in the set those workers drain: the set
    belongs to the queues' namespace, not to the publishing app's name."""
    from .conftest import producer_app
    from .helpers import shared_task

    web = producer_app(stack, "web_frontend")  # the test app's queue namespace
    record = shared_task(web, "tests.integration.ledger_app.record")
    try:
        # When it publishes a job due in half a second
        result = record.apply_async((token,), countdown=0.5)
        # Then the workers of the namespace run it (before: held for ever in a set of its own)
        assert result.get(timeout=30)["token"] == token
        assert effect_count("record", token) == 1
    finally:
        web.close()
