"""What the benchmarks share: servers, workers, statistics, output (table, JSON, PNG)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pymongo import monitoring
from rich.console import Console
from rich.table import Table

from celery_ledger.embedded.servers import ServerProcess, start_secantus, start_valkey
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "ops" / "bench" / "results"

console = Console(width=110)


@dataclass
class Servers:
    """A valkey broker and a SecantusDB server of our own, on free loopback ports."""

    broker: ServerProcess
    ledger: ServerProcess
    data_dir: Path

    def stack(self, app_module: str) -> EmbeddedStack:
        """A stack object over these servers, to start workers of ``app_module`` with."""
        return EmbeddedStack(app_module, self.data_dir, broker=self.broker, ledger=self.ledger)

    def mongo_url(self, database: str) -> str:
        """The ledger server's URI with a database path (``retryWrites=false`` kept)."""
        base, _, query = self.ledger.url.partition("/?")
        return f"{base}/{database}?{query}"

    def redis_url(self, db: int) -> str:
        return self.broker.url.rsplit("/", 1)[0] + f"/{db}"


@contextlib.contextmanager
def running_servers(prefix: str) -> Iterator[Servers]:
    """Start both servers in a fresh temporary directory; stop them (by PID) on exit."""
    with tempfile.TemporaryDirectory(prefix=f"{prefix}-") as tmp:
        data_dir = Path(tmp)
        broker = start_valkey(data_dir / "valkey")
        try:
            # The server's default commit: the baselines' writes (Celery's MongoDB backend,
            # w=1) must not be journaled for them; celery-ledger's writes ask for j=True.
            ledger = start_secantus(data_dir / "secantus", sync_on_commit=False)
        except BaseException:
            broker.stop()
            raise
        try:
            yield Servers(broker, ledger, data_dir)
        finally:
            ledger.stop()
            broker.stop()


def start_worker(
    servers: Servers,
    app_module: str,
    *,
    queue: str,
    concurrency: int,
    name: str,
    env: Mapping[str, str] | None = None,
    pool: str = "prefork",
) -> WorkerProcess:
    """A ``celery worker`` subprocess of ``app_module`` on ``queue``, ready when returned."""
    worker_env = {"PYTHONPATH": str(REPO), "BENCH_QUEUE": queue, **(env or {})}
    return servers.stack(app_module).start_worker(
        queue,
        concurrency=concurrency,
        pool=pool,
        name=f"{name}@127.0.0.1",
        env=worker_env,
        extra_args=("--loglevel", "WARNING"),
    )


# A new pooled connection's handshake and authentication (the pool opens one when another thread,
# such as the worker's housekeeping, holds the idle one): not a round trip of the protocol.
CONNECTION_SETUP = frozenset(
    {"hello", "isMaster", "ismaster", "saslStart", "saslContinue", "authenticate", "getnonce"}
)


@contextlib.contextmanager
def solo_worker_per_delivery(
    app: Any,
    queues: Sequence[str],
    begin: Any,
    end: Any,
) -> Iterator[None]:
    """An in-process solo worker of ``app`` on ``queues``; ``begin(task_id, task)`` and
    ``end()`` bracket each of its deliveries (on the worker's thread), for command counting."""
    from celery import signals
    from celery.contrib.testing.worker import start_worker as start_inprocess

    def prerun(task_id: str, task: Any, **_: Any) -> None:
        if task.app is app:
            begin(task_id, task)

    def postrun(task: Any, **_: Any) -> None:
        if task.app is app:
            end()

    signals.task_prerun.connect(prerun, weak=False)
    signals.task_postrun.connect(postrun, weak=False)
    try:
        with start_inprocess(
            app,
            pool="solo",
            queues=list(queues),
            perform_ping_check=False,
            loglevel="WARNING",
            shutdown_timeout=10,
        ):
            yield
    finally:
        signals.task_prerun.disconnect(prerun)
        signals.task_postrun.disconnect(postrun)


def rss_kib(pid: int) -> int:
    """Resident set size of a process (``VmRSS`` in /proc/<pid>/status), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS for pid {pid}")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear interpolation; ``values`` need not be sorted."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine() -> dict[str, Any]:
    import celery
    import pymongo

    return {
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "celery": celery.__version__,
        "pymongo": pymongo.version,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def print_header(title: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """Print the benchmark's configuration and the machine; returns the machine facts."""
    facts = machine()
    console.print(f"[bold]{title}[/]")
    console.print(
        "configuration: " + ", ".join(f"{k}={v}" for k, v in config.items()), highlight=False
    )
    console.print(
        f"machine: {facts['cores']} cores, {facts['platform']}, python {facts['python']},"
        f" celery {facts['celery']}, pymongo {facts['pymongo']},"
        f" load average {facts['loadavg_at_start']}",
        highlight=False,
    )
    return facts


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title)
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    console.print(table)


def write_results(name: str, data: Mapping[str, Any], figure: Any) -> tuple[Path, Path]:
    """Write ``<name>-<timestamp>.json`` and ``.png`` to ``ops/bench/results/``; print where."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = RESULTS / f"{name}-{stamp}.json"
    png_path = RESULTS / f"{name}-{stamp}.png"
    json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    if isinstance(figure, NoPlot):
        console.print(
            f"wrote {json_path}\nno figure: matplotlib is missing (pip install -e '.[bench]')",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        return json_path, png_path
    figure.savefig(png_path, dpi=110, bbox_inches="tight")
    console.print(f"wrote {json_path}\nwrote {png_path}", highlight=False, soft_wrap=True)
    return json_path, png_path


class NoPlot:
    """Stands in for pyplot, its figures and axes when matplotlib (the bench extra) is missing:
    every call and attribute is itself, so a benchmark's plotting code runs unchanged and its
    tables and results stay what it measured (they used to end in an ImportError, exit 1)."""

    def __getattr__(self, name: str) -> NoPlot:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> NoPlot:
        return self

    def __getitem__(self, key: Any) -> NoPlot:
        return self

    def __iter__(self) -> Iterator[NoPlot]:
        return iter((self, self))  # ``figure, axes = plt.subplots(...)``


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed); :class:`NoPlot` without it."""
    try:
        import matplotlib
    except ImportError:
        return NoPlot()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class Commands(monitoring.CommandListener):
    """MongoDB commands sent by the thread that made it (the benchmark's producer, or its
    scheduler), by name; a connection's own set-up is not counted."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.thread = threading.get_ident()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if threading.get_ident() == self.thread and event.command_name not in CONNECTION_SETUP:
            self.counts[event.command_name] += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass
