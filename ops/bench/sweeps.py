"""The reconciler's reads over a queued backlog: what a sweep costs, and what it holds up.

    python -m ops.bench.sweeps [--backlog 20000] [--repeats 3]

A ledger is filled with ``--backlog`` queued jobs (``Ledger.enqueue_many``, as a producer's
publishes leave them) on two layouts of the same records, each on a database of its own:

    current     the records' indexes as ``ensure_indexes`` makes them: the sweepers' index is
                ``(state, claimable_at, updated_at)``
    earlier     the sweepers' index of releases before 2026-11-29, ``(state, claimable_at)``

Each of the reconciler's reads is timed (median of --repeats), and while it runs a second
client reads one record by ``_id`` every 5 ms: the longest such read is what the sweep held up
(on the embedded SecantusDB a read holds a global lock, and every producer's publish and every
claim waits behind it). Read at two moments of the backlog's life:

    young       the jobs just published: the stale read (untouched for 900 s) and the look for
                missing messages (untouched for 30 s) find nothing
    old         an hour later, read by a ledger whose clock is an hour ahead: everything is
                stale and quiet (the look reads up to 5,000, the stale read up to 500)

The figure that matters is young's: a sweep runs every 30 s on a fleet whose queues are full
of young jobs, and its stale read found nothing at the cost of the whole backlog.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from pymongo import ASCENDING

from celery_ledger.ledger import Ledger
from celery_ledger.ledger.core import SWEEP_INDEX
from celery_ledger.ledger.message import KeptMessage
from celery_ledger.ledger.publishing import ENQUEUE_BATCH, QueuedJob
from celery_ledger.ledger.record import State

from .common import (
    median,
    print_header,
    print_table,
    pyplot,
    running_servers,
    write_results,
)

TASK = "bench.sweep"
LAYOUTS = ("current", "earlier")
READS: dict[str, Callable[[Ledger], Any]] = {
    "stale queued (900 s)": lambda ledger: ledger.stale(State.QUEUED, older_than_seconds=900),
    "stale retrying (900 s)": lambda ledger: ledger.stale(State.RETRYING, older_than_seconds=900),
    "quiet waiting (30 s, 5,000)": lambda ledger: ledger.quiet_waiting(
        older_than_seconds=30, limit=5000
    ),
}


def fill(ledger: Ledger, backlog: int) -> None:
    message = KeptMessage.of_call([1], {}, message_headers={})
    run = uuid.uuid4().hex[:8]
    for start in range(0, backlog, ENQUEUE_BATCH):
        jobs = [
            QueuedJob(
                record_id=f"{run}-{i}", task=TASK, key=f"{run}-{i}", tier="default", message=message
            )
            for i in range(start, min(start + ENQUEUE_BATCH, backlog))
        ]
        ledger.enqueue_many(jobs)


def held_up(ledger: Ledger, read: Callable[[Ledger], Any]) -> tuple[float, float, int]:
    """The read's wall ms, the longest probe read's ms meanwhile, and how many it returned."""
    probes: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            ledger.collection.find_one({"_id": "absent"})
            probes.append(time.perf_counter() - started)
            time.sleep(0.005)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    time.sleep(0.05)
    started = time.perf_counter()
    found = read(ledger)
    took = time.perf_counter() - started
    stop.set()
    thread.join()
    return took * 1000, max(probes) * 1000, len(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    facts = print_header("Sweeps", vars(args))
    results: dict[str, Any] = {"machine": facts, "config": vars(args), "reads": {}}
    with running_servers("bench-sweeps") as servers:
        ledgers: dict[str, Ledger] = {}
        for layout in LAYOUTS:
            ledger = Ledger(
                uri=servers.ledger.url, database=f"bench_sweeps_{layout}", ttl_index=False
            )
            ledger.ensure_indexes()
            if layout == "earlier":  # a benchmark's stand-in for the earlier release's index
                ledger.collection.drop_index(SWEEP_INDEX)
                ledger.collection.create_index(
                    [("state", ASCENDING), ("claimable_at", ASCENDING)], name="state_claimable"
                )
            fill(ledger, args.backlog)
            ledgers[layout] = ledger
        hour_later = datetime.now(UTC) + timedelta(hours=1)
        rows = []
        for moment in ("young", "old"):
            for name, read in READS.items():
                row: list[Any] = [f"{moment}: {name}"]
                for layout in LAYOUTS:
                    ledger = ledgers[layout]
                    if moment == "old":  # the same records, read by a clock an hour ahead
                        ledger = Ledger(
                            uri=servers.ledger.url,
                            database=f"bench_sweeps_{layout}",
                            ttl_index=False,
                            clock=lambda: hour_later,
                        )
                    runs = [held_up(ledger, read) for _ in range(args.repeats)]
                    took, probe = median([r[0] for r in runs]), median([r[1] for r in runs])
                    results["reads"][f"{moment}: {name}: {layout}"] = {
                        "ms": took,
                        "held_up_ms": probe,
                        "found": runs[0][2],
                    }
                    row += [f"{took:.0f}", f"{probe:.0f}", runs[0][2]]
                    if moment == "old":
                        ledger.close()
                current, earlier = (results["reads"][f"{moment}: {name}: {x}"] for x in LAYOUTS)
                row.append(f"{current['ms'] / max(earlier['ms'], 0.001):.3f}")
                rows.append(row)
        for ledger in ledgers.values():
            ledger.close()
    print_table(
        f"The reconciler's reads over {args.backlog:,} queued jobs (median of {args.repeats})",
        [
            "read",
            "current ms",
            "held up ms",
            "found",
            "earlier ms",
            "held up ms",
            "found",
            "current / earlier",
        ],
        rows,
    )
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 3.2))
    labels = [row[0] for row in rows]
    for offset, (layout, color) in enumerate((("current", "#4c72b0"), ("earlier", "#dd8452"))):
        axis.barh(
            [i + offset * 0.4 for i in range(len(labels))],
            [results["reads"][f"{label}: {layout}"]["held_up_ms"] for label in labels],
            height=0.4,
            color=color,
            label=layout,
        )
    axis.set_yticks([i + 0.2 for i in range(len(labels))], labels)
    axis.set_xlabel("longest read by _id held up meanwhile, ms")
    axis.legend()
    write_results("sweeps", results, figure)


if __name__ == "__main__":
    main()
