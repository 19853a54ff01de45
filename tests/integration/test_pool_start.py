"""A pool process killed (SIGKILL) as its worker starts, before the worker's first loop (the OOM
killer, an operator, a deploy tool): the worker goes on with a new process in its place and
runs jobs once each. Celery's prefork pool ended the whole worker ("Could not start worker
processes"), as the failover soak saw; celery_ledger.prefork keeps that for a process that exits
by itself."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from celery_ledger.embedded.stack import EmbeddedStack

from .conftest import producer_app, start_healing_worker
from .helpers import effect_count, shared_task, wait_for

KILL_FIRST_POOL_PROCESS = "TEST_KILL_FIRST_POOL_PROCESS"  # (ledger_app.py's; not imported
# here: the test app binds to the session's servers when it is first imported)

pytestmark = pytest.mark.integration


def test_a_pool_process_killed_as_its_worker_starts_does_not_end_the_worker(
    own: EmbeddedStack, tmp_path: Path
) -> None:
    # Given a worker one of whose pool processes is SIGKILLed as it starts
    killed = tmp_path / "killed"
    worker = start_healing_worker(
        own, "pool-start", concurrency=2, env={KILL_FIRST_POOL_PROCESS: str(killed)}
    )
    # When jobs are published to it
    producer = producer_app(own, "pool_start")
    task = shared_task(producer, "tests.integration.ledger_app.record")
    tokens = [f"pool-start-{uuid.uuid4().hex[:8]}-{n}" for n in range(6)]
    for token in tokens:
        task.delay(token)
    # Then they run, once each, and the worker lives on, its process replaced
    wait_for(
        lambda: all(effect_count("record", t) == 1 for t in tokens),
        timeout=60,
        what="every job to run",
    )
    assert killed.exists(), "no pool process was killed: the case did not arise"
    log = worker.log_path.read_text(errors="replace")
    assert "Could not start worker processes" not in log
    assert "pool process(es) killed (SIGKILL) as the worker started: replaced" in log
    assert worker.alive()
    assert [t for t in tokens if effect_count("record", t) != 1] == []
    producer.close()
