"""celery_ledger.envelope: the checks that keep malformed queue items away from kombu and Celery.

The tables below name bad and good values per header and property; the class tests make sure
that every header and property Celery, kombu and the ledger send or read has a check (and a
row in these tables); the property at the end is the proof that the checks cover the class:
whatever an envelope carries, either it is refused with a reason, or a worker's main process
(:mod:`tests.unit.worker_probe`, Celery's and kombu's own objects) handles it without raising.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sentry_sdk
from celery import Celery, chain, chord, group
from celery.app.task import Context
from hypothesis import event, given, settings
from hypothesis import strategies as st
from kombu.transport.virtual.base import Base64
from kombu.utils.json import dumps
from sentry_sdk.transport import Transport

import celery_ledger
from celery_ledger import headers as ledger_headers
from celery_ledger.envelope import (
    CELERY_HEADER_CHECKS,
    EMBED_CHECKS,
    LEDGER_HEADER_CHECKS,
    PROPERTY_CHECKS,
    RESERVED_STAMP_NAMES,
    WORKER_SET_HEADERS,
    body_problem,
    envelope_problem,
    task_headers_problem,
)
from tests.conftest import examples

from .worker_probe import LEDGER_TASK, PLAIN_TASK, REVOKED_ID, REVOKED_STAMP, Worker

CODECS = {"base64": Base64()}
SOON = (datetime.now(UTC) + timedelta(seconds=30)).isoformat()


def published(task: str = LEDGER_TASK, **options: Any) -> dict[str, Any]:
    """A task message exactly as Celery and kombu publish it (with the ledger's headers), as
    the Redis transport stores it: published through kombu's in-memory transport."""
    producer = Celery("producer", broker="memory://", set_as_current=False)
    queue = f"q-{uuid.uuid4().hex}"
    ledger = {
        ledger_headers.KEY: "order-7",
        ledger_headers.TIER: "default",
        ledger_headers.ENQUEUED_AT: 1_800_000_000.0,
        ledger_headers.SENT_AT: 1_800_000_000.5,
    }
    producer.send_task(task, (1, "a"), {"k": [1]}, queue=queue, headers=ledger, **options)
    with producer.connection_for_read() as connection:
        raw: dict[str, Any] = connection.default_channel._get(queue)
    producer.close()
    return raw


PUBLISHED = published()


def envelope(**changes: Any) -> dict[str, Any]:
    """The published task message with ``changes`` to its top level."""
    value = copy.deepcopy(PUBLISHED)
    value.update(changes)
    return value


def with_properties(**changes: Any) -> dict[str, Any]:
    value = envelope()
    value["properties"].update(changes)
    return value


def with_headers(**changes: Any) -> dict[str, Any]:
    value = envelope()
    value["headers"].update(changes)
    return value


def encoded(body: Any) -> str:
    return base64.b64encode(json.dumps(body).encode()).decode()


def test_a_published_task_message_passes() -> None:
    assert envelope_problem(envelope(), CODECS) is None
    assert envelope_problem(published(countdown=30), CODECS) is None  # an eta
    assert envelope_problem(published(expires=60, priority=5, time_limit=3), CODECS) is None


def test_a_message_without_a_task_header_is_left_to_celery() -> None:
    # Given a message that is not a task message (no 'task' header, a body that is no task)
    headers_without_task = {"id": {"x": 1}, "ledger_whatever": [1]}
    assert envelope_problem(envelope(headers=headers_without_task), CODECS) is None
    no_headers = envelope()
    del no_headers["headers"]
    assert envelope_problem(no_headers, CODECS) is None


def test_a_protocol_1_task_message_is_refused() -> None:
    # Given the task's fields in a JSON object body and no 'task' header (Celery's protocol 1)
    body = encoded({"task": LEDGER_TASK, "id": "x", "args": [], "kwargs": {}, "eta": 0})
    problem = envelope_problem(envelope(headers={}, body=body), CODECS)
    assert problem is not None and "protocol 1" in problem


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        ([1], "envelope is of type list"),
        (envelope(body=None), "body is missing"),
        (envelope(body=5), "body is of type int"),
        (envelope(**{"content-type": 5}), "content-type is of type int"),
        (envelope(**{"content-encoding": "\ud800"}), "content-encoding is not valid UTF-8"),
        (envelope(properties=None), "properties is missing"),
        (envelope(properties="x"), "properties is of type str"),
        (envelope(headers="x"), "headers is of type str"),
        (envelope(headers=None), "headers is missing, not an object"),  # restore sets a field
        (envelope(body=""), "empty body"),
        (envelope(body="a"), "body is not valid base64"),
        (with_properties(body_encoding="rot13"), "unknown body_encoding 'rot13'"),
        (with_properties(body_encoding=None, **{}), "body is not valid UTF-8"),
    ],
)
def test_a_malformed_envelope_is_named(item: object, reason: str) -> None:
    if reason == "body is not valid UTF-8":
        item = envelope(body="[[], {}, {}]\ud800")
        item["properties"]["body_encoding"] = None
    problem = envelope_problem(item, CODECS)
    assert problem is not None and reason in problem, problem


def test_a_plain_body_needs_no_codec() -> None:
    plain = json.dumps([[1], {}, {}])
    assert envelope_problem(with_properties(body_encoding=None) | {"body": plain}, CODECS) is None
    assert (
        envelope_problem(with_properties(body_encoding="utf-8") | {"body": plain}, CODECS) is None
    )


# -- per header and per property: bad values, each with its reason, and good ones ------------

LONE = "a\udfffb"
ABSENT = object()  # the name is left out
BAD_HEADERS: list[tuple[str, Any, str]] = [
    ("task", ["a"], "header 'task' is of type list"),
    ("task", LONE, "header 'task' is not valid UTF-8"),
    ("task", None, "header 'task' is missing, not a string"),
    ("id", ABSENT, "header 'id' is missing"),
    ("id", {"a": 1}, "header 'id' is of type dict"),
    ("id", "", "header 'id' is empty"),
    ("id", "\ud800", "header 'id' is not valid UTF-8"),
    ("id", uuid.uuid4(), "header 'id' is of type UUID"),  # kombu's JSON decodes these
    ("shadow", 3, "header 'shadow' is of type int"),
    ("root_id", [1], "header 'root_id' is of type list"),
    ("parent_id", LONE, "header 'parent_id' is not valid UTF-8"),
    ("group", {}, "header 'group' is of type dict"),
    ("group_index", "1", "header 'group_index' is of type str"),
    ("group_index", -1, "header 'group_index' is not an integer from 0"),
    ("group_index", 2**64, "header 'group_index' is not an integer from 0"),
    ("retries", "abc", "header 'retries' is of type str"),
    ("retries", 1.0, "header 'retries' is of type float"),
    ("retries", True, "header 'retries' is of type bool"),
    ("retries", -1, "header 'retries' is not an integer"),
    ("retries", 2**31, "header 'retries' is not an integer"),
    ("replaced_task_nesting", [], "header 'replaced_task_nesting' is of type list"),
    ("timelimit", ["a", "b"], "header 'timelimit' is not [hard, soft]"),
    ("timelimit", [1], "header 'timelimit' is not [hard, soft]"),
    ("timelimit", "x", "header 'timelimit' is not [hard, soft]"),
    ("timelimit", [-1, None], "header 'timelimit' is not [hard, soft]"),
    ("timelimit", [float("nan"), None], "header 'timelimit' is not [hard, soft]"),
    ("timelimit", [float("inf"), None], "header 'timelimit' is not [hard, soft]"),
    ("timelimit", [2**1100, None], "header 'timelimit' is not [hard, soft]"),
    ("timelimit", [True, None], "header 'timelimit' is not [hard, soft]"),
    ("timelimit", [Decimal(1), None], "header 'timelimit' is not [hard, soft]"),
    # eta and expires: what Celery's Request and strategy make of them, all of it
    ("eta", 0, "header 'eta' is not a date Celery can read (AttributeError"),  # falsy: None
    ("eta", "", "header 'eta' is not a date Celery can read"),
    ("eta", [], "header 'eta' is not a date Celery can read"),
    ("eta", 1700000000, "header 'eta' is not a date Celery can read (TypeError"),
    ("eta", "tomorrow", "header 'eta' is not a date Celery can read (ValueError"),
    ("eta", "9999-12-31T24:00:00", "header 'eta' is not a date Celery can read (OverflowError"),
    ("eta", "9999-12-31T23:00:00-05:00", "header 'eta' is not a date Celery can read (Overflow"),
    ("eta", "0001-01-01T00:30:00+01:00", "header 'eta' is not a date Celery can read (Overflow"),
    ("eta", "9999-12-31T12:00:00", "header 'eta' is a date at the edge of the calendar"),
    ("eta", "0001-01-01T00:00:00", "header 'eta' is a date at the edge of the calendar"),
    ("eta", "2026-11-23T10:00:00+24:00", "header 'eta' is not a date Celery can read"),
    ("eta", "2026-11-23T10:00\ud800", "header 'eta' is not a date Celery can read"),
    ("eta", datetime(2026, 1, 1).date(), "header 'eta' is not a date Celery can read"),
    ("expires", True, "header 'expires' is not a date Celery can read"),
    ("expires", {"a": 1}, "header 'expires' is not a date Celery can read"),
    ("expires", "2026-02-30", "header 'expires' is not a date Celery can read (ValueError"),
    ("expires", "9999-12-31T24:00:00", "header 'expires' is not a date Celery can read"),
    ("expires", "0", "header 'expires' is not a date Celery can read"),
    ("argsrepr", 5, "header 'argsrepr' is of type int"),
    ("kwargsrepr", [LONE], "header 'kwargsrepr' is of type list"),
    ("origin", ["host"], "header 'origin' is of type list"),
    ("lang", 1, "header 'lang' is of type int"),
    ("ignore_result", "yes", "header 'ignore_result' is of type str, not true or false"),
    ("ignore_result", 1, "header 'ignore_result' is of type int"),
    ("stamped_headers", 5, "header 'stamped_headers' is not a list of strings"),
    ("stamped_headers", [["a"]], "header 'stamped_headers' is not a list of strings"),
    ("stamps", "x", "header 'stamps' is of type str, not an object"),
    ("compression", 1, "header 'compression' is of type int"),
    ("callbacks", "x", "header 'callbacks' is not a list of signatures"),
    ("errbacks", [1], "header 'errbacks' is not a list of signatures"),
    ("chain", {}, "header 'chain' is not a list of signatures"),
    ("chord", [], "header 'chord' is not a signature"),
    # the ledger's headers
    (ledger_headers.KEY, "", "header 'ledger_key' is not a valid key"),
    (ledger_headers.KEY, "x" * 513, "header 'ledger_key' is not a valid key"),
    (ledger_headers.KEY, LONE, "header 'ledger_key' is not a valid key"),
    (ledger_headers.KEY, 7, "header 'ledger_key' is not a valid key"),
    (ledger_headers.TIER, ["x"], "header 'ledger_tier' is of type list"),
    (ledger_headers.TIER, LONE, "header 'ledger_tier' is not valid UTF-8"),
    (ledger_headers.DEFERRALS, "nan", "header 'ledger_deferrals' is of type str"),
    (ledger_headers.DEFERRALS, float("nan"), "header 'ledger_deferrals' is not a finite number"),
    (ledger_headers.DEFERRALS, True, "header 'ledger_deferrals' is of type bool"),
    (ledger_headers.PREVIOUS_DELAY, -1, "header 'ledger_previous_delay' is not a finite"),
    (ledger_headers.PREVIOUS_DELAY, float("inf"), "header 'ledger_previous_delay' is not a"),
    (ledger_headers.ENQUEUED_AT, 2**70, "header 'ledger_enqueued_at' is not a finite number"),
    (ledger_headers.ENQUEUED_AT, 1e12, "header 'ledger_enqueued_at' is not a finite number"),
    (ledger_headers.SENT_AT, [1.0], "header 'ledger_sent_at' is of type list"),
    (ledger_headers.SENT_AT, Decimal("1.5"), "header 'ledger_sent_at' is of type Decimal"),
    (ledger_headers.UNRUNNABLE_SINCE, "soon", "header 'ledger_unrunnable_since' is of type str"),
    (ledger_headers.UNRUNNABLE_DEFERRALS, -1, "header 'ledger_unrunnable_deferrals'"),
    (ledger_headers.WORKFLOW, 7, "header 'ledger_workflow' is not a valid key"),
    (ledger_headers.WORKFLOW, "x" * 513, "header 'ledger_workflow' is not a valid key"),
    (ledger_headers.WORKFLOW_TIER, {"a": 1}, "header 'ledger_workflow_tier' is of type dict"),
    (ledger_headers.SIGNATURE, ["v1"], "header 'ledger_signature' is of type list"),
    # names that are not the message's to set
    ("ledger_settled", True, "header 'ledger_settled' is not a header of celery-ledger"),
    ("ledger_run_tier", "bulk", "header 'ledger_run_tier' is not a header of celery-ledger"),
    ("headers", "x", "header 'headers' is of type str, not an object"),
    ("headers", [], "header 'headers' is of type list, not an object"),
    ("update", 1, "header 'update' is reserved"),
    ("_children", 1, "header '_children' is reserved"),
    ("utc", False, "header 'utc' is reserved"),
    ("time_limit", 5, "header 'time_limit' is reserved"),
]
GOOD_HEADERS: list[tuple[str, Any]] = [
    ("task", ""),  # an empty name is an unknown task: Celery dead-letters it
    ("id", "0b4f0c3e-1b61-4b43-9b3f-7a5ad7a0e4a1"),
    ("shadow", None),
    ("shadow", "an alias"),
    ("root_id", None),
    ("parent_id", "p"),
    ("group", "g"),
    ("group_index", 3),
    ("retries", 0),
    ("retries", None),
    ("retries", 2**31 - 1),
    ("replaced_task_nesting", 1),
    ("timelimit", [None, None]),
    ("timelimit", [10, 5.5]),
    ("timelimit", (0, None)),
    ("timelimit", None),
    ("eta", None),
    ("eta", SOON),
    ("eta", "2026-11-23T10:00:00"),  # naive: UTC
    ("eta", "2026-11-23T10:00:00.123456+05:30"),
    ("eta", datetime(2026, 11, 23, tzinfo=UTC)),  # as kombu's JSON decodes a datetime
    ("eta", "2000-01-01T00:00:00Z"),  # in the past: runs now
    ("expires", "2026-11-23"),
    ("expires", "9999-12-31T23:59:59-23:59"),  # only compared with now: any date
    ("expires", "0001-01-01T00:00:00+00:00"),  # as Celery publishes expires=datetime.min
    ("argsrepr", ""),
    ("argsrepr", "('\ud800',)"),  # Celery's saferepr keeps lone surrogates of the arguments
    ("kwargsrepr", None),
    ("origin", "gen1@host"),
    ("lang", "py"),
    ("ignore_result", None),
    ("ignore_result", True),
    ("stamped_headers", None),
    ("stamped_headers", []),
    ("stamps", {}),
    ("compression", None),
    ("headers", {"sentry-trace": "t", "ledger_key": "order-7"}),  # Sentry's Celery integration
    ("callbacks", [{"task": "t"}]),
    ("errbacks", None),
    ("chain", []),
    ("chord", {"task": "t"}),
    (ledger_headers.KEY, "order-7"),
    (ledger_headers.KEY, None),
    (ledger_headers.TIER, "nowhere"),  # an unknown tier: the guard falls back to the task's
    (ledger_headers.DEFERRALS, 3),
    (ledger_headers.PREVIOUS_DELAY, 0.5),
    (ledger_headers.ENQUEUED_AT, 1_800_000_000.25),
    (ledger_headers.SENT_AT, 0),
    (ledger_headers.UNRUNNABLE_SINCE, 1_800_000_000.5),
    (ledger_headers.UNRUNNABLE_DEFERRALS, 3),
    (ledger_headers.WORKFLOW, "6f1c3a52-5d0e-4c4e-9b59-3f0a6c1d2e77"),
    (ledger_headers.WORKFLOW_TIER, "nowhere"),  # an unknown tier: the wake goes to the default
    (ledger_headers.SIGNATURE, "v1:0123456789ab:00"),  # checked by the consumer, not here
    # names the worker overwrites, and names of the message's own
    ("hostname", ["anything"]),
    ("is_eager", True),
    ("called_directly", True),
    ("x-trace-id", {"any": ["json"]}),
    ("redelivered", True),
]


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    BAD_HEADERS,
    ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_HEADERS)],
)
def test_a_bad_header_is_named_with_what_is_wrong(name: str, value: Any, reason: str) -> None:
    item = with_headers(**{name: value})
    if value is ABSENT:
        del item["headers"][name]
    problem = envelope_problem(item, CODECS)
    assert problem is not None and problem.startswith(reason), problem


@pytest.mark.parametrize(("name", "value"), GOOD_HEADERS, ids=[n for n, _ in GOOD_HEADERS])
def test_a_good_header_passes(name: str, value: Any) -> None:
    assert envelope_problem(with_headers(**{name: value}), CODECS) is None


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({"stamped_headers": ["on"]}, "missing from header 'stamps'"),
        ({"stamped_headers": ["on"], "stamps": {"off": 1}}, "missing from header 'stamps'"),
        ({"stamped_headers": ["task_id"], "stamps": {"task_id": "x"}}, "an option of Celery's"),
        ({"stamped_headers": ["queue"], "stamps": {"queue": "x"}}, "an option of Celery's"),
        ({"stamped_headers": ["eta"], "stamps": {"eta": "x"}}, "an option of Celery's"),
    ],
)
def test_stamps_a_retry_could_not_resend_are_refused(headers: dict[str, Any], reason: str) -> None:
    problem = task_headers_problem({"task": "t", "id": "i", **headers})
    assert problem is not None and reason in problem, problem


def test_stamps_of_the_messages_own_pass() -> None:
    stamps = {"stamped_headers": ["on_signature"], "stamps": {"on_signature": ["x", 1]}}
    assert task_headers_problem({"task": "t", "id": "i", **stamps}) is None


BAD_PROPERTIES: list[tuple[str, Any, str]] = [
    (ledger_headers.NEW, "yes", "properties.ledger_new is of type str, not true or false"),
    (ledger_headers.NEW, 1, "properties.ledger_new is of type int, not true or false"),
    (ledger_headers.HANDED_BACK, "2", "properties.ledger_handed_back is of type str, not a number"),
    (ledger_headers.HANDED_BACK, -1, "properties.ledger_handed_back is not a finite number"),
    (ledger_headers.PARKED, 7, "properties.ledger_parked is of type int, not a string"),
    (ledger_headers.TENANT, 7, "properties.ledger_tenant is of type int, not a string"),
    (ledger_headers.TENANT, LONE, "properties.ledger_tenant is not valid UTF-8"),
    (ledger_headers.PARKED, "", "properties.ledger_parked is empty"),
    ("delivery_tag", ABSENT, "properties.delivery_tag is missing"),
    ("delivery_tag", None, "properties.delivery_tag is missing, not a string"),
    ("delivery_tag", ["x"], "properties.delivery_tag is of type list"),
    ("delivery_tag", "", "properties.delivery_tag is empty"),
    ("delivery_tag", LONE, "properties.delivery_tag is not valid UTF-8"),  # a Redis hash field
    ("delivery_info", ABSENT, "properties.delivery_info is missing"),
    ("delivery_info", "x", "properties.delivery_info is of type str"),
    ("delivery_info", {"exchange": ""}, "properties.delivery_info has no 'routing_key'"),
    ("delivery_info", {"routing_key": "q"}, "properties.delivery_info has no 'exchange'"),
    ("delivery_info", {"exchange": 1, "routing_key": "q"}, "properties.delivery_info 'exchange'"),
    ("delivery_info", {"exchange": "", "routing_key": LONE}, "properties.delivery_info 'routing"),
    ("delivery_info", {"exchange": "", "routing_key": None}, "properties.delivery_info 'routing"),
    ("delivery_info", {"exchange": "0", "routing_key": ""}, "properties.delivery_info 'routing"),
    (
        "delivery_info",
        {"exchange": "", "routing_key": "q", "redelivered": "yes"},
        "properties.delivery_info 'redelivered'",
    ),
    ("body_encoding", 7, "properties.body_encoding is of type int"),
    ("priority", "5", "properties.priority is of type str"),
    ("priority", 256, "properties.priority is not an integer from 0 to 255"),
    ("priority", float("inf"), "properties.priority is of type float"),  # kombu's restore: int()
    ("priority", -1, "properties.priority is not an integer"),
    ("correlation_id", 5, "properties.correlation_id is of type int"),
    ("reply_to", {"a": 1}, "properties.reply_to is of type dict"),
]
GOOD_PROPERTIES: list[tuple[str, Any]] = [
    (ledger_headers.NEW, True),
    (ledger_headers.NEW, False),
    (ledger_headers.NEW, None),
    (ledger_headers.HANDED_BACK, 3),
    (ledger_headers.HANDED_BACK, None),
    (ledger_headers.PARKED, "0f3a9c"),
    (ledger_headers.TENANT, "acme"),
    (ledger_headers.TENANT, None),
    ("delivery_tag", "tag-1"),
    ("delivery_info", {"exchange": "", "routing_key": "default"}),
    ("delivery_info", {"exchange": "default", "routing_key": "default", "redelivered": True}),
    ("delivery_info", {"exchange": None, "routing_key": "default"}),
    ("body_encoding", "base64"),
    ("priority", None),
    ("priority", 9),
    ("priority", 255),
    ("correlation_id", None),
    ("reply_to", ""),
    ("delivery_mode", "anything"),  # kombu's Redis transport does not read it
]


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    BAD_PROPERTIES,
    ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_PROPERTIES)],
)
def test_a_bad_property_is_named_with_what_is_wrong(name: str, value: Any, reason: str) -> None:
    item = with_properties(**{name: value})
    if value is ABSENT:
        del item["properties"][name]
    problem = envelope_problem(item, CODECS)
    assert problem is not None and problem.startswith(reason), problem


@pytest.mark.parametrize(("name", "value"), GOOD_PROPERTIES, ids=[n for n, _ in GOOD_PROPERTIES])
def test_a_good_property_passes(name: str, value: Any) -> None:
    assert envelope_problem(with_properties(**{name: value}), CODECS) is None


@pytest.mark.parametrize("value", [True, "x", [1], {"a": None}])
def test_a_property_no_check_knows_passes(value: Any) -> None:
    # A later release's hint reaches a worker of this one as an unknown property: it passes
    # (where an unknown ledger_ header is refused), so producers may be upgraded first. The
    # ledger_new property came that way: an earlier release's workers pass it and ignore it.
    assert envelope_problem(with_properties(ledger_later_hint=value), CODECS) is None


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ([1], "not an [args, kwargs, embed] triple"),
        (b"", "not an [args, kwargs, embed] triple"),
        ({"args": []}, "not an [args, kwargs, embed] triple"),
        (None, "not an [args, kwargs, embed] triple"),
        (["x", {}, {}], "args is of type str"),
        ([[], [1], {}], "kwargs is of type list"),
        ([[], {}, "x"], "embed is of type str"),
        ([[], {}, {"callbacks": "x"}], "embed 'callbacks'"),
        ([[], {}, {"chain": [1]}], "embed 'chain'"),
        ([[], {}, {"chord": []}], "embed 'chord'"),
        # the embed is merged into the request: a key would replace a request field
        ([[], {}, {"is_eager": True}], "embed 'is_eager' is not a signature field"),
        ([[], {}, {"retries": "x"}], "embed 'retries' is not a signature field"),
    ],
)
def test_a_body_that_is_not_a_triple_is_named(body: object, reason: str) -> None:
    problem = body_problem(body)
    assert problem is not None and reason in problem, problem


def test_a_protocol_2_body_passes() -> None:
    embed = {"callbacks": [{"task": "t"}], "errbacks": None, "chain": None, "chord": None}
    assert body_problem([[1, "a"], {"k": [1]}, embed]) is None
    assert body_problem(((1,), {}, {})) is None


# -- the class: every name Celery, kombu and the ledger send or read has a check and rows ------


def test_every_header_celery_sends_has_a_check() -> None:
    sent = set(published(countdown=5, expires=10, time_limit=3).get("headers", {}))
    ledger = set(LEDGER_HEADER_CHECKS)
    assert sent - ledger <= set(CELERY_HEADER_CHECKS), sent - ledger - set(CELERY_HEADER_CHECKS)


PRODUCER = Celery("producer", broker="memory://", set_as_current=False)


@PRODUCER.task(name=LEDGER_TASK, shared=False)
def producer_task(*args: Any) -> None:
    """The probe task as a producer's app knows it (publishing only)."""


surrogates = st.sampled_from(["\ud800", "a\udfffb"])
arguments = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | surrogates,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children),
    max_leaves=6,
)


@given(
    args=st.lists(arguments, max_size=3),
    kwargs=st.dictionaries(st.text(max_size=6) | surrogates, arguments, max_size=2),
    options=st.fixed_dictionaries(
        {},
        optional={
            "countdown": st.floats(0, 1e6),
            "expires": st.floats(1, 1e6) | st.datetimes(timezones=st.just(UTC)),
            "priority": st.integers(0, 9),
            "shadow": st.text(max_size=8),
            "time_limit": st.integers(1, 10**6),
            "soft_time_limit": st.floats(0.1, 1e6),
            "retries": st.integers(0, 100),
        },
    ),
)
def test_any_message_celery_publishes_passes(
    args: list[Any], kwargs: dict[str, Any], options: dict[str, Any]
) -> None:
    """No false alarms: what Celery itself publishes, for any JSON arguments and any of its
    options, passes the checks."""
    queue = f"q-{uuid.uuid4().hex}"
    PRODUCER.send_task(LEDGER_TASK, args, kwargs, queue=queue, **options)
    with PRODUCER.connection_for_read() as connection:
        raw = connection.default_channel._get(queue)
    assert envelope_problem(raw, CODECS) is None


class NoNetwork(Transport):
    def capture_envelope(self, envelope: Any) -> None:
        pass


def test_a_message_published_with_sentrys_celery_integration_passes() -> None:
    """No false alarm for a producer with Sentry's defaults (a web app that calls
    ``sentry_sdk.init(dsn=...)``): its Celery integration adds trace headers to every message,
    and a 'headers' object that becomes the task request's headers."""
    sentry_sdk.init(dsn="https://public@sentry.invalid/1", transport=NoNetwork())
    try:
        queue = f"q-{uuid.uuid4().hex}"
        producer_task.apply_async((1,), queue=queue, headers={"ledger_key": "order-7"})
        with PRODUCER.connection_for_read() as connection:
            raw = connection.default_channel._get(queue)
        assert {"sentry-trace", "headers"} <= set(raw["headers"]), raw["headers"]  # it is on
        assert envelope_problem(raw, CODECS) is None
    finally:
        sentry_sdk.init()  # a disabled client for the rest of the session


CANVAS = Celery("canvas", broker="memory://", backend="cache+memory://", set_as_current=False)


@CANVAS.task(name=LEDGER_TASK, shared=False)
def canvas_task(*args: Any) -> None:
    """The probe task as a producer with a result backend knows it (chords need one)."""


CANVAS_SHAPES: dict[str, Callable[[str], Any]] = {
    "chain": lambda q: chain(canvas_task.s(1).set(queue=q), canvas_task.s().set(queue=q))(),
    "group": lambda q: group(canvas_task.s(1).set(queue=q), canvas_task.s(2).set(queue=q))(),
    "chord": lambda q: chord([canvas_task.s(1).set(queue=q)], canvas_task.s().set(queue=q))(),
    "link": lambda q: canvas_task.apply_async(
        (1,), queue=q, link=canvas_task.s(), link_error=canvas_task.s()
    ),
    "stamped": lambda q: canvas_task.s(1).set(queue=q).stamp(on_signature="x").apply_async(),
}


@pytest.mark.parametrize("publish", CANVAS_SHAPES.values(), ids=CANVAS_SHAPES.keys())
def test_every_message_of_celerys_canvas_passes(publish: Callable[[str], Any]) -> None:
    queue = f"q-{uuid.uuid4().hex}"
    publish(queue)
    with CANVAS.connection_for_read() as connection:
        channel = connection.default_channel
        messages = [channel._get(queue) for _ in range(channel._size(queue))]
    assert messages
    assert [envelope_problem(raw, CODECS) for raw in messages] == [None] * len(messages)


def test_every_property_kombu_stores_has_a_check_or_is_never_read() -> None:
    never_read = {"delivery_mode"}  # kombu's Redis transport and Celery's worker ignore it
    stored = set(published(priority=3, reply_to="r")["properties"])
    assert stored - never_read <= set(PROPERTY_CHECKS), stored - never_read - set(PROPERTY_CHECKS)


def test_every_header_of_the_ledger_has_a_row() -> None:
    # headers.py names every header the ledger adds; each needs its row in the table
    names = {
        value
        for name, value in vars(ledger_headers).items()
        if name.isupper() and isinstance(value, str)
    }
    assert names - set(ledger_headers.PROPERTIES) == set(LEDGER_HEADER_CHECKS)
    # the ledger's message properties: each checked by the transport, none a header
    assert set(ledger_headers.PROPERTIES) <= set(PROPERTY_CHECKS) - set(LEDGER_HEADER_CHECKS)


def test_every_field_of_the_ledger_on_a_request_is_refused_as_a_header() -> None:
    # The guard keeps per-run state on Celery's request; a header of that name would preset it.
    source = Path(celery_ledger.__file__).parent
    pattern = re.compile(r"request\.(ledger_\w+)\s*=|getattr\([\w.]*request, \"(ledger_\w+)\"")
    fields = {
        name
        for path in source.rglob("*.py")
        for match in pattern.finditer(path.read_text())
        for name in match.groups()
        if name
    }
    assert {"ledger_fence", "ledger_execution", "ledger_run_tier"} <= fields  # the scan works
    for name in fields - set(LEDGER_HEADER_CHECKS):
        problem = task_headers_problem({"task": "t", "id": "i", name: True})
        assert problem is not None and "is not a header of celery-ledger" in problem, name


def test_every_field_of_celerys_task_context_is_checked_set_by_the_worker_or_refused() -> None:
    for name in dir(Context):
        problem = task_headers_problem({"task": "t", "id": "i", name: "surely-not-valid\ud800"})
        known = name in CELERY_HEADER_CHECKS or name in LEDGER_HEADER_CHECKS
        assert known or name in WORKER_SET_HEADERS or problem is not None, name


def test_the_tables_of_this_file_cover_every_check() -> None:
    checked = set(CELERY_HEADER_CHECKS) | set(LEDGER_HEADER_CHECKS)
    assert checked <= {name for name, _, _ in BAD_HEADERS}
    assert checked <= {name for name, _ in GOOD_HEADERS}
    assert set(PROPERTY_CHECKS) <= {name for name, _, _ in BAD_PROPERTIES}
    assert set(PROPERTY_CHECKS) <= {name for name, _ in GOOD_PROPERTIES}
    assert set(EMBED_CHECKS) <= set(CELERY_HEADER_CHECKS)
    assert {"countdown", "eta", "task_id", "queue", "priority"} <= RESERVED_STAMP_NAMES


# -- the proof: anything passes the checks only if a worker handles it ---------------------------

lone_surrogates = st.sampled_from(["\ud800", "a\udfffb", "\udc80"])
texts = st.text(max_size=12) | lone_surrogates
integers = st.integers() | st.sampled_from(
    [2**31 - 1, 2**31, 2**63, 2**64, -(2**70), 10**30, 255, 256, -1, 0]
)
floats = st.floats() | st.sampled_from([1e308, -1e308, 1e12, 5e-324, -0.0])
# Dates as text: any datetime in any timezone and format Python writes, ISO-like text, and
# the odd ones (hour 24, week dates, offsets past a day, the ends of the calendar).
date_texts = st.one_of(
    st.datetimes(timezones=st.none() | st.timezones()).map(datetime.isoformat),
    st.datetimes(timezones=st.none() | st.timezones()).map(
        lambda d: d.isoformat(sep=" ", timespec="microseconds")
    ),
    st.from_regex(
        r"\d{4}-?\d{2}-?\d{2}"  # a date, then perhaps a time and an offset
        r"([T ]\d{2}(:?\d{2}(:?\d{2}([.,]\d{1,9})?)?)?)?(Z|[+-]\d{2}(:?\d{2})?)?",
        fullmatch=True,
    ),
    st.sampled_from(
        [
            "9999-12-31T24:00:00",
            "9999-12-31T23:59:59-23:59",
            "9999-12-31T23:59:59+14:00",
            "9999-12-30T00:00:00",
            "0001-01-01T00:00:00+00:01",
            "0001-01-01T00:00:00-14:00",
            "0001-01-03T00:00:00",
            "2026-11-23T10:00:00+24:00",
            "2026-W48-1",
            "2026-327",
            "20261123T100000Z",
            "2026-11-23T10:00:00.1234567890Z",
            "T10",
            "now",
            "0",
            "",
            SOON,
        ]
    ),
)
# What kombu's JSON decoder makes of {"__type__": ..., "__value__": ...} objects.
kombu_objects = st.one_of(
    st.datetimes(timezones=st.none() | st.timezones()),
    st.dates(),
    st.times(),
    st.decimals(),
    st.uuids(),
    st.binary(max_size=4),
)
scalars = st.none() | st.booleans() | integers | floats | texts | date_texts | kombu_objects
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(texts, children, max_size=3),
    max_leaves=8,
)
HEADER_NAMES = sorted(
    set(CELERY_HEADER_CHECKS)
    | set(LEDGER_HEADER_CHECKS)
    | WORKER_SET_HEADERS
    | {name for name in dir(Context) if not name.startswith("__")}
    | {"ledger_settled", "ledger_fence", "redelivered", "x-custom"}
)
PROPERTY_NAMES = sorted(set(PROPERTY_CHECKS) | {"delivery_mode", "x-property"})
Change = Callable[[dict[str, Any]], None]


def kombu_encoded(body: Any) -> str:
    """``body`` as kombu would write it (its JSON knows dates, decimals, UUIDs and bytes)."""
    return base64.b64encode(dumps(body).encode()).decode()


def _plain_body(text: str) -> Change:
    """``text`` as the body, without a body encoding (kombu hands it on as it is)."""

    def change(item: dict[str, Any]) -> None:
        _set(("body",), text)(item)
        _delete(("properties", "body_encoding"))(item)

    return change


def _stamped(value: Any) -> Change:
    """A stamp the worker checks against its revoked stamps, with ``value``."""

    def change(item: dict[str, Any]) -> None:
        _set(("headers", "stamped_headers"), [REVOKED_STAMP[0]])(item)
        _set(("headers", "stamps"), {REVOKED_STAMP[0]: value})(item)

    return change


def _set(path: tuple[str, ...], value: Any) -> Change:
    def change(item: dict[str, Any]) -> None:
        target: Any = item
        for step in path[:-1]:
            target = target.get(step) if isinstance(target, dict) else None
        if isinstance(target, dict):
            target[path[-1]] = value

    return change


def _delete(path: tuple[str, ...]) -> Change:
    def change(item: dict[str, Any]) -> None:
        target: Any = item
        for step in path[:-1]:
            target = target.get(step) if isinstance(target, dict) else None
        if isinstance(target, dict):
            target.pop(path[-1], None)

    return change


header_names = st.sampled_from(HEADER_NAMES) | st.text(max_size=8)
triples = st.tuples(
    st.lists(json_values, max_size=2),
    st.dictionaries(st.text(max_size=4), json_values, max_size=2),
    st.dictionaries(st.sampled_from(sorted(EMBED_CHECKS)) | st.text(max_size=4), json_values),
)
bodies = st.one_of(
    triples.map(list),
    json_values,
    st.dictionaries(header_names, json_values, max_size=4).map(
        lambda fields: {"task": LEDGER_TASK, **fields}  # protocol 1
    ),
)
header_changes = st.one_of(
    st.builds(lambda n, v: _set(("headers", n), v), header_names, json_values),
    st.builds(lambda n: _delete(("headers", n)), header_names),
    st.just(_set(("headers", "id"), REVOKED_ID)),  # an id the worker was told to revoke
    st.builds(_stamped, json_values | st.just(REVOKED_STAMP[1])),
)
property_changes = st.one_of(
    st.builds(
        lambda n, v: _set(("properties", n), v), st.sampled_from(PROPERTY_NAMES), json_values
    ),
    st.builds(lambda n: _delete(("properties", n)), st.sampled_from(PROPERTY_NAMES)),
    st.builds(
        lambda n, v: _set(("properties", "delivery_info", n), v),
        st.sampled_from(["exchange", "routing_key", "redelivered", "x"]),
        json_values,
    ),
    st.builds(
        lambda n: _delete(("properties", "delivery_info", n)),
        st.sampled_from(["exchange", "routing_key"]),
    ),
)
envelope_changes = st.one_of(
    st.builds(
        lambda n, v: _set((n,), v),
        st.sampled_from(["body", "headers", "properties", "content-type", "content-encoding"]),
        json_values,
    ),
    st.builds(lambda body: _set(("body",), kombu_encoded(body)), bodies),
    st.builds(_plain_body, bodies.map(dumps) | texts),  # no body_encoding: the text as it is
)
# Headers are the largest part of the class: most edits change one.
changes: st.SearchStrategy[Change] = st.one_of(
    header_changes, header_changes, header_changes, property_changes, envelope_changes
)
TASKS = (LEDGER_TASK, PLAIN_TASK, "no.such.task")
PUBLISHED_BY_TASK = {task: published(task) for task in TASKS}


@pytest.fixture(scope="module")
def worker() -> Worker:
    return Worker()


@settings(max_examples=examples(1000))
@given(task=st.sampled_from(TASKS), edits=st.lists(changes, max_size=4), item=json_values)
def test_an_item_passes_the_checks_only_if_a_worker_handles_it_without_raising(
    worker: Worker, task: str, edits: list[Change], item: Any
) -> None:
    """Passes by not raising: any JSON in any header, property or field of a published task
    message (or any JSON value as the whole item) is refused with a reason, or a worker's main
    process (kombu, LedgerConsumer, Celery's strategy and Request, the pool's callbacks, the
    ledger's header readers, kombu's restore) handles it without an exception."""
    raw = copy.deepcopy(PUBLISHED_BY_TASK[task])
    for edit in edits:
        edit(raw)
    for candidate in (item, raw):
        problem = envelope_problem(candidate, CODECS)
        if problem is not None:
            assert isinstance(problem, str) and problem
            event(f"refused: {problem.split(' is ')[0][:40]}")
            continue
        outcome = worker.handle(copy.deepcopy(candidate))
        event(outcome.summary())


# Every place a value can sit: each header name (checked, worker-set, Celery's context fields,
# the ledger's), each property and delivery field, each top-level field.
PLACES = [
    *(("headers", name) for name in HEADER_NAMES),
    *(("properties", name) for name in PROPERTY_NAMES),
    *(("properties", "delivery_info", name) for name in ("exchange", "routing_key", "redelivered")),
    *((name,) for name in ("body", "headers", "properties", "content-type", "content-encoding")),
]


@settings(max_examples=examples(2000))
@given(task=st.sampled_from(TASKS), place=st.sampled_from(PLACES), value=json_values)
def test_any_value_in_any_one_place_is_refused_or_handled_without_raising(
    worker: Worker, task: str, place: tuple[str, ...], value: Any
) -> None:
    """Passes by not raising: one value anywhere in a published task message (the same proof
    as above, one place at a time, so that every place gets its share of values)."""
    raw = copy.deepcopy(PUBLISHED_BY_TASK[task])
    _set(place, value)(raw)
    problem = envelope_problem(raw, CODECS)
    if problem is not None:
        event(f"refused: {place[-1]}")
        return
    event(f"{worker.handle(raw).summary()}")


# The values at the edges of what each reader accepts, tried in every place (no sampling).
EDGE_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    255,
    256,
    2**31,
    2**63,
    2**64,
    -(2**70),
    0.5,
    -0.0,
    1e12,
    1e308,
    float("inf"),
    float("-inf"),
    float("nan"),
    "",
    "x",
    "0",
    "\ud800",
    "now",
    SOON,
    "2000-01-01T00:00:00",
    "9999-12-31T24:00:00",
    "9999-12-31T23:00:00-05:00",
    "0001-01-01T00:00:00+00:01",
    "2026-11-23T10:00:00+24:00",
    [],
    [1],
    [None, None],
    [1, 2, 3],
    ["a", "b"],
    [{"task": "t"}],
    {},
    {"a": 1},
    {"task": "t"},
    {"exchange": "", "routing_key": "q"},
    Decimal("Infinity"),
    Decimal("NaN"),
    Decimal("1e999999"),
    uuid.UUID(int=1),
    datetime(9999, 12, 31, 23, 59, 59),
    datetime(1, 1, 1, tzinfo=UTC),
    datetime(2026, 11, 23).date(),
    datetime(2026, 11, 23).time(),
    b"\xff",
]


@pytest.mark.parametrize("task", TASKS)
def test_every_edge_value_in_every_place_is_refused_or_handled_without_raising(
    worker: Worker, task: str
) -> None:
    """Passes by not raising: each of EDGE_VALUES in each of PLACES."""
    for place in PLACES:
        for value in EDGE_VALUES:
            raw = copy.deepcopy(PUBLISHED_BY_TASK[task])
            _set(place, value)(raw)
            if envelope_problem(raw, CODECS) is None:
                try:
                    worker.handle(raw)
                except Exception as exc:
                    raise AssertionError(f"{place} = {value!r}: {exc!r}") from exc


@pytest.mark.parametrize("task", TASKS)
def test_every_edge_value_in_a_protocol_1_body_is_refused_or_handled_without_raising(
    worker: Worker, task: str
) -> None:
    """Passes by not raising: the task's fields in the body (Celery's protocol 1), no 'task'
    header, each field set to each of EDGE_VALUES."""
    for name in HEADER_NAMES:
        for value in EDGE_VALUES:
            raw = copy.deepcopy(PUBLISHED_BY_TASK[task])
            fields = {"task": task, "id": "p1", "args": [], "kwargs": {}, name: value}
            raw["headers"] = {}
            raw["body"] = kombu_encoded(fields)
            if envelope_problem(raw, CODECS) is None:
                try:
                    worker.handle(raw)
                except Exception as exc:
                    raise AssertionError(f"body {name} = {value!r}: {exc!r}") from exc
