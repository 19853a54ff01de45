"""What each index of the records, and the shape of the claim's and completion's filters, cost
the ledger server per job, in one run.

    python -m ops.bench.indexes [--jobs 1500] [--repeats 3]

A job here is the ledger's happy path without Celery: one claim and one completion, called
directly on :class:`~celery_ledger.ledger.Ledger` from this process (every write journaled,
``w=majority``), so the ledger server's CPU time per job is the cost of the two statements
alone. Layouts, each on a fresh database, interleaved repeat by repeat:

    current      the records' indexes as ensure_indexes makes them (retention and the
                 sweepers' ``(state, claimable_at, updated_at)``)
    +2 sparse    the same plus the two sparse indexes the records carried until 2026-11-26
                 (``slo_at``, ``replace_due``), which no job of this run has
    +1 plain     the same plus one plain index on a field every record has (``tier``)
    bare filters the current indexes, with the claim's and the completion's filters sent as
                 they were until 2026-11-27 (equalities bare; see ``_on_one_record`` in the
                 ledger's store), to show what their shape costs the embedded server
    upsert claim the current indexes, every claim the conditional upsert (as before the first
                 publish's claim became an insert, the ``ledger_new`` message property)
    8 at once    the current layout, jobs run 8 at a time on 8 threads, each its claim then its
                 completion: group commit sends together the writes that queue while a flush is
                 in flight, as in a threads pool (see the README, Throughput, for what a prefork
                 worker's parent claiming its prefetched messages in one bulk write would save)

In every other layout a claim is told its job is new (``new=True``), as a worker claims the
first delivery of a job published by ``apply_async``.

A sparse index on a field no record carries is not free on the embedded server: it is the
reason latency objectives now live in a companion collection (see Ledger.ensure_indexes).
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery_ledger.identity import derive_task_id
from celery_ledger.ledger import Ledger, claims, dead_records, long_jobs
from celery_ledger.ledger import base as ledger_base
from celery_ledger.ledger import store as ledger_store

from .common import median, print_header, print_table, pyplot, running_servers, write_results
from .throughput import cpu_seconds

TASK = "bench.noop"


def _extra_sparse(ledger: Ledger) -> None:
    ledger.collection.create_index("slo_at", name="objective_old", sparse=True)
    ledger.collection.create_index("replace_due", name="replacement_due_old", sparse=True)


def _extra_plain(ledger: Ledger) -> None:
    ledger.collection.create_index("tier", name="tier")


LAYOUTS: dict[str, Callable[[Ledger], None] | None] = {
    "current": None,
    "+2 sparse": _extra_sparse,
    "+1 plain": _extra_plain,
    "bare filters": None,
    "upsert claim": None,
    "8 at once": None,
}
AT_ONCE = 8

_SHAPED = ledger_store._on_one_record
# The store's modules that shape a filter (each imported the helper by name)
_SHAPING = [claims, dead_records, long_jobs, ledger_base]


def _shape_filters(shape: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    for module in _SHAPING:
        module._on_one_record = shape  # type: ignore[attr-defined]


def _bare(conditions: dict[str, Any]) -> dict[str, Any]:
    """The filters' shape until 2026-11-27: only comparisons said ``$exists: true``."""
    ranges = ("$lt", "$lte", "$gt", "$gte")
    return {
        field: (
            {**value, "$exists": True}
            if isinstance(value, dict) and value and all(op in ranges for op in value)
            else value
        )
        for field, value in conditions.items()
    }


def run_once(url: str, layout: str, jobs: int) -> dict[str, float]:
    """Claim and complete ``jobs`` new records; the server's CPU ms and the wall ms per job."""
    database = f"bench_indexes_{uuid.uuid4().hex[:8]}"
    ledger = Ledger(uri=url, database=database, ttl_index=False)
    # The earlier shape, for this run only (a benchmark's stand-in, never the product's).
    _shape_filters(_bare if layout == "bare filters" else _SHAPED)
    try:
        ledger.ensure_indexes()
        extra = LAYOUTS[layout]
        if extra is not None:
            extra(ledger)
        run = uuid.uuid4().hex[:8]

        def job(i: int) -> None:
            key = f"{run}-{i}"
            record_id = derive_task_id(TASK, key)
            claim = ledger.claim(
                record_id,
                task=TASK,
                key=key,
                tier="default",
                owner="bench:1",
                new=layout != "upsert claim",
            )
            assert claim.fence is not None
            ledger.complete(record_id, claim.fence, "1", op=uuid.uuid4().hex)

        def run_jobs(numbers: range) -> None:
            if layout != "8 at once":
                for i in numbers:
                    job(i)
                return
            with ThreadPoolExecutor(AT_ONCE) as pool:
                for start in range(numbers.start, numbers.stop, AT_ONCE):
                    list(pool.map(job, range(start, min(start + AT_ONCE, numbers.stop))))

        run_jobs(range(-50, 0))  # warm-up: connections, the collection's first pages
        pid = _server_pid
        cpu_before, started = cpu_seconds(pid), time.perf_counter()
        run_jobs(range(jobs))
        wall, cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu_before
        return {"server_cpu_ms": 1000 * cpu / jobs, "wall_ms": 1000 * wall / jobs}
    finally:
        _shape_filters(_SHAPED)
        ledger.client.drop_database(database)
        ledger.close()


_server_pid = 0


def main(argv: list[str] | None = None) -> int:
    global _server_pid
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1500, help="jobs per run (1500)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per layout (3)")
    args = parser.parse_args(argv)
    machine = print_header(
        "indexes: the ledger server's CPU per job (claim + completion) by index layout and filter",
        {"jobs": args.jobs, "repeats": args.repeats, "write concern": "w=majority, journaled"},
    )
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    with running_servers("bench-indexes") as servers:
        _server_pid = servers.ledger.pid
        for repeat in range(args.repeats):
            for name in LAYOUTS:
                result = run_once(servers.ledger.url, name, args.jobs)
                runs[name].append(result)
                print(
                    f"  run {repeat + 1}/{args.repeats} {name:10s}"
                    f" server {result['server_cpu_ms']:.2f} ms/job,"
                    f" wall {result['wall_ms']:.2f} ms/job",
                    flush=True,
                )
    medians = {
        name: {k: median([r[k] for r in results]) for k in ("server_cpu_ms", "wall_ms")}
        for name, results in runs.items()
    }
    base = medians["current"]["server_cpu_ms"]
    print_table(
        f"ledger server per job, median of {args.repeats}",
        ["layout", "server CPU ms/job", "wall ms/job", "server CPU / current"],
        [
            (
                name,
                f"{m['server_cpu_ms']:.2f}",
                f"{m['wall_ms']:.2f}",
                f"{m['server_cpu_ms'] / base:.2f}",
            )
            for name, m in medians.items()
        ],
    )
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.2))
    names = list(medians)
    axis.bar(names, [medians[n]["server_cpu_ms"] for n in names], color="#4c72b0")
    axis.set_ylabel("ledger server CPU ms per job")
    axis.set_title("claim + completion, by index layout and filter shape")
    data: dict[str, Any] = {"machine": machine, "runs": runs, "medians": medians}
    write_results("indexes", data, figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
