"""(d) celery-ledger with its security on: every message signed (``LEDGER_SIGNING_KEYS``) and
``bench.noop`` a sensitive task (its message body sealed by the publisher, its result and kept
message sealed in the ledger). Against (c), the cost of both in the same run."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from celery_ledger import LedgerCelery, Settings, create_app

# Fixed bench-only keys: the producer (this process) and the worker must share them.
SIGNING_KEY = "bench-signing-key-0123456789abcdef0123456789"
FERNET_KEY = "AcKyJ2oLnrAAy_LZcIqJcLFxu0NMYeTJnp7JIrpzIs4="


def build(env: Mapping[str, str]) -> LedgerCelery:
    settings = Settings(
        broker_url=env["LEDGER_BROKER_URL"],
        mongo_uri=env["LEDGER_MONGO_URI"],
        mongo_db=env.get("LEDGER_MONGO_DB", "bench_ledger_secured"),
        signing_keys=[SIGNING_KEY],
        encryption_keys=[FERNET_KEY],
    )
    app = create_app("bench_ledger_secured", settings=settings, set_as_current=False)
    app.conf.task_default_queue = env.get("BENCH_QUEUE", "bench")

    @app.task(  # type: ignore[untyped-decorator]
        name="bench.noop", idempotency_key="{run}-{i}", sensitive=True, shared=False
    )
    def noop(run: str, i: int) -> int:
        return i

    return app


def __getattr__(name: str) -> Any:  # ``celery -A`` reads ``app``; built on first access
    if name == "app":
        globals()["app"] = build(os.environ)
        return globals()["app"]
    raise AttributeError(name)
