"""The main job: start the embedded stack, run a workload of the reference app, report.

    python -m tasks.demo            (what ``./run demo`` runs)

Every charge is published twice and every email three times, as an at-least-once producer
would; the gateway fails a fifth of the calls, so charges retry. The report shows that each
job's effect happened exactly once.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from celery_ledger.embedded.stack import running_stack
from celery_ledger.policies.breaker import BreakerState

console = Console(width=max(Console().width, 100))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path(".ledger-dev"))
    parser.add_argument("--orders", type=int, default=40)
    parser.add_argument("--emails", type=int, default=20)
    parser.add_argument("--reports", type=int, default=30)
    args = parser.parse_args()

    os.environ.setdefault("LEDGER_BUSY_RECHECK_SECONDS", "1")
    console.print("[bold]Starting the embedded stack[/] (valkey-server, SecantusDB, 3 workers)...")
    started = time.monotonic()
    # The reference app's tier queues are named after it ("reference.critical", ...)
    namespace = os.environ.get("LEDGER_QUEUE_NAMESPACE", "reference")
    with running_stack("tasks", args.data_dir, queue_namespace=namespace) as stack:
        console.print(stack.describe(), highlight=False, soft_wrap=True)
        console.print(f"up in {time.monotonic() - started:.1f}s\n")
        report = run_workload(args.orders, args.emails, args.reports)
    console.print("stack stopped.")
    return 0 if report["ok"] else 1


def run_workload(orders: int, emails: int, reports: int) -> dict[str, Any]:
    from tasks import app
    from tasks.effects import effects
    from tasks.notifications import send_email
    from tasks.payments import charge
    from tasks.reports import rebuild_report

    run = int(time.time())  # fresh keys each run; the ledger keeps earlier runs' records
    # The data directory keeps the broker's and the ledger's state between runs, breakers
    # included: one an earlier run left open or half-open (its gateway's random timeouts, its
    # degradation example) would send this run's jobs to their fallbacks. Start them closed.
    for name in ("gateway", "backup-gateway", "fraud", "warehouse", "mail"):
        app.breakers[name].reset()
    jobs: list[tuple[Any, str, Any]] = []  # (task, key, AsyncResult)
    published: Counter[str] = Counter()
    started = time.monotonic()
    for i in range(orders):
        order_id = run * 1000 + i
        for _ in range(2):
            result = charge.delay(order_id, 1000 + i)
            published[charge.name] += 1
        jobs.append((charge, f"order-{order_id}", result))
    for i in range(emails):
        user_id = run * 1000 + i
        for _ in range(3):
            result = send_email.delay(user_id, "welcome", {"name": f"user {i}"})
            published[send_email.name] += 1
        jobs.append((send_email, f"email-{user_id}-welcome", result))
    for i in range(reports):
        result = rebuild_report.delay(f"sales-{run}", f"2026-10-{i + 1:02d}")
        published[rebuild_report.name] += 1
        jobs.append((rebuild_report, "", result))
    console.print(f"published {sum(published.values())} messages for {len(jobs)} jobs")

    for _, _, result in jobs:
        result.get(timeout=120, propagate=False)
    elapsed = time.monotonic() - started
    # Let the late duplicate deliveries be suppressed before counting them.
    expected_duplicates = sum(published.values()) - len(jobs)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        records = [app.ledger.get_by_id(result.id) for _, _, result in jobs]
        if sum(r.duplicates for r in records if r) >= expected_duplicates:
            break
        time.sleep(0.5)

    table = Table(title="celery-ledger demo: exactly-once effects")
    for column in ("task", "sent", "jobs", "ok", "dead", "effects", "max/key", "dups", "retries"):
        table.add_column(column, justify="right" if column != "task" else "left")
    ok = True
    for task in (charge, send_email, rebuild_report):
        mine = [(key, r) for t, key, r in jobs if t is task]
        records = [app.ledger.get_by_id(r.id) for _, r in mine]
        kind = task.name.rsplit(".", 1)[-1].replace("rebuild_report", "report").replace("send_", "")
        per_key = Counter(
            doc["key"]
            for doc in effects().find(
                {
                    "kind": kind,
                    "key": {
                        "$in": [k for k, _ in mine]
                        if kind != "report"
                        else [f"sales-{run}:2026-10-{i + 1:02d}" for i in range(reports)]
                    },
                }
            )
        )
        succeeded = sum(1 for r in records if r and r.state == "succeeded")
        dead = sum(1 for r in records if r and r.state == "dead")
        max_effects = max(per_key.values(), default=0)
        ok &= max_effects == 1 and succeeded + dead == len(mine)
        table.add_row(
            task.name.removeprefix("tasks."),
            str(published[task.name]),
            str(len(mine)),
            str(succeeded),
            str(dead),
            str(sum(per_key.values())),
            str(max_effects),
            str(sum(r.duplicates for r in records if r)),
            str(sum(r.attempts - 1 for r in records if r)),
        )
    console.print(table)
    console.print(
        "sent: messages published; effects: side effects that happened (counted in "
        "MongoDB); max/key: most effects of one key; dups: deliveries suppressed by "
        "the ledger; retries: extra attempts after gateway timeouts"
    )
    backfill_orders(run)
    ok &= fulfil_orders(run)
    ok &= checkout_in_a_transaction(run)
    ok &= vault_cards(run)
    ok &= degrade_while_down(run)
    sample = app.ledger.get(charge.name, jobs[0][1])
    if sample is not None:
        console.print(
            f"sample result of {sample.key}: {sample.result} (attempts {sample.attempts})"
        )
    console.print(
        f"all jobs settled in {elapsed:.1f}s; "
        + (
            "[green]every job's effect happened exactly once[/]"
            if ok
            else "[red]exactly-once check FAILED[/]"
        )
    )
    return {"ok": ok}


def fulfil_orders(run: int, n: int = 5) -> bool:
    """The durable-workflow example: ``n`` orders fulfilled by ``tasks.fulfilment``; the last
    one is rejected, so its charge is refunded and its items released."""
    from tasks.effects import effects
    from tasks.fulfilment import fulfil_order
    from tasks.payments import order_key

    started = time.monotonic()
    handles = []
    for i in range(n):
        order_id = run * 1000 + 900 + i
        handle = fulfil_order.start(order_id, ["book", "lamp"], 2500 + i)
        assert fulfil_order.start(order_id, ["book", "lamp"], 2500 + i).id == handle.id
        handles.append((order_id, handle))
    for i, (_, handle) in enumerate(handles):
        handle.signal("approved", i < n - 1)  # kept until the workflow waits for it
    table = Table(title="celery-ledger demo: durable workflows (tasks/fulfilment.py)")
    for column in ("order", "status", "charge", "reserved", "shipped", "refunded", "released"):
        table.add_column(column, justify="left" if column in ("order", "status") else "right")
    ok = True
    for i, (order_id, handle) in enumerate(handles):
        handle.result(timeout=120, propagate=False)
        status = handle.status()
        counts = {
            kind: effects().count_documents({"kind": kind, "key": {"$regex": f"^{order_id}"}})
            for kind in ("reserve", "ship", "refund", "release")
        }
        # The step's charge is keyed on the workflow's step; while the gateway's breaker is
        # open (random timeouts earlier in the demo can open it), the charge's fallback makes
        # it on the backup gateway under the order's key instead: either way, once.
        charges = effects().count_documents(
            {
                "kind": "charge",
                "$or": [
                    {"key": {"$regex": f"^wf:{handle.id}:"}},
                    {"key": order_key(order_id)},
                ],
            }
        )
        expected = "completed" if i < n - 1 else "compensated"
        undone = 0 if expected == "completed" else 1
        ok &= status.status == expected and charges == 1 and counts["reserve"] == 2
        ok &= counts["ship"] == 1 - undone and counts["refund"] == undone
        ok &= counts["release"] == 2 * undone
        table.add_row(
            str(order_id),
            status.status,
            str(charges),
            str(counts["reserve"]),
            str(counts["ship"]),
            str(counts["refund"]),
            str(counts["release"]),
        )
    console.print(table)
    last = handles[-1][1]
    console.print(
        f"{n} workflows in {time.monotonic() - started:.1f}s; the rejected one's log:"
        f" {', '.join(e.kind for e in last.history())}"
    )
    console.print(f"  inspect: celery -A tasks ledger workflows history {last.id}")
    return ok


def checkout_in_a_transaction(run: int, n: int = 3) -> bool:
    """The outbox example (``tasks.checkout``): orders whose fulfilment and email are made in
    the order's own transaction; the last order's checkout is refused inside its transaction,
    so it leaves no order, no workflow and no email."""
    from celery_ledger.identity import derive_task_id
    from tasks import app
    from tasks.checkout import SHOP_DB, OutOfStock, place_order
    from tasks.effects import effects
    from tasks.fulfilment import fulfil_order

    shop = app.ledger.client.get_database(SHOP_DB)
    shop.retired_items.update_one({"_id": f"fax-{run}"}, {"$set": {"run": run}}, upsert=True)
    table = Table(title="celery-ledger demo: checkout in one transaction (tasks/checkout.py)")
    for column in ("order", "checkout", "order saved", "workflow", "emails"):
        table.add_column(column, justify="left" if column in ("order", "checkout") else "right")
    ok = True
    for i in range(n):
        order_id = run * 1000 + 950 + i
        refused = i == n - 1
        items = ["book", f"fax-{run}"] if refused else ["book"]
        try:
            ids = place_order(order_id, customer_id=order_id, items=items, amount_cents=1200)
        except OutOfStock:
            ids = None
        if ids is not None:
            handle = fulfil_order.handle(ids["workflow"])
            handle.signal("approved", True)
            handle.result(timeout=120, propagate=False)
            status = handle.status().status
            app.AsyncResult(ids["email"]).get(timeout=60, propagate=False)
        else:
            workflow_id = derive_task_id(fulfil_order.name, f"fulfil-{order_id}")
            state = app.workflow_engine.log.get_state(workflow_id)
            status = "none" if state is None else str(state.get("status"))
        emails = effects().count_documents({"kind": "email", "key": f"order-received-{order_id}"})
        saved = shop.orders.count_documents({"_id": order_id})
        expected = (0, "none", 0) if refused else (1, "completed", 1)
        ok &= (saved, status, emails) == expected
        table.add_row(
            str(order_id), "refused" if refused else "committed", str(saved), status, str(emails)
        )
    console.print(table)
    console.print(
        "a refused checkout aborts its transaction: no order, no workflow, no email;"
        " a committed one runs each once, even if the process dies right after the commit"
    )
    return ok


def vault_cards(run: int, n: int = 10) -> bool:
    """The sensitive-task example: card numbers sealed from the publisher's process on. Every
    byte the broker holds and every record of the ledger's database is searched for them."""
    from tasks import app
    from tasks.payments import store_card

    cards = [f"4000{run % 10**8:08d}{i:04d}" for i in range(n)]
    results = [store_card.delay(run * 1000 + i, card) for i, card in enumerate(cards)]
    vaulted = [result.get(timeout=60) for result in results]
    held = [*_broker_bytes(app.runtime.redis), *_ledger_bytes(app)]
    found = sum(1 for card in cards if any(card.encode() in item for item in held))
    record = app.ledger.get_by_id(results[0].id)
    console.print(
        f"sensitive: {len(vaulted)} cards vaulted by payments.store_card (last4"
        f" {vaulted[0]['last4']}, ...); card numbers found in the broker or the ledger:"
        f" {found}; a derived key: {record.key if record else '?'} (an HMAC)"
    )
    return found == 0 and len(vaulted) == n


def degrade_while_down(run: int) -> bool:
    """The graceful-degradation example: with the warehouse's and the mail service's breakers
    held open, a dashboard is served from its last good build and an email is "queued"; each
    record says degraded and when the real job runs again to replace it (once)."""
    from tasks import app
    from tasks.effects import effects
    from tasks.notifications import send_email
    from tasks.reports import customer_dashboard

    customer, user = run % 10**6, run * 1000 + 999
    fresh = customer_dashboard.delay(customer, "2026-11-24").get(timeout=60)
    for name in ("warehouse", "mail"):
        app.breakers[name].force(BreakerState.OPEN)
    try:
        served = customer_dashboard.delay(customer, "2026-11-25").get(timeout=60)
        queued = send_email.delay(user, "receipt").get(timeout=60)
    finally:
        for name in ("warehouse", "mail"):
            app.breakers[name].force(None)  # half-open: probes decide, the replacements run
    dashboard = app.ledger.get(customer_dashboard.name, f"dashboard-{customer}-2026-11-25")
    email = app.ledger.get(send_email.name, f"email-{user}-receipt")
    sent = effects().count_documents({"kind": "email", "key": f"email-{user}-receipt"})
    for label, record in (("dashboard", dashboard), ("email", email)):
        degraded = record.degraded if record else None
        due = degraded.get("replace_at") if degraded else None
        console.print(
            f"degraded {label}: status {record.status if record else '?'},"
            f" served by {degraded.get('fallback') if degraded else '?'}"
            f" ({degraded.get('reason') if degraded else '?'}); the real job replaces it at"
            f" {due:%H:%M:%S}"
            if due
            else f"degraded {label}: {degraded}"
        )
    return (
        served == fresh
        and queued == "queued"
        and sent == 0
        and dashboard is not None
        and dashboard.degraded is not None
        and email is not None
        and email.degraded is not None
    )


def _broker_bytes(client: Any) -> list[bytes]:
    found: list[bytes] = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == b"list":
            found += client.lrange(key, 0, -1)
        elif kind == b"zset":
            found += client.zrange(key, 0, -1)
        elif kind == b"hash":
            found += [b"%s=%s" % item for item in client.hgetall(key).items()]
        elif kind == b"string":
            found.append(client.get(key) or b"")
    return found


def _ledger_bytes(app: Any) -> list[bytes]:
    from bson import BSON

    database = app.ledger.collection.database
    return [
        BSON.encode(doc)
        for name in database.list_collection_names()
        for doc in database[name].find()
    ]


def backfill_orders(run: int, n: int = 2000) -> None:
    """The long-job example: a checkpointed backfill over ``n`` orders."""
    from tasks.backfills import loyalty_backfill
    from tasks.effects import effects

    orders = effects().database.get_collection("orders")
    orders.delete_many({})
    orders.insert_many(
        [{"_id": i, "customer_id": i % 97, "amount_cents": 1000 + i} for i in range(n)]
    )
    started = time.monotonic()
    result = loyalty_backfill.delay(str(run)).get(timeout=300)
    console.print(
        f"long job: loyalty_backfill over {n} orders in batches of 500: {result} "
        f"in {time.monotonic() - started:.1f}s"
    )


if __name__ == "__main__":
    raise SystemExit(main())
