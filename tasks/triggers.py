"""Loyalty points as orders come in: a change-stream trigger on the orders collection.

Each order inserted into ``reference_world.orders`` runs ``award_points`` once (keyed on the
change, whatever crashes or restarts happen), in the bulk tier: a burst of orders makes the
watcher wait for room instead of flooding the tier. Its write is the loyalty backfill's (an
idempotent ``$max`` per order), so the backfill (:mod:`tasks.backfills`) is also this trigger's
recovery after a stream is lost: reset the trigger, then run the backfill.
"""

from __future__ import annotations

from typing import Any

from celery_ledger.triggers import from_json

from .celery import app
from .effects import effects


@app.on_change("reference_world.orders", match={"operationType": "insert"}, tier="bulk")
def award_points(order: dict[str, Any]) -> dict[str, Any]:
    """Credit one new order's points to its customer (orders without a customer earn none).

    ``order`` is the inserted document as relaxed Extended JSON; ``from_json`` restores its
    BSON types (an ``ObjectId`` ``_id``, a ``Decimal128`` amount, a ``datetime``).
    """
    doc = from_json(order)
    customer, cents = doc.get("customer_id"), doc.get("amount_cents")
    if customer is None or not isinstance(cents, int):
        return {"order": str(doc.get("_id")), "points": 0}
    points = cents // 100
    effects().database.get_collection("loyalty_points").update_one(
        {"_id": customer}, {"$max": {f"orders.{doc['_id']}": points}}, upsert=True
    )
    return {"order": str(doc["_id"]), "points": points}
