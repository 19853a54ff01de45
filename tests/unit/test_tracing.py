"""The tracing module's pieces on the real OpenTelemetry SDK, in memory: which span is whose
parent, what a span records of a job, what the exporters leave out. (Worker processes, real
messages and the whole tree: tests/integration/test_tracing.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_ledger import tracecontext
from celery_ledger.events import Job
from celery_ledger.observability import tracing

CARD = "4111111111111111"


@pytest.fixture
def spans() -> Iterator[tuple[trace.Tracer, InMemorySpanExporter, TracerProvider]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(
        SimpleSpanProcessor(tracing.Redacting(exporter, lambda name: name == "vault"))
    )
    yield provider.get_tracer("test"), exporter, provider
    provider.shutdown()


def test_a_copy_made_inside_a_span_carries_that_span(spans: Any) -> None:
    tracer, _, _ = spans
    headers: dict[str, Any] = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    with tracer.start_as_current_span("attempt") as attempt:
        tracing._inject(headers)
    assert tracecontext.trace_id_of(headers) == format(attempt.get_span_context().trace_id, "032x")


def test_with_no_span_current_a_copy_keeps_the_context_it_carries(spans: Any) -> None:
    headers: dict[str, Any] = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    tracing._inject(headers)
    assert tracecontext.trace_id_of(headers) == "1" * 32


def test_a_publish_continues_the_carried_trace_whatever_span_is_current(spans: Any) -> None:
    tracer, exporter, _ = spans
    carried = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    with tracer.start_as_current_span("sweep"):  # a reconciler sweep run as a task
        with tracing._continuing(carried), tracer.start_as_current_span("publish"):
            pass
        with tracer.start_as_current_span("after"):
            pass
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    assert format(by_name["publish"].context.trace_id, "032x") == "a" * 32
    assert by_name["publish"].parent is not None and by_name["publish"].parent.span_id == int(
        "b" * 16, 16
    )
    # and the context is back as it was after the publish
    assert by_name["after"].parent is not None
    assert by_name["after"].parent.span_id == by_name["sweep"].context.span_id


def test_a_publish_of_a_message_without_a_context_is_a_child_of_the_current_span(
    spans: Any,
) -> None:
    tracer, exporter, _ = spans
    with (
        tracer.start_as_current_span("attempt"),
        tracing._continuing({"traceparent": "bad"}),
        tracer.start_as_current_span("publish"),
    ):
        pass
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    assert by_name["publish"].parent is not None
    assert by_name["publish"].parent.span_id == by_name["attempt"].context.span_id


def test_the_job_and_its_events_are_on_the_delivery_span(spans: Any) -> None:
    tracer, exporter, _ = spans
    observer = tracing.TracingObserver(lambda name: name == "vault", key_secret=b"s" * 32)
    with tracer.start_as_current_span("run/pay"):
        observer.claimed(Job("pay", "default", "r-1", "order-7"), 42)
        observer.retried(Job("pay", "default", "r-1", "order-7"), 1.5, ValueError(CARD))
    with tracer.start_as_current_span("run/vault"):
        observer.claimed(Job("vault", "critical", "r-2", CARD), 43)
        observer.deferred(Job("vault", "critical", "r-2", CARD), f"rate limited: {CARD}", 2.0)
    pay, vault = exporter.get_finished_spans()
    assert pay.attributes is not None and vault.attributes is not None
    assert pay.attributes["ledger.key"] == "order-7"
    assert pay.attributes["ledger.fence"] == 42
    assert pay.attributes["ledger.outcome"] == "retried"
    assert [e.name for e in pay.events] == ["claimed", "retry scheduled"]
    assert str(vault.attributes["ledger.key"]).startswith("hmac:")
    # a reason's details (which may quote the message) never reach a span; nor an error's text
    assert CARD not in repr(
        [(s.attributes, [e.attributes for e in s.events]) for s in (pay, vault)]
    )


def test_a_sensitive_tasks_error_text_is_dropped_at_export(spans: Any) -> None:
    tracer, exporter, _ = spans
    for task in ("vault", "report"):
        with tracer.start_as_current_span(f"run/{task}") as span:
            span.set_attribute("celery.task_name", task)
            span.set_attribute("celery.retry.reason", f"Retry in 5s: ValueError('{CARD}')")
            span.record_exception(ValueError(f"card {CARD} declined"))
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"card {CARD} declined"))
    vault, report = exporter.get_finished_spans()
    assert CARD not in repr((vault.attributes, [e.attributes for e in vault.events]))
    assert vault.status.status_code is trace.StatusCode.ERROR and not vault.status.description
    assert vault.events[0].attributes == {
        "exception.type": "ValueError",
        "exception.escaped": "False",
    }
    # a task that is not sensitive keeps its error's text: it is what one debugs with
    assert CARD in str(report.status.description)


def test_a_ledger_command_is_a_child_span_named_by_its_operation(spans: Any) -> None:
    tracer, exporter, provider = spans
    listener = tracing.LedgerCommandSpans(provider)
    event = SimpleNamespace(
        request_id=1, operation_id=1, command_name="update", database_name="ledger"
    )
    listener.started(event)  # type: ignore[arg-type]  # outside a job: no span
    listener.succeeded(event)  # type: ignore[arg-type]
    with tracer.start_as_current_span("run/pay"), tracecontext.ledger_operation("claim"):
        listener.started(event)  # type: ignore[arg-type]
        listener.failed(SimpleNamespace(**vars(event), failure={"code": 112}))  # type: ignore[arg-type]
    claim, run = exporter.get_finished_spans()
    assert claim.name == "ledger claim" and claim.parent is not None
    assert claim.parent.span_id == run.context.span_id
    assert claim.status.status_code is trace.StatusCode.ERROR
    assert claim.attributes is not None and claim.attributes["db.operation.name"] == "update"
