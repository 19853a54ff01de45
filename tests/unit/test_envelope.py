"""celery_ledger.envelope: the checks that keep malformed queue items away from kombu and Celery."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kombu.transport.virtual.base import Base64

from celery_ledger.envelope import body_problem, envelope_problem, task_headers_problem

CODECS = {"base64": Base64()}


def envelope(**changes: Any) -> dict[str, Any]:
    """A task message as kombu's Redis transport stores it, with ``changes`` applied."""
    value: dict[str, Any] = {
        "body": base64.b64encode(json.dumps([[1], {}, {}]).encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"lang": "py", "task": "tasks.add", "id": "abc"},
        "properties": {
            "correlation_id": "abc",
            "delivery_info": {"exchange": "", "routing_key": "default"},
            "body_encoding": "base64",
            "delivery_tag": "tag-1",
        },
    }
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


def test_a_well_formed_task_message_passes() -> None:
    assert envelope_problem(envelope(), CODECS) is None


def test_a_message_without_a_task_header_is_left_to_celery() -> None:
    # Given a protocol 1 or control message (no 'task' header): no task header checks
    assert envelope_problem(envelope(headers={"id": {"x": 1}}), CODECS) is None
    assert envelope_problem(envelope(headers=None), CODECS) is None


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        ([1], "envelope is of type list"),
        (envelope(body=None), "body is missing"),
        (envelope(body=5), "body is of type int"),
        (envelope(**{"content-type": 5}), "content-type is of type int"),
        (envelope(properties=None), "properties is missing"),
        (envelope(properties="x"), "properties is of type str"),
        (with_properties(delivery_tag=None), "delivery_tag"),
        (with_properties(delivery_tag=["x"]), "delivery_tag"),
        (with_properties(delivery_info="x"), "delivery_info"),
        (with_properties(delivery_info={"exchange": ""}), "delivery_info"),
        (with_properties(body_encoding="rot13"), "unknown body_encoding 'rot13'"),
        (with_properties(body_encoding=7), "body_encoding is of type int"),
        (envelope(body="a"), "body is not valid base64"),
        (envelope(headers="x"), "headers is of type str"),
        (envelope(body=""), "empty body"),
    ],
)
def test_a_malformed_envelope_is_named(item: object, reason: str) -> None:
    problem = envelope_problem(item, CODECS)
    assert problem is not None and reason in problem, problem


def test_a_plain_body_needs_no_codec() -> None:
    assert envelope_problem(with_properties(body_encoding=None), CODECS) is None
    assert envelope_problem(with_properties(body_encoding="utf-8"), CODECS) is None


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({"task": ["a"]}, "header 'task' is of type list"),
        ({"id": {"a": 1}}, "header 'id'"),
        ({"id": ""}, "header 'id'"),
        ({"id": "\ud800"}, "header 'id'"),
        ({"shadow": 3}, "header 'shadow'"),
        ({"timelimit": ["a", "b"]}, "timelimit"),
        ({"timelimit": [1]}, "timelimit"),
        ({"timelimit": "x"}, "timelimit"),
        ({"timelimit": [-1, None]}, "timelimit"),
        ({"timelimit": [float("nan"), None]}, "timelimit"),
        ({"timelimit": [2**1100, None]}, "timelimit"),
        ({"timelimit": [True, None]}, "timelimit"),
        ({"stamped_headers": 5}, "stamped_headers"),
        ({"stamped_headers": [["a"]]}, "stamped_headers"),
        ({"stamps": "x"}, "header 'stamps' is of type str"),
        ({"stamped_headers": ["on"]}, "missing from header 'stamps'"),
        ({"stamped_headers": ["on"], "stamps": {"off": 1}}, "missing from header 'stamps'"),
    ],
)
def test_unusable_task_headers_are_named(headers: dict[str, Any], reason: str) -> None:
    problem = envelope_problem(with_headers(**headers), CODECS)
    assert problem is not None and reason in problem, problem


@pytest.mark.parametrize(
    "headers",
    [
        {"timelimit": [None, None]},
        {"timelimit": [10, 5.5]},
        {"timelimit": (0, None)},
        {"stamped_headers": ["on"], "stamps": {"on": ["x"]}},
        {"shadow": None, "stamps": None, "stamped_headers": None},
        {"stamps": {"on": 1}, "stamped_headers": []},
        {"task": ""},  # an empty name is an unknown task: Celery dead-letters it
    ],
)
def test_valid_task_headers_pass(headers: dict[str, Any]) -> None:
    assert task_headers_problem({"task": "t", "id": "i", **headers}) is None


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
    ],
)
def test_a_body_that_is_not_a_triple_is_named(body: object, reason: str) -> None:
    problem = body_problem(body)
    assert problem is not None and reason in problem, problem


def test_a_protocol_2_body_passes() -> None:
    embed = {"callbacks": [{"task": "t"}], "errbacks": None, "chain": None, "chord": None}
    assert body_problem([[1, "a"], {"k": [1]}, embed]) is None
    assert body_problem(((1,), {}, {})) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=10,
)
mutations: st.SearchStrategy[Callable[[dict[str, Any]], None]] = st.one_of(
    st.builds(
        lambda key, value: lambda e: e.__setitem__(key, value), st.text(max_size=8), json_values
    ),
    st.builds(
        lambda key, value: lambda e: e["properties"].__setitem__(key, value),
        st.sampled_from(["delivery_tag", "delivery_info", "body_encoding"]),
        json_values,
    ),
    st.builds(
        lambda key, value: lambda e: e["headers"].__setitem__(key, value),
        st.sampled_from(["id", "task", "timelimit", "stamps", "stamped_headers", "shadow"]),
        json_values,
    ),
)


@given(changes=st.lists(mutations, max_size=3), item=json_values)
def test_the_checks_never_raise(changes: list[Callable[[dict[str, Any]], None]], item: Any) -> None:
    # Given any JSON value, or a valid envelope with arbitrary fields replaced
    value = envelope()
    for change in changes:
        change(value)
    # Then the checks answer (a reason or None) instead of raising
    for candidate in (item, value):
        problem = envelope_problem(candidate, CODECS)
        assert problem is None or isinstance(problem, str)
    assert body_problem(item) is None or isinstance(body_problem(item), str)
