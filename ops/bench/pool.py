"""A pool process's CPU per task, in one process: celery-ledger against plain Celery.

``ops.bench.throughput`` reads every process's CPU from /proc while they all share the machine;
on a 2-core machine whose speed drifts, a difference of a tenth of a millisecond in the pool
is lost in its noise. This benchmark measures what a worker does with a message once it has
it (Celery's tracer, the task's ledger work, the result's writes, the acknowledgement, which a
prefork worker's parent sends), in this process, with nothing else of the benchmark running
beside it:

1. publish N tiny tasks of a configuration (the throughput benchmark's apps and queues);
2. take the messages off the broker (kombu), and run each through its task's request class
   (``Request.execute``, celery-ledger's ``LedgerRequest``): the tracer a solo or prefork pool
   runs, and the acknowledgement, without the prefork pool's pipe;
3. time the CPU of this process (``time.process_time``) over the N executions, configurations
   interleaved, median of the repeats;
4. once more under ``cProfile`` (timed by CPU), to say where the time goes: the profile's
   time of each function goes to the layer of its file (celery-ledger, pymongo and bson,
   Celery and kombu), a function of none of them (the standard library, a builtin, redis-py)
   to its callers' layers in proportion; the layers' shares are applied to the unprofiled
   CPU, since a profiler slows code of many small calls most. (cProfile sees this thread
   only; the CPU time counts every thread of the process, the ledger's heartbeat thread and
   pymongo's monitors included.)

The ledger server runs in its own process and is not counted here: its share is in
``ops.bench.throughput`` and ``ops.bench.indexes``.

Run: ``python -m ops.bench.pool [--tasks N] [--repeats R] [--only a,b]``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from celery.utils.imports import symbol_by_name
from kombu.entity import Queue

from .common import (
    Servers,
    median,
    print_header,
    print_table,
    pyplot,
    running_servers,
    write_results,
)
from .throughput import CONFIGURATIONS, Configuration

# Layers by the path of a function's file; the first that matches wins.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("celery-ledger", ("/celery_ledger/",)),
    ("pymongo, bson", ("/pymongo/", "/bson/")),
    ("Celery, kombu", ("/celery/", "/kombu/", "/billiard/", "/vine/")),
)
OTHER = "other"
DEFAULT = ("plain-mongo-durable", "ledger")
WARM = 30


@dataclass(frozen=True)
class Measured:
    configuration: str
    tasks: int
    cpu_ms_per_task: float


def layer_of(filename: str) -> str | None:
    for name, marks in LAYERS:
        if any(mark in filename for mark in marks):
            return name
    return None


def layers(stats: pstats.Stats) -> dict[str, float]:
    """The profile's own time (seconds) by layer; see the module docstring."""
    table: Mapping[Any, Any] = stats.stats  # type: ignore[attr-defined]
    shares: dict[Any, dict[str, float]] = {}

    def share(func: Any, seen: frozenset[Any]) -> dict[str, float]:
        if func in shares:
            return shares[func]
        own = layer_of(func[0])
        if own is not None:
            result = {own: 1.0}
        else:
            callers = table[func][4] if func in table else {}
            weights = {c: t[2] for c, t in callers.items() if c not in seen and t[2] > 0}
            total = sum(weights.values())
            if not total:
                result = {OTHER: 1.0}
            else:
                result = {}
                for caller, weight in weights.items():
                    for name, part in share(caller, seen | {func}).items():
                        result[name] = result.get(name, 0.0) + part * weight / total
        shares[func] = result
        return result

    out: dict[str, float] = {}
    for func, (_cc, _nc, tottime, _ct, _callers) in table.items():
        for name, part in share(func, frozenset({func})).items():
            out[name] = out.get(name, 0.0) + tottime * part
    return out


def run_once(
    servers: Servers, configuration: Configuration, *, tasks: int, profile: bool = False
) -> tuple[Measured, dict[str, float] | None]:
    """Publish, drain and execute ``tasks`` messages of ``configuration`` in this process."""
    configuration.reset(servers)
    env = configuration.env(servers)
    app = import_module(configuration.app_module).build(env)
    task = app.tasks["bench.noop"]
    run = uuid.uuid4().hex[:10]
    hostname = f"bench-pool-{run}@127.0.0.1"
    try:
        with app.connection_for_read() as connection:
            queue = connection.SimpleQueue(Queue(configuration.queue))
            queue.clear()  # anything an earlier run left (an interrupted one's messages)
            for i in range(WARM + tasks):
                task.apply_async((run, i), queue=configuration.queue)
            messages = [queue.get(timeout=30) for _ in range(WARM + tasks)]

            # The task's own request class (celery-ledger's keeps the message's checks), acking
            # and rejecting as Celery's consumer does
            request_class = symbol_by_name(task.Request)

            def execute(i: int) -> None:
                message = messages[i]
                request = request_class(
                    message,
                    on_ack=message.ack_log_error,
                    on_reject=message.reject_log_error,
                    app=app,
                    task=task,
                    hostname=hostname,
                )
                if list(request.args) != [run, i]:
                    raise AssertionError(f"{configuration.name}: message {i} is {request.args}")
                returned = request.execute()
                if returned != i:
                    raise AssertionError(f"{configuration.name}: task {i} returned {returned!r}")

            for i in range(WARM):  # connections made, caches filled
                execute(i)
            profiler = cProfile.Profile(time.process_time) if profile else None
            started = time.process_time()
            if profiler is not None:
                profiler.enable()
            for i in range(WARM, WARM + tasks):
                execute(i)
            if profiler is not None:
                profiler.disable()
            cpu = time.process_time() - started
            queue.close()
        measured = Measured(configuration.name, tasks, 1000 * cpu / tasks)
        if profiler is None:
            return measured, None
        return measured, layers(pstats.Stats(profiler))
    finally:
        app.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1500, help="tasks per run (1500)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per configuration (5)")
    parser.add_argument(
        "--only",
        default=",".join(DEFAULT),
        help=f"comma-separated configuration names ({','.join(DEFAULT)})",
    )
    args = parser.parse_args(argv)
    by_name = {c.name: c for c in CONFIGURATIONS if c.pool == "prefork"}
    names = args.only.split(",")
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"--only: not a prefork configuration: {', '.join(unknown)}")
    chosen = [by_name[n] for n in names]
    facts = print_header(
        "pool: CPU per task of a pool process's work, in one process",
        {"tasks": args.tasks, "repeats": args.repeats, "path": "Request.execute (trace, ack)"},
    )
    runs: list[Measured] = []
    profiles: dict[str, dict[str, float]] = {}
    with running_servers("bench-pool") as servers:
        for repeat in range(args.repeats):
            for configuration in chosen:
                measured, _ = run_once(servers, configuration, tasks=args.tasks)
                runs.append(measured)
                print(
                    f"  run {repeat + 1}/{args.repeats} {configuration.name:<20}"
                    f" {measured.cpu_ms_per_task:6.3f} ms CPU a task",
                    flush=True,
                )
        for configuration in chosen:
            _, profile = run_once(servers, configuration, tasks=args.tasks, profile=True)
            assert profile is not None
            profiles[configuration.name] = profile

    cpu = {
        c.name: median([r.cpu_ms_per_task for r in runs if r.configuration == c.name])
        for c in chosen
    }
    rows = []
    for configuration in chosen:
        mine = [r.cpu_ms_per_task for r in runs if r.configuration == configuration.name]
        rows.append(
            [
                configuration.name,
                f"{cpu[configuration.name]:.3f}",
                f"{min(mine):.3f}",
                f"{max(mine):.3f}",
            ]
        )
    print_table(
        f"a pool process's CPU ms per task, median of {args.repeats}",
        ["configuration", "ms", "min", "max"],
        rows,
    )
    names_of_layers = [name for name, _ in LAYERS] + [OTHER]
    split: dict[str, dict[str, float]] = {}
    for configuration in chosen:
        profile = profiles[configuration.name]
        total = sum(profile.values()) or 1.0
        split[configuration.name] = {
            name: cpu[configuration.name] * profile.get(name, 0.0) / total
            for name in names_of_layers
        }
    print_table(
        "where it goes: ms per task by layer (the profile's shares of the median above)",
        ["configuration", *names_of_layers],
        [[c.name, *(f"{split[c.name][n]:.3f}" for n in names_of_layers)] for c in chosen],
    )
    ratios: dict[str, float] = {}
    if {"ledger", "plain-mongo-durable"} <= cpu.keys():
        ratios["ledger / plain-mongo-durable"] = cpu["ledger"] / cpu["plain-mongo-durable"]
        print(f"ledger / plain-mongo-durable: {ratios['ledger / plain-mongo-durable']:.2f}x")

    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 3.6))
    bottom = [0.0] * len(chosen)
    for name in names_of_layers:
        heights = [split[c.name][name] for c in chosen]
        axis.bar([c.name for c in chosen], heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axis.set_ylabel("CPU ms per task (pool process's work)")
    axis.legend(fontsize=8)
    axis.set_title(f"{args.tasks} tiny tasks, median of {args.repeats}")
    write_results(
        "pool",
        {
            "machine": facts,
            "tasks": args.tasks,
            "repeats": args.repeats,
            "runs": [r.__dict__ for r in runs],
            "cpu_ms_per_task": cpu,
            "layers_ms_per_task": split,
            "ratios": ratios,
        },
        figure,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
