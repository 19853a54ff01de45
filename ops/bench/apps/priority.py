"""The flood benchmark's app: bulk work (a few ms each) and critical pings, both LedgerTasks.

``BENCH_NAIVE=1`` routes both to one queue (``default``), as a single-queue setup would.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping
from typing import Any

from celery_ledger import LedgerCelery, Settings, create_app


def build(env: Mapping[str, str]) -> LedgerCelery:
    naive = env.get("BENCH_NAIVE") == "1"
    settings = Settings(
        broker_url=env["LEDGER_BROKER_URL"],
        mongo_uri=env["LEDGER_MONGO_URI"],
        mongo_db=env.get("LEDGER_MONGO_DB", "bench_priority"),
        routing_rules={"bench.*": "default"} if naive else {},
        tier_limits={"bulk": {"high_water": 1_000_000}},
        queue_namespace="",  # the benchmark's workers consume the bare tier names
        # The latency-driven throttle, as an app with a foreground budget would set it
        # (the benchmark's producer reports the critical latency it sees).
        throttle_latency_ms=float(env.get("BENCH_THROTTLE_MS", "500")),
        throttle_check_seconds=float(env.get("BENCH_THROTTLE_CHECK_SECONDS", "1.0")),
    )
    app = create_app("bench_priority", settings=settings, set_as_current=False)

    @app.task(name="bench.bulk_work", idempotency_key="{run}-{i}", tier="bulk", shared=False)
    def bulk_work(run: str, i: int) -> int:
        deadline = time.perf_counter() + 0.003  # a few ms of CPU
        digest = b""
        while time.perf_counter() < deadline:
            digest = hashlib.sha256(digest + b"x").digest()
        return i

    @app.task(name="bench.critical", idempotency_key="{run}-{i}", tier="critical", shared=False)
    def critical(run: str, i: int) -> float:
        return time.time()  # when the body ran: latency = this minus the publish time

    return app


def __getattr__(name: str) -> Any:  # ``celery -A`` reads ``app``; built on first access
    if name == "app":
        globals()["app"] = build(os.environ)
        return globals()["app"]
    raise AttributeError(name)
