"""OpenTelemetry traces of every job (extra ``tracing``; on with ``LEDGER_TRACING=true``).

One job is one trace, from the request that published it through every attempt, retry,
deferral, reconciler republish and replay, to the jobs it publishes in turn.

What ``opentelemetry-instrumentation-celery`` does (:func:`install` turns it on): a producer
span per publish (``apply_async/<task>``) whose context it writes into the message's
``traceparent`` header (Celery's ``before_task_publish``), and a consumer span per delivery run
(``run/<task>``) that continues the context the message carries (``task_prerun``), with
Celery's fields (message id, queue, retries) as attributes.

What this module adds, for what the instrumentation cannot see:

- Publishes made with no span current (a housekeeping thread publishing a due retry, the
  reconciler, a replay from the CLI) continue the trace the message carries, instead of
  starting a new one (``tracecontext.continuing``, around the one publish path).
- Copies made inside an attempt (a retry, a deferral, the message the ledger keeps for the
  reconciler) carry the attempt's context (``tracecontext.stamp``): the next attempt is a
  child of the one before it.
- Spans of the platform: ``body``, ``step <name>``, and one per ledger command (``ledger
  claim``, ``ledger complete``... a pymongo command listener, named by the store's operation),
  whose duration is the round trip.
- The job's fields on the delivery's span: task, tier, key (an HMAC digest for a sensitive
  task: never its value), attempt, fence, outcome; deferrals, retries, dead-lettering and lost
  leases as span events. No argument, result or error text of a sensitive task is recorded.
- The trace id in JSON log lines (``trace_id``, ``span_id``) and on Sentry events (a tag);
  the record's kept message carries it, so ``celery ledger show`` prints it.

Exporters follow the standard variables: ``OTEL_TRACES_EXPORTER`` (``otlp``, the default;
``console``; ``none``), ``OTEL_EXPORTER_OTLP_*`` and ``OTEL_SERVICE_NAME`` (default: the app's
name). ``LEDGER_TRACING_DIR`` also writes every finished span as a JSON line to
``<dir>/spans-<pid>.jsonl`` (one file per process: the prefork pool's processes never share
one), synchronously: what tests and ``ops/tracing`` read.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery import signals
from opentelemetry import context as context_api
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import SpanKind, Status, StatusCode
from pymongo import monitoring

from .. import tracecontext
from ..errors import ConfigurationError
from ..events import Job, Observer
from ..locks import ForkSafeLock

if TYPE_CHECKING:
    from celery import Celery

    from ..ledger.dead import DeadLetter
    from ..runtime import Runtime

logger = logging.getLogger("celery_ledger.tracing")

TRACER_NAME = "celery_ledger"


class JsonLinesExporter(SpanExporter):
    """Each span as one JSON line in ``<directory>/spans-<pid>.jsonl`` (a file per process,
    opened after a fork in the child's own name)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._lock = ForkSafeLock()  # fresh in a forked child (see celery_ledger.locks)
        self._pid: int | None = None
        self._file: Any = None

    def _out(self) -> Any:
        if self._pid != os.getpid():  # a forked child writes a file of its own
            self.directory.mkdir(parents=True, exist_ok=True)
            self._file = (self.directory / f"spans-{os.getpid()}.jsonl").open("a")
            self._pid = os.getpid()
        return self._file

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            out = self._out()
            for span in spans:
                out.write(span.to_json(indent=None) + "\n")
            out.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
            self._pid = None


class Redacting(SpanExporter):
    """Exports through ``inner`` with the error text of a sensitive task's spans removed.

    Celery's instrumentation records a failed task's exception (its message and traceback, whose
    last line repeats the message) and a retry's reason on the task's span; a sensitive task's
    exception often quotes the arguments it failed on. As with Sentry, such a span keeps the
    exception's type, never its text. (The ledger's own spans never record exception text.)
    """

    def __init__(self, inner: SpanExporter, sensitive: Callable[[str], bool]) -> None:
        self.inner = inner
        self._sensitive = sensitive

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.inner.export([self._redacted(span) for span in spans])

    def _redacted(self, span: ReadableSpan) -> ReadableSpan:
        attributes = dict(span.attributes or {})
        task = attributes.get("ledger.task") or attributes.get("celery.task_name")
        if not isinstance(task, str) or not self._sensitive(task):
            return span
        attributes.pop("celery.retry.reason", None)
        events = [
            Event(
                event.name,
                {k: v for k, v in (event.attributes or {}).items() if k in _SAFE_EXCEPTION_FIELDS}
                if event.name == "exception"
                else event.attributes,
                event.timestamp,
            )
            for event in span.events
        ]
        return ReadableSpan(
            name=span.name,
            context=span.context,
            parent=span.parent,
            resource=span.resource,
            attributes=attributes,
            events=events,
            links=span.links,
            kind=span.kind,
            status=Status(span.status.status_code),  # no description: it is the error's text
            start_time=span.start_time,
            end_time=span.end_time,
            instrumentation_scope=span.instrumentation_scope,
        )

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


_SAFE_EXCEPTION_FIELDS = frozenset({"exception.type", "exception.escaped"})


class PerProcess(SpanExporter):
    """An exporter made anew in each process (``factory()`` on a process's first export): a
    pool process must not share its parent's HTTP connection to the collector."""

    def __init__(self, factory: Callable[[], SpanExporter]) -> None:
        self._factory = factory
        self._pid: int | None = None
        self._inner: SpanExporter | None = None

    def _here(self) -> SpanExporter:
        if self._inner is None or self._pid != os.getpid():
            self._inner, self._pid = self._factory(), os.getpid()
        return self._inner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self._here().export(spans)

    def shutdown(self) -> None:
        if self._inner is not None and self._pid == os.getpid():
            self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if self._inner is not None and self._pid == os.getpid():
            return self._inner.force_flush(timeout_millis)
        return True


def provider_for(
    service_name: str, directory: str | None, sensitive: Callable[[str], bool] = lambda _: False
) -> TracerProvider:
    """A tracer provider exporting as the ``OTEL_*`` variables and ``directory`` say, a
    sensitive task's error text removed from its spans (:class:`Redacting`)."""
    resource = Resource.create(
        {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    )
    provider = TracerProvider(resource=resource)
    for name in _exporter_names():
        if name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ModuleNotFoundError as exc:
                raise ConfigurationError(
                    "OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter:"
                    " pip install 'celery-ledger[tracing]'"
                ) from exc
            provider.add_span_processor(
                BatchSpanProcessor(Redacting(PerProcess(OTLPSpanExporter), sensitive))
            )
        elif name == "console":
            provider.add_span_processor(
                BatchSpanProcessor(Redacting(PerProcess(ConsoleSpanExporter), sensitive))
            )
    if directory:
        provider.add_span_processor(
            SimpleSpanProcessor(Redacting(JsonLinesExporter(directory), sensitive))
        )
    return provider


def _exporter_names() -> list[str]:
    names = [
        n.strip().lower()
        for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")
        if n.strip()
    ]
    unknown = sorted(set(names) - {"otlp", "console", "none"})
    if unknown:
        raise ConfigurationError(
            f"OTEL_TRACES_EXPORTER: unknown exporter(s) {', '.join(unknown)}"
            " (otlp, console or none)"
        )
    return [n for n in names if n != "none"]


# -- the hooks the engine calls (see celery_ledger.tracecontext) ------------------------------


def _inject(message_headers: MutableMapping[str, Any]) -> None:
    if trace.get_current_span().get_span_context().is_valid:
        propagate.inject(message_headers)


@contextlib.contextmanager
def _continuing(message_headers: Mapping[str, Any]) -> Iterator[None]:
    # A message that carries a context is a copy of a job (a retry, a deferral, a republish by
    # the reconciler, a replay): it continues that job's trace, whatever span is current (a
    # sweep run as a task is not the jobs' parent). A copy made inside an attempt carries the
    # attempt's own context (``stamp``), so that is the same thing there.
    carried = propagate.extract(tracecontext.carried(message_headers))
    if trace.get_current_span(carried).get_span_context().is_valid:
        token = context_api.attach(carried)
    else:
        token = context_api.attach(context_api.get_current())
    try:
        yield
    finally:
        # Restores the context as it was, even if the publish failed between the
        # instrumentation's before- and after-publish hooks (its span left current).
        context_api.detach(token)


def _current_ids() -> tuple[str, str] | None:
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


class TracingObserver(Observer):
    """The platform's events on the span of the delivery they happen in."""

    def __init__(
        self,
        sensitive: Callable[[str], bool],
        *,
        key_secret: bytes | None = None,
        sentry: bool = False,
    ) -> None:
        self._sensitive = sensitive
        self._key_secret = key_secret
        self._sentry = sentry

    def _span(self, job: Job) -> trace.Span:
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute("ledger.task", job.task)
            span.set_attribute("ledger.record_id", job.record_id)
            if job.tier is not None:
                span.set_attribute("ledger.tier", job.tier)
            if job.key is not None:
                span.set_attribute("ledger.key", self._key(job))
        return span

    def _key(self, job: Job) -> str:
        if not self._sensitive(job.task):
            return str(job.key)
        # Never a sensitive key's value (it may be an account number): a digest that matches
        # the same key across spans. Keyed with LEDGER_KEY_SECRET when set, since a plain hash
        # of a value with few possibilities is found by trying them all.
        key = str(job.key).encode()
        if self._key_secret is not None:
            return "hmac:" + hmac.new(self._key_secret, key, hashlib.sha256).hexdigest()[:16]
        return "sha256:" + hashlib.sha256(key).hexdigest()[:16]

    def claimed(self, job: Job, fence: int) -> None:
        span = self._span(job)
        span.set_attribute("ledger.fence", fence)
        span.add_event("claimed", {"ledger.fence": fence})
        if self._sentry:
            _sentry_tag()

    def duplicate(self, job: Job) -> None:
        self._span(job).set_attribute("ledger.outcome", "duplicate")

    def deferred(self, job: Job, reason: str, delay_seconds: float) -> None:
        span = self._span(job)
        span.set_attribute("ledger.outcome", "deferred")
        span.add_event("deferred", {"ledger.reason": _category(reason), "delay_s": delay_seconds})

    def retried(self, job: Job, delay_seconds: float, error: BaseException | None) -> None:
        span = self._span(job)
        span.set_attribute("ledger.outcome", "retried")
        attributes: dict[str, Any] = {"delay_s": delay_seconds}
        if error is not None:
            attributes["error.type"] = type(error).__name__
        span.add_event("retry scheduled", attributes)

    def succeeded(self, job: Job, seconds: float) -> None:
        self._span(job).set_attribute("ledger.outcome", "succeeded")

    def dead(self, job: Job, letter: DeadLetter) -> None:
        span = self._span(job)
        span.set_attribute("ledger.outcome", "dead")
        span.add_event(
            "dead-lettered",
            {"ledger.death": letter.death or "", "ledger.fingerprint": letter.fingerprint or ""},
        )
        span.set_status(Status(StatusCode.ERROR, "dead-lettered"))

    def step_skipped(self, job: Job, step: str, reason: str) -> None:
        self._span(job).add_event("step skipped", {"ledger.step": step, "ledger.reason": reason})

    def degraded(self, job: Job, reason: str, fallback: str) -> None:
        span = self._span(job)
        span.set_attribute("ledger.degraded", reason)
        span.add_event("fallback served", {"ledger.reason": reason, "ledger.fallback": fallback})

    def lease_lost(self, job: Job, fence: int) -> None:
        span = self._span(job)
        span.set_attribute("ledger.outcome", "lease lost")
        span.add_event("lease lost", {"ledger.fence": fence})


def _category(reason: str) -> str:
    # A reason's head names the kind ("circuit open", "rate limited"); its tail may quote the
    # message ("arguments do not bind: got 'x'"): only the head goes on a span.
    return reason.split(":", 1)[0].split(" (", 1)[0][:80]


def _sentry_tag() -> None:
    ids = _current_ids()
    if ids is None:
        return
    with contextlib.suppress(Exception):  # Sentry absent or not set up: nothing to tag
        import sentry_sdk

        sentry_sdk.set_tag("trace_id", ids[0])


def _flush(**_: Any) -> None:
    with contextlib.suppress(Exception):
        flush = getattr(trace.get_tracer_provider(), "force_flush", None)
        if flush is not None:
            flush(2000)


class LedgerCommandSpans(monitoring.CommandListener):
    """A client span per command the ledger's client sends, named by the store's operation
    (``ledger claim``), child of whatever span is current in the calling thread."""

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        self._provider = provider  # None: the global one
        self._spans: dict[tuple[int, int], trace.Span] = {}
        # The worker's main process sends commands from its housekeeping threads: a plain lock
        # held by one of them at a fork would hang the pool process's first command.
        self._lock = ForkSafeLock()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if not trace.get_current_span().get_span_context().is_valid:
            return  # housekeeping outside any job: no trace to belong to
        operation = tracecontext.LEDGER_OPERATION.get() or event.command_name
        span = trace.get_tracer(TRACER_NAME, tracer_provider=self._provider).start_span(
            f"ledger {operation}",
            kind=SpanKind.CLIENT,
            attributes={
                "db.system": "mongodb",
                "db.operation.name": event.command_name,
                "db.namespace": event.database_name,
                "ledger.operation": operation,
            },
        )
        with self._lock:
            self._spans[(event.request_id, event.operation_id or 0)] = span

    def _end(self, event: Any, error: str | None) -> None:
        with self._lock:
            span = self._spans.pop((event.request_id, event.operation_id or 0), None)
        if span is None:
            return
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        self._end(event, None)

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self._end(event, f"command failed (code {getattr(event, 'failure', {}).get('code')})")


LEDGER_COMMANDS = LedgerCommandSpans()


def install(app: Celery, runtime: Runtime, *, sensitive: Callable[[str], bool]) -> None:
    """Turn tracing on in this process (and the pool processes it forks)."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    current = trace.get_tracer_provider()
    if isinstance(current, trace.ProxyTracerProvider):  # the app has set up none of its own
        directory = runtime.settings.tracing_dir
        trace.set_tracer_provider(provider_for(app.main or "celery", directory, sensitive))
    instrumentor = CeleryInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()
    tracer = trace.get_tracer(TRACER_NAME)

    @contextlib.contextmanager
    def span(name: str, attributes: Mapping[str, Any]) -> Iterator[trace.Span]:
        # An exception's text may quote a sensitive task's arguments: the span records its
        # type only (the task's own span says how the job ended).
        with tracer.start_as_current_span(
            name,
            attributes=dict(attributes),
            record_exception=False,
            set_status_on_exception=False,
        ) as current:
            try:
                yield current
            except BaseException as exc:
                current.set_attribute("error.type", type(exc).__name__)
                raise

    tracecontext.HOOKS.inject = _inject
    tracecontext.HOOKS.continuing = _continuing
    tracecontext.HOOKS.span = span
    tracecontext.HOOKS.current_ids = _current_ids
    secret = runtime.settings.key_secret
    runtime.observers.add(
        TracingObserver(
            sensitive,
            key_secret=secret.get_secret_value().encode() if secret is not None else None,
            sentry=bool(runtime.settings.sentry_dsn),
        )
    )
    # A pool process ends with os._exit (no atexit): what its batch processor still holds
    # (often the last attempt's run span) is sent first.
    signals.worker_process_shutdown.connect(_flush, weak=False, dispatch_uid="ledger-tracing")


__all__ = ["LEDGER_COMMANDS", "JsonLinesExporter", "TracingObserver", "install", "provider_for"]
