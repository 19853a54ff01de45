"""celery_ledger.ledger.record (typed records) and the backend's exception payload."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from celery_ledger.backend import _exception_payload
from celery_ledger.ledger.record import SCHEMA_VERSION, ErrorEntry, LedgerRecord, State

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def error(n: int, type_: str = "builtins.ValueError", message: str = "bad") -> dict[str, Any]:
    return {
        "type": type_,
        "message": f"{message} {n}",
        "traceback_digest": f"d{n}",
        "at": T0 + timedelta(seconds=n),
        "worker": "w1@host",
        "attempt": n,
        "fence": 1000 + n,
    }


def raw_doc(**overrides: Any) -> dict[str, Any]:
    """A document shaped like the ones the store writes."""
    doc: dict[str, Any] = {
        "_id": "6b1a7c4e-0000-5000-8000-000000000001",
        "v": SCHEMA_VERSION,
        "task": "shop.charge",
        "key": "order-7",
        "tier": "critical",
        "state": "succeeded",
        "attempts": 3,
        "fence": 1_700_000_000_000_000_123,
        "lease_owner": None,
        "lease_expires_at": None,
        "claimable_at": datetime(9999, 12, 31, tzinfo=UTC),
        "result": json.dumps({"charged": 12.5, "items": [1, 2]}),
        "errors": [error(1), error(2, "myapp.errors.CardDeclined", "declined")],
        "duplicates": 4,
        "last_duplicate_at": T0,
        "created_at": T0,
        "updated_at": T0 + timedelta(minutes=2),
        "started_at": T0 + timedelta(minutes=1),
        "finished_at": T0 + timedelta(minutes=2),
        "expires_at": T0 + timedelta(days=7),
        "traceback": "",
    }
    doc.update(overrides)
    return doc


# -- LedgerRecord -----------------------------------------------------------------------------


def test_raw_document_gives_typed_fields() -> None:
    record = LedgerRecord.model_validate(raw_doc())

    assert record.id == "6b1a7c4e-0000-5000-8000-000000000001"
    assert record.schema_version == SCHEMA_VERSION
    assert (record.task, record.key, record.tier) == ("shop.charge", "order-7", "critical")
    assert record.state is State.SUCCEEDED
    assert record.attempts == 3
    assert record.fence == 1_700_000_000_000_000_123
    assert record.duplicates == 4
    assert record.created_at == T0
    assert record.finished_at == T0 + timedelta(minutes=2)
    assert record.expires_at == T0 + timedelta(days=7)
    assert all(isinstance(e, ErrorEntry) for e in record.errors)


def test_result_is_decoded_from_json() -> None:
    record = LedgerRecord.model_validate(raw_doc())

    assert record.result == {"charged": 12.5, "items": [1, 2]}
    assert record.result_json == '{"charged": 12.5, "items": [1, 2]}'


@pytest.mark.parametrize(
    ("stored", "decoded"), [("null", None), ("0", 0), ('"ok"', "ok"), ("[]", [])]
)
def test_result_of_any_json_value(stored: str, decoded: Any) -> None:
    assert LedgerRecord.model_validate(raw_doc(result=stored)).result == decoded


def test_no_result_yet_is_none() -> None:
    doc = raw_doc(state="running")
    del doc["result"]

    assert LedgerRecord.model_validate(doc).result is None


def test_last_error_is_the_newest_entry() -> None:
    last = LedgerRecord.model_validate(raw_doc()).last_error

    assert last is not None
    assert last.type == "myapp.errors.CardDeclined"
    assert last.message == "declined 2"
    assert last.traceback_digest == "d2"
    assert last.at == T0 + timedelta(seconds=2)
    assert (last.worker, last.attempt, last.fence) == ("w1@host", 2, 1002)


def test_no_errors_means_no_last_error() -> None:
    assert LedgerRecord.model_validate(raw_doc(errors=[])).last_error is None
    doc = raw_doc()
    del doc["errors"]
    assert LedgerRecord.model_validate(doc).last_error is None


def test_unknown_keys_are_ignored() -> None:
    doc = raw_doc(celery_state="SUCCESS", next_attempt_at=T0, dead_reason="x", future_field=[1])
    doc["errors"][0]["host_pid"] = 42

    record = LedgerRecord.model_validate(doc)

    assert not hasattr(record, "future_field")
    assert record.errors[0].message == "bad 1"


def test_queued_record_written_at_publish_uses_defaults() -> None:
    record = LedgerRecord.model_validate(
        {
            "_id": "id-1",
            "v": 1,
            "task": "t",
            "key": "k",
            "tier": "default",
            "state": "queued",
            "attempts": 0,
            "fence": 0,
            "created_at": T0,
            "updated_at": T0,
        }
    )

    assert record.state is State.QUEUED
    assert record.errors == []
    assert record.duplicates == 0
    assert record.result is None
    assert record.finished_at is None


def test_populate_by_field_name() -> None:
    record = LedgerRecord(id="id-1", task="t", key="k", state=State.DEAD, result_json="1")

    assert record.id == "id-1"
    assert record.result == 1
    assert record.schema_version == SCHEMA_VERSION


@pytest.mark.parametrize("field", ["_id", "task", "key", "state"])
def test_required_fields(field: str) -> None:
    doc = raw_doc()
    del doc[field]

    with pytest.raises(ValidationError, match=field.lstrip("_")):
        LedgerRecord.model_validate(doc)


def test_unknown_state_is_refused() -> None:
    with pytest.raises(ValidationError):
        LedgerRecord.model_validate(raw_doc(state="exploded"))


def test_terminal_states() -> None:
    assert {s.value for s in State} == {"queued", "running", "retrying", "succeeded", "dead"}
    assert State("dead") is State.DEAD


# -- the backend's exception payload ----------------------------------------------------------


def test_exception_payload_of_the_last_error() -> None:
    payload = _exception_payload(raw_doc(state="dead"))

    assert payload == {
        "exc_type": "CardDeclined",
        "exc_message": ["declined 2"],
        "exc_module": "myapp.errors",
    }


def test_exception_payload_of_a_builtin_type() -> None:
    payload = _exception_payload(raw_doc(errors=[error(1, "builtins.KeyError", "k")]))

    assert payload == {"exc_type": "KeyError", "exc_message": ["k 1"], "exc_module": "builtins"}


def test_exception_payload_of_an_undotted_type_is_a_builtin() -> None:
    payload = _exception_payload({"errors": [{"type": "RuntimeError", "message": "m"}]})

    assert payload == {"exc_type": "RuntimeError", "exc_message": ["m"], "exc_module": "builtins"}


def test_exception_payload_without_a_message() -> None:
    payload = _exception_payload({"errors": [{"type": "a.b.C"}]})

    assert payload == {"exc_type": "C", "exc_message": [""], "exc_module": "a.b"}


@pytest.mark.parametrize("errors", [None, []], ids=["missing", "empty"])
def test_exception_payload_without_errors_uses_the_dead_reason(errors: Any) -> None:
    doc: dict[str, Any] = {"state": "dead", "dead_reason": "poison message"}
    if errors is not None:
        doc["errors"] = errors

    assert _exception_payload(doc) == {
        "exc_type": "TaskError",
        "exc_message": ["poison message"],
        "exc_module": "celery_ledger.errors",
    }


def test_exception_payload_without_errors_or_reason() -> None:
    assert _exception_payload({"state": "dead"}) == {
        "exc_type": "TaskError",
        "exc_message": ["failed"],
        "exc_module": "celery_ledger.errors",
    }
