"""The pool benchmark (``ops.bench.pool``) measures what it says: every message it takes off
the broker is run through Celery's request path to its expected result and acknowledged, and
its profile puts the ledger's own code in celery-ledger's layer and none of it in plain
Celery's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from ops.bench.common import Servers
from ops.bench.pool import LAYERS, OTHER, run_once
from ops.bench.throughput import CONFIGURATIONS


def test_pool_benchmark_runs_each_task_and_splits_its_cpu(stack: Any, tmp_path: Path) -> None:
    assert stack.broker is not None and stack.ledger is not None
    servers = Servers(stack.broker, stack.ledger, tmp_path)
    by_name = {c.name: c for c in CONFIGURATIONS}
    split = {}
    for name in ("plain-mongo-durable", "ledger"):
        # run_once raises if a message is not the one published or a task returns another value
        measured, profile = run_once(servers, by_name[name], tasks=40, profile=True)
        assert measured.tasks == 40 and measured.cpu_ms_per_task > 0
        assert profile is not None and set(profile) <= {n for n, _ in LAYERS} | {OTHER}
        split[name] = profile
    assert split["ledger"].get("celery-ledger", 0) > 0
    assert split["plain-mongo-durable"].get("celery-ledger", 0) == 0
    for profile in split.values():
        assert profile["pymongo, bson"] > 0 and profile["Celery, kombu"] > 0
    # every message was acknowledged, as a worker's consumer does: none went back to its queue
    # when the run's connection closed
    broker = redis.Redis.from_url(stack.broker.url)
    for name in ("plain-mongo-durable", "ledger"):
        assert broker.llen(by_name[name].queue) == 0
    measured, _ = run_once(servers, by_name["ledger"], tasks=10)
    assert measured.tasks == 10 and broker.llen(by_name["ledger"].queue) == 0
