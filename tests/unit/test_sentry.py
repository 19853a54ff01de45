"""Sentry: real sentry-sdk, events captured by a Transport of our own (no network)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import sentry_sdk
from celery.exceptions import Ignore, Retry
from sentry_sdk.envelope import Envelope
from sentry_sdk.transport import Transport

from celery_ledger import Job, Settings, create_app
from celery_ledger.errors import CircuitOpen, LeaseLost
from celery_ledger.ledger.dead import DeadLetter
from celery_ledger.observability import sentry
from celery_ledger.policies.breaker import BreakerState

DSN = "https://public@sentry.invalid/1"
SECRET = "s3cr3t-card-4242"


class Captured(Transport):
    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.events: list[dict[str, Any]] = []

    def capture_envelope(self, envelope: Envelope) -> None:
        for item in envelope.items:
            if item.type == "event":
                self.events.append(json.loads(item.get_bytes()))


@pytest.fixture
def captured() -> Iterator[Captured]:
    transport = Captured()
    yield transport
    sentry_sdk.init()  # no DSN: a disabled client for the rest of the session


@pytest.fixture
def app(captured: Captured) -> Any:
    keys = ["AcKyJ2oLnrAAy_LZcIqJcLFxu0NMYeTJnp7JIrpzIs4="]
    app = create_app("sentry_tests", settings=Settings(encryption_keys=keys), set_as_current=False)
    app.runtime.settings = Settings(sentry_dsn=DSN, encryption_keys=keys)
    assert sentry.install(
        app.runtime,
        transport=captured,
        sensitive=lambda name: bool(getattr(app.tasks.get(name), "sensitive", False)),
    )
    options = sentry_sdk.get_client().options
    assert not options["send_default_pii"] and not options["include_local_variables"]
    app.conf.task_always_eager = True

    @app.task(name="sentry_tests.charge", idempotency_key="{card}", shared=False)
    def charge(card: str, retry: bool = False, lease: bool = False) -> None:
        password = SECRET  # a local variable that must not be sent
        if retry:
            raise Retry("later")
        if lease:
            raise LeaseLost("r1", 7)
        raise ValueError(f"declined ({len(password)})")

    @app.task(name="sentry_tests.card", idempotency_key="{card}", sensitive=True, shared=False)
    def card(card: str) -> None:
        raise ValueError(f"gateway declined card {card}")

    return app


def flush() -> None:
    sentry_sdk.flush(timeout=2)


def test_off_without_a_dsn() -> None:
    app = create_app("sentry_off", settings=Settings(), set_as_current=False)
    assert sentry.install(app.runtime) is False
    assert not any(isinstance(o, sentry.SentryObserver) for o in app.observers)


def test_a_dead_letter_is_one_event_grouped_by_its_fingerprint(
    app: Any, captured: Captured
) -> None:
    # Given a body's exception that kills the job (the guard announces it inside `except`)
    try:
        raise ValueError(f"gateway refused {SECRET}-not-in-args")
    except ValueError as exc:
        app.observers.dead(
            Job("billing.charge", "critical", "rec-1", "k"),
            DeadLetter(
                record_id="rec-1",
                task="billing.charge",
                key="k",
                tier="critical",
                reason="error not retryable",
                death="failed",
                fingerprint="95decee9b9d5",
                fingerprint_text="ValueError at charge",
                message={"args_json": f'["{SECRET}"]'},
                errors=[],
                at="now",
            ),
        )
        sentry_sdk.capture_exception(exc)  # what the Celery integration does next
    flush()
    # Then one event, with the exception, the fingerprint and tags, and no message data
    [event] = captured.events
    assert event["fingerprint"] == ["celery-ledger", "dead", "95decee9b9d5"]
    assert event["tags"]["celery_ledger.event"] == "dead"
    assert event["tags"]["celery_ledger.task"] == "billing.charge"
    assert event["exception"]["values"][-1]["type"] == "ValueError"
    assert event["contexts"]["dead letter"]["record_id"] == "rec-1"
    assert f'["{SECRET}"]' not in json.dumps(event)


def test_breaker_open_and_lost_leases_are_warnings_with_fingerprints(
    app: Any, captured: Captured
) -> None:
    app.observers.breaker("payments", BreakerState.CLOSED.value, BreakerState.OPEN.value)
    app.observers.breaker("payments", BreakerState.OPEN.value, BreakerState.HALF_OPEN.value)
    app.observers.lease_lost(Job("billing.charge", "critical", "r", "k"), 3)
    flush()
    fingerprints = [e["fingerprint"] for e in captured.events]
    assert fingerprints == [
        ["celery-ledger", "breaker-open", "payments"],
        ["celery-ledger", "lease-lost", "billing.charge"],
    ]
    assert {e["level"] for e in captured.events} == {"warning"}


def test_a_stopped_trigger_is_an_error_with_its_fingerprint(app: Any, captured: Captured) -> None:
    app.observers.trigger_problem("shop.on_order", "shop.orders", "history_lost", "oplog rolled")
    flush()
    [event] = captured.events
    assert event["fingerprint"] == ["celery-ledger", "trigger", "shop.on_order", "history_lost"]
    assert event["level"] == "error" and "reset it and backfill" in event["message"]
    assert event["tags"]["celery_ledger.event"] == "trigger_problem"
    assert event["contexts"]["trigger"]["namespace"] == "shop.orders"


def test_task_failures_are_scrubbed(app: Any, captured: Captured) -> None:
    # When a task fails with a secret in its arguments and its local variables
    app.tasks["sentry_tests.charge"].apply(args=(SECRET,))
    flush()
    # Then the failure is reported without arguments, local variables or request data
    [event] = captured.events
    assert event["exception"]["values"][-1]["type"] == "ValueError"
    assert SECRET not in json.dumps(event)
    frames = event["exception"]["values"][-1]["stacktrace"]["frames"]
    assert frames and all("vars" not in frame for frame in frames)
    assert "request" not in event
    assert event["extra"]["celery-job"]["task_name"] == "sentry_tests.charge"


def test_control_flow_is_never_reported(app: Any, captured: Captured) -> None:
    task = app.tasks["sentry_tests.charge"]
    task.apply(args=("c1",), kwargs={"retry": True})
    task.apply(args=("c2",), kwargs={"lease": True})
    for exc in (Ignore("dup"), CircuitOpen("payments", None), LeaseLost("r", 1)):
        sentry_sdk.capture_exception(exc)
    flush()
    assert captured.events == []


def test_credentials_in_urls_are_redacted() -> None:
    event = {
        "message": "cannot reach redis://:hunter2@10.0.0.5:6379/0",
        "extra": {"uri": "mongodb://ledger:pw@mongo:27017/?authSource=admin", "kwargs": {}},
        "breadcrumbs": {"values": [{"message": "GET http://u:p@x/", "data": {"a": 1}}]},
    }
    scrubbed = sentry.scrub(event)
    text = json.dumps(scrubbed)
    assert "hunter2" not in text and ":pw@" not in text and "u:p@" not in text
    assert "redis://[Filtered]@10.0.0.5:6379/0" in text
    assert scrubbed["extra"]["kwargs"] == "[Filtered]"
    assert "data" not in scrubbed["breadcrumbs"]["values"][0]


def test_a_sensitive_tasks_events_carry_no_text(app: Any, captured: Captured) -> None:
    # When a sensitive task fails with its argument in the exception's text
    app.tasks["sentry_tests.card"].apply(args=(SECRET,))
    # and its death is announced with a reason that quotes it
    try:
        raise ValueError(f"gateway declined card {SECRET}")
    except ValueError:
        app.observers.dead(
            Job("sentry_tests.card", "critical", "rec-2", "k"),
            DeadLetter(
                record_id="rec-2",
                task="sentry_tests.card",
                key="k",
                tier="critical",
                reason=f"permanent error: declined {SECRET}",
                death="failed",
                fingerprint="f00",
                fingerprint_text="ValueError at card",
                message=None,
                errors=[],
                at="now",
            ),
        )
    flush()
    # Then the events keep the exception's type and stack, and none of its text
    assert captured.events
    assert SECRET not in json.dumps(captured.events)
    for event in captured.events:
        for value in event.get("exception", {}).get("values", []):
            assert value["type"] == "ValueError" and value["value"] == sentry.SENSITIVE_TEXT
            assert value["stacktrace"]["frames"]
