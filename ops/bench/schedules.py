"""The fleet's scheduler: 1,000 schedules firing every second, their slot lag and the
scheduler's cost per slot.

    python -m ops.bench.schedules [--entries 1000] [--seconds 30] [--repeats 3]
                                  [--profile]

One app with ``--entries`` interval entries in its ``beat_schedule`` (each a no-op ledger task
every second), fired by a :class:`~celery_ledger.schedules.FleetScheduler` in this process, on
the embedded stack (valkey and SecantusDB server processes of the benchmark's own). No worker
consumes the queue: what is measured is the scheduler (the fleet's workers run the jobs); the
queue is emptied between runs.

``tick_if_leader()`` is driven as the worker's housekeeping lane drives it (``worker.Paced``):
call, then wait the delay it returns, at most ``defer_poll_seconds`` (1 s by default).
``--repeats`` runs.

Per run, over ``--seconds`` whole 1-s windows after a warm-up (which takes the lease and fires
every entry's first window): runs sent against runs expected (entries x windows); windows
missed (an entry's window with no run: a window the scheduler gets to more than a minute late,
``late_after_seconds``, is skipped and counted; one it gets to sooner is sent late) and
doubled; slot lag (the broker's clock when the run was sent minus its slot: the ``scheduled``
event) p50, p99 and max; the scheduler process's CPU per run sent (``time.process_time``:
pymongo's and the broker client's threads included), its broker commands (valkey's ``INFO
commandstats``) and ledger commands per run sent; how long the passes that fired took.

Goal: slot lag p99 <= 1 s (the median of the runs' p99). A missed window counts as a run
later than its window (its lag is over 1 s): the p99 is taken over the expected slots, so more
than 1 % of windows missed fails the goal whatever the lag of the runs that were sent.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import math
import os
import pstats
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from celery_ledger import LedgerCelery, Observer, Settings, create_app
from celery_ledger.schedules import FleetScheduler, lease_key, slots_key
from celery_ledger.worker import PACED_FLOOR_SECONDS

from .common import (
    RESULTS,
    Commands,
    console,
    median,
    percentile,
    print_header,
    print_table,
    running_servers,
)

QUEUE = "bench_schedules"
TASK = "bench.tick"
GOAL_P99_SECONDS = 1.0
DRIVES = ("housekeeping",)


class Lags(Observer):
    """Every ``scheduled`` event: (entry, slot, lag)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, float, float]] = []

    def scheduled(self, schedule: str, task: str, slot: float, lag_seconds: float) -> None:
        self.sent.append((schedule, slot, lag_seconds))


@dataclass
class Run:
    """What one run measured."""

    drive: str
    entries: int
    windows: int
    sent: int = 0
    missed: int = 0
    doubled: int = 0
    lags: list[float] = field(default_factory=list)
    cpu_seconds: float = 0.0
    sent_in_cpu_window: int = 0
    broker_commands: dict[str, int] = field(default_factory=dict)
    ledger_commands: dict[str, int] = field(default_factory=dict)
    pass_seconds: list[float] = field(default_factory=list)
    busy: float = 0.0  # share of the run's wall time spent in tick_if_leader

    @property
    def expected(self) -> int:
        return self.entries * self.windows

    def p(self, q: float) -> float:
        """Lag percentile over the expected slots: a missed window is later than any run."""
        if not self.expected:
            return float("nan")
        ordered = sorted(self.lags) + [math.inf] * (self.expected - len(self.lags))
        position = (len(ordered) - 1) * q / 100
        low, high = int(position), min(int(position) + 1, len(ordered) - 1)
        if math.isinf(ordered[high]):
            return math.inf if position > low or math.isinf(ordered[low]) else ordered[low]
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    def per_run(self, counts: dict[str, int]) -> float:
        return sum(counts.values()) / self.sent_in_cpu_window if self.sent_in_cpu_window else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "drive": self.drive,
            "sent": self.sent,
            "expected": self.expected,
            "missed": self.missed,
            "doubled": self.doubled,
            "lag_p50": percentile(self.lags, 50),
            "lag_p99_sent": percentile(self.lags, 99),
            "lag_max_sent": max(self.lags, default=float("nan")),
            "lag_p99": self.p(99),
            "cpu_us_per_run": 1e6 * self.cpu_seconds / max(self.sent_in_cpu_window, 1),
            "broker_commands_per_run": self.per_run(self.broker_commands),
            "ledger_commands_per_run": self.per_run(self.ledger_commands),
            "broker_commands": self.broker_commands,
            "ledger_commands": self.ledger_commands,
            "pass_p50": percentile(self.pass_seconds, 50),
            "pass_max": max(self.pass_seconds, default=float("nan")),
            "busy": self.busy,
        }


def build(broker_url: str, mongo_uri: str, entries: int, listener: Commands) -> LedgerCelery:
    settings = Settings(broker_url=broker_url, mongo_uri=mongo_uri, mongo_db="bench_schedules")
    app = create_app(
        "bench_schedules", settings=settings, command_listeners=(listener,), set_as_current=False
    )

    @app.task(name=TASK, shared=False)  # type: ignore[untyped-decorator]
    def tick() -> None:
        return None

    app.conf.beat_schedule = {
        f"tick-{i:04d}": {"task": TASK, "schedule": 1.0, "options": {"queue": QUEUE}}
        for i in range(entries)
    }
    return app


def broker_calls(app: LedgerCelery) -> dict[str, int]:
    """valkey's calls of each command since its last ``CONFIG RESETSTAT``."""
    stats = app.runtime.redis.info("commandstats")
    calls: dict[str, int] = {}
    for name, value in stats.items():
        if isinstance(value, dict) and "calls" in value:
            command = name.removeprefix("cmdstat_")
            if command not in ("info", "config|resetstat", "config"):
                calls[command] = int(value["calls"])
    return calls


def fresh_scheduler(app: LedgerCelery) -> FleetScheduler:
    """A scheduler that starts from nothing: no lease, no last slots, an empty queue."""
    client = app.runtime.redis
    client.delete(lease_key(app.runtime.name), slots_key(app.runtime.name), QUEUE)
    return FleetScheduler(app)


def one_run(
    app: LedgerCelery,
    lags: Lags,
    listener: Commands,
    *,
    drive: str,
    entries: int,
    seconds: int,
    warmup: float,
    profile: cProfile.Profile | None = None,
) -> Run:
    """Drive a fresh scheduler for ``warmup`` seconds, then measure ``seconds`` windows."""
    interval = float(app.settings.defer_poll_seconds)
    scheduler = fresh_scheduler(app)
    clock = app.runtime.message_time
    client = app.runtime.redis
    lags.sent.clear()
    start_slot = float(math.floor(clock() + warmup) + 1)
    end_slot = start_slot + seconds
    measuring = False
    cpu0 = wall0 = 0.0
    sent0 = 0
    busy = 0.0
    passes: list[float] = []
    delay: float | None = 0.0
    try:
        while True:
            # (Housekeeping._run with a Paced job: the lane waits the delay asked, at most
            # its interval; the floor is PACED_FLOOR_SECONDS)
            time.sleep(min(max(delay or 0.0, PACED_FLOOR_SECONDS), interval))
            now = clock()
            if now >= end_slot:
                break
            if not measuring and now >= start_slot:
                measuring = True
                client.config_resetstat()
                listener.counts.clear()
                sent0 = len(lags.sent)
                wall0, cpu0 = time.monotonic(), time.process_time()
                if profile is not None:
                    profile.enable()
            before, began = len(lags.sent), time.perf_counter()
            delay = scheduler.tick_if_leader()
            took = time.perf_counter() - began
            if delay is None:
                raise RuntimeError("the benchmark's scheduler does not hold the fleet's lease")
            if measuring:
                busy += took
                if len(lags.sent) > before:
                    passes.append(took)
        cpu = time.process_time() - cpu0
        wall = time.monotonic() - wall0
        if profile is not None:
            profile.disable()
        run = Run(drive, entries, seconds, cpu_seconds=cpu, pass_seconds=passes)
        run.sent_in_cpu_window = len(lags.sent) - sent0
        run.broker_commands = broker_calls(app)
        run.ledger_commands = dict(listener.counts)
        run.busy = busy / wall if wall else 0.0
    finally:
        scheduler.stop()
        client.delete(QUEUE)
    by_entry: dict[str, Counter[float]] = defaultdict(Counter)
    for name, slot, lag in lags.sent:
        if start_slot <= slot < end_slot:
            by_entry[name][slot] += 1
            run.lags.append(lag)
    run.sent = len(run.lags)
    windows = [start_slot + i for i in range(seconds)]
    for name in app.conf.beat_schedule:
        sent = by_entry.get(name, Counter())
        run.missed += sum(1 for w in windows if sent[w] == 0)
        run.doubled += sum(n - 1 for n in sent.values() if n > 1)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1000)
    parser.add_argument("--seconds", type=int, default=30, help="windows measured per run")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--drive", nargs="+", choices=DRIVES, default=list(DRIVES))
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the measured part of one extra run"
    )
    args = parser.parse_args(argv)
    config = {**vars(args), "consumer": "none (the scheduler alone)"}
    facts = print_header("schedules: the fleet's scheduler, interval entries every second", config)
    logging.getLogger("celery.beat").setLevel(logging.WARNING)
    runs: dict[str, list[Run]] = defaultdict(list)
    profiles: dict[str, str] = {}
    with running_servers("bench-schedules") as servers:
        listener = Commands()
        app = build(
            servers.broker.url, servers.mongo_url("bench_schedules"), args.entries, listener
        )
        lags = app.observers.add(Lags())
        assert isinstance(lags, Lags)
        try:
            for _ in range(args.repeats):
                for drive in args.drive:
                    run = one_run(
                        app,
                        lags,
                        listener,
                        drive=drive,
                        entries=args.entries,
                        seconds=args.seconds,
                        warmup=args.warmup,
                    )
                    runs[drive].append(run)
                    s = run.summary()
                    console.print(
                        f"  {drive}: {s['sent']}/{s['expected']} sent, {s['missed']} missed,"
                        f" lag p99 {_s(s['lag_p99'])}, {s['cpu_us_per_run']:.0f} µs CPU per run,"
                        f" load average {[round(x, 2) for x in _loadavg()]}",
                        highlight=False,
                    )
            if args.profile:
                for drive in args.drive:
                    profile = cProfile.Profile()
                    one_run(
                        app,
                        lags,
                        listener,
                        drive=drive,
                        entries=args.entries,
                        seconds=min(args.seconds, 10),
                        warmup=args.warmup,
                        profile=profile,
                    )
                    out = io.StringIO()
                    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(30)
                    profiles[drive] = out.getvalue()
        finally:
            app.close()

    summary: dict[str, Any] = {}
    for drive in args.drive:
        done = [r.summary() for r in runs[drive]]
        p99 = median([d["lag_p99"] for d in done])
        summary[drive] = {"lag_p99": p99, "met": p99 <= GOAL_P99_SECONDS, "runs": done}
        print_table(
            f"drive {drive}: {args.entries} entries every second, {args.seconds} windows per run:"
            f" {args.entries * args.seconds} runs expected (no consumer; times in seconds)",
            [
                "run",
                "sent",
                "missed",
                "dbl",
                "lag p50/p99/max",
                "p99 all",
                "µs/run",
                "cmds",
                "pass",
                "busy",
            ],
            [
                [
                    index,
                    d["sent"],
                    d["missed"],
                    d["doubled"],
                    "/".join(_s(d[k]) for k in ("lag_p50", "lag_p99_sent", "lag_max_sent")),
                    _s(d["lag_p99"]),
                    f"{d['cpu_us_per_run']:.0f}",
                    f"{d['broker_commands_per_run']:.2f}/{d['ledger_commands_per_run']:.3f}",
                    f"{_s(d['pass_p50'])}/{_s(d['pass_max'])}",
                    f"{100 * d['busy']:.0f}%",
                ]
                for index, d in enumerate(done, 1)
            ],
        )
    console.print(
        "lag p50/p99/max: of the runs sent; p99 all: over the expected slots (a missed window"
        " counts as late); µs/run: the process's CPU per run sent; cmds: valkey/mongo commands"
        " per run sent; pass: p50/max of a pass that sent; busy: share of the wall time in"
        " tick_if_leader",
        highlight=False,
    )
    print_table(
        f"slot lag p99 of all slots, median of {args.repeats} runs",
        ["drive", "p99 (s)", "goal", "met"],
        [
            [
                drive,
                _s(summary[drive]["lag_p99"]),
                f"<= {GOAL_P99_SECONDS:g} s",
                "yes" if summary[drive]["met"] else "NO",
            ]
            for drive in args.drive
        ],
    )
    last = runs[args.drive[0]][-1]
    console.print(
        "broker commands (last run, all): "
        + ", ".join(f"{k} {v}" for k, v in sorted(last.broker_commands.items())),
        highlight=False,
    )
    for drive, text in profiles.items():
        console.print(f"[bold]profile, {drive}[/]\n{text}", highlight=False)
    write_json_and_figure(
        {"machine": facts, "config": config, "goal_p99_seconds": GOAL_P99_SECONDS, **summary},
        runs,
    )
    return 0


def write_json_and_figure(data: dict[str, Any], runs: dict[str, list[Run]]) -> None:
    """``ops/bench/results/schedules-<stamp>.json``, and a lag CDF (``.png``) if matplotlib
    is installed (the ``bench`` extra)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"schedules-{stamp}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    console.print(f"wrote {path}", highlight=False, soft_wrap=True)
    try:
        import matplotlib
    except ImportError:
        console.print("(no figure: matplotlib is not installed)", highlight=False)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for drive, done in runs.items():
        lags = sorted(lag for run in done for lag in run.lags)
        expected = sum(run.expected for run in done)
        if lags:
            axes.plot(lags, [(i + 1) / expected for i in range(len(lags))], label=drive)
    axes.axvline(GOAL_P99_SECONDS, color="#c33", linestyle="--", label="goal (p99)")
    axes.axhline(0.99, color="#999", linewidth=0.5)
    axes.set_xlabel("slot lag (s)")
    axes.set_ylabel("share of expected slots sent")
    axes.legend()
    png = path.with_suffix(".png")
    figure.savefig(png, dpi=110, bbox_inches="tight")
    console.print(f"wrote {png}", highlight=False, soft_wrap=True)


def _s(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    if math.isinf(seconds):
        return "missed"
    return f"{seconds:.2f}"


def _loadavg() -> tuple[float, float, float]:
    return os.getloadavg()


if __name__ == "__main__":
    raise SystemExit(main())
