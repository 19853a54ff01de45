"""The workflow benchmark's app: one ledger task, a sequential workflow of its steps, and the
same steps as a Celery chain (``ops.bench.workflows``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from celery_ledger import LedgerCelery, Settings, create_app


def build(
    env: Mapping[str, str], *, command_listeners: tuple[Any, ...] = (), **overrides: Any
) -> LedgerCelery:
    settings = Settings(
        broker_url=env["LEDGER_BROKER_URL"],
        mongo_uri=env["LEDGER_MONGO_URI"],
        mongo_db=env.get("LEDGER_MONGO_DB", "bench_workflows"),
        ttl_index=False,  # SecantusDB's TTL sweep blocks writes; MongoDB's does not
        **overrides,
    )
    app = create_app(
        "bench_workflows",
        settings=settings,
        set_as_current=False,
        command_listeners=command_listeners,
    )

    @app.task(name="bw.step", idempotency_key="{run}-{i}", shared=False)  # type: ignore[untyped-decorator]
    def step(run: str, i: int) -> int:
        return i

    @app.workflow(name="bw.steps", idempotency_key="{run}")
    def steps(wf: Any, run: str, n: int) -> int:
        total = 0
        for i in range(n):
            total += wf.run(step, f"{run}-wf", i)
        return total

    return app


def __getattr__(name: str) -> Any:  # ``celery -A`` reads ``app``; built on first access
    if name == "app":
        globals()["app"] = build(os.environ)
        return globals()["app"]
    raise AttributeError(name)
