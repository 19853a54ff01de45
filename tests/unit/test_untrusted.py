"""The guard's pure helpers: what raw messages' headers become before the ledger stores them."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import bson
import celery.app.task
import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_ledger import Settings, create_app
from celery_ledger.task import LedgerRequest, LedgerTask
from celery_ledger.untrusted import expiry_of, retries_done, storable_key, storable_value

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text()
    | st.sampled_from(["\ud800", "a\udfffb"]),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.text(max_size=6) | st.sampled_from(["$x", "a\x00b"]), children, max_size=3
        )
    ),
    max_leaves=10,
)


@given(headers=st.dictionaries(st.text(max_size=8), json_values, max_size=4))
def test_any_decoded_headers_become_a_storable_document(headers: dict[str, Any]) -> None:
    # When headers of a raw message are made storable, BSON encodes them
    bson.encode({"headers": storable_value(headers)})


def test_storable_value_keeps_what_bson_stores_and_rewrites_the_rest() -> None:
    headers = {
        "x-big": 2**70,
        "x-small": -(2**63),
        "x-\x00": 1,
        "$where": "a\ud800",
        "nested": [{"k": 2**64}, 1.5, None, True],
        "odd": {1, 2},
    }

    assert storable_value(headers) == {
        "x-big": str(2**70),
        "x-small": -(2**63),
        "x-\\x00": 1,
        "\\$where": "a\\ud800",
        "nested": [{"k": str(2**64)}, 1.5, None, True],
        "odd": "{1, 2}",
    }


@pytest.mark.parametrize(
    ("name", "key"), [("plain", "plain"), ("a\x00b", "a\\x00b"), ("$x", "\\$x"), ("a$", "a$")]
)
def test_storable_key(name: str, key: str) -> None:
    assert storable_key(name) == key


@pytest.mark.parametrize(
    ("header", "retries"),
    [
        (0, 0),
        (3, 3),
        (None, 0),
        ("abc", 0),
        ("3", 0),
        (2.0, 0),
        (True, 0),
        (-1, 0),
        (2**70, 0),
        ([1], 0),
    ],
)
def test_retries_done_is_a_count_or_zero(header: Any, retries: int) -> None:
    assert retries_done(header) == retries


def test_expiry_of_reads_celerys_iso_header_as_an_aware_time() -> None:
    aware = datetime(2000, 1, 1, tzinfo=UTC)

    assert expiry_of("2000-01-01T00:00:00+00:00") == aware
    assert expiry_of("2000-01-01T00:00:00") == aware  # naive is UTC, as the app's clock
    assert expiry_of("2000-01-01T01:00:00+01:00") == aware
    later = datetime(2000, 1, 1, 2, tzinfo=timezone(timedelta(hours=2)))
    assert expiry_of(later) == aware


@pytest.mark.parametrize("header", [None, "", "soon", 5, [1], {"a": 1}, "2000-13-45"])
def test_expiry_of_anything_else_is_none(header: Any) -> None:
    assert expiry_of(header) is None


def test_ledger_tasks_leave_expiry_to_the_guard() -> None:
    # Celery would revoke an expired message unrecorded; the guard retires it instead
    assert LedgerTask.Request is LedgerRequest
    request = SimpleNamespace(expires=datetime(2000, 1, 1, tzinfo=UTC))
    assert LedgerRequest.maybe_expire(request) is False  # type: ignore[arg-type]


def test_a_retry_goes_to_the_tier_the_guard_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(
        "unit",
        settings=Settings(broker_url="redis://127.0.0.1:1/0", mongo_uri="mongodb://127.0.0.1:1/"),
        set_as_current=False,
    )

    @app.task(shared=False, name="unit.job")  # type: ignore[untyped-decorator]
    def job() -> None:
        pass

    asked: dict[str, Any] = {}
    monkeypatch.setattr(
        celery.app.task.Task, "retry", lambda self, *a, **options: asked.update(options)
    )
    # Given a running message whose own tier header is unknown, checked by the guard
    job.push_request(ledger_tier="nowhere", ledger_run_tier="bulk")
    try:
        # When the body (or Celery's autoretry) asks for a retry
        job.retry(countdown=1)
    finally:
        job.pop_request()
    # Then the retry is published to the checked tier (a call option beats the header)
    assert asked["tier"] == "bulk"


def _delivery_of(**request_fields: Any) -> Any:
    """The delivery a worker builds of a request with these fields (message ``m-1``)."""
    app = create_app(
        "unit",
        settings=Settings(broker_url="redis://127.0.0.1:1/0", mongo_uri="mongodb://127.0.0.1:1/"),
        set_as_current=False,
    )

    @app.task(shared=False, name="unit.job")  # type: ignore[untyped-decorator]
    def job(x: int) -> None:
        pass

    job.push_request(id="m-1", retries=0, **request_fields)
    try:
        return job._delivery((1,), {})
    finally:
        job.pop_request()


@pytest.mark.parametrize(
    ("request_fields", "new", "redelivered"),
    [
        (
            {"properties": {"ledger_new": True}, "delivery_info": {"redelivered": False}},
            True,
            False,
        ),
        ({"properties": {"ledger_new": 1}}, False, False),  # only true is the hint
        ({"properties": "junk", "delivery_info": None}, False, False),
        ({"properties": {"ledger_new": True}, "delivery_info": {"redelivered": True}}, True, True),
        ({"properties": {}, "headers": {"redelivered": True}}, False, True),  # kombu's restore
    ],
)
def test_a_deliverys_first_publish_hint_is_read_from_the_messages_property(
    request_fields: dict[str, Any], new: bool, redelivered: bool
) -> None:
    delivery = _delivery_of(**request_fields)
    assert (delivery.new, delivery.redelivered) == (new, redelivered)
    assert delivery.first_publish is (new and not redelivered)


def test_a_copy_the_reconciler_puts_back_is_not_a_first_publish() -> None:
    from celery_ledger.broker import _restored_copy

    # Given a first publish's message as a dead worker left it unacknowledged
    held = {
        "body": "e30=",
        "headers": {"task": "unit.job", "id": "m-1"},
        "properties": {
            "ledger_new": True,
            "delivery_info": {"exchange": "", "routing_key": "default"},
        },
    }
    # When the reconciler puts it back, the copy a worker receives is marked as kombu marks its own
    copy = json.loads(_restored_copy(held))
    delivery = _delivery_of(
        headers=copy["headers"],
        properties=copy["properties"],
        delivery_info=copy["properties"]["delivery_info"],
    )
    # Then its claim is not tried as an insert: the job's record exists
    assert delivery.new and delivery.redelivered and not delivery.first_publish
    # And a message of an odd shape is put back as it was, not refused
    odd = {"headers": "junk", "properties": {"delivery_info": None}}
    assert json.loads(_restored_copy(odd)) == odd
