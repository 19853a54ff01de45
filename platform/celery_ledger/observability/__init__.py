"""Operations: Prometheus metrics, Sentry reports and JSON logs, each off unless configured.

``create_app`` calls :func:`install` (and passes :func:`ledger_listeners` to the ledger). Metrics
and Sentry are observers of the platform's events (:mod:`celery_ledger.events`):

- ``LEDGER_METRICS_PORT``: workers count platform events and ledger round trips
  (:mod:`.metrics`) and serve ``/metrics`` from their main process (:mod:`.exporter`).
- ``LEDGER_SENTRY_DSN``: Sentry with its Celery integration, scrubbed (:mod:`.sentry`).
- ``LEDGER_LOG_FORMAT=json``: one JSON object per log line with the task's fields (:mod:`.logs`).
- ``LEDGER_TRACING=true``: OpenTelemetry traces of every job, one trace per job (:mod:`.tracing`).

Every producer stamps the messages it publishes with ``ledger_sent_at`` (unix seconds), from
which workers measure how long a message waited in its queue.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from celery import signals

from .. import headers as ledger_headers
from ..clock import last_known_time
from ..errors import ConfigurationError

if TYPE_CHECKING:
    from celery import Celery
    from pymongo.monitoring import CommandListener

    from ..runtime import Runtime
    from ..settings import Settings


def stamp_sent_at(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish``: the publish time, overwritten at every (re)publish, on the
    broker's clock as this process last read it (every time on a message is the broker's;
    Celery's signal does not say which app publishes, and a publish must not wait for a read)."""
    if isinstance(headers, dict):
        headers[ledger_headers.SENT_AT] = last_known_time("broker")


def ledger_listeners(settings: Settings) -> list[CommandListener]:
    """The pymongo command listeners the ledger's client gets (ledger latency metrics, ledger
    spans)."""
    listeners = []
    if settings.metrics_port is not None:
        listeners.append(_metrics_module().LEDGER_COMMANDS)
    if settings.tracing:
        listeners.append(_tracing_module().LEDGER_COMMANDS)
    return listeners


def install(app: Celery, runtime: Runtime) -> None:
    """Wire what the settings ask for; does nothing for the defaults but stamp messages."""
    signals.before_task_publish.connect(
        stamp_sent_at, weak=False, dispatch_uid=ledger_headers.SENT_AT
    )
    settings = runtime.settings

    def sensitive(name: str) -> bool:
        return bool(getattr(app.tasks.get(name), "sensitive", False))

    if settings.metrics_port is not None:
        from .exporter import MetricsStep

        named = frozenset(settings.tenants)  # ("*" is no tenant's name: never a label)
        _metrics_module().instrument(runtime.observers, lambda: app.tasks, named)
        app.steps["worker"].add(MetricsStep)
    if settings.sentry_dsn:
        from .sentry import install as install_sentry

        install_sentry(runtime, sensitive=sensitive)
    if settings.tracing:
        _tracing_module().install(app, runtime, sensitive=sensitive)
    if settings.log_format == "json":
        from .logs import install as install_json_logs

        install_json_logs()


def _tracing_module() -> Any:
    return _extra_module("tracing", "opentelemetry", "LEDGER_TRACING needs OpenTelemetry")


def _metrics_module() -> Any:
    return _extra_module(
        "metrics", "prometheus_client", "LEDGER_METRICS_PORT needs prometheus-client"
    )


def _extra_module(name: str, needs: str, what: str) -> Any:
    """This package's module ``name``, which imports the optional package ``needs`` (the
    extra of the same name): a missing one is a configuration error that says what to install."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if not str(exc.name).startswith(needs):
            raise
        raise ConfigurationError(f"{what}: pip install 'celery-ledger[{name}]'") from exc


__all__ = ["install", "ledger_listeners", "stamp_sent_at"]
