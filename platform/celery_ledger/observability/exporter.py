"""The worker's ``/metrics`` endpoint: prometheus-client's multiprocess mode for the prefork pool.

:class:`MetricsStep` is a worker bootstep (added by ``create_app`` when ``LEDGER_METRICS_PORT``
is set). Its ``create`` runs in the worker's main process before the pool forks:

1. it makes a fresh private directory, ``celery-ledger-metrics-<pid>`` under
   ``$PROMETHEUS_MULTIPROC_DIR`` if set (else the system's temp directory), and points
   ``PROMETHEUS_MULTIPROC_DIR`` at it, so two workers on one host never mix files;
2. it switches prometheus-client to multiprocess values (the library reads the variable when
   it is first imported, possibly earlier) and enables the metrics: each pool process then
   writes its own files there, which survive its exit (counters keep their totals).

Its ``start`` runs after the pool has forked and serves ``/metrics`` from a thread of the main
process on ``LEDGER_METRICS_ADDRESS:LEDGER_METRICS_PORT`` (loopback unless set), behind HTTP
basic authentication when ``LEDGER_METRICS_AUTH`` is set: the files merged by
``MultiProcessCollector``, plus gauges read from Redis and the ledger (:class:`StateCollector`),
at most once per ``LEDGER_METRICS_CACHE_SECONDS`` however often or by whom it is scraped. A pool
process that exits is marked dead (``worker_process_shutdown``), which drops its live gauges;
the directory is removed when the worker shuts down.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from celery import bootsteps, signals
from prometheus_client import CollectorRegistry, make_wsgi_app, multiprocess, values
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from ..handoff import tally
from ..ledger.workflow_log import ACTIVE
from ..policies.breaker import BreakerState
from . import metrics

logger = logging.getLogger("celery_ledger.metrics")

ENV = "PROMETHEUS_MULTIPROC_DIR"
BREAKER_VALUES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


def prepare_multiprocess_dir() -> Path:
    """A fresh per-worker directory, set as ``PROMETHEUS_MULTIPROC_DIR`` (see the module doc)."""
    path = Path(_base_dir()) / f"celery-ledger-metrics-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)  # left by a killed worker that had our pid
    path.mkdir(parents=True, mode=0o700)
    os.environ[ENV] = str(path)
    values.ValueClass = values.get_value_class()
    return path


def _base_dir() -> str:
    current = os.environ.get(ENV, "")
    if current and Path(current).name.startswith("celery-ledger-metrics-"):
        return str(Path(current).parent)  # inherited from a worker that started us
    return current or tempfile.gettempdir()


def mark_dead(pid: int | None = None, **_: Any) -> None:
    """``worker_process_shutdown``: drop the exiting pool process's live gauges."""
    path = os.environ.get(ENV)
    if path and metrics.active() is not None:
        with contextlib.suppress(Exception):
            multiprocess.mark_process_dead(pid or os.getpid(), path)


# Task names come from messages (any producer's): a bounded number of label values.
PARKED_TASKS_NAMED = 20


class StateCollector(Collector):
    """Gauges read from Redis and the ledger when Prometheus scrapes (main process only).

    Every worker exports the same shared state: aggregate with ``max`` across instances. The
    reads (queue lengths, the delayed set, the breakers, two ledger counts) are kept for
    ``cache_seconds``: scrapes more frequent than that, from however many scrapers, cost the
    broker and the ledger nothing.
    """

    def __init__(
        self,
        runtime: Any,
        consuming: list[str],
        workflow_counts: Callable[[], dict[str, int]] | None = None,
        *,
        cache_seconds: float = 0.0,
        tenants_top: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtime = runtime
        self.consuming = consuming
        self.tenants_top = tenants_top  # tenants named per tier; the rest are "other"
        self.workflow_counts = workflow_counts  # workflows by status, from the ledger
        self.cache_seconds = cache_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._cached: tuple[float, list[Metric]] | None = None

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # one read at a time: concurrent scrapes share it
            now = self.clock()
            if self._cached is None or now - self._cached[0] >= self.cache_seconds:
                self._cached = (now, list(self._read()))
            return iter(self._cached[1])

    def _read(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "celery_ledger_dependency_up",
            "1 if the worker reached the dependency during this scrape.",
            labels=["dependency"],
        )
        consuming = GaugeMetricFamily(
            "celery_ledger_worker_consuming", "Queues this worker consumes.", labels=["queue"]
        )
        for queue in self.consuming:
            consuming.add_metric([queue], 1)
        yield consuming
        broker_up = True
        try:
            yield from self._broker()
        except Exception as exc:
            broker_up = False
            logger.warning("metrics: broker unreachable on scrape: %s", exc)
        if broker_up:
            yield from self._tenants()
        up.add_metric(["broker"], 1 if broker_up else 0)
        ledger_up = True
        try:
            dead = self.runtime.ledger.count_dead()
        except Exception as exc:
            ledger_up = False
            logger.warning("metrics: ledger unreachable on scrape: %s", exc)
        else:
            yield GaugeMetricFamily(
                "celery_ledger_dead_letters", "Dead records in the ledger.", value=dead
            )
            if self.workflow_counts is not None:
                yield from self._workflows()
        up.add_metric(["ledger"], 1 if ledger_up else 0)
        yield up

    def _workflows(self) -> Iterator[Metric]:
        assert self.workflow_counts is not None
        try:
            counts = self.workflow_counts()
        except Exception as exc:
            logger.warning("metrics: workflow counts unavailable on scrape: %s", exc)
            return
        gauge = GaugeMetricFamily(
            "celery_ledger_workflows", "Workflows in the ledger by status.", labels=["state"]
        )
        for state in ("running", "compensating", "stuck", *sorted(set(counts) - set(ACTIVE))):
            gauge.add_metric([state], counts.get(state, 0))
        yield gauge

    def _broker(self) -> Iterator[Metric]:
        depths = self.runtime.queue_depths.depths()  # by tier (and dead_letter)
        depth = GaugeMetricFamily(
            "celery_ledger_queue_depth", "Messages waiting in each queue.", labels=["queue"]
        )
        for queue, n in sorted(depths.items()):
            depth.add_metric([queue], n)
        delayed = GaugeMetricFamily(
            "celery_ledger_delayed_deliveries",
            "Retries and deferrals held in Redis until due.",
            value=self.runtime.delayed.pending(),
        )
        breakers = GaugeMetricFamily(
            "celery_ledger_breaker_state",
            "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            labels=["breaker"],
        )
        for status in self.runtime.breakers.statuses():
            breakers.add_metric([status.name], BREAKER_VALUES[status.state])
        unrecorded = GaugeMetricFamily(
            "celery_ledger_unrecorded_jobs",
            "Jobs published while the ledger was away whose records the reconciler has not"
            " written yet (a lost message of theirs comes back only once it has).",
            value=self.runtime.unrecorded.count(),
        )
        yield from (depth, delayed, breakers, unrecorded)
        yield from self._parked()

    def _tenants(self) -> Iterator[Metric]:
        """Each tier's tenants with work (fairness.py), the most waiting by name, the rest
        summed as ``other``: as many series per tier as ``tenants_top`` + 1, however many
        tenants there are. Nothing with fair dispatch off."""
        fair = self.runtime.fair
        if fair is None:
            return
        waiting = GaugeMetricFamily(
            "celery_ledger_tenant_waiting",
            "Jobs of a tenant waiting in its lanes of a tier (fair dispatch), the tenants most"
            " waiting by name and the rest as 'other'.",
            labels=["tier", "tenant"],
        )
        running = GaugeMetricFamily(
            "celery_ledger_tenant_running",
            "Jobs of a tenant with a concurrency limit moved to its tier's queue and not"
            " ended (its slots in use), for the same tenants.",
            labels=["tier", "tenant"],
        )
        tiers = self.runtime.tiers
        try:
            for tier in tiers.names:
                for share in fair.shares(tiers.queue(tier), top=self.tenants_top):
                    waiting.add_metric([tier, share.tenant], share.waiting)
                    running.add_metric([tier, share.tenant], share.running)
        except Exception as exc:  # (the broker answered the reads before: not its outage)
            logger.warning("metrics: tenants' lanes unreadable on scrape: %s", exc)
            return
        yield from (waiting, running)

    def _parked(self) -> Iterator[Metric]:
        """The messages parked for a worker that can run them (celery_ledger.handoff)."""
        counts, oldest = tally(self.runtime.parking.all(), now=self.runtime.message_time())
        parked = GaugeMetricFamily(
            "celery_ledger_parked_messages",
            "Messages a worker could not run, parked for one that can (a deploy under way),"
            " by reason and task (the 20 most parked tasks; the rest as 'other').",
            labels=["reason", "task"],
        )
        tasks: dict[str, int] = {}
        for (_why, task), n in counts.items():
            tasks[task] = tasks.get(task, 0) + n
        named = set(sorted(tasks, key=lambda t: -tasks[t])[:PARKED_TASKS_NAMED])
        merged: dict[tuple[str, str], int] = {}
        for (why, task), n in counts.items():
            label = (why, task if task in named else "other")
            merged[label] = merged.get(label, 0) + n
        for (why, task), n in sorted(merged.items()):
            parked.add_metric([why, task], n)
        yield parked
        yield GaugeMetricFamily(
            "celery_ledger_parked_oldest_seconds",
            "How long the oldest parked message has been put off (0: none parked).",
            value=oldest,
        )


class MetricsStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Multiprocess metrics set-up and the ``/metrics`` server of a worker (module doc)."""

    requires: ClassVar[set[str]] = {"celery.worker.components:Pool"}
    label = "ledger metrics"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.server: Any = None
        self.directory: Path | None = None
        self._owner_pid = os.getpid()

    def create(self, worker: Any) -> None:
        self.directory = prepare_multiprocess_dir()
        self._owner_pid = os.getpid()
        metrics.enable(registry=None)
        signals.worker_process_shutdown.connect(mark_dead, weak=False, dispatch_uid=ENV)
        signals.worker_shutdown.connect(self._cleanup, weak=False, dispatch_uid=f"{ENV}-{id(self)}")

    def start(self, worker: Any) -> None:
        app = worker.app
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(self.directory))
        consuming = sorted(app.amqp.queues.consume_from or app.amqp.queues)
        workflow_counts = app.workflow_engine.log.count_by_status
        settings = app.settings
        registry.register(
            StateCollector(
                app.runtime,
                consuming,
                workflow_counts,
                cache_seconds=settings.metrics_cache_seconds,
                tenants_top=settings.tenants_top,
            )
        )
        port, address = settings.metrics_port, settings.metrics_address
        auth = settings.metrics_auth.get_secret_value() if settings.metrics_auth else None
        try:
            self.server = serve_metrics(address, port, metrics_app(registry, auth))
        except OSError as exc:  # metrics must not stop the worker
            logger.error("metrics: cannot listen on %s:%s: %s", address, port, exc)
            return
        logger.info(
            "metrics on http://%s:%s/metrics (%s, %s)",
            address,
            port,
            "basic auth" if auth else "no auth",
            self.directory,
        )

    def stop(self, worker: Any) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def terminate(self, worker: Any) -> None:
        self.stop(worker)

    def shutdown(self, worker: Any) -> None:
        self.stop(worker)

    def _cleanup(self, **_: Any) -> None:
        if os.getpid() == self._owner_pid and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def metrics_app(registry: CollectorRegistry, auth: str | None) -> Callable[..., Iterable[bytes]]:
    """prometheus-client's WSGI app, behind HTTP basic authentication if ``auth``
    (``user:password``) is given.

    Written here because prometheus-client's own server has TLS but no authentication; the
    comparison is constant-time.
    """
    served = make_wsgi_app(registry)
    if auth is None:
        return served
    expected = auth.encode()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        scheme, _, given = str(environ.get("HTTP_AUTHORIZATION", "")).partition(" ")
        try:
            credentials = base64.b64decode(given.strip(), validate=True)
        except (binascii.Error, ValueError):
            credentials = b""
        if scheme.lower() == "basic" and hmac.compare_digest(credentials, expected):
            return served(environ, start_response)  # type: ignore[no-any-return]
        start_response(
            "401 Unauthorized",
            [("WWW-Authenticate", 'Basic realm="celery-ledger metrics"'), ("Content-Length", "0")],
        )
        return [b""]

    return app


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape on the worker's stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_metrics(address: str, port: int, app: Callable[..., Iterable[bytes]]) -> WSGIServer:
    """Serve ``app`` on ``address:port`` from a daemon thread; returns the server to stop."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    server: WSGIServer = make_server(address, port, app, server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="ledger-metrics", daemon=True).start()
    return server
