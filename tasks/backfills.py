"""A long job: recompute every order's loyalty points, resumable after any crash or deploy."""

from __future__ import annotations

from typing import Any

from pymongo import UpdateOne

from .celery import app
from .effects import effects, record_effect


@app.task(
    bind=True,
    tier="bulk",
    idempotency_key="loyalty-backfill-{run_id}",
    soft_time_limit=3600,  # retired (dead, with cleanup) after an hour of running ...
    time_limit=3700,  # ... or killed for good shortly after
    max_age_seconds=24 * 3600,  # a message older than a day is retired, not run
    max_attempts=20,
)
def loyalty_backfill(self: Any, run_id: str, batch_size: int = 500) -> dict[str, int]:
    """Walk the orders in ``_id`` order, 500 per query, updating each customer's points.

    Each batch is written idempotently (``$max`` of a per-order value), and the cursor is
    checkpointed after it, so a crash re-reads at most the batch in flight. On a warm shutdown
    the job checkpoints, hands its message back and resumes on another worker.
    """
    orders = effects().database.get_collection("orders")
    points = effects().database.get_collection("loyalty_points")
    done = 0
    for batch in self.batches(orders, batch_size=batch_size, name="orders"):
        points.bulk_write(
            [
                UpdateOne(
                    {"_id": order["customer_id"]},
                    {"$max": {f"orders.{order['_id']}": order["amount_cents"] // 100}},
                    upsert=True,
                )
                for order in batch
            ],
            ordered=False,
        )
        done += len(batch)

    # A side effect that must happen once per run, even if the job is retried after it.
    self.step("announce").run(lambda: record_effect("announcement", f"loyalty-{run_id}"))
    return {"orders_this_attempt": done}
