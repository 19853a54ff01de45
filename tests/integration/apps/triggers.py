"""An app with a change-stream trigger: each order inserted into ``reference_world.<collection>``
runs ``triggers.on_order`` once, whose effect (one document per order) counts its runs.

The watched collection is ``TRIGGER_TEST_COLLECTION`` (each test watches its own); the lease
is short (3 s) so that a killed watcher is replaced within the test's patience.
"""

from __future__ import annotations

import os
from typing import Any

from celery_ledger import create_app
from celery_ledger.triggers import from_json
from tasks.effects import effects

NAME = "triggers"
TASK = "triggers.on_order"
# Short, so a killed watcher is replaced quickly; a test of who holds it sets a longer one
LEASE_SECONDS = float(os.environ.get("TRIGGER_TEST_LEASE_SECONDS", "3"))
EFFECTS = "trigger_effects"  # in reference_world: one document per order, with its runs


def collection_name() -> str:
    return os.environ.get("TRIGGER_TEST_COLLECTION", "trigger_orders")


def on_order(order: dict[str, Any]) -> str:
    """The order's effect, idempotent at its receiver (one document per order, as the README
    asks of effects outside the ledger), counting the runs that reached it; the argument's
    types say how BSON arrived."""
    restored = from_json(order)
    effects().database.get_collection(EFFECTS).update_one(
        {"_id": str(restored["_id"])},
        {
            "$setOnInsert": {
                "amount": str(restored.get("amount")),
                "amount_type": type(restored.get("amount")).__name__,
                "placed_type": type(restored.get("placed_at")).__name__,
            },
            "$inc": {"runs": 1},
        },
        upsert=True,
    )
    return str(restored["_id"])


def register(app: Any, collection: str | None = None) -> Any:
    """The trigger on ``app`` (a probe app of a test declares it too, for the health check)."""
    return app.on_change(
        f"reference_world.{collection or collection_name()}",
        match={"operationType": "insert"},
        tier="bulk",
        name=TASK,
        lease_seconds=LEASE_SECONDS,
    )(on_order)


app = create_app(NAME, set_as_current=False)
on_order_task = register(app)
