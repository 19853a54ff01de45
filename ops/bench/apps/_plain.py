"""Plain Celery (no ledger) with the same delivery settings as a celery-ledger app."""

from __future__ import annotations

from collections.abc import Mapping

from celery import Celery


def build_plain(env: Mapping[str, str], *, backend: str, track_started: bool) -> Celery:
    """A plain Celery app on ``BENCH_BROKER_URL`` whose one task is ``bench.noop``.

    Delivery settings match ``create_app`` (JSON, ``acks_late``, ``reject_on_worker_lost``,
    prefetch 1) unless ``BENCH_PLAIN_DEFAULTS=1`` asks for Celery's own defaults; kombu's Redis
    transport unless ``BENCH_LEDGER_TRANSPORT=1`` asks for celery-ledger's.
    """
    app = Celery(
        "bench_plain", broker=env["BENCH_BROKER_URL"], backend=backend, set_as_current=False
    )
    app.conf.update(
        task_default_queue=env.get("BENCH_QUEUE", "bench"),
        task_track_started=track_started,
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
    )
    if env.get("BENCH_LEDGER_TRANSPORT") == "1":
        # celery-ledger's broker transport class (its credit repair for pools without an event
        # loop, its kept Redis client), without the rest of create_app's settings: a baseline
        # that drains the broker as the ledger's workers do.
        app.conf.broker_transport = "celery_ledger.transport:Transport"
    if env.get("BENCH_PLAIN_DEFAULTS") != "1":
        app.conf.update(
            task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1
        )

    @app.task(name="bench.noop", shared=False)  # type: ignore[untyped-decorator]
    def noop(run: str, i: int) -> int:
        return i

    return app
