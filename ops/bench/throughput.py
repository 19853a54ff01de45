"""End-to-end throughput: celery-ledger against plain Celery, in one run.

    python -m ops.bench.throughput [--tasks 1000] [--concurrency 2] [--threads 16] [--repeats 3]
        [--only NAME,...] [--compare-library DIR]

Configurations, all on the same valkey broker and the same SecantusDB server, each with its own
queue and database and a fresh worker per run: ``--concurrency`` prefork processes, or (the
``-threads`` configurations) one process with a pool of ``--threads`` threads:

    plain-redis         plain Celery, Redis result backend
    plain-mongo         plain Celery, Celery's MongoDB result backend (retryWrites=false)
    plain-mongo-started the same with task_track_started
    plain-mongo-durable the same with the ledger's write concern (w=majority, journaled)
    ledger              celery_ledger.create_app (LedgerTask, the ledger as result backend)
    ledger-secured      the same with every message signed and the task sensitive (its body
                        sealed by the publisher, its result sealed in the ledger)
    plain-redis-threads, plain-mongo-threads, ledger-threads
                        the same on the threads pool (where group commit coalesces the
                        ledger's writes of tasks running at once)
    ledger-threads-alone
                        ledger-threads with group commit off (each write sent alone)
    plain-mongo-gevent, plain-mongo-gevent-transport, ledger-gevent
                        the same on the gevent pool, the second on celery-ledger's broker
                        transport; only with --only (and gevent installed: the bench extra).
                        Celery's gevent pool on kombu's Redis transport stalls whenever every
                        slot is busy (it sits out its 2-second drain with free slots: see
                        celery_ledger.transport), which made plain Celery run 10 to 54 tasks/s
                        here, too slow to run by default

Each run also reads the CPU time of every process (worker, pool processes, ledger server,
broker, this producer) from /proc, and the table of CPU milliseconds per task shows where the
time goes: on a 2-core machine where all of them share the CPU, that is the profile that counts.

``--compare-library DIR`` adds ``<name>-compared`` for each ledger configuration chosen
(``ledger-compared``, ``ledger-threads-compared``, ...): the same configuration on a worker that
imports celery_ledger from DIR (another commit's ``platform/``, e.g. from ``git worktree add``),
so that a change is measured side by side with what it replaced, in one run (the producer, this
process, keeps the current library).

A run publishes N tiny tasks and waits for every result (``AsyncResult.get``); its time runs from
the first publish to the last result. Runs are interleaved across configurations (repeat 1 of
each, then repeat 2, ...) so that the machine's noise spreads evenly; the median is reported.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import import_module
from pathlib import Path
from typing import Any

from celery import Celery
from pymongo import MongoClient
from redis import Redis

from .common import (
    REPO,
    Servers,
    median,
    print_header,
    print_table,
    pyplot,
    rss_kib,
    running_servers,
    start_worker,
    write_results,
)

# (ratio, numerator, denominator, goal): the goals, each measured in the same run. The
# 1.0x goal reads "Celery's MongoDB backend with task_track_started and the same write concern":
# plain-mongo-durable. Until 2026-11-26 it was printed against plain-mongo-started (w=1), a
# stricter reading, which stays in the table without a goal.
GOALS: list[tuple[str, str, str, float]] = [
    ("prefork: ledger / plain-mongo", "ledger", "plain-mongo", 0.8),
    (
        "prefork, same durability: ledger / plain-mongo-durable",
        "ledger",
        "plain-mongo-durable",
        1.0,
    ),
    ("threads: ledger / plain-mongo", "ledger-threads", "plain-mongo-threads", 1.0),
    ("gevent: ledger / plain-mongo", "ledger-gevent", "plain-mongo-gevent", 1.0),
    ("stretch, prefork: ledger / plain-redis", "ledger", "plain-redis", 0.6),
    ("stretch, threads: ledger / plain-redis", "ledger-threads", "plain-redis-threads", 0.6),
]

# (ratio, processes, numerator, denominator, goal): CPU per task, medians of the same run, at
# most the goal. What celery-ledger adds to each task's work in the worker's processes and in
# the producer, against Celery with its MongoDB backend (the ledger server's share is the
# throughput goals' above).
CPU_GOALS: list[tuple[str, tuple[str, ...], str, str, float]] = [
    (
        "worker + pool CPU a task: ledger / plain-mongo",
        ("worker", "pool"),
        "ledger",
        "plain-mongo",
        1.2,
    ),
    # The producer goal was set when a publish wrote nothing to the ledger; dedupe on
    # publish (on by default since) adds one ledger write a publish, reported beside it
    (
        "producer CPU a task: ledger-no-dedupe / plain-mongo",
        ("producer",),
        "ledger-no-dedupe",
        "plain-mongo",
        1.2,
    ),
]
# (ratio, processes, numerator, denominator): CPU ratios reported without a goal.
CPU_REPORTED: list[tuple[str, tuple[str, ...], str, str]] = [
    (
        "producer CPU a task, dedupe on publish (default): ledger / plain-mongo",
        ("producer",),
        "ledger",
        "plain-mongo",
    ),
    (
        "dedupe on publish's producer cost: ledger / ledger-no-dedupe",
        ("producer",),
        "ledger",
        "ledger-no-dedupe",
    ),
    (
        "worker + pool, Celery writing twice: ledger / plain-mongo-durable",
        ("worker", "pool"),
        "ledger",
        "plain-mongo-durable",
    ),
]


def cpu_ratios(profile: dict[str, dict[str, float]]) -> list[tuple[str, float, float]]:
    """(label, ratio, goal) of each CPU goal whose two configurations ran."""
    found = []
    for label, parts, numerator, denominator, goal in CPU_GOALS:
        ratio = _cpu_ratio(profile, parts, numerator, denominator)
        if ratio is not None:
            found.append((label, ratio, goal))
    return found


def cpu_reported(profile: dict[str, dict[str, float]]) -> list[tuple[str, float]]:
    """(label, ratio) of each CPU ratio reported without a goal whose configurations ran."""
    found = []
    for label, parts, numerator, denominator in CPU_REPORTED:
        ratio = _cpu_ratio(profile, parts, numerator, denominator)
        if ratio is not None:
            found.append((label, ratio))
    return found


def _cpu_ratio(
    profile: dict[str, dict[str, float]], parts: tuple[str, ...], numerator: str, denominator: str
) -> float | None:
    if not {numerator, denominator} <= profile.keys():
        return None
    baseline = sum(profile[denominator][p] for p in parts)
    return sum(profile[numerator][p] for p in parts) / baseline if baseline > 0 else None


@dataclass(frozen=True)
class Configuration:
    name: str
    app_module: str
    description: str
    database: str | None = None  # the MongoDB database it writes (dropped before each run)
    redis_db: int | None = None  # the Redis database of its results (flushed before each run)
    pool: str = "prefork"
    extra_env: tuple[tuple[str, str], ...] = ()

    @property
    def queue(self) -> str:
        return f"bench_{self.name.replace('-', '_')}"

    def env(self, servers: Servers) -> dict[str, str]:
        return {
            "BENCH_BROKER_URL": servers.broker.url,
            "BENCH_REDIS_RESULTS": servers.redis_url(1),
            "BENCH_MONGO_RESULTS": servers.mongo_url(self.database or "bench_unused"),
            "LEDGER_BROKER_URL": servers.broker.url,
            "LEDGER_MONGO_URI": servers.ledger.url,
            "LEDGER_MONGO_DB": self.database or "bench_unused",
            "BENCH_QUEUE": self.queue,
            **dict(self.extra_env),
        }

    def reset(self, servers: Servers) -> None:
        if self.database:
            client: MongoClient[dict[str, Any]]
            with MongoClient(servers.ledger.url) as client:
                client.drop_database(self.database)
        if self.redis_db is not None:
            with Redis.from_url(servers.redis_url(self.redis_db)) as redis:
                redis.flushdb()


CONFIGURATIONS = (
    Configuration(
        "plain-redis", "ops.bench.apps.plain_redis", "plain Celery, Redis result backend", None, 1
    ),
    Configuration(
        "plain-mongo",
        "ops.bench.apps.plain_mongo",
        "plain Celery, MongoDB result backend",
        "bench_plain_mongo",
    ),
    Configuration(
        "plain-mongo-started",
        "ops.bench.apps.plain_mongo_started",
        "plain Celery, MongoDB result backend, task_track_started",
        "bench_plain_mongo_started",
    ),
    Configuration(
        "plain-mongo-durable",
        "ops.bench.apps.plain_mongo_durable",
        "plain Celery, MongoDB backend, track_started, w=majority + journal (as the ledger)",
        "bench_plain_mongo_durable",
    ),
    Configuration("ledger", "ops.bench.apps.ledger", "celery-ledger (LedgerTask)", "bench_ledger"),
    Configuration(
        "ledger-no-dedupe",
        "ops.bench.apps.ledger",
        "celery-ledger, LEDGER_DEDUPE_ON_PUBLISH=false (a publish writes no record)",
        "bench_ledger_no_dedupe",
        extra_env=(("BENCH_DEDUPE_ON_PUBLISH", "0"),),
    ),
    Configuration(
        "ledger-secured",
        "ops.bench.apps.ledger_secured",
        "celery-ledger, messages signed, task sensitive (sealed)",
        "bench_ledger_secured",
    ),
    Configuration(
        "plain-redis-threads",
        "ops.bench.apps.plain_redis",
        "plain Celery, Redis result backend, threads pool",
        None,
        2,
        pool="threads",
    ),
    Configuration(
        "plain-mongo-threads",
        "ops.bench.apps.plain_mongo",
        "plain Celery, MongoDB result backend, threads pool",
        "bench_plain_mongo_threads",
        pool="threads",
    ),
    Configuration(
        "ledger-threads",
        "ops.bench.apps.ledger",
        "celery-ledger, threads pool (group commit)",
        "bench_ledger_threads",
        pool="threads",
    ),
    Configuration(
        "ledger-threads-alone",
        "ops.bench.apps.ledger",
        "celery-ledger, threads pool, every write alone (LEDGER_GROUP_COMMIT_MAX=1)",
        "bench_ledger_threads_alone",
        pool="threads",
        extra_env=(("BENCH_GROUP_COMMIT_MAX", "1"),),
    ),
    Configuration(
        "plain-mongo-gevent",
        "ops.bench.apps.plain_mongo",
        "plain Celery, MongoDB result backend, gevent pool",
        "bench_plain_mongo_gevent",
        pool="gevent",
    ),
    Configuration(
        "plain-mongo-gevent-transport",
        "ops.bench.apps.plain_mongo",
        "plain Celery, MongoDB result backend, gevent pool, on celery-ledger's broker transport",
        "bench_plain_mongo_gevent_transport",
        pool="gevent",
        extra_env=(("BENCH_LEDGER_TRANSPORT", "1"),),
    ),
    Configuration(
        "ledger-gevent",
        "ops.bench.apps.ledger",
        "celery-ledger, gevent pool (group commit)",
        "bench_ledger_gevent",
        pool="gevent",
    ),
)


def compared(configuration: Configuration, library: Path) -> Configuration:
    """``configuration`` on a worker that imports celery_ledger from ``library``."""
    return replace(
        configuration,
        name=f"{configuration.name}-compared",
        description=f"{configuration.description}, the worker's library from {library}",
        database=f"{configuration.database}_compared" if configuration.database else None,
        extra_env=(
            *configuration.extra_env,
            ("PYTHONPATH", f"{library}{os.pathsep}{REPO}"),
        ),
    )


def ledger_commands(servers: Servers) -> dict[str, int]:
    """The ledger server's command counters (SecantusDB counts a command, a bulk write of
    many statements once: so these are round trips, the producer's result reads included)."""
    client: MongoClient[dict[str, Any]]
    with MongoClient(servers.ledger.url) as client:
        counters = client.admin.command("serverStatus").get("opcounters", {})
    return {k: int(counters.get(k, 0)) for k in ("insert", "query", "update", "delete")}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, threads included (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class RunResult:
    configuration: str
    tasks: int
    seconds: float
    pool_rss_kib: list[int]
    worker_rss_kib: int
    cpu_ms_per_task: dict[str, float]
    ledger_commands_per_task: dict[str, float]

    @property
    def tasks_per_second(self) -> float:
        return self.tasks / self.seconds


def run_once(
    servers: Servers,
    configuration: Configuration,
    *,
    tasks: int,
    concurrency: int,
    threads: int = 16,
    after: Callable[[Any], None] | None = None,
) -> RunResult:
    """One run: reset its database, start a fresh worker, publish ``tasks``, wait for them."""
    configuration.reset(servers)
    env = configuration.env(servers)
    worker = start_worker(
        servers,
        configuration.app_module,
        queue=configuration.queue,
        concurrency=concurrency if configuration.pool == "prefork" else threads,
        pool=configuration.pool,
        name=f"{configuration.name}-{uuid.uuid4().hex[:6]}",
        env=env,
    )
    app: Celery = import_module(configuration.app_module).build(env)
    task = app.tasks["bench.noop"]
    run = uuid.uuid4().hex[:10]
    try:
        # Warm-up: every pool process connects before the clock starts.
        warm = [task.apply_async((f"warm-{run}", i), queue=configuration.queue) for i in range(8)]
        for result in warm:
            result.get(timeout=60, interval=0.05)
        processes = {
            "worker": [worker.pid],
            "pool": worker.pool_pids(),
            "ledger server": [servers.ledger.pid],
            "broker": [servers.broker.pid],
            "producer": [os.getpid()],
        }
        cpu_before = {k: sum(map(cpu_seconds, pids)) for k, pids in processes.items()}
        commands_before = ledger_commands(servers)
        started = time.perf_counter()
        results = [task.apply_async((run, i), queue=configuration.queue) for i in range(tasks)]
        for i, result in enumerate(results):
            value = result.get(timeout=600, interval=0.05)
            if value != i:
                raise AssertionError(f"{configuration.name}: task {i} returned {value!r}")
        seconds = time.perf_counter() - started
        cpu = {
            k: 1000 * (sum(map(cpu_seconds, pids)) - cpu_before[k]) / tasks
            for k, pids in processes.items()
        }
        commands_after = ledger_commands(servers)
        commands = {
            k: (commands_after[k] - commands_before.get(k, 0)) / tasks for k in commands_after
        }
        pool = [rss_kib(pid) for pid in worker.pool_pids()]
        result_obj = RunResult(
            configuration.name, tasks, seconds, pool, rss_kib(worker.pid), cpu, commands
        )
        if after is not None:
            after(app)
        return result_obj
    finally:
        worker.stop()
        app.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1000, help="tasks per run (default 1000)")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork processes (2)")
    parser.add_argument("--threads", type=int, default=16, help="threads pool size (16)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration (3)")
    parser.add_argument(
        "--compare-library",
        default="",
        help="a directory holding another celery_ledger (its platform/): adds <name>-compared",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated configuration names (default: all but the gevent ones)",
    )
    args = parser.parse_args(argv)
    wanted = set(args.only.split(",")) if args.only else None
    unknown = sorted((wanted or set()) - {c.name for c in CONFIGURATIONS})
    if unknown:
        parser.error(f"--only: no configuration named {', '.join(unknown)}")
    chosen = [c for c in CONFIGURATIONS if (c.name in wanted if wanted else c.pool != "gevent")]
    if args.compare_library:
        library = Path(args.compare_library).resolve()
        if not (library / "celery_ledger" / "__init__.py").is_file():
            parser.error(f"--compare-library: no celery_ledger package in {library}")
        # Each ledger configuration chosen runs twice, on this library and then on the other
        # one, so that a change is measured on every pool it touches, each pair side by side.
        chosen = [
            twin
            for c in chosen
            for twin in ((c, compared(c, library)) if c.name.startswith("ledger") else (c,))
        ]

    config = {
        "tasks": args.tasks,
        "worker": f"1 worker x {args.concurrency} prefork processes, or x {args.threads} threads",
        "repeats": args.repeats,
        "delivery": "acks_late, prefetch 1, JSON (as create_app)",
        "wait": "AsyncResult.get per task, poll interval 0.05s",
    }
    facts = print_header("throughput: end-to-end tasks/s, first publish to last result", config)
    runs: list[RunResult] = []
    with running_servers("bench-throughput") as servers:
        for repeat in range(args.repeats):
            for configuration in chosen:
                result = run_once(
                    servers,
                    configuration,
                    tasks=args.tasks,
                    concurrency=args.concurrency,
                    threads=args.threads,
                )
                runs.append(result)
                print(
                    f"  run {repeat + 1}/{args.repeats} {configuration.name:<30}"
                    f" {result.tasks_per_second:7.1f} tasks/s ({result.seconds:.2f}s)",
                    flush=True,
                )

    medians: dict[str, float] = {}
    rows = []
    for configuration in chosen:
        rates = [r.tasks_per_second for r in runs if r.configuration == configuration.name]
        medians[configuration.name] = median(rates)
        rows.append(
            [
                configuration.name,
                configuration.description,
                f"{median(rates):.1f}",
                f"{min(rates):.1f}",
                f"{max(rates):.1f}",
                f"{args.tasks / median(rates):.2f}",
            ]
        )
    print_table(
        f"throughput, {args.tasks} tiny tasks, median of {args.repeats} runs",
        ["configuration", "what", "tasks/s", "min", "max", "seconds"],
        rows,
    )
    ratios: dict[str, float] = {}
    goal_rows = []
    comparisons = [
        (
            f"this library / the compared one: {c.name} / {c.name}-compared",
            c.name,
            f"{c.name}-compared",
        )
        for c in chosen
        if not c.name.endswith("-compared")
    ]
    for label, numerator, denominator, goal in GOALS:
        if {numerator, denominator} <= medians.keys():
            ratios[label] = medians[numerator] / medians[denominator]
            met = "yes" if ratios[label] >= goal else "NO"
            goal_rows.append([label, f"{ratios[label]:.2f}", f">= {goal}", met])
    for label, numerator, denominator in (
        *comparisons,
        ("started, w=1: ledger / plain-mongo-started", "ledger", "plain-mongo-started"),
        (
            "gevent, the same transport: ledger / plain-mongo-gevent-transport",
            "ledger-gevent",
            "plain-mongo-gevent-transport",
        ),
        ("security's cost: ledger-secured / ledger", "ledger-secured", "ledger"),
        (
            "group commit: ledger-threads / ledger-threads-alone",
            "ledger-threads",
            "ledger-threads-alone",
        ),
    ):
        if {numerator, denominator} <= medians.keys():
            ratios[label] = medians[numerator] / medians[denominator]
            goal_rows.append([label, f"{ratios[label]:.2f}", "-", "-"])
    if goal_rows:
        print_table("ratios (medians)", ["ratio", "value", "goal", "met"], goal_rows)

    # Where the time goes: CPU milliseconds per task of each process, median over the runs.
    parts = ["worker", "pool", "ledger server", "broker", "producer"]
    profile: dict[str, dict[str, float]] = {}
    for configuration in chosen:
        mine = [r.cpu_ms_per_task for r in runs if r.configuration == configuration.name]
        profile[configuration.name] = {part: median([m[part] for m in mine]) for part in parts}
        profile[configuration.name]["total"] = sum(profile[configuration.name].values())
    commands: dict[str, dict[str, float]] = {}
    for configuration in chosen:
        mine = [r.ledger_commands_per_task for r in runs if r.configuration == configuration.name]
        commands[configuration.name] = {k: median([m[k] for m in mine]) for k in mine[0]}
    print_table(
        "ledger server commands (round trips) per task, median; reads are mostly the"
        " producer's AsyncResult.get",
        ["configuration", "update", "insert", "delete", "query"],
        [
            [name, *(f"{values[k]:.2f}" for k in ("update", "insert", "delete", "query"))]
            for name, values in commands.items()
        ],
    )
    print_table(
        "CPU ms per task by process (median): where the time goes",
        ["configuration", *parts, "total"],
        [
            [name, *(f"{values[p]:.2f}" for p in [*parts, "total"])]
            for name, values in profile.items()
        ],
    )

    cpu_goals = cpu_ratios(profile)
    reported = cpu_reported(profile)
    if cpu_goals or reported:
        print_table(
            "CPU a task (medians): what celery-ledger adds, at most the goal",
            ["ratio", "value", "goal", "met"],
            [
                *(
                    [label, f"{ratio:.2f}", f"<= {goal}", "yes" if ratio <= goal else "NO"]
                    for label, ratio, goal in cpu_goals
                ),
                *([label, f"{ratio:.2f}", "-", "-"] for label, ratio in reported),
            ],
        )
    ratios.update({label: ratio for label, ratio, _ in cpu_goals})
    ratios.update(dict(reported))

    plt = pyplot()
    figure, axes = plt.subplots(figsize=(8, 4))
    names = [c.name for c in chosen]
    values = [medians[n] for n in names]
    lows = [
        medians[n] - min(r.tasks_per_second for r in runs if r.configuration == n) for n in names
    ]
    highs = [
        max(r.tasks_per_second for r in runs if r.configuration == n) - medians[n] for n in names
    ]
    colours = ["#36c" if n.startswith("ledger") else "#999" for n in names]
    axes.bar(names, values, yerr=[lows, highs], capsize=4, color=colours)
    axes.set_ylabel("tasks/s (median, min-max)")
    axes.tick_params(axis="x", labelrotation=30)
    axes.set_title(
        f"{args.tasks} tiny tasks, {args.concurrency} prefork processes or {args.threads} threads"
    )
    figure.tight_layout()
    write_results(
        "throughput",
        {
            "configuration": config,
            "machine": facts,
            "runs": [vars(r) | {"tasks_per_second": r.tasks_per_second} for r in runs],
            "median_tasks_per_second": medians,
            "ratios": ratios,
            "goals": {label: goal for label, _, _, goal in GOALS},
            "cpu_goals_at_most": {label: goal for label, _, _, _, goal in CPU_GOALS},
            "cpu_ms_per_task": profile,
            "ledger_commands_per_task": commands,
        },
        figure,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
