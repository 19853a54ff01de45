"""The fairness benchmark's app: one task of a few ms of CPU on the default tier, whose jobs
name their tenant per call (``apply_async(..., tenant=...)``); the body returns when it ran."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any

from celery_ledger import LedgerCelery, Settings, create_app


def build(env: Mapping[str, str]) -> LedgerCelery:
    settings = Settings(
        broker_url=env["LEDGER_BROKER_URL"],
        mongo_uri=env["LEDGER_MONGO_URI"],
        mongo_db=env.get("LEDGER_MONGO_DB", "bench_fairness"),
        tier_limits={"default": {"high_water": 10_000_000}},
        queue_namespace="bench_fair",
        ttl_index=False,  # (SecantusDB's TTL sweep blocks every write for seconds)
        tenants=json.loads(env.get("BENCH_TENANTS", "{}")),
        fair_queue_depth=int(env.get("BENCH_FAIR_DEPTH", "1")),
    )
    app = create_app("bench_fairness", settings=settings, set_as_current=False)

    @app.task(name="bench.fair_work", idempotency_key="{run}-{i}", shared=False)
    def fair_work(run: str, i: int) -> float:
        ran_at = time.time()  # when the body ran: the wait is this minus the publish time
        deadline = time.perf_counter() + 0.003  # a few ms of CPU
        digest = b""
        while time.perf_counter() < deadline:
            digest = hashlib.sha256(digest + b"x").digest()
        return ran_at

    return app


def __getattr__(name: str) -> Any:  # ``celery -A`` reads ``app``; built on first access
    if name == "app":
        globals()["app"] = build(os.environ)
        return globals()["app"]
    raise AttributeError(name)
