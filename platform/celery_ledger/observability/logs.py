"""JSON log lines with the running task's fields (``LEDGER_LOG_FORMAT=json``).

:class:`JsonFormatter` writes one JSON object per record. :class:`TaskContextFilter` adds
``task_id``, ``task_name``, ``key``, ``tier``, ``attempt`` and ``fence`` (and, tracing on,
``trace_id`` and ``span_id``) to every record emitted while a task runs in this thread (from
Celery's current task: its message headers and the fencing token the guard sets on the
request). :func:`install` puts both on the handlers Celery
sets up for the worker (``after_setup_logger`` and ``after_setup_task_logger``).

Whatever the format, :func:`redact_task_logs` puts one filter on Celery's task logger that
redacts the values of every live ledger app's sensitive tasks (by the line's task name, or as
the task this thread runs when its caller gave it a ``shadow`` name).
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from datetime import UTC, datetime
from typing import Any

from celery import signals
from celery._state import get_current_task

from .. import tracecontext
from ..crypto import RedactSensitive

TASK_FIELDS = ("task_id", "task_name", "key", "tier", "attempt", "fence")
TRACE_FIELDS = ("trace_id", "span_id")  # with LEDGER_TRACING on, while a span is current

# Attributes every LogRecord has; anything else came from ``extra=`` or a filter.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "data",  # Celery's task logger
}


class TaskContextFilter(logging.Filter):
    """Adds the running task's fields to a record (never overrides fields already set)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            fields = task_fields()
        except Exception:  # logging must never fail
            return True
        for name, value in fields.items():
            if value is not None and getattr(record, name, None) in (None, "???"):
                setattr(record, name, value)
        return True


def task_fields() -> dict[str, Any]:
    task = get_current_task()
    request = getattr(task, "request", None)
    if task is None or request is None or not getattr(request, "id", None):
        return {}
    ids = tracecontext.current_ids()
    return {
        "trace_id": ids[0] if ids else None,
        "span_id": ids[1] if ids else None,
        "task_id": request.id,
        "task_name": task.name,
        "key": _header(request, "ledger_key"),
        "tier": _header(request, "ledger_tier") or getattr(task, "tier", None),
        "attempt": int(getattr(request, "retries", 0) or 0) + 1,
        "fence": getattr(request, "ledger_fence", None),
    }


def _header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None and isinstance(getattr(request, "headers", None), dict):
        value = request.headers.get(name)
    return value


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "message", "process", <task fields>, <extra>, "exc_info"}``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.processName,
            "pid": record.process,
        }
        for name, value in vars(record).items():
            if name not in _STANDARD and not name.startswith("_") and value not in (None, "???"):
                entry[name] = value
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure(logger: logging.Logger) -> None:
    """JSON formatter and task filter on every handler of ``logger`` (idempotent)."""
    for handler in logger.handlers:
        handler.setFormatter(JsonFormatter())
        if not any(isinstance(f, TaskContextFilter) for f in handler.filters):
            handler.addFilter(TaskContextFilter())


def _on_setup(logger: logging.Logger | None = None, **_: Any) -> None:
    if logger is not None:
        configure(logger)


def install() -> None:
    """Switch the worker's log handlers to JSON when Celery sets them up."""
    signals.after_setup_logger.connect(_on_setup, weak=False, dispatch_uid="ledger-json-logs")
    signals.after_setup_task_logger.connect(
        _on_setup, weak=False, dispatch_uid="ledger-json-task-logs"
    )


# -- sensitive tasks in Celery's task log lines (every app, whatever the format) ------------


def _running_sensitive(task_id: Any) -> bool:
    """Whether the line is about the sensitive task this thread runs: Celery logs a task under
    the ``shadow`` name its caller gave, which need not name a sensitive task (or any task), and
    writes its outcome's lines while the task is still current."""
    task = get_current_task()
    if task is None or task_id is None or not getattr(task, "sensitive", False):
        return False
    return bool(getattr(task.request, "id", None) == task_id)


class _LiveApps:
    """Every ledger app of this process, held weakly, asked by one filter on Celery's task
    logger. (A filter per app, as before, kept every app ever built alive for the process's life
    and ran once more for each on every task log line.) The references are a tuple replaced
    whole under a lock, so a log line read while another thread builds an app never sees a
    collection change under it (a ``WeakSet`` raises then, and a filter that raises breaks the
    task's own log call)."""

    def __init__(self) -> None:
        self._refs: tuple[weakref.ref[Any], ...] = ()
        self._lock = threading.Lock()

    def add(self, app: Any) -> None:
        with self._lock:
            kept = tuple(r for r in self._refs if r() is not None and r() is not app)
            self._refs = (*kept, weakref.ref(app))

    def sensitive(self, task_name: Any, task_id: Any) -> bool:
        if _running_sensitive(task_id):
            return True
        for ref in self._refs:
            app = ref()
            if app is not None and app.is_sensitive(task_name):
                return True
        return False


_redacting_apps = _LiveApps()
_trace_filter = RedactSensitive(_redacting_apps.sensitive)


def redact_task_logs(app: Any) -> None:
    """Redact ``app``'s sensitive tasks in Celery's task log lines (``app.is_sensitive``), for
    as long as the app lives."""
    _redacting_apps.add(app)
    logger = logging.getLogger("celery.app.trace")
    if _trace_filter not in logger.filters:
        logger.addFilter(_trace_filter)
