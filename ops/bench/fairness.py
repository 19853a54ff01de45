"""Tenant fairness: a small tenant's wait behind another tenant's backlog, weights, and what
fair dispatch costs, in one run.

    python -m ops.bench.fairness [--backlog 50000] [--small 100] [--rate 5] [--repeats 3]
                                 [--weighted 10000] [--window 15] [--throughput 4000] [--depth 1]

Each scenario runs fresh workers (one ``celery worker -c 2``, started before anything is
published) on the same valkey and SecantusDB servers, with the broker and the ledger database
emptied between scenarios:

    idle        the small tenant's --small jobs at --rate a second on an idle tier
    backlog     the same, while another tenant's --backlog jobs wait on the same tier (published
                first, with ``app.publish_many``)
    weights     two tenants with --weighted jobs each, weights 3 and 1: the jobs each got done
                in --window seconds
    plain       --throughput jobs naming no tenant: tasks a second from their publish to the last
    tenants     the same jobs spread over 10 tenants (through their lanes)

A wait runs from the publish to the moment the body ran (its return value); the table also
splits off the publish's own time (its ledger write and the broker's script, slower while a
backlog keeps the servers busy) from the time after it. The goals (issue
40): backlog p99 <= 2x idle p99; the weights' ratio within 10% of 3; tenants/plain >= 0.9.
Each figure is the median over --repeats runs; only ratios within one run mean anything on a
shared machine. On the embedded SecantusDB (one core, a global lock) a worker's reconciler sweep
over a deep backlog stalls the producer's publishes for hundreds of ms, which sets the backlog's
p99 (``LEDGER_RECONCILE_IN_WORKERS=false`` in the environment takes it out of the measure).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from typing import Any

import redis
from pymongo import MongoClient

from celery_ledger import LedgerCelery

from .apps.fairness import build
from .common import (
    Servers,
    median,
    percentile,
    print_header,
    print_table,
    pyplot,
    running_servers,
    start_worker,
    write_results,
)

APP = "ops.bench.apps.fairness"
QUEUE = "bench_fair.default"
WEIGHTS = {"gold": {"weight": 3}}
PUBLISH_BATCH = 1000
# BENCH_DIAGNOSE=1: print the small tenant's five longest waits, when, and its publish's time
DIAGNOSE = bool(os.environ.get("BENCH_DIAGNOSE"))
DEPTH = [1]  # LEDGER_FAIR_QUEUE_DEPTH of the run (--depth)


def environment(servers: Servers, database: str) -> dict[str, str]:
    return {
        "LEDGER_BROKER_URL": servers.broker.url,
        "LEDGER_MONGO_URI": servers.ledger.url,
        "LEDGER_MONGO_DB": database,
        "BENCH_TENANTS": json.dumps(WEIGHTS),
        "BENCH_FAIR_DEPTH": str(DEPTH[0]),
    }


def emptied(servers: Servers, database: str) -> None:
    redis.Redis.from_url(servers.broker.url).flushdb()
    client: MongoClient[dict[str, Any]]
    with MongoClient(servers.ledger.url) as client:
        client.drop_database(database)


def publish_backlog(app: LedgerCelery, run: str, jobs: int, tenants: list[str | None]) -> None:
    task = app.tasks["bench.fair_work"]
    for start in range(0, jobs, PUBLISH_BATCH):
        batch = []
        for i in range(start, min(start + PUBLISH_BATCH, jobs)):
            tenant = tenants[i % len(tenants)]
            signature = task.s(run, i)
            batch.append(signature.set(tenant=tenant) if tenant else signature)
        app.publish_many(batch)


def small_waits(app: LedgerCelery, *, small: int, rate: float) -> list[tuple[float, float]]:
    """Each small job's wait from the call to its body, and how much of it its publish took."""
    task = app.tasks["bench.fair_work"]
    run = f"small-{uuid.uuid4().hex[:6]}"
    sent: list[tuple[float, float, Any]] = []
    for i in range(small):
        at = time.time()
        result = task.apply_async((run, i), tenant="small")
        sent.append((at, time.time(), result))
        time.sleep(1.0 / rate)
    waits = [
        (max(0.0, result.get(timeout=600) - at), at, published) for at, published, result in sent
    ]
    if DIAGNOSE:
        first = sent[0][0]
        for wait, at, published in sorted(waits, reverse=True)[:5]:
            took = 1000 * (published - at)
            print(f"    wait {wait * 1000:.0f} ms at +{at - first:.2f}s (publish {took:.0f} ms)")
    return [(wait, published - at) for wait, at, published in waits]


def succeeded_by_tenant(servers: Servers, database: str, app: LedgerCelery) -> dict[str, int]:
    client: MongoClient[dict[str, Any]]
    with MongoClient(servers.ledger.url) as client:
        records = client[database][app.ledger.collection_name]
        found = records.aggregate(
            [{"$match": {"state": "succeeded"}}, {"$group": {"_id": "$tenant", "n": {"$sum": 1}}}]
        )
        return {str(row["_id"]): int(row["n"]) for row in found}


def scenario(servers: Servers, name: str, args: argparse.Namespace, repeat: int) -> dict[str, Any]:
    database = f"bench_fair_{name}_{repeat}"
    emptied(servers, database)
    env = environment(servers, database)
    app = build(env)
    run = uuid.uuid4().hex[:8]
    result: dict[str, Any] = {"scenario": name}
    # The worker first: only a tier a worker feeds holds tenants' jobs in lanes (a backlog
    # published before any worker would wait in the queue itself, unfairly)
    worker = start_worker(
        servers, APP, queue=QUEUE, concurrency=2, name=f"fair-{name}-{repeat}", env=env
    )
    try:
        started = time.monotonic()
        if name == "backlog":
            publish_backlog(app, run, args.backlog, ["big"])
        elif name == "weights":
            publish_backlog(app, run, 2 * args.weighted, ["gold", "basic"])
        elif name in ("plain", "tenants"):
            tenants: list[str | None] = (
                [f"t{n}" for n in range(10)] if name == "tenants" else [None]
            )
            publish_backlog(app, run, args.throughput, tenants)
        if name in ("idle", "backlog"):
            if name == "backlog":
                time.sleep(2.0)  # the backlog running first
            found = small_waits(app, small=args.small, rate=args.rate)
            waits = [wait for wait, _ in found]
            # (the publish's own share: its ledger write and the broker's script, which wait
            # for the servers the backlog keeps busy, not for a turn in the queue)
            queued = [wait - publish for wait, publish in found]
            result |= {
                "wait_p50_ms": percentile(waits, 50) * 1000,
                "wait_p99_ms": percentile(waits, 99) * 1000,
                "publish_p50_ms": percentile([publish for _, publish in found], 50) * 1000,
                "after_publish_p50_ms": percentile(queued, 50) * 1000,
                "after_publish_p99_ms": percentile(queued, 99) * 1000,
            }
        elif name == "weights":
            # (counted over a window once both have waited: the publish ran while they started)
            before = succeeded_by_tenant(servers, database, app)
            time.sleep(args.window)
            after = succeeded_by_tenant(servers, database, app)
            done = {t: after.get(t, 0) - before.get(t, 0) for t in ("gold", "basic")}
            result |= {"gold": done.get("gold", 0), "basic": done.get("basic", 0)}
            result["weight_ratio"] = result["gold"] / max(result["basic"], 1)
        else:
            deadline = started + 900
            while time.monotonic() < deadline:
                if sum(succeeded_by_tenant(servers, database, app).values()) >= args.throughput:
                    break
                time.sleep(0.25)
            result["tasks_per_second"] = args.throughput / (time.monotonic() - started)
    finally:
        worker.stop()
        app.close()
    return result


SCENARIOS = ("idle", "backlog", "weights", "plain", "tenants")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backlog", type=int, default=50_000)
    parser.add_argument("--small", type=int, default=100)
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--weighted", type=int, default=10_000)
    parser.add_argument("--window", type=float, default=15.0)
    parser.add_argument("--throughput", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depth", type=int, default=1, help="LEDGER_FAIR_QUEUE_DEPTH")
    parser.add_argument("--only", default=",".join(SCENARIOS))
    args = parser.parse_args()
    chosen = [name for name in args.only.split(",") if name]
    DEPTH[0] = args.depth
    config = print_header("Tenant fairness", vars(args))
    runs: list[dict[str, Any]] = []
    with running_servers("bench-fairness") as servers:
        for repeat in range(args.repeats):
            for name in chosen:
                found = scenario(servers, name, args, repeat)
                print(f"  run {repeat + 1} {name}: {found}")
                runs.append(found)

    def med(name: str, field: str) -> float | None:
        values = [r[field] for r in runs if r["scenario"] == name and r.get(field) is not None]
        return median(values) if values else None

    idle, backlog = med("idle", "wait_p99_ms"), med("backlog", "wait_p99_ms")
    plain, tenants = med("plain", "tasks_per_second"), med("tenants", "tasks_per_second")
    ratios = {
        "backlog_p99_over_idle_p99": backlog / idle if idle and backlog is not None else None,
        "weight_ratio": med("weights", "weight_ratio"),
        "tenants_over_plain": tenants / plain if plain and tenants is not None else None,
    }
    fields = ("wait_p50_ms", "wait_p99_ms", "publish_p50_ms")
    fields += ("after_publish_p50_ms", "after_publish_p99_ms")
    print_table(
        "Waits of the small tenant (ms, median of runs)",
        ["scenario", "p50", "p99", "its publish p50", "after it: p50", "p99"],
        [
            [name, *(f"{med(name, field) or 0:.1f}" for field in fields)]
            for name in ("idle", "backlog")
            if name in chosen
        ],
    )
    print_table(
        "Goals",
        ["measure", "value", "goal"],
        [
            ["backlog p99 / idle p99", _fmt(ratios["backlog_p99_over_idle_p99"]), "<= 2.0"],
            ["weights 3:1, ratio seen", _fmt(ratios["weight_ratio"]), "2.7 .. 3.3"],
            ["tenants / plain throughput", _fmt(ratios["tenants_over_plain"]), ">= 0.9"],
        ],
    )
    figure = None
    plt = pyplot()
    if idle is not None and backlog is not None:
        figure, axis = plt.subplots(figsize=(5, 3))
        axis.bar(["idle", f"behind {args.backlog:,}"], [idle, backlog])
        axis.set_ylabel("small tenant p99 wait (ms)")
    write_results("fairness", {"config": config, "runs": runs, "ratios": ratios}, figure)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
