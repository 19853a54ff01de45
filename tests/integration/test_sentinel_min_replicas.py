"""A primary set to refuse writes without its replicas (``min-replicas-to-write``, the setting
that bounds what a failover can lose: docs/operations/deployment.md), on a failover group of
its own with a real worker. While its replicas are away every write is refused (NOREPLICAS):
the worker's takes, bookings and acknowledgements, the producer's publishes, the housekeeping's
locks. Nothing may end the worker or lose a job: once the replicas are back, every job
published before, during (a refused publish, tried again, as the caller is told) and after
runs once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from celery_ledger.embedded.stack import EmbeddedStack
from celery_ledger.health import Check, run_checks

from .failover import (
    RECORD,
    SETTLE_SECONDS,
    assert_worker_stayed,
    group_producer,
    group_worker,
    loaded,
    node_client,
    paused,
    replicated,
    runs_not_once,
    sentinel_group,
    wait_all_ran,
)
from .helpers import shared_task, wait_for

pytestmark = pytest.mark.integration
MAX_LAG_SECONDS = 2


def replicas_check(producer: Any) -> Check:
    return next(c for c in run_checks(producer, required=(), timeout=2) if c.name == "replicas")


def test_a_primary_refusing_writes_without_its_replicas_loses_no_job_and_ends_no_worker(
    tmp_path: Path, stack: EmbeddedStack
) -> None:
    with sentinel_group(tmp_path / "sentinel") as group:
        replicated(group)  # (the replicas' first sync done: they count as good from then on)
        for node in group.nodes:  # (every node: any may be the primary)
            with node_client(group, node) as client:
                client.config_set("min-replicas-to-write", "1")
                client.config_set("min-replicas-max-lag", str(MAX_LAG_SECONDS))
        worker = group_worker(tmp_path / "stack", stack, group)
        pid = worker.pid
        producer = group_producer(stack, group, "min-replicas-producer")
        try:
            primary = group.primary()
            replicas = [node for node in group.nodes if node is not primary]
            refused: list[Any] = []
            with loaded(shared_task(producer, RECORD)) as load:
                time.sleep(2.0)  # (jobs published and run before)
                assert replicas_check(producer).status == "ok"
                # When the replicas stop (not past the sentinels' timeout for a primary: no
                # failover), so that the primary refuses writes once their lag passes the bound
                with paused(*replicas):

                    def refusing() -> bool:
                        with node_client(group, primary) as client:
                            try:
                                client.set("min-replicas-probe", "1")
                            except Exception as exc:
                                refused.append(exc)
                                return True
                        return False

                    wait_for(refusing, timeout=30, what="the primary refusing writes")
                    # (and the health check warns: a publish while the ledger is away would be
                    # refused too, NotReplicated, for want of a replica to confirm it)
                    warned = replicas_check(producer)
                    assert warned.status == "warn", warned
                    refusals = load.refusals
                    time.sleep(6.0)  # the worker and the producer meet the refusals meanwhile
                    during = load.refusals - refusals
                wait_for(lambda: not refusing(), timeout=30, what="the primary taking writes")
                time.sleep(3.0)  # (jobs published after)
            tokens = load.tokens()
            # Then every job runs, once, and the worker never ended
            took = wait_all_ran(tokens, timeout=180)
            time.sleep(SETTLE_SECONDS)
            assert runs_not_once(tokens) == {}
            assert_worker_stayed(worker, pid)
            assert "NOREPLICAS" in str(refused[0])
            print(
                f"{len(tokens)} jobs, {during} publishes refused while the replicas were away,"
                f" all ran {took:.1f} s after the load stopped"
            )
        finally:  # (a failed assertion leaves no worker running past the test)
            worker.stop()
            producer.close()
