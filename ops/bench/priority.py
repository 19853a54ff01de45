"""Critical latency under a bulk flood: tiers against a naive single-queue setup, in one run.

    python -m ops.bench.priority [--bulk 20000] [--critical 60] [--rate 4]

Scenarios, each with fresh workers on the same valkey and SecantusDB servers and the same
number of worker processes (3):

    idle    critical tasks only (critical worker -c 1)
    tiers   --bulk bulk tasks flood the bulk queue (bulk worker -c 2) while critical tasks
            trickle in at --rate per second (critical worker -c 1)
    naive   the same flood and trickle, every task on one queue, default (one worker -c 3)

Critical latency runs from publish to the moment its body ran (its return value), so result
polling does not blur it. Bulk throughput is bulk tasks per second from the first publish to the
last bulk result.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from typing import Any

from celery_ledger import LedgerCelery

from .apps.priority import build
from .common import (
    Servers,
    percentile,
    print_header,
    print_table,
    pyplot,
    running_servers,
    start_worker,
    write_results,
)

APP = "ops.bench.apps.priority"


def scenario(
    servers: Servers, name: str, *, bulk: int, critical: int, rate: float
) -> dict[str, Any]:
    naive = name == "naive"
    env = {
        "LEDGER_BROKER_URL": servers.broker.url,
        "LEDGER_MONGO_URI": servers.ledger.url,
        "LEDGER_MONGO_DB": f"bench_priority_{name}",
        "BENCH_NAIVE": "1" if naive else "0",
    }
    app: LedgerCelery = build(env)
    workers = (
        [start_worker(servers, APP, queue="default", concurrency=3, name=f"{name}-all", env=env)]
        if naive
        else [
            start_worker(
                servers, APP, queue="critical", concurrency=1, name=f"{name}-critical", env=env
            )
        ]
        + (
            [start_worker(servers, APP, queue="bulk", concurrency=2, name=f"{name}-bulk", env=env)]
            if bulk
            else []
        )
    )
    run = uuid.uuid4().hex[:8]
    bulk_task, critical_task = app.tasks["bench.bulk_work"], app.tasks["bench.critical"]
    try:
        started = time.monotonic()
        bulk_results: list[Any] = []
        flooding = threading.Thread(
            target=lambda: bulk_results.extend(bulk_task.delay(run, i) for i in range(bulk))
        )
        flooding.start()
        time.sleep(2.0 if bulk else 0.0)  # let the flood build a backlog first
        sent: list[tuple[float, Any]] = []
        for i in range(critical):
            sent.append((time.time(), critical_task.delay(run, i)))
            time.sleep(1.0 / rate)
        latencies = [result.get(timeout=600) - at for at, result in sent]
        flooding.join()
        for result in bulk_results:
            result.get(timeout=1800)
        bulk_seconds = time.monotonic() - started
    finally:
        for worker in workers:
            worker.stop()
    return {
        "scenario": name,
        "critical_p50_ms": percentile(latencies, 50) * 1000,
        "critical_p95_ms": percentile(latencies, 95) * 1000,
        "critical_p99_ms": percentile(latencies, 99) * 1000,
        "bulk_tasks_per_second": bulk / bulk_seconds if bulk else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bulk", type=int, default=20000)
    parser.add_argument("--critical", type=int, default=60)
    parser.add_argument("--rate", type=float, default=4.0)
    args = parser.parse_args()
    config = print_header("priority: critical latency under a bulk flood", vars(args))
    with running_servers("priority") as servers:
        rows = [scenario(servers, "idle", bulk=0, critical=args.critical, rate=args.rate)]
        for name in ("tiers", "naive"):
            rows.append(
                scenario(servers, name, bulk=args.bulk, critical=args.critical, rate=args.rate)
            )
    idle, tiers, naive = rows
    print_table(
        "critical latency (ms) and bulk throughput",
        ["scenario", "p50", "p95", "p99", "bulk tasks/s"],
        [
            [
                r["scenario"],
                f"{r['critical_p50_ms']:.0f}",
                f"{r['critical_p95_ms']:.0f}",
                f"{r['critical_p99_ms']:.0f}",
                "" if r["bulk_tasks_per_second"] is None else f"{r['bulk_tasks_per_second']:.0f}",
            ]
            for r in rows
        ],
    )
    ratios = {
        "tiers_p99_over_idle_p99": tiers["critical_p99_ms"] / idle["critical_p99_ms"],
        "naive_p99_over_idle_p99": naive["critical_p99_ms"] / idle["critical_p99_ms"],
        "tiers_bulk_over_naive_bulk": tiers["bulk_tasks_per_second"]
        / naive["bulk_tasks_per_second"],
    }
    print_table(
        "ratios (targets: tiers p99 <= 2x idle; tiers bulk >= 0.8x naive)",
        ["ratio", "value"],
        [[k, f"{v:.2f}"] for k, v in ratios.items()],
    )
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["scenario"] for r in rows]
    for q in ("p50", "p95", "p99"):
        left.plot(names, [r[f"critical_{q}_ms"] for r in rows], marker="o", label=q)
    left.set_ylabel("critical latency (ms)")
    left.set_yscale("log")
    left.legend()
    right.bar(names[1:], [r["bulk_tasks_per_second"] for r in rows[1:]])
    right.set_ylabel("bulk tasks/s")
    figure.suptitle(f"{args.bulk} bulk tasks, critical at {args.rate}/s")
    write_results("priority", {"config": config, "rows": rows, "ratios": ratios}, figure)


if __name__ == "__main__":
    main()
