"""Self-healing without celery beat or an operator: a job whose whole worker is SIGKILLed comes
back by itself on another live worker, from its last checkpoint.

The workers' own housekeeping runs the reconciler (one sweeper at a time, a lease lock in
Redis): once the dead holder's lease has ended, the sweeper puts the job's unacknowledged
message back on its queue, and a live worker takes the job over with a higher fencing token.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import redis
from pymongo import MongoClient

from celery_ledger import State
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess
from celery_ledger.progress import shutdown_flag

from .conftest import (
    HEALING_GRACE,
    HEALING_LEASE,
    HEALING_SWEEP_EVERY,
    UNACKED,
    producer_app,
    start_healing_worker,
)
from .helpers import shared_task, wait_for

N_DOCS = 3000


def worker(isolated: EmbeddedStack, name: str) -> WorkerProcess:
    return start_healing_worker(isolated, name, concurrency=1)


def test_a_job_whose_whole_worker_is_killed_twice_resumes_by_itself(
    isolated: EmbeddedStack,
) -> None:
    assert isolated.ledger is not None
    producer = producer_app(isolated, "healing_producer")
    backfill = shared_task(producer, "tests.integration.ledger_app.backfill_docs")
    world = MongoClient(isolated.ledger.url, tz_aware=True).get_database("reference_world")
    token = f"heal-{random.randint(0, 10**9)}"
    world.get_collection(f"source_{token}").insert_many(
        [{"_id": i, "payload": i} for i in range(N_DOCS)]
    )
    workers = {name: worker(isolated, name) for name in ("w1", "w2")}

    def reads() -> int:
        return sum(d["n"] for d in world.effects.find({"kind": "read", "key": token}))

    def record() -> Any:
        return producer.ledger.get(backfill.name, token)

    # Given a long checkpointed job (30 batches of 100, 0.25 s each) and no beat running
    result = backfill.apply_async((token,), kwargs={"batch_size": 100, "pause": 0.25})
    fence = 0
    for kill in range(2):
        running = wait_for(
            lambda f=fence: (
                (r := record()) is not None and r.state is State.RUNNING and r.fence > f and r
            ),
            timeout=60,
            what=f"the job running (before kill {kill + 1})",
        )
        target = reads() + random.randint(1, 8) * 100
        wait_for(lambda t=target: reads() >= t, timeout=60, what="progress")
        # When the whole worker holding it dies (a host crash): pool and main process
        holder = str(running.lease_owner).split("@", 1)[0]
        workers[holder].kill()
        killed_at = time.monotonic()
        # Then a live worker takes it over by itself, within about lease + sweep interval
        taken = wait_for(
            lambda f=running.fence: (
                (r := record()) is not None and r.state is State.RUNNING and r.fence > f and r
            ),
            timeout=HEALING_LEASE + HEALING_GRACE + HEALING_SWEEP_EVERY + 20,
            what="another worker taking the job over",
        )
        print(f"kill {kill + 1}: taken over after {time.monotonic() - killed_at:.1f}s")
        assert str(taken.lease_owner).split("@", 1)[0] != holder
        workers[holder] = worker(isolated, holder)  # the host comes back (for the next kill)
        fence = running.fence

    # And the job finishes, every document processed once, resumed from its checkpoints
    assert result.get(timeout=120) > 0
    final = record()
    assert final.state is State.SUCCEEDED and final.attempts == 3
    processed = world.processed.count_documents({"_id": {"$regex": f"^{token}:"}})
    assert processed == N_DOCS
    assert N_DOCS <= reads() <= N_DOCS + 2 * 100  # at most the batch in flight, per kill
    assert final.model_dump().get("lease_owner") is None
    reconciled = producer.ledger.find_raw(final.id)
    assert reconciled is not None and reconciled.get("reconciled", 0) >= 2
    producer.close()


def test_a_message_a_dead_worker_took_before_its_claim_comes_back_by_itself(
    isolated: EmbeddedStack,
) -> None:
    """The whole worker dies between taking a message and claiming its job: no record says
    anything is wrong, and kombu would put the message back only after its visibility timeout
    (an hour). The workers' reconciler puts it back once it has been held a lease without a
    claim."""
    assert isolated.ledger is not None and isolated.broker is not None
    producer = producer_app(isolated, "stranded_producer")
    task = shared_task(producer, "tests.integration.ledger_app.record")
    token = f"taken-{random.randint(0, 10**9)}"
    broker = redis.Redis.from_url(isolated.broker.url)
    # Given a worker holding the job's message, its claim held up by a ledger that does not
    # answer (a stopped process)
    first = start_healing_worker(
        isolated, "taker", concurrency=1, env={"LEDGER_MONGO_TIMEOUT_MS": "15000"}
    )
    os.kill(isolated.ledger.pid, signal.SIGSTOP)
    try:
        result = task.apply_async((token,))
        wait_for(lambda: broker.hlen(UNACKED) >= 1, timeout=30, interval=0.02, what="taken")
        # When the whole worker dies (a host crash) before its claim
        first.expect_exit()
        first.kill()
    finally:
        os.kill(isolated.ledger.pid, signal.SIGCONT)
    killed_at = time.monotonic()
    assert producer.ledger.get(task.name, token) is None  # nothing in the ledger says so
    worker(isolated, "survivor")
    # Then a live worker runs it once, within about a lease and a sweep, not an hour
    assert (
        result.get(timeout=HEALING_LEASE + HEALING_GRACE + HEALING_SWEEP_EVERY + 30)["token"]
        == token
    )
    print(f"back after {time.monotonic() - killed_at:.1f}s")
    final = producer.ledger.get(task.name, token)
    assert final.state is State.SUCCEEDED and final.attempts == 1
    assert broker.hlen(UNACKED) == 0
    producer.close()


def test_a_job_released_for_a_requeue_its_dying_worker_never_sent_comes_back(
    isolated: EmbeddedStack,
) -> None:
    """A warm shutdown: the body checkpoints and releases its claim for the main process to
    hand its message back; the main process is killed first (a supervisor's grace period).
    The record says ``queued`` and the message sits unacknowledged: the reconciler puts it
    back, and the job resumes from its checkpoint."""
    assert isolated.ledger is not None and isolated.broker is not None
    producer = producer_app(isolated, "released_producer")
    backfill = shared_task(producer, "tests.integration.ledger_app.backfill_docs")
    world = MongoClient(isolated.ledger.url, tz_aware=True).get_database("reference_world")
    token = f"released-{random.randint(0, 10**9)}"
    world.get_collection(f"source_{token}").insert_many(
        [{"_id": i, "payload": i} for i in range(N_DOCS)]
    )
    first = worker(isolated, "stopping")
    result = backfill.apply_async((token,), kwargs={"batch_size": 100, "pause": 0.25})
    wait_for(
        lambda: sum(d["n"] for d in world.effects.find({"kind": "read", "key": token})) >= 300,
        timeout=60,
        what="progress",
    )
    # Given the body told of a warm shutdown (the flag the main process's handler writes),
    # the main process too busy to requeue anything (stopped)
    first.expect_exit()
    os.kill(first.pid, signal.SIGSTOP)
    flag = shutdown_flag(first.pid)
    flag.touch()
    try:
        wait_for(
            lambda: producer.ledger.get(backfill.name, token).state is State.QUEUED,
            timeout=30,
            what="the claim released",
        )
        # When the supervisor kills the whole worker before its requeue
        os.killpg(first.pid, signal.SIGKILL)
        first.process.wait(10)
    finally:
        flag.unlink(missing_ok=True)
    worker(isolated, "survivor")
    # Then the job comes back by itself and finishes, resumed from its checkpoint
    assert result.get(timeout=120) > 0
    final = producer.ledger.get(backfill.name, token)
    assert final.state is State.SUCCEEDED
    assert world.processed.count_documents({"_id": {"$regex": f"^{token}:"}}) == N_DOCS
    assert sum(d["n"] for d in world.effects.find({"kind": "read", "key": token})) < 2 * N_DOCS
    producer.close()
