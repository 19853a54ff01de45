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
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from celery_ledger import State
from celery_ledger.embedded.stack import EmbeddedStack

from .conftest import (
    DEFAULT_QUEUE,
    UNACKED,
    broker_client,
    producer_app,
    start_healing_worker,
)
from .helpers import shared_task, wait_for


def world(stack: EmbeddedStack) -> Any:
    assert stack.ledger is not None
    return MongoClient(stack.ledger.url, tz_aware=True).get_database("reference_world")


def test_the_main_process_killed_alone_takes_its_pool_with_it_and_the_job_comes_back(
    own: EmbeddedStack,
) -> None:
    """SIGKILL of the prefork main process only: a pool process left running its body would
    hold the lease and write under it with nobody to acknowledge."""
    producer = producer_app(own, "stops_main_producer")
    task = shared_task(producer, "tests.integration.ledger_app.long_sleeper")
    token = f"main-{random.randint(0, 10**9)}"
    w1 = start_healing_worker(own, "main1", concurrency=1)
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
    start_healing_worker(own, "main2", concurrency=1)
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
    w1 = start_healing_worker(own, "cold1", concurrency=1)
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
    b = broker_client(own)
    left = producer.ledger.get(task.name, token)
    waiting = b.llen(DEFAULT_QUEUE)
    print(f"\n{signum}: left record {left.state} unacked {b.hlen(UNACKED)} queue {waiting}")
    start_healing_worker(own, "cold2", concurrency=1)
    assert result.get(timeout=90) > 0
    final = producer.ledger.get(task.name, token)
    slept = world(own).effects.count_documents({"kind": "slept", "key": token})
    print(
        f"{signum}: done {time.monotonic() - stopped:.1f}s after exit; attempts"
        f" {final.attempts}; effects {slept}"
    )
    assert slept == 1
    producer.close()
