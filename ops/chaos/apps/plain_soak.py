"""The soak on plain Celery: ``acks_late`` and ``reject_on_worker_lost``, no ledger, no results."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from kombu.entity import Queue

from . import world
from .ledger_soak import RESTORE_SWEEP

TIERS = ("critical", "default", "bulk")


def queue_of(tier: str) -> str:
    return f"plain_{tier}"


def build(broker_url: str | None = None) -> Celery:
    """The app (broker from ``SOAK_PLAIN_BROKER_URL`` unless given) with ``soak.work``."""
    broker = broker_url or os.environ["SOAK_PLAIN_BROKER_URL"]
    app = Celery("soak_plain", broker=broker, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=os.environ.get("SOAK_PLAIN_REJECT_ON_WORKER_LOST", "1") == "1",
        worker_prefetch_multiplier=1,
        broker_transport_options={
            "visibility_timeout": int(os.environ.get("SOAK_VISIBILITY_TIMEOUT_SECONDS", "30")),
            **RESTORE_SWEEP,
        },
        broker_connection_retry_on_startup=True,
        task_default_queue=queue_of("default"),
        task_queues=[Queue(queue_of(tier)) for tier in TIERS],
    )

    @app.task(  # type: ignore[untyped-decorator]
        bind=True,
        shared=False,
        name="soak.work",
        autoretry_for=(world.FlakyError,),
        default_retry_delay=0.3,
        retry_backoff=False,
        max_retries=8,
    )
    def work(self: Any, key: str, kind: str, param: float) -> str:
        return world.work("plain", key, kind, param, None)

    return app


def __getattr__(name: str) -> Any:  # ``celery -A`` reads ``app``; built on first access
    if name == "app":
        globals()["app"] = build()
        return globals()["app"]
    raise AttributeError(name)
