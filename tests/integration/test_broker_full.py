"""A broker at its memory limit (``maxmemory`` with ``noeviction``, what a deep backlog makes):
it answers reads and deletes (so a worker still takes messages) but refuses every write that
adds (the booking of a taken message, a requeue, a retry, a poison entry). Every job must still
end as it should once the broker takes writes again, and no worker may end.
"""

from __future__ import annotations

import base64
import contextlib
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ledger import State
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess

from .conftest import (
    APP_MODULE,
    DEFAULT_QUEUE,
    NAMESPACE,
    UNACKED,
    broker_client,
    own_stack,
    producer_app,
    start_healing_worker,
)
from .helpers import effect_count, shared_task, wait_for

DELAYED = f"{NAMESPACE}:ledger:delayed"
POISON = f"{NAMESPACE}:ledger:poison"
ITEM = b"not json \xff kept-poison"


def _stack_at_limit(base: Path, app_module: str) -> Iterator[EmbeddedStack]:
    """A stack of its own, relieved of its memory limit before it stops (a worker's stop
    writes to the broker)."""
    with own_stack(base, app_module) as running:
        try:
            yield running
        finally:
            with contextlib.suppress(Exception):
                relieve(broker_client(running))


@pytest.fixture
def own(tmp_path: Path, app: Any) -> Iterator[EmbeddedStack]:
    yield from _stack_at_limit(tmp_path, APP_MODULE)


def start(stack: EmbeddedStack, name: str, **options: Any) -> WorkerProcess:
    """A healing worker whose reconciler also sends again a queued job whose message is gone
    (after 5 s, not 15 minutes)."""
    env = {"LEDGER_RECONCILE_STALE_AFTER_SECONDS": "5", **options.pop("env", {})}
    return start_healing_worker(stack, name, env=env, **options)


def oom(b: redis.Redis) -> None:
    """The broker at its memory limit: writes refused with OOM, reads and deletes answered."""
    b.config_set("maxmemory-policy", "noeviction")
    b.config_set("maxmemory", "1")
    with pytest.raises(redis.ResponseError, match="maxmemory"):
        b.set("probe", "x")


def relieve(b: redis.Redis) -> None:
    b.config_set("maxmemory", "0")


def keys_summary(b: redis.Redis) -> str:
    return (
        f"queue={b.llen(DEFAULT_QUEUE)} unacked={b.hlen(UNACKED)} delayed={b.zcard(DELAYED)}"
        f" poison={b.llen(POISON)}"
    )


def states(producer: Any, name: str, tokens: list[str]) -> dict[str, str]:
    found = {}
    for t in tokens:
        r = producer.ledger.get(name, t)
        found[t] = "none" if r is None else r.state.value
    return found


def log_lines(worker: WorkerProcess, *needles: str) -> list[str]:
    text = worker.log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if any(n in line for n in needles)][:12]


@pytest.mark.parametrize("dedupe", [False, True], ids=["default", "dedupe_on_publish"])
def test_take_while_the_broker_is_at_its_memory_limit(own: EmbeddedStack, dedupe: bool) -> None:
    """Messages queued and one running when the broker hits maxmemory (noeviction); relieved
    after 10 s (a supervisor restarts a dead worker then). Every job must end succeeded; the
    worker must stay up."""
    producer = producer_app(own, "full_producer", dedupe_on_publish=dedupe)
    record = shared_task(producer, "tests.integration.ledger_app.record")
    b = broker_client(own)
    w = start(own, "oom1", concurrency=1)
    w.expect_exit()  # type: ignore[attr-defined]  # observed here, not by the watchdog
    run = f"oom-{random.randint(0, 10**9)}"
    first = f"{run}-first"
    record.apply_async((first,), {"sleep_seconds": 4.0})
    wait_for(lambda: b.hlen(UNACKED) >= 1, timeout=20, interval=0.05, what="first taken")
    queued = [f"{run}-{i}" for i in range(3)]
    for t in queued:
        record.apply_async((t,))
    print("\nbefore OOM:", keys_summary(b))
    oom(b)
    oom_at = time.monotonic()
    time.sleep(10)
    print(f"during OOM ({time.monotonic() - oom_at:.0f}s):", keys_summary(b))
    print("states:", states(producer, record.name, [first, *queued]))
    died = not w.alive()
    print("worker alive:", w.alive())
    relieve(b)
    if died:
        start(own, "oom1-restarted", concurrency=1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = states(producer, record.name, [first, *queued])
        if all(v == "succeeded" for v in s.values()):
            break
        time.sleep(0.5)
    s = states(producer, record.name, [first, *queued])
    print(f"after relief ({time.monotonic() - oom_at:.0f}s):", keys_summary(b), s)
    print("worker alive:", w.alive())
    for line in log_lines(
        w, "maxmemory", "Unrecoverable", "lost", "restore", "Restoring", "could not"
    ):
        print("  log:", line[:300])
    print("unacked ids:", [json.loads(v)[0]["headers"]["id"][:8] for v in b.hvals(UNACKED)])
    print("effects:", {t: effect_count("record", t) for t in [first, *queued]})
    assert all(v == "succeeded" for v in s.values()), f"jobs not processed: {s}"
    assert not died, "the worker died"
    producer.close()


FULL_APP = "tests.integration.apps.broker_full"


@pytest.fixture
def full_stack(tmp_path: Path, app: Any) -> Iterator[EmbeddedStack]:
    """A stack of its own whose workers run the test app and the broker_full task."""
    yield from _stack_at_limit(tmp_path, FULL_APP)


@pytest.mark.parametrize("mode", ["retry", "requeue", "dead"])
def test_an_outcome_while_the_broker_is_at_its_memory_limit(
    full_stack: EmbeddedStack, mode: str
) -> None:
    """A running job's outcome needs a broker write (a retry's ZADD, a requeue's LPUSH, a dead
    letter's copy) while the broker is at maxmemory; relieved after 12 s."""
    import tests.integration.apps.broker_full  # noqa: F401  (registers the shared task)

    own = full_stack
    producer = producer_app(own, "full_outcome")
    task = shared_task(producer, "tests.integration.apps.broker_full.pause_then")
    b = broker_client(own)
    w = start(own, "oomo", concurrency=1)
    w.expect_exit()  # type: ignore[attr-defined]  # observed here
    token = f"oomo-{mode}-{random.randint(0, 10**9)}"
    task.apply_async((token, mode, 3.0))
    wait_for(lambda: b.hlen(UNACKED) >= 1, timeout=20, interval=0.05, what="taken")
    oom(b)
    oom_at = time.monotonic()
    time.sleep(12)
    r = producer.ledger.get(task.name, token)
    print(
        f"\n[{mode}] during OOM: {keys_summary(b)} record={r.state.value if r else None}"
        f" attempts={r.attempts if r else None} alive={w.alive()}"
    )
    died = not w.alive()
    relieve(b)
    if died:
        start(own, "oomo-restarted", concurrency=1)
    want = State.DEAD if mode == "dead" else State.SUCCEEDED
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        r = producer.ledger.get(task.name, token)
        if (
            r is not None
            and r.state is want
            and (mode != "dead" or b.llen(f"{NAMESPACE}.dead_letter") >= 1)
        ):
            break
        time.sleep(0.5)
    r = producer.ledger.get(task.name, token)
    print(
        f"[{mode}] {time.monotonic() - oom_at:.0f}s after OOM: {keys_summary(b)}"
        f" record={r.state.value if r else None} dlq={b.llen(f'{NAMESPACE}.dead_letter')}"
        f" attempts={effect_count('attempt', token)} done={effect_count('done', token)}"
    )
    for line in log_lines(
        w, "maxmemory", "Unrecoverable", "not published", "requeue", "could not", "Could not"
    ):
        print("  log:", line[:260])
    assert r is not None and r.state is want
    assert not died, "the worker died"
    producer.close()


def test_a_poison_item_taken_while_the_broker_is_at_its_memory_limit(own: EmbeddedStack) -> None:
    """A non-JSON item is taken while the broker is at maxmemory: the transport's quarantine
    (LPUSH to the poison list) is refused. The item must be kept, the worker stay up."""
    producer = producer_app(own, "full_poison")
    record = shared_task(producer, "tests.integration.ledger_app.record")
    b = broker_client(own)
    w = start(own, "oomp", concurrency=1)
    w.expect_exit()  # type: ignore[attr-defined]
    token = f"oomp-{random.randint(0, 10**9)}"
    record.apply_async((token,), {"sleep_seconds": 3.0})
    wait_for(lambda: b.hlen(UNACKED) >= 1, timeout=20, interval=0.05, what="taken")
    b.lpush(DEFAULT_QUEUE, ITEM)
    oom(b)
    time.sleep(8)
    alive = w.alive()
    relieve(b)

    def kept() -> bool:
        # held in the worker while the broker refused it, pushed at its next take: then drained
        # into the ledger as a dead record with its reason
        return (
            producer.ledger.collection.find_one(
                {
                    "state": "dead",
                    "message.raw_base64": base64.b64encode(ITEM).decode(),
                }
            )
            is not None
        )

    wait_for(kept, timeout=20, what="the poison item's dead record")
    print(f"\npoison under OOM: worker alive={alive}; {keys_summary(b)}")
    for line in log_lines(w, "Unrecoverable", "undecodable", "kept in"):
        print("  log:", line[:240])
    assert alive, "the worker died"
    producer.close()
