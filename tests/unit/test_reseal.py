"""Sealing stored values again with the newest key: what changes, what is left, what is counted."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from cryptography.fernet import Fernet

from celery_ledger.crypto import PREFIX, Sealer
from celery_ledger.errors import StoreError
from celery_ledger.reseal import Tally, reseal_tree, resealed_queue_item

OLD, NEW, GONE = (Fernet.generate_key().decode() for _ in range(3))
before = Sealer([OLD])  # what sealed the stored values
rotated = Sealer([NEW, OLD])  # after the rotation's first step
only_new = Sealer([NEW])  # after the old key is dropped


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def queue_item(
    body: str, content_type: str = "application/x-celery-ledger-sealed"
) -> dict[str, Any]:
    return {
        "body": b64(body),
        "content-type": content_type,
        "headers": {"task": "pay"},
        "properties": {"body_encoding": "base64", "delivery_tag": "t-1"},
    }


def test_a_value_sealed_with_an_older_key_is_sealed_again_and_keeps_its_timestamp() -> None:
    sealed = before.seal("4111-1111")
    again = rotated.reseal(sealed)

    assert again is not None and again != sealed
    assert only_new.open(again) == "4111-1111"
    token = lambda text: text[len(PREFIX) :].encode()  # noqa: E731
    assert Fernet(NEW).extract_timestamp(token(again)) == Fernet(OLD).extract_timestamp(
        token(sealed)
    )


def test_plain_text_and_values_of_the_newest_key_need_no_change() -> None:
    assert rotated.reseal("plain") is None
    assert rotated.reseal(rotated.seal("x")) is None


def test_a_value_no_listed_key_opens_is_refused_clearly() -> None:
    with pytest.raises(StoreError, match="cannot be opened"):
        rotated.reseal(Sealer([GONE]).seal("x"))


def test_a_document_has_every_sealed_value_resealed_at_any_depth_and_the_rest_untouched() -> None:
    doc = {
        "state": "succeeded",
        "result": before.seal('{"ok": 1}'),
        "message": {"args_json": before.seal("[1]"), "kwargs_json": before.seal("{}")},
        "steps": {"charge": {"result": before.seal('"r-1"'), "atomic": True}},
        "errors": [{"type": "X", "message": before.seal("boom")}, {"type": "Y"}],
        "attempts": 2,
    }
    tally = Tally()

    new = reseal_tree(doc, rotated.reseal, tally)

    assert tally == Tally(stale=5)
    assert (
        new["state"] == "succeeded" and new["attempts"] == 2 and new["errors"][1] == {"type": "Y"}
    )
    assert only_new.open(new["steps"]["charge"]["result"]) == '"r-1"'
    assert only_new.open(new["errors"][0]["message"]) == "boom"
    assert doc["result"] != new["result"]  # the document read is not changed in place


def test_an_unchanged_part_is_the_same_object_so_only_changed_fields_are_written() -> None:
    doc = {"a": {"b": [rotated.seal("x"), "y"]}, "c": before.seal("z")}
    new = reseal_tree(doc, rotated.reseal, Tally())
    assert new["a"] is doc["a"] and new["c"] is not doc["c"]
    assert reseal_tree(doc["a"], rotated.reseal, Tally()) is doc["a"]


def test_values_no_key_opens_are_counted_and_left_as_they_are() -> None:
    lost = Sealer([GONE]).seal("x")
    doc = {"result": lost, "checkpoint": before.seal("{}")}
    tally = Tally()

    new = reseal_tree(doc, rotated.reseal, tally)

    assert tally == Tally(stale=1, unopenable=1)
    assert new["result"] == lost


def test_a_kept_raw_body_and_a_kept_queue_item_are_resealed_inside_their_base64() -> None:
    body = before.seal('[["4111"], {}, {}]')
    item = json.dumps(queue_item(body))
    doc = {
        "poison_body": {"raw_base64": b64(body), "raw_kind": "body"},
        "poison_item": {"raw_base64": b64(item), "raw_kind": "envelope"},
        "unreadable": {"raw_base64": b64("\x00not text or json"), "raw_kind": "entry"},
    }
    tally = Tally()

    new = reseal_tree(doc, rotated.reseal, tally)

    assert tally == Tally(stale=2)
    opened_body = base64.b64decode(new["poison_body"]["raw_base64"]).decode()
    assert only_new.open(opened_body) == '[["4111"], {}, {}]'
    kept_item = json.loads(base64.b64decode(new["poison_item"]["raw_base64"]))
    assert kept_item["headers"] == {"task": "pay"}
    assert only_new.open(base64.b64decode(kept_item["body"]).decode()) == '[["4111"], {}, {}]'
    assert new["unreadable"] is doc["unreadable"]


def test_a_queue_item_with_a_sealed_body_is_resealed_and_others_are_left_alone() -> None:
    tally = Tally()
    sealed = queue_item(before.seal("[[1], {}, {}]"))
    new = resealed_queue_item(sealed, rotated.reseal, tally)
    assert tally == Tally(stale=1)
    assert only_new.open(base64.b64decode(new["body"]).decode()) == "[[1], {}, {}]"
    assert new["properties"] == sealed["properties"] and new["headers"] == sealed["headers"]

    plain = queue_item("[[1], {}, {}]", content_type="application/json")
    assert resealed_queue_item(plain, rotated.reseal, tally) is plain
    for odd in ({"body": "%%%", "properties": {"body_encoding": "base64"}}, ["x"], {"body": 3}):
        assert resealed_queue_item(odd, rotated.reseal, tally) is odd
    assert tally == Tally(stale=1)


def test_a_dead_letter_copy_has_the_sealed_values_of_its_json_body_resealed() -> None:
    letter = {"record": "r-1", "message": {"args_json": before.seal("[1]")}}
    copy = queue_item(json.dumps(letter), content_type="application/json")
    tally = Tally()

    new = resealed_queue_item(copy, rotated.reseal, tally)

    assert tally == Tally(stale=1)
    body = json.loads(base64.b64decode(new["body"]))
    assert body["record"] == "r-1" and only_new.open(body["message"]["args_json"]) == "[1]"
