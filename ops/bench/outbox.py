"""The outbox: a job enqueued inside the app's MongoDB transaction, against the same job
published after the transaction commits, in the same run.

    python -m ops.bench.outbox [--jobs 300] [--repeats 3]

Each job is an app's own write (an order document, in a transaction) plus its job:

- **after commit**: the transaction commits, then ``apply_async`` publishes (what apps do with
  Celery today: a crash between the two loses the job, and nothing says so);
- **after commit, recorded**: the same with the ledger's queued record written at publish
  (``dedupe_on_publish``): the job is known to the ledger, but a crash between the commit and
  the publish still loses it;
- **in the transaction**: ``apply_async(..., session=s)`` inside the transaction and the
  outbox's publish after the commit (``app.outbox.transaction``): no crash loses it.

Per job: the time from the transaction's start to the message being on the broker (publish
latency: median and p95), and the MongoDB commands the producer sent (the app's own insert and
commit included, counted the same way for all three). Runs are interleaved, ``--repeats``
times; medians of the runs. No worker runs: publishing is what is measured.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections import defaultdict
from typing import Any

from celery_ledger import LedgerCelery, Settings, create_app

from .common import (
    Commands,
    median,
    percentile,
    print_header,
    print_table,
    pyplot,
    running_servers,
    write_results,
)

CASES = ("after commit", "after commit, recorded", "in the transaction")
QUEUE = "bench_outbox"


def build(broker_url: str, mongo_uri: str, listener: Commands) -> LedgerCelery:
    settings = Settings(broker_url=broker_url, mongo_uri=mongo_uri, mongo_db="bench_outbox")
    app = create_app(
        "bench_outbox", settings=settings, command_listeners=(listener,), set_as_current=False
    )

    @app.task(name="bench.order", idempotency_key="{run}-{i}", shared=False)  # type: ignore[untyped-decorator]
    def order(run: str, i: int) -> int:
        return i

    @app.task(  # type: ignore[untyped-decorator]
        name="bench.order_recorded",
        idempotency_key="{run}-{i}",
        dedupe_on_publish=True,
        shared=False,
    )
    def order_recorded(run: str, i: int) -> int:
        return i

    return app


def one_run(app: LedgerCelery, listener: Commands, case: str, jobs: int) -> dict[str, Any]:
    """``jobs`` orders with their job, one at a time; latencies (ms) and commands per job."""
    run = uuid.uuid4().hex[:10]
    client = app.ledger.client
    orders = client.get_database("shop").get_collection("orders")
    task = app.tasks["bench.order_recorded" if case == "after commit, recorded" else "bench.order"]
    wc = app.ledger.write_concern
    latencies: list[float] = []
    listener.counts.clear()
    began = time.perf_counter()
    for i in range(jobs):
        order = {"_id": f"{run}-{i}", "cents": 100 + i}
        started = time.perf_counter()
        if case == "in the transaction":

            def checkout(session: Any, order: dict[str, Any] = order, i: int = i) -> None:
                orders.insert_one(order, session=session)
                task.apply_async((run, i), queue=QUEUE, session=session)

            app.outbox.transaction(checkout)
        else:

            def write(session: Any, order: dict[str, Any] = order) -> None:
                orders.insert_one(order, session=session)

            with client.start_session() as session:
                session.with_transaction(write, write_concern=wc)
            task.apply_async((run, i), queue=QUEUE)
        latencies.append((time.perf_counter() - started) * 1000)
    seconds = time.perf_counter() - began
    return {
        "median_ms": median(latencies),
        "p95_ms": percentile(latencies, 95),
        "per_second": jobs / seconds,
        "commands_per_job": sum(listener.counts.values()) / jobs,
        "commands": {name: n / jobs for name, n in sorted(listener.counts.items())},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    facts = print_header("outbox: enqueue in the transaction against after the commit", vars(args))
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    with running_servers("bench-outbox") as servers:
        listener = Commands()
        app = build(servers.broker.url, servers.ledger.url, listener)
        try:
            app.ledger.ensure_indexes()
            for case in CASES:  # a warm-up of each: connections, collections, indexes
                one_run(app, listener, case, 20)
            for _ in range(args.repeats):
                for case in CASES:
                    runs[case].append(one_run(app, listener, case, args.jobs))
                app.runtime.redis.delete(QUEUE)
        finally:
            app.runtime.redis.delete(QUEUE)
            app.close()

    base = median([r["median_ms"] for r in runs["after commit"]])
    rows = []
    summary: dict[str, Any] = {}
    for case in CASES:
        med = median([r["median_ms"] for r in runs[case]])
        p95 = median([r["p95_ms"] for r in runs[case]])
        rate = median([r["per_second"] for r in runs[case]])
        commands = runs[case][-1]["commands"]
        per_job = median([r["commands_per_job"] for r in runs[case]])
        summary[case] = {"median_ms": med, "p95_ms": p95, "per_second": rate, "commands": per_job}
        rows.append(
            [
                case,
                f"{med:.2f}",
                f"{p95:.2f}",
                f"{med / base:.2f}",
                f"{rate:.0f}",
                f"{per_job:.2f}",
                " + ".join(f"{name} {n:g}" for name, n in commands.items()),
            ]
        )
    print_table(
        f"{args.jobs} orders with a job each, one at a time, median of {args.repeats} runs",
        ["case", "latency ms", "p95 ms", "x after commit", "jobs/s", "commands", "per job"],
        rows,
    )

    plt = pyplot()
    figure, axes = plt.subplots(figsize=(7, 3.5))
    axes.bar(list(CASES), [summary[c]["median_ms"] for c in CASES], color="#36c", label="median")
    axes.scatter(list(CASES), [summary[c]["p95_ms"] for c in CASES], color="#c33", label="p95")
    axes.set_ylabel("ms from transaction start to published")
    axes.legend()
    write_results(
        "outbox",
        {"machine": facts, "config": vars(args), "runs": dict(runs), "summary": summary},
        figure,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
