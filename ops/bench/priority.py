"""Critical latency under a bulk flood: tiers against a naive single-queue setup, in one run.

    python -m ops.bench.priority [--bulk 20000] [--critical 60] [--rate 4] [--repeats 3]
                                 [--throttle-ms 60]

Scenarios, each with fresh workers on the same valkey and SecantusDB servers and the same
number of worker processes (3):

    idle    critical tasks only (critical worker -c 1)
    tiers   --bulk bulk tasks flood the bulk queue (bulk worker -c 2) while critical tasks
            trickle in at --rate per second (critical worker -c 1)
    naive   the same flood and trickle, every task on one queue, default (one worker -c 3)

Critical latency runs from publish to the moment its body ran (its return value), so result
polling does not blur it. Bulk throughput is bulk tasks per second from the first publish to the
last bulk result.

The latency-driven throttle is engaged as a real app engages it: the producer reports each
critical latency it observes with ``pressure.report_latency`` (as a web tier reports its
requests), and the workers run with ``LEDGER_THROTTLE_LATENCY_MS`` at ``--throttle-ms``, so bulk
workers pause while the reported p95 is above it. Scenarios are interleaved over ``--repeats``
runs (idle, tiers, naive; then again) and each figure is the median over the runs.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from typing import Any

from celery_ledger import LedgerCelery, pressure

from .apps.priority import build
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

APP = "ops.bench.apps.priority"


def scenario(
    servers: Servers,
    name: str,
    *,
    bulk: int,
    critical: int,
    rate: float,
    throttle_ms: float,
    repeat: int = 0,
) -> dict[str, Any]:
    naive = name == "naive"
    env = {
        "LEDGER_BROKER_URL": servers.broker.url,
        "LEDGER_MONGO_URI": servers.ledger.url,
        "LEDGER_MONGO_DB": f"bench_priority_{name}_{repeat}",
        "BENCH_NAIVE": "1" if naive else "0",
        "BENCH_THROTTLE_MS": str(throttle_ms),
    }
    reporter = pressure.configure(servers.broker.url)
    reporter.client.delete(reporter.key)  # no samples from the scenario before
    app: LedgerCelery = build(env)
    tag = f"{name}-{repeat}"  # worker logs are per name: each run counts its own throttling
    workers = (
        [start_worker(servers, APP, queue="default", concurrency=3, name=f"{tag}-all", env=env)]
        if naive
        else [
            start_worker(
                servers,
                APP,
                queue="critical",
                concurrency=1,
                name=f"{tag}-critical",
                env=env,
            )
        ]
        + (
            [start_worker(servers, APP, queue="bulk", concurrency=2, name=f"{tag}-bulk", env=env)]
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
        latencies: list[float] = []

        def observe() -> None:  # the foreground's own view, reported as an app reports it
            for i in range(critical):
                while len(sent) <= i:
                    time.sleep(0.005)
                at, result = sent[i]
                latency = result.get(timeout=600) - at
                latencies.append(latency)
                reporter.report_latency(max(0.0, latency * 1000))

        observer = threading.Thread(target=observe)
        observer.start()
        for i in range(critical):
            sent.append((time.time(), critical_task.delay(run, i)))
            time.sleep(1.0 / rate)
        observer.join()
        flooding.join()
        for result in bulk_results:
            result.get(timeout=1800)
        bulk_seconds = time.monotonic() - started
    finally:
        for worker in workers:
            worker.stop()
    # How often the bulk workers paused for the foreground (they log each pause).
    engagements = sum(
        worker.log_path.read_text(errors="replace").count("throttling ")
        for worker in workers
        if worker.log_path.exists()
    )
    return {
        "throttle_engagements": engagements,
        "scenario": name,
        "critical_p50_ms": percentile(latencies, 50) * 1000,
        "critical_p95_ms": percentile(latencies, 95) * 1000,
        "critical_p99_ms": percentile(latencies, 99) * 1000,
        "bulk_tasks_per_second": bulk / bulk_seconds if bulk else None,
    }


SCENARIOS = ("idle", "tiers", "naive")
METRICS = ("critical_p50_ms", "critical_p95_ms", "critical_p99_ms", "bulk_tasks_per_second")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bulk", type=int, default=20000)
    parser.add_argument("--critical", type=int, default=60)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each scenario (3)")
    parser.add_argument(
        "--throttle-ms",
        type=float,
        default=60.0,
        help="the foreground latency budget bulk workers pause above (LEDGER_THROTTLE_LATENCY_MS)",
    )
    args = parser.parse_args()
    config = print_header("priority: critical latency under a bulk flood", vars(args))
    runs: list[dict[str, Any]] = []
    with running_servers("priority") as servers:
        for repeat in range(args.repeats):
            for name in SCENARIOS:
                row = scenario(
                    servers,
                    name,
                    bulk=0 if name == "idle" else args.bulk,
                    critical=args.critical,
                    rate=args.rate,
                    throttle_ms=args.throttle_ms,
                    repeat=repeat,
                )
                runs.append(row)
                print(
                    f"  run {repeat + 1}/{args.repeats} {name:<6} p99"
                    f" {row['critical_p99_ms']:8.0f} ms,"
                    f" bulk {row['bulk_tasks_per_second'] or 0:.0f}/s,"
                    f" throttle engaged {row['throttle_engagements']} times",
                    flush=True,
                )
    rows = []
    for name in SCENARIOS:
        mine = [r for r in runs if r["scenario"] == name]
        rows.append(
            {"scenario": name}
            | {m: None if mine[0][m] is None else median([r[m] for r in mine]) for m in METRICS}
        )
    idle, tiers, naive = rows
    per_run = [
        t["critical_p99_ms"] / i["critical_p99_ms"]
        for i, t in zip(runs[0::3], runs[1::3], strict=True)
    ]
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
        "tiers_p99_over_idle_p99_per_run_median": median(per_run),
        "naive_p99_over_idle_p99": naive["critical_p99_ms"] / idle["critical_p99_ms"],
        "tiers_bulk_over_naive_bulk": tiers["bulk_tasks_per_second"]
        / naive["bulk_tasks_per_second"],
    }
    print_table(
        f"ratios of the medians of {args.repeats} runs"
        " (targets: tiers p99 <= 2x idle; tiers bulk >= 0.8x naive)",
        ["ratio", "value"],
        [[k, f"{v:.2f}"] for k, v in ratios.items()]
        + [["tiers p99 / idle p99, each run", " / ".join(f"{v:.2f}" for v in per_run)]],
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
    figure.suptitle(
        f"{args.bulk} bulk tasks, critical at {args.rate}/s, throttle at {args.throttle_ms:g} ms,"
        f" median of {args.repeats}"
    )
    write_results(
        "priority",
        {"config": config, "runs": runs, "medians": rows, "ratios": ratios, "per_run": per_run},
        figure,
    )


if __name__ == "__main__":
    main()
