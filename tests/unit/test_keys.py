"""celery_ledger.identity: canonical JSON, default keys, derived task ids and key specs."""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from celery_ledger.errors import ConfigurationError, PayloadError
from celery_ledger.identity import (
    canonical_json,
    compute_key,
    default_key,
    derive_task_id,
    identity_of,
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=6)
task_names = st.text(min_size=1, max_size=40)


def reversed_keys(value: Any) -> Any:
    """The same value with every dict's insertion order reversed, recursively."""
    if isinstance(value, dict):
        return {k: reversed_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reversed_keys(item) for item in value]
    return value


def charge(order_id: int, region: str = "eu") -> None:
    """Stand-in task body for key templates."""


# -- canonical_json ---------------------------------------------------------------------------


@given(json_values)
def test_canonical_json_ignores_dict_key_order(value: Any) -> None:
    assert canonical_json(reversed_keys(value)) == canonical_json(value)


@given(json_values)
def test_canonical_json_is_compact_json_of_the_same_value(value: Any) -> None:
    text = canonical_json(value)

    assert json.loads(text) == value
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


def test_canonical_json_of_equal_dicts_built_in_different_orders_is_equal() -> None:
    assert canonical_json({"b": 1, "a": [{"y": 2, "x": 1}]}) == '{"a":[{"x":1,"y":2}],"b":1}'
    assert canonical_json({"a": [{"x": 1, "y": 2}], "b": 1}) == '{"a":[{"x":1,"y":2}],"b":1}'


@pytest.mark.parametrize(
    "value",
    [object(), {1, 2}, math.nan, math.inf, -math.inf, {"nested": [b"bytes"]}, {"k": {1}}],
    ids=["object", "set", "nan", "inf", "-inf", "bytes", "nested-set"],
)
def test_canonical_json_refuses_values_json_cannot_represent(value: Any) -> None:
    with pytest.raises(PayloadError, match="not JSON-serialisable"):
        canonical_json(value)


# -- default_key ------------------------------------------------------------------------------


@given(task_names, st.lists(json_values, max_size=4), json_objects)
def test_default_key_is_stable_and_independent_of_kwargs_order(
    name: str, args: list[Any], kwargs: dict[str, Any]
) -> None:
    key = default_key(name, args, kwargs)

    assert re.fullmatch(r"h:[0-9a-f]{32}", key)
    assert default_key(name, tuple(args), reversed_keys(kwargs)) == key


@given(task_names, st.lists(json_values, max_size=3), st.lists(json_values, max_size=3))
def test_default_key_differs_when_args_differ(
    name: str, args1: list[Any], args2: list[Any]
) -> None:
    assume(canonical_json(args1) != canonical_json(args2))

    assert default_key(name, args1, {}) != default_key(name, args2, {})


@given(task_names, task_names, st.lists(json_values, max_size=3))
def test_default_key_differs_when_task_name_differs(
    name1: str, name2: str, args: list[Any]
) -> None:
    assume(name1 != name2)

    assert default_key(name1, args, {}) != default_key(name2, args, {})


def test_default_key_tells_args_from_kwargs() -> None:
    assert default_key("t", [1], {}) != default_key("t", [], {"x": 1})
    assert default_key("t", [1], {"x": 2}) != default_key("t", [1], {"x": 3})


def test_default_key_refuses_non_json_arguments() -> None:
    with pytest.raises(PayloadError):
        default_key("t", [object()], {})


# -- derive_task_id ---------------------------------------------------------------------------


@given(task_names, st.text(min_size=1, max_size=60))
def test_derive_task_id_is_a_deterministic_uuid(name: str, key: str) -> None:
    task_id = derive_task_id(name, key)

    assert str(uuid.UUID(task_id)) == task_id
    assert uuid.UUID(task_id).version == 5
    assert derive_task_id(name, key) == task_id


@given(st.text(max_size=30), st.text(max_size=60))
def test_derive_task_id_is_uuid5_of_the_json_pair(name: str, key: str) -> None:
    # Ids must never change: the id computed without a UUID object is uuid5's, exactly.
    expected = uuid.uuid5(
        uuid.UUID("6f1c3a52-5d0e-4c4e-9b59-3f0a6c1d2e77"), json.dumps([name, key])
    )

    assert derive_task_id(name, key) == str(expected)


def test_derive_task_id_of_a_known_job_is_unchanged() -> None:
    assert derive_task_id("shop.charge", "order-1") == "bc3f463e-1f25-54e6-924a-ffa2d9a6461d"


@given(st.text(max_size=30), st.text(max_size=30), st.text(max_size=30), st.text(max_size=30))
def test_derive_task_id_differs_for_distinct_jobs(
    name1: str, key1: str, name2: str, key2: str
) -> None:
    assume((name1, key1) != (name2, key2))

    assert derive_task_id(name1, key1) != derive_task_id(name2, key2)


@pytest.mark.parametrize(
    ("job1", "job2"),
    [
        (("a", "b\x00c"), ("a\x00b", "c")),  # would collide if joined with a NUL
        (("ab", "c"), ("a", "bc")),
        (("a", 'b","c'), ('a","b', "c")),  # would collide if the JSON were not escaped
        (("a", ""), ("", "a")),
    ],
)
def test_derive_task_id_separates_name_from_key(
    job1: tuple[str, str], job2: tuple[str, str]
) -> None:
    assert derive_task_id(*job1) != derive_task_id(*job2)


# -- compute_key ------------------------------------------------------------------------------


def key_of(spec: Any, *args: Any, **kwargs: Any) -> str:
    return compute_key(spec, task_name="shop.charge", run=charge, args=args, kwargs=kwargs)


def test_no_spec_gives_the_default_key() -> None:
    assert key_of(None, 7, region="us") == default_key("shop.charge", (7,), {"region": "us"})


def test_callable_spec_is_called_with_the_task_arguments() -> None:
    def spec(order_id: int, region: str = "eu") -> str:
        return f"{region}/{order_id}"

    assert key_of(spec, 7) == "eu/7"
    assert key_of(spec, 7, region="us") == "us/7"
    assert key_of(spec, order_id=8) == "eu/8"


def test_template_spec_formats_arguments_by_name_with_defaults_applied() -> None:
    template = "order-{order_id}-{region}"

    assert key_of(template, 7) == "order-7-eu"
    assert key_of(template, 7, "us") == "order-7-us"
    assert key_of(template, order_id=7, region="us") == "order-7-us"


@pytest.mark.parametrize("template", ["order-{customer}", "order-{0}"])
def test_template_naming_an_unknown_argument_is_a_configuration_error(template: str) -> None:
    with pytest.raises(ConfigurationError, match=r"shop\.charge") as info:
        key_of(template, 7)
    assert "unknown argument" in str(info.value)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((), {}), ((1, "us", "extra"), {}), ((1,), {"colour": "red"}), ((1,), {"order_id": 2})],
    ids=["missing", "too-many", "unexpected-kwarg", "duplicate"],
)
def test_template_with_arguments_not_matching_the_signature_is_a_payload_error(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    with pytest.raises(PayloadError, match="arguments do not match charge"):
        key_of("order-{order_id}", *args, **kwargs)


@pytest.mark.parametrize(
    "returned", [7, None, b"order-7", ""], ids=["int", "none", "bytes", "empty"]
)
def test_callable_returning_a_non_str_or_empty_key_is_a_payload_error(returned: Any) -> None:
    with pytest.raises(PayloadError, match="non-empty str"):
        key_of(lambda *a, **k: returned, 7)


def test_key_of_512_characters_is_accepted_and_513_refused() -> None:
    assert key_of(lambda order_id: "k" * 512, 7) == "k" * 512
    with pytest.raises(PayloadError, match="longer than 512"):
        key_of(lambda order_id: "k" * 513, 7)
    with pytest.raises(PayloadError, match="longer than 512"):
        key_of("{region}", 7, "r" * 513)


def test_key_that_is_not_valid_utf8_is_refused() -> None:
    with pytest.raises(PayloadError, match="not valid UTF-8"):
        key_of(lambda order_id: "order-\ud800", 7)


@pytest.mark.parametrize("spec", [42, ["order-{order_id}"], b"order-{order_id}"])
def test_spec_of_the_wrong_type_is_a_configuration_error(spec: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"must be a callable or a str\.format template"):
        key_of(spec, 7)


@pytest.mark.parametrize("error", [KeyError("id"), ValueError("bad"), AttributeError("x"), None])
def test_a_message_whose_key_function_fails_is_keyed_by_its_id(
    error: BaseException | None,
) -> None:
    # A message from another producer, without a key header, whose arguments the app's key
    # function does not expect: keyed by its own id, never an exception in the worker
    def key_of_arguments() -> str:
        if error is not None:
            raise error
        return "order-7"

    identity = identity_of("shop.charge", "m-1", key_header=None, key_of_arguments=key_of_arguments)
    expected = "order-7" if error is None else "id:m-1"
    assert identity.key == expected
    assert identity.record_id == derive_task_id("shop.charge", expected)
