"""Ways a whole worker stops with a job running, and what each leaves behind: the prefork main
process SIGKILLed alone (its pool processes die with it), a cold shutdown (SIGQUIT, or a second
SIGINT during a warm one). Each time the job comes back on another worker and its effect happens
once. (A whole worker SIGKILLed, a pool process killed, a warm shutdown and a worker dead before
its claim: test_self_healing.py and test_long_jobs.py.)"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from pymongo import MongoClient

from celery_ledger import State
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess

from .conftest import NAMESPACE, TEST_ENV, make_isolated_stack, producer_app
from .helpers import shared_task, wait_for

LEASE = 3.0
SWEEP_EVERY = 1.0
GRACE = 1.0
HEALING = {
    "LEDGER_LEASE_SECONDS": str(LEASE),
    "LEDGER_RECONCILE_EVERY_SECONDS": str(SWEEP_EVERY),
    "LEDGER_RECONCILE_LEASE_GRACE_SECONDS": str(GRACE),
    "LEDGER_VISIBILITY_TIMEOUT_SECONDS": "3600",
    "LEDGER_RECONCILE_IN_WORKERS": "true",
}
QUEUE = f"{NAMESPACE}.default"
UNACKED = f"{NAMESPACE}.unacked"


@pytest.fixture
def own(tmp_path: Path) -> Iterator[EmbeddedStack]:
    """An isolated stack without the session's worker (the machine is small)."""
    saved = dict(os.environ)
    os.environ.update(TEST_ENV)
    running = make_isolated_stack(tmp_path)
    try:
        yield running
    finally:
        running.stop()
        os.environ.clear()
        os.environ.update(saved)


def start(stack: EmbeddedStack, name: str, **options: Any) -> WorkerProcess:
    env = {**HEALING, **options.pop("env", {})}
    return stack.start_worker(QUEUE, name=f"{name}@127.0.0.1", env=env, **options)


def world(stack: EmbeddedStack) -> Any:
    assert stack.ledger is not None
    return MongoClient(stack.ledger.url, tz_aware=True).get_database("reference_world")


def broker(stack: EmbeddedStack) -> redis.Redis:
    assert stack.broker is not None
    return redis.Redis.from_url(stack.broker.url)


def test_the_main_process_killed_alone_takes_its_pool_with_it_and_the_job_comes_back(
    own: EmbeddedStack,
) -> None:
    """SIGKILL of the prefork main process only: a pool process left running its body would
    hold the lease and write under it with nobody to acknowledge."""
    producer = producer_app(own, "stops_main_producer")
    task = shared_task(producer, "tests.integration.ledger_app.long_sleeper")
    token = f"main-{random.randint(0, 10**9)}"
    w1 = start(own, "main1", concurrency=1)
    result = task.apply_async((token, 6.0))
    running = wait_for(
        lambda: (
            (r := producer.ledger.get(task.name, token)) is not None
            and r.state is State.RUNNING
            and r
        ),
        what="running",
    )
    child = int(str(running.lease_owner).rsplit(":", 1)[1])
    w1.expect_exit()  # type: ignore[attr-defined]
    os.kill(w1.pid, signal.SIGKILL)
    w1.process.wait(10)
    killed = time.monotonic()
    time.sleep(1.0)
    try:
        stat = Path(f"/proc/{child}/stat").read_text()
        child_alive = stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        child_alive = False
    start(own, "main2", concurrency=1)
    assert result.get(timeout=60) > 0
    back = time.monotonic() - killed
    final = producer.ledger.get(task.name, token)
    slept = world(own).effects.count_documents({"kind": "slept", "key": token})
    print(
        f"\nmain-only SIGKILL: child alive 1s later: {child_alive}; done after {back:.1f}s;"
        f" attempts {final.attempts}; effects {slept}"
    )
    assert not child_alive and slept == 1
    producer.close()


@pytest.mark.parametrize("signum", [signal.SIGQUIT, "double-SIGINT"])
def test_a_cold_shutdown_with_a_job_running_brings_it_back_once(
    own: EmbeddedStack, signum: Any
) -> None:
    """Cold shutdown (SIGQUIT, or a second SIGINT during the warm one) with a job running."""
    producer = producer_app(own, "stops_cold_producer")
    task = shared_task(producer, "tests.integration.ledger_app.long_sleeper")
    token = f"cold-{random.randint(0, 10**9)}"
    w1 = start(own, "cold1", concurrency=1)
    result = task.apply_async((token, 8.0))
    wait_for(
        lambda: (
            (r := producer.ledger.get(task.name, token)) is not None and r.state is State.RUNNING
        ),
        what="running",
    )
    w1.expect_exit()  # type: ignore[attr-defined]
    if signum == "double-SIGINT":
        os.kill(w1.pid, signal.SIGINT)
        time.sleep(0.5)
        os.kill(w1.pid, signal.SIGINT)
    else:
        os.kill(w1.pid, signum)
    w1.process.wait(30)
    stopped = time.monotonic()
    b = broker(own)
    left = producer.ledger.get(task.name, token)
    print(f"\n{signum}: left record {left.state} unacked {b.hlen(UNACKED)} queue {b.llen(QUEUE)}")
    start(own, "cold2", concurrency=1)
    assert result.get(timeout=90) > 0
    final = producer.ledger.get(task.name, token)
    slept = world(own).effects.count_documents({"kind": "slept", "key": token})
    print(
        f"{signum}: done {time.monotonic() - stopped:.1f}s after exit; attempts"
        f" {final.attempts}; effects {slept}"
    )
    assert slept == 1
    producer.close()
