"""The job's trace context in message headers: what is carried, what is read, and that tracing
off costs nothing (no OpenTelemetry import, no header written)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from celery_ledger import Settings, tracecontext
from celery_ledger.errors import ConfigurationError
from celery_ledger.ledger.message import carried_headers
from celery_ledger.ledger.record import LedgerRecord

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    "value",
    [None, 12, ["00-x"], {"a": 1}, b"00-", "garbage", "x" * (tracecontext.MAX_HEADER + 1)],
)
def test_a_trace_header_that_is_not_a_short_string_is_not_carried(value: Any) -> None:
    kept = carried_headers({"traceparent": value, "tracestate": value, "ledger_key": "k"})
    assert "traceparent" not in kept and "tracestate" not in kept
    assert kept["ledger_key"] == "k"  # the rest of the message's headers still travel


def test_a_tracestate_travels_only_with_a_valid_traceparent() -> None:
    assert carried_headers({"traceparent": "garbage", "tracestate": "vendor=1"}) == {}
    assert carried_headers({"traceparent": VALID, "tracestate": ["x"]}) == {"traceparent": VALID}


def test_a_valid_trace_context_is_carried_with_the_ledger_headers() -> None:
    kept = carried_headers({"traceparent": VALID, "tracestate": "vendor=1", "other": "x"})
    assert kept == {"traceparent": VALID, "tracestate": "vendor=1"}


@pytest.mark.parametrize(
    ("headers", "trace_id"),
    [
        ({"traceparent": VALID}, "4bf92f3577b34da6a3ce929d0e0e4736"),
        ({"traceparent": f"  {VALID} "}, "4bf92f3577b34da6a3ce929d0e0e4736"),
        ({"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}, None),  # all zeros: none
        ({"traceparent": "00-XYZ-00f067aa0ba902b7-01"}, None),
        ({"traceparent": 5}, None),
        ({}, None),
        (None, None),
        ("not a mapping", None),
    ],
)
def test_the_trace_id_is_read_only_from_a_w3c_traceparent(headers: Any, trace_id: Any) -> None:
    assert tracecontext.trace_id_of(headers) == trace_id


def test_a_record_names_the_trace_its_kept_message_carries() -> None:
    base = {"_id": "r", "task": "t", "key": "k", "state": "succeeded"}
    record = LedgerRecord.model_validate({**base, "message": {"headers": {"traceparent": VALID}}})
    assert record.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert LedgerRecord.model_validate(base).trace_id is None


def test_with_tracing_off_every_hook_is_a_no_op() -> None:
    assert not tracecontext.enabled()
    message_headers: dict[str, Any] = {"ledger_key": "k"}
    tracecontext.stamp(message_headers)
    with tracecontext.continuing({"traceparent": VALID}), tracecontext.span("body", a=1) as span:
        assert span is None
    assert message_headers == {"ledger_key": "k"}
    assert tracecontext.current_ids() is None


def test_the_library_loads_no_tracing_while_tracing_is_off() -> None:
    # A worker or producer without LEDGER_TRACING pays nothing for tracing: neither our tracing
    # module nor Celery's instrumentation is loaded. (redis-py may import OpenTelemetry's
    # packages on its own when they are installed: not ours to count.)
    code = (
        "import sys; from celery_ledger import create_app, Settings;"
        " create_app('t', settings=Settings(), set_as_current=False);"
        " print(sorted(m for m in sys.modules if m.startswith("
        "('celery_ledger.observability.tracing', 'opentelemetry.instrumentation.celery',"
        " 'opentelemetry.sdk.trace'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_an_unknown_exporter_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_ledger.observability import tracing

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,zipkin")
    with pytest.raises(ConfigurationError, match="zipkin"):
        tracing.provider_for("svc", None)


def test_spans_of_each_process_go_to_a_file_of_its_own(tmp_path: Any) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from celery_ledger.observability.tracing import JsonLinesExporter

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(tmp_path)))
    with provider.get_tracer("t").start_as_current_span("one"):
        pass
    [path] = tmp_path.glob("spans-*.jsonl")
    assert path.name == f"spans-{os.getpid()}.jsonl"
    assert '"name": "one"' in path.read_text()


def test_tracing_on_without_its_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_ledger import observability

    monkeypatch.delitem(sys.modules, "celery_ledger.observability.tracing", raising=False)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # not installed
    with pytest.raises(ConfigurationError, match=r"pip install 'celery-ledger\[tracing\]'"):
        observability.ledger_listeners(Settings(tracing=True))
