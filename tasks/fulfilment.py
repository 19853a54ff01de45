"""Order fulfilment: a durable workflow over payments, inventory and shipping.

Each step is a ledger task (run once per workflow, whatever crashes); each step with an effect
to undo registers its compensation right after it succeeds, so a later failure, a rejection or a
cancellation undoes exactly what was done, newest first. The cooling-off timer and the wait for
approval hold no worker: the workflow sleeps in the ledger and the delayed set until woken.
"""

from __future__ import annotations

from typing import Any

from celery_ledger import PermanentError

from .celery import app
from .effects import record_effect
from .payments import charge


class NotApproved(PermanentError):
    """Nobody approved the order in time, or somebody rejected it."""


@app.task(idempotency_key="reserve-{order_id}-{item}")
def reserve(order_id: int, item: str) -> str:
    record_effect("reserve", f"{order_id}:{item}")
    return f"{item}@shelf-{order_id % 7}"


@app.task(idempotency_key="release-{order_id}-{item}")
def release(order_id: int, item: str) -> None:
    record_effect("release", f"{order_id}:{item}")


@app.task(idempotency_key="refund-{order_id}", tier="critical")
def refund(order_id: int, charge_id: str) -> str:
    record_effect("refund", str(order_id), charge_id=charge_id)
    return f"re_{charge_id}"


@app.task(idempotency_key="ship-{order_id}")
def ship(order_id: int, items: list[str]) -> str:
    record_effect("ship", str(order_id), items=items)
    return f"parcel-{order_id}"


@app.workflow(idempotency_key="fulfil-{order_id}", tier="critical")
def fulfil_order(
    wf: Any,
    order_id: int,
    items: list[str],
    amount_cents: int,
    cooling_off_seconds: float = 1.0,
    approval_timeout_seconds: float = 86_400.0,
) -> dict[str, Any]:
    """Charge, reserve every item in parallel, wait out the cooling-off period and for an
    approval, then ship. Rejected, timed out or cancelled: refund and release."""
    charged = wf.run(charge, order_id, amount_cents)
    wf.compensate(refund, order_id, charged["charge_id"])
    shelves = wf.gather([reserve.s(order_id, item) for item in items])
    for item in items:
        wf.compensate(release, order_id, item)
    wf.sleep(cooling_off_seconds)
    approval = wf.wait_signal("approved", timeout=approval_timeout_seconds)
    if not approval:
        raise NotApproved(f"order {order_id} was not approved")
    parcel = wf.run(ship, order_id, items)
    return {"charge": charged["charge_id"], "shelves": shelves, "parcel": parcel}
