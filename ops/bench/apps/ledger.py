"""(c) celery-ledger: ``create_app``, settings from ``LEDGER_*``; ``bench.noop`` is a LedgerTask."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from celery_ledger import LedgerCelery, Settings, create_app


def build(env: Mapping[str, str]) -> LedgerCelery:
    settings = Settings(
        broker_url=env["LEDGER_BROKER_URL"],
        mongo_uri=env["LEDGER_MONGO_URI"],
        mongo_db=env.get("LEDGER_MONGO_DB", "bench_ledger"),
        group_commit_max=int(env.get("BENCH_GROUP_COMMIT_MAX", "128")),
        # The default (on) unless a configuration measures the producer without it
        dedupe_on_publish=env.get("BENCH_DEDUPE_ON_PUBLISH", "1") != "0",
    )
    app = create_app("bench_ledger", settings=settings, set_as_current=False)
    app.conf.task_default_queue = env.get("BENCH_QUEUE", "bench")

    @app.task(name="bench.noop", idempotency_key="{run}-{i}", shared=False)  # type: ignore[untyped-decorator]
    def noop(run: str, i: int) -> int:
        return i

    return app


def __getattr__(name: str) -> Any:  # ``celery -A`` reads ``app``; built on first access
    if name == "app":
        globals()["app"] = build(os.environ)
        return globals()["app"]
    raise AttributeError(name)
