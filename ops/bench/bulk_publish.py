"""Bulk publish against one by one: round trips per 100 jobs and the producer's CPU per job.

    python -m ops.bench.bulk_publish [--jobs 1000] [--repeats 3]

A producer publishes ``--jobs`` new ledger jobs (dedupe on publish, the default) four ways in
the same run: one ``apply_async`` each, a Celery ``group``, ``app.publish_many``, and
``publish_many`` again of jobs already known. MongoDB commands are counted with pymongo's
command monitoring, Redis round trips by counting each send on a connection (a pipeline is one
send), both on the producer's thread; CPU is the producer process's (user + sys). No worker
runs: the messages wait in the queue, which is emptied between passes. Only the ratios within
one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
import redis.connection
from celery import group

from celery_ledger import LedgerCelery, Settings, create_app

from .common import (
    Commands,
    median,
    print_header,
    print_table,
    pyplot,
    running_servers,
    write_results,
)

NAMESPACE = "bench_bulk"
TASK = "bb.noop"
# The goal: per 100 jobs of a bulk publish
GOAL_LEDGER_PER_100 = 2
GOAL_BROKER_PER_100 = 1


@contextmanager
def broker_round_trips() -> Iterator[Counter[str]]:
    """Redis round trips this thread makes in the block, by their first command (a pipeline
    is one send of all its commands: one round trip). The benchmark's and the bulk publish
    test's one counter."""
    counts: Counter[str] = Counter()
    thread = threading.get_ident()
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        if threading.get_ident() == thread:
            first = command[0] if isinstance(command, list | tuple) else command
            found = re.search(rb"\$\d+\r\n([A-Za-z]+)", bytes(first)[:64])
            counts[found.group(1).decode().upper() if found else "?"] += 1
        original(self, command, check_health)

    redis.connection.AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        redis.connection.AbstractConnection.send_packed_command = original  # type: ignore[method-assign]


def producer(broker_url: str, mongo_uri: str) -> tuple[LedgerCelery, Commands]:
    listener = Commands()
    settings = Settings(
        broker_url=broker_url,
        mongo_uri=mongo_uri,
        mongo_db="bench_bulk",
        queue_namespace=NAMESPACE,
    )
    app = create_app(
        "bench_bulk", settings=settings, set_as_current=False, command_listeners=[listener]
    )

    @app.task(  # type: ignore[untyped-decorator]
        shared=False, name=TASK, idempotency_key="{token}"
    )
    def noop(token: str) -> str:
        return token

    return app, listener


def one_by_one(app: LedgerCelery, tokens: list[str]) -> None:
    task = app.tasks[TASK]
    for token in tokens:
        task.apply_async((token,))


def as_group(app: LedgerCelery, tokens: list[str]) -> None:
    task = app.tasks[TASK]
    group(task.s(token) for token in tokens).apply_async()


def publish_many(app: LedgerCelery, tokens: list[str]) -> None:
    task = app.tasks[TASK]
    app.publish_many([task.s(token) for token in tokens])


MODES: dict[str, Callable[[LedgerCelery, list[str]], None]] = {
    "one by one": one_by_one,
    "group": as_group,
    "publish_many": publish_many,
    "publish_many, all known": publish_many,
}


def measure(app: LedgerCelery, listener: Commands, mode: str, tokens: list[str]) -> dict[str, Any]:
    listener.counts.clear()
    cpu = time.process_time()
    wall = time.perf_counter()
    with broker_round_trips() as broker:
        MODES[mode](app, tokens)
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    per_100 = 100 / len(tokens)
    return {
        "ledger_per_100": sum(listener.counts.values()) * per_100,
        "broker_per_100": sum(broker.values()) * per_100,
        "broker_per_job_100": broker["LPUSH"] * per_100,  # the messages' own round trips
        "cpu_ms_per_job": cpu * 1000 / len(tokens),
        "wall_ms_per_job": wall * 1000 / len(tokens),
        "ledger_commands": dict(listener.counts),
        "broker_commands": dict(broker),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    config = {"jobs": args.jobs, "repeats": args.repeats, "dedupe_on_publish": True}
    facts = print_header("bulk_publish: round trips and producer CPU, bulk vs one by one", config)
    passes: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with running_servers("bench-bulk") as servers:
        app, listener = producer(servers.broker.url, servers.mongo_url("bench_bulk"))
        flush = redis.Redis.from_url(servers.broker.url)
        app.tasks[TASK].delay("probe")  # connections, indexes, queue declared
        for _ in range(args.repeats):
            for mode in MODES:
                if mode != "publish_many, all known":
                    tokens = [uuid.uuid4().hex for _ in range(args.jobs)]
                passes[mode].append(measure(app, listener, mode, tokens))
                flush.delete(*app.tiers.queues)
        flush.close()

    keys = ("ledger_per_100", "broker_per_100", "broker_per_job_100", "cpu_ms_per_job")
    medians = {
        mode: {k: median([p[k] for p in runs]) for k in keys} for mode, runs in passes.items()
    }
    single = medians["one by one"]
    rows = []
    for mode, found in medians.items():
        bulk = mode != "one by one"
        met = (
            found["ledger_per_100"] <= GOAL_LEDGER_PER_100
            and found["broker_per_job_100"] <= GOAL_BROKER_PER_100
        )
        rows.append(
            [
                mode,
                f"{found['ledger_per_100']:.1f}",
                f"{found['broker_per_100']:.1f} ({found['broker_per_job_100']:.1f})",
                f"{found['cpu_ms_per_job']:.3f}",
                f"{found['ledger_per_100'] / single['ledger_per_100']:.3f}x",
                f"{found['broker_per_100'] / single['broker_per_100']:.3f}x",
                f"{found['cpu_ms_per_job'] / single['cpu_ms_per_job']:.2f}x",
                ("yes" if met else "NO") if bulk else "-",
            ]
        )
    print_table(
        f"per 100 jobs ({args.jobs} a pass), median of {args.repeats} passes; ratios against"
        " one by one in this run",
        [
            "mode",
            "ledger/100",
            "broker/100 (LPUSH)",
            "CPU ms/job",
            "ledger x",
            "broker x",
            "CPU x",
            f"<= {GOAL_LEDGER_PER_100}+{GOAL_BROKER_PER_100}",
        ],
        rows,
    )

    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(MODES)
    axes[0].bar(names, [medians[n]["ledger_per_100"] for n in names], color="#36c")
    axes[0].set_ylabel("ledger round trips per 100 jobs")
    axes[1].bar(names, [medians[n]["cpu_ms_per_job"] for n in names], color="#3a6")
    axes[1].set_ylabel("producer CPU ms per job")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    write_results(
        "bulk_publish",
        {"configuration": config, "machine": facts, "median": medians, "passes": passes},
        figure,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
