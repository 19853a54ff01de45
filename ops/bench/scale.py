"""Scale: claim and completion latency as the ledger grows, disk per record, memory per worker.

    python -m ops.bench.scale [--sizes 10000,100000,1000000] [--samples 300] [--repeats 3]
                              [--memory-tasks 1000]

Latency: the ledger is filled with succeeded records (shaped as ``Ledger.complete`` leaves
them) up to each size, then ``Ledger.claim`` of a new key, ``Ledger.complete`` of that claim
and ``Ledger.claim`` of the now succeeded key (a suppressed duplicate) are timed, one call at a
time. Filling to 1M records takes about ten minutes; ``--sizes 10000,100000`` for a quick run.

Disk: the size of SecantusDB's storage directory over the record count, the growth between
sizes over the records added, and ``collStats`` (documents + indexes).

Memory: the VmRSS of a worker's pool processes after running ``--memory-tasks`` tiny tasks,
plain Celery against LedgerTask (fresh workers, as in the throughput benchmark).
"""

from __future__ import annotations

import argparse
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pymongo import MongoClient, WriteConcern
from pymongo.errors import AutoReconnect, BulkWriteError, NetworkTimeout

from celery_ledger.identity import derive_task_id
from celery_ledger.ledger import Ledger
from celery_ledger.ledger.store import FOREVER, ClaimOutcome

from .common import (
    Servers,
    median,
    percentile,
    print_header,
    print_table,
    pyplot,
    running_servers,
    write_results,
)
from .throughput import CONFIGURATIONS, run_once

TASK = "bench.scale"
FILL_BATCH = 1000
OPERATIONS = ("claim", "complete", "duplicate claim")


def succeeded_record(index: int, now: datetime) -> dict[str, Any]:
    key = f"fill-{index}"
    return {
        "_id": derive_task_id(TASK, key),
        "v": 1,
        "task": TASK,
        "key": key,
        "tier": "default",
        "state": "succeeded",
        "attempts": 1,
        "inflight": 0,
        "fence": time.time_ns(),
        "lease_owner": None,
        "lease_expires_at": None,
        "claimable_at": FOREVER,
        "created_at": now,
        "started_at": now,
        "updated_at": now,
        "finished_at": now,
        "expires_at": now + timedelta(days=7),
        "result": f'{{"n": {index}}}',
    }


def fill(ledger: Ledger, start: int, stop: int) -> float:
    """Insert records ``start..stop-1``; returns docs/s.

    Through a client of its own without a socket timeout: past 100k records SecantusDB can
    stall a batch for longer than the ledger's timeouts (its TTL sweeper, see ``settle``). A
    batch that fails on the network is sent again; records it already inserted are
    duplicates, skipped.
    """
    began = time.perf_counter()
    now = datetime.now(UTC)
    client: MongoClient[dict[str, Any]]
    with MongoClient(ledger.uri, socketTimeoutMS=None) as client:
        collection = client[ledger.database_name][ledger.collection_name]
        for low in range(start, stop, FILL_BATCH):
            docs = [succeeded_record(i, now) for i in range(low, min(low + FILL_BATCH, stop))]
            for attempt in range(5):
                try:
                    collection.insert_many(docs, ordered=False)
                    break
                except BulkWriteError as exc:
                    if any(e.get("code") != 11000 for e in exc.details.get("writeErrors", [])):
                        raise
                    break
                except (AutoReconnect, NetworkTimeout):
                    if attempt == 4:
                        raise
                    time.sleep(1.0)
    return (stop - start) / max(time.perf_counter() - began, 1e-9)


def time_operations(ledger: Ledger, samples: int) -> dict[str, list[float]]:
    """Milliseconds per call of each operation, on fresh keys."""
    timings: dict[str, list[float]] = {name: [] for name in OPERATIONS}
    run = uuid.uuid4().hex[:8]
    for i in range(samples):
        key = f"sample-{run}-{i}"
        record_id = derive_task_id(TASK, key)
        t0 = time.perf_counter()
        claim = ledger.claim(record_id, task=TASK, key=key, tier="default", owner="bench:1")
        t1 = time.perf_counter()
        ledger.complete(record_id, claim.fence, "1")
        t2 = time.perf_counter()
        duplicate = ledger.claim(record_id, task=TASK, key=key, tier="default", owner="bench:1")
        t3 = time.perf_counter()
        assert claim.outcome is ClaimOutcome.CLAIMED and duplicate.outcome is ClaimOutcome.DUPLICATE
        timings["claim"].append((t1 - t0) * 1000)
        timings["complete"].append((t2 - t1) * 1000)
        timings["duplicate claim"].append((t3 - t2) * 1000)
    return timings


def settle(ledger: Ledger, timeout: float = 600.0) -> float:
    """Wait until the server takes journaled writes quickly again; returns the seconds waited.

    A large fill leaves SecantusDB busy for a while (it stalled single claims for more than
    10 s right after 900k inserts): the latency wanted here is the steady state's.

    Note: those stalls are SecantusDB's TTL sweeper, not the ledger's op shapes. Every 60 s
    (after the previous pass ends) it walks the whole collection of every TTL-indexed
    collection, decoding each document, under its global storage lock; every ``update`` on
    any collection waits for that lock (``get_collection_options``). Measured on 2 cores:
    5 s per pass at 105k records, 12 s at 350k (a claim stalled 10.3 s there), linear in
    the record count, so past ~300k a claim that lands in a pass outlasts the ledger's 10 s
    socket timeout. With the ``retention`` TTL index replaced by a plain index on
    ``expires_at``, 379 claims in 80 s at 350k took at most 0.05 s. This wait only finds a
    window between passes: it cannot keep a later pass out of the timed calls.
    """
    began = time.perf_counter()
    quick = 0
    with MongoClient(ledger.uri, socketTimeoutMS=None) as client:
        probes = client[ledger.database_name].get_collection(
            "settle_probe", write_concern=WriteConcern(w=1, j=True)
        )
        while quick < 20 and time.perf_counter() - began < timeout:
            t0 = time.perf_counter()
            probes.update_one({"_id": "probe"}, {"$inc": {"n": 1}}, upsert=True)
            quick = quick + 1 if time.perf_counter() - t0 < 0.05 else 0
            time.sleep(0.05)
    return time.perf_counter() - began


def storage_stats(ledger: Ledger) -> tuple[int, dict[str, Any]]:
    """Record count and ``collStats``, without a timeout (SecantusDB counts by reading all)."""
    client: MongoClient[dict[str, Any]]
    with MongoClient(ledger.uri, socketTimeoutMS=None) as client:
        database = client[ledger.database_name]
        count = database[ledger.collection_name].estimated_document_count()
        client.admin.command("fsync")
        return count, database.command("collStats", ledger.collection_name)


def disk_usage(path: Path) -> dict[str, int]:
    """Bytes under SecantusDB's storage directory, by part."""
    parts = {"documents": 0, "oplog": 0, "journal": 0, "other": 0}
    for file in path.rglob("*"):
        if not file.is_file():
            continue
        name = file.name
        part = (
            "documents"
            if name.startswith(("secantus_documents", "secantus_index", "secantus_natural"))
            else "oplog"
            if name.startswith("secantus_oplog")
            else "journal"
            if name.startswith("WiredTigerLog")
            else "other"
        )
        parts[part] += file.stat().st_size
    parts["total"] = sum(parts.values())
    return parts


def measure_sizes(
    servers: Servers, sizes: list[int], samples: int, repeats: int
) -> list[dict[str, Any]]:
    # As the embedded stack runs it: SecantusDB's TTL sweep would stall every write (Ledger.expire)
    ledger = Ledger(uri=servers.ledger.url, database="bench_scale", ttl_index=False)
    ledger.ensure_indexes()
    storage = servers.ledger.data_dir / "db"
    rows: list[dict[str, Any]] = []
    filled = 0
    try:
        for size in sizes:
            rate = fill(ledger, filled, size)
            filled = size
            print(f"  filled to {size:,} records ({rate:,.0f} docs/s)", flush=True)
            settled = settle(ledger)
            print(f"  server settled {settled:.0f}s after the fill", flush=True)
            per_repeat = [time_operations(ledger, samples) for _ in range(repeats)]
            print(f"  timed {repeats} x {samples} calls at {size:,} records", flush=True)
            count, stats = storage_stats(ledger)
            row: dict[str, Any] = {
                "records": count,
                "fill_docs_per_second": rate,
                "settle_seconds": settled,
            }
            for name in OPERATIONS:
                row[f"{name} p50 ms"] = median([percentile(t[name], 50) for t in per_repeat])
                row[f"{name} p99 ms"] = median([percentile(t[name], 99) for t in per_repeat])
            row["disk"] = disk_usage(storage)
            row["collstats_bytes"] = int(stats.get("size", 0)) + int(stats.get("totalIndexSize", 0))
            rows.append(row)
    finally:
        ledger.close()
    return rows


def measure_memory(servers: Servers, tasks: int) -> list[dict[str, Any]]:
    chosen = [c for c in CONFIGURATIONS if c.name in ("plain-redis", "plain-mongo", "ledger")]
    rows = []
    for configuration in chosen:
        result = run_once(servers, configuration, tasks=tasks, concurrency=2)
        rows.append(
            {
                "configuration": configuration.name,
                "pool_rss_kib": result.pool_rss_kib,
                "worker_rss_kib": result.worker_rss_kib,
                "tasks_per_second": result.tasks_per_second,
            }
        )
        print(f"  {configuration.name}: pool RSS {result.pool_rss_kib} KiB", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000", help="ledger sizes (records)")
    parser.add_argument("--samples", type=int, default=300, help="calls per operation per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-tasks", type=int, default=1000)
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    config = {
        "sizes": sizes,
        "samples": args.samples,
        "repeats": args.repeats,
        "memory_tasks": args.memory_tasks,
        "write_concern": "majority, j (the ledger's)",
    }
    facts = print_header(
        "scale: latency vs ledger size, disk per record, memory per worker", config
    )
    with running_servers("bench-scale") as servers:
        latency = measure_sizes(servers, sizes, args.samples, args.repeats)
        memory = measure_memory(servers, args.memory_tasks)

    print_table(
        f"ledger call latency (ms), median over {args.repeats} runs of {args.samples} calls",
        ["records", *[f"{op} {q}" for op in OPERATIONS for q in ("p50", "p99")]],
        [
            [f"{row['records']:,}"]
            + [f"{row[f'{op} {q} ms']:.2f}" for op in OPERATIONS for q in ("p50", "p99")]
            for row in latency
        ],
    )
    disk_rows = []
    previous: dict[str, Any] | None = None
    for row in latency:
        disk = row["disk"]
        marginal = "-"
        if previous is not None:
            added = row["records"] - previous["records"]
            marginal = f"{(disk['total'] - previous['disk']['total']) / added:,.0f}"
        disk_rows.append(
            [
                f"{row['records']:,}",
                f"{disk['total'] / 2**20:,.1f}",
                f"{disk['documents'] / 2**20:,.1f}",
                f"{disk['oplog'] / 2**20:,.1f}",
                f"{disk['journal'] / 2**20:,.1f}",
                f"{disk['total'] / row['records']:,.0f}",
                marginal,
                f"{row['collstats_bytes'] / row['records']:,.0f}",
            ]
        )
        previous = row
    print_table(
        "ledger size on disk (SecantusDB storage directory)",
        [
            "records",
            "total MiB",
            "docs+idx MiB",
            "oplog MiB",
            "journal MiB",
            "bytes/record",
            "growth bytes/record",
            "collStats bytes/record",
        ],
        disk_rows,
    )
    print_table(
        f"memory per worker after {args.memory_tasks} tasks (VmRSS, KiB)",
        ["configuration", "pool processes", "pool mean", "worker main process", "tasks/s"],
        [
            [
                row["configuration"],
                " ".join(str(v) for v in row["pool_rss_kib"]),
                f"{sum(row['pool_rss_kib']) / max(len(row['pool_rss_kib']), 1):,.0f}",
                f"{row['worker_rss_kib']:,}",
                f"{row['tasks_per_second']:.0f}",
            ]
            for row in memory
        ],
    )

    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    records = [row["records"] for row in latency]
    for op, colour in zip(OPERATIONS, ("#36c", "#4a7", "#c63"), strict=True):
        left.plot(
            records, [r[f"{op} p50 ms"] for r in latency], "o-", color=colour, label=f"{op} p50"
        )
        left.plot(
            records, [r[f"{op} p99 ms"] for r in latency], "o--", color=colour, label=f"{op} p99"
        )
    left.set_xscale("log")
    left.set_xlabel("records in the ledger")
    left.set_ylabel("ms per call")
    left.set_ylim(bottom=0)
    left.legend(fontsize=7)
    names = [row["configuration"] for row in memory]
    means = [sum(r["pool_rss_kib"]) / max(len(r["pool_rss_kib"]), 1) / 1024 for r in memory]
    right.bar(names, means, color=["#999", "#4a7", "#36c"][: len(names)])
    right.set_ylabel("pool process RSS (MiB, mean)")
    write_results(
        "scale",
        {"configuration": config, "machine": facts, "latency": latency, "memory": memory},
        figure,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
