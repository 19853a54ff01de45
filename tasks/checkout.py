"""Checkout: an order, its fulfilment and its confirmation email made in one MongoDB transaction.

Written the usual way (insert the order, then ``fulfil_order.start(...)``), a crash between
the two leaves an order nobody charges, and an order whose transaction aborts after the start
is charged anyway. Here the workflow's start and the email job are written in the order's own
transaction (the outbox): an aborted checkout leaves no order and no job; a committed one runs
its fulfilment and sends its email exactly once, even if this process dies right after the
commit (the workers' outbox relay publishes what it did not).
"""

from __future__ import annotations

from typing import Any

from pymongo.client_session import ClientSession

from .celery import app
from .fulfilment import fulfil_order
from .notifications import send_email

SHOP_DB = "shop"


class OutOfStock(ValueError):
    """An item of the order is not sold any more: the checkout is refused, nothing is kept."""


def place_order(
    order_id: int, customer_id: int, items: list[str], amount_cents: int
) -> dict[str, Any]:
    """Record the order and make its work, atomically; returns the ids to follow it by."""

    def checkout(session: ClientSession) -> dict[str, Any]:
        # The app's collections on the same deployment as the ledger, through the session's
        # client: everything written here commits or aborts together
        shop = session.client.get_database(SHOP_DB)
        if shop.retired_items.find_one({"_id": {"$in": items}}, session=session):
            raise OutOfStock(f"order {order_id}: an item is no longer sold")
        shop.orders.insert_one(
            {"_id": order_id, "customer": customer_id, "items": items, "cents": amount_cents},
            session=session,
        )
        workflow = app.enqueue(session, fulfil_order.s(order_id, items, amount_cents))
        email = send_email.apply_async(
            (customer_id, "order-received", {"order": str(order_id)}),
            idempotency_key=f"order-received-{order_id}",  # one per order, not per template
            session=session,
        )
        return {"order": order_id, "workflow": workflow.id, "email": email.id}

    # Runs the transaction (retried on transient errors), then publishes what it enqueued
    return app.outbox.transaction(checkout)
