"""The pool benchmark (``ops.bench.pool``) measures what it says: every message it takes off
the broker is run through Celery's request path to its expected result and acknowledged, and
its profile puts the ledger's own code in celery-ledger's layer and none of it in plain
Celery's."""

from __future__ import annotations

import multiprocessing
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis

from ops.bench.common import Servers
from ops.bench.pool import LAYERS, OTHER, run_once
from ops.bench.throughput import CONFIGURATIONS


def _profiles(servers: Servers, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Each configuration's profile of 40 tasks, measured in the calling process."""
    by_name = {c.name: c for c in CONFIGURATIONS}
    split = {}
    for name in names:
        # run_once raises if a message is not the one published or a task returns another value
        measured, profile = run_once(servers, by_name[name], tasks=40, profile=True)
        assert measured.tasks == 40 and measured.cpu_ms_per_task > 0
        assert profile is not None
        split[name] = profile
    return split


def test_pool_benchmark_runs_each_task_and_splits_its_cpu(stack: Any, tmp_path: Path) -> None:
    assert stack.broker is not None and stack.ledger is not None
    servers = Servers(stack.broker, stack.ledger, tmp_path)
    by_name = {c.name: c for c in CONFIGURATIONS}
    # plain first: a ledger app once built keeps its task log filter for the process's life
    # (the child logs below INFO, so Celery's task lines, and the filter, are not reached)
    names = ("plain-mongo-durable", "ledger")
    # Profiled in a process of its own, as the benchmark's is: Celery's signals are the
    # process's, and a test that ran before this one in this process may have left a ledger
    # app's receivers (metrics, tracing, logs) connected, which a plain app's tasks would pass
    # through. The servers go by their addresses (a child cannot hold their processes).
    portable = Servers(
        replace(stack.broker, process=None), replace(stack.ledger, process=None), tmp_path
    )
    # (a pool that ends its process on the way out, a timeout included: an executor's exit
    # would wait for a stuck child, past the test's own timeout)
    with multiprocessing.get_context("spawn").Pool(1) as child:
        split = child.apply_async(_profiles, (portable, names)).get(timeout=240)
    for profile in split.values():
        assert set(profile) <= {n for n, _ in LAYERS} | {OTHER}
        assert profile["pymongo, bson"] > 0 and profile["Celery, kombu"] > 0
    assert split["ledger"].get("celery-ledger", 0) > 0
    assert split["plain-mongo-durable"].get("celery-ledger", 0) == 0
    # every message was acknowledged, as a worker's consumer does: none went back to its queue
    # when the run's connection closed
    broker = redis.Redis.from_url(stack.broker.url)
    for name in names:
        assert broker.llen(by_name[name].queue) == 0
    measured, _ = run_once(servers, by_name["ledger"], tasks=10)
    assert measured.tasks == 10 and broker.llen(by_name["ledger"].queue) == 0
