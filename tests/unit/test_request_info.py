"""LedgerRequest.info: what a worker tells ``inspect`` and Flower about a message it holds."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from celery_ledger import Settings, create_app
from celery_ledger.crypto import REDACTED
from celery_ledger.task import LedgerRequest

CARD = "4111111111111111"


@pytest.fixture
def app() -> Any:
    app = create_app(
        "unit",
        settings=Settings(broker_url="redis://127.0.0.1:1/0", mongo_uri="mongodb://127.0.0.1:1/"),
        set_as_current=False,
    )

    @app.task(shared=False, name="unit.store_card", sensitive=True)  # type: ignore[untyped-decorator]
    def store_card(token: str, card_number: str) -> None:
        pass

    @app.task(shared=False, name="unit.echo")  # type: ignore[untyped-decorator]
    def echo(token: str, card_number: str) -> None:
        pass

    return app


def request_of(app: Any, name: str, *, argsrepr: str) -> LedgerRequest:
    """A request as the worker's main process holds it: its arguments already opened."""
    task_id = str(uuid.uuid4())
    message_headers = {
        "id": task_id,
        "task": name,
        "argsrepr": argsrepr,
        "kwargsrepr": argsrepr,
    }
    message = SimpleNamespace(headers=message_headers, delivery_info={}, properties={})
    body = (["t-1"], {"card_number": CARD}, {})
    return LedgerRequest(
        message,
        app=app,
        task=app.tasks[name],
        body=body,
        headers=message_headers,
        decoded=True,
        hostname="unit@host",
    )


@pytest.mark.parametrize("safe", [False, True])
def test_a_sensitive_requests_info_shows_the_marker_for_its_arguments(app: Any, safe: bool) -> None:
    # Given a sensitive task's message whose argsrepr a foreign publisher filled with the card
    request = request_of(app, "unit.store_card", argsrepr=f"('t-1', {CARD!r})")

    # When the worker describes it (inspect active/reserved/scheduled, query_task)
    described = request.info(safe=safe)

    # Then its arguments are the redaction marker, whichever form was asked for
    assert (described["args"], described["kwargs"]) == (REDACTED, REDACTED)
    assert CARD not in repr(described)
    # And the rest of the description is Celery's, so Flower still lists the job
    assert (described["id"], described["name"]) == (request.id, "unit.store_card")
    assert described["hostname"] == "unit@host"
    # While the worker itself still holds the opened arguments to run the body
    assert request.kwargs == {"card_number": CARD}


def test_a_plain_requests_info_keeps_its_arguments(app: Any) -> None:
    request = request_of(app, "unit.echo", argsrepr="('t-1', 'x')")

    assert request.info()["kwargs"] == {"card_number": CARD}
    assert request.info(safe=True)["args"] == "('t-1', 'x')"
