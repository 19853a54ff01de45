"""Message authentication: what a signature binds, rotation, and every way a message fails."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from kombu.utils import json as kombu_json

from celery_ledger.errors import ConfigurationError
from celery_ledger.signing import HEADER, Signer

OLD, NEW = "o" * 40, "n" * 40
HEADERS: dict[str, Any] = {
    "task": "shop.charge",
    "id": "5b0c6c1e-0000-4000-8000-000000000001",
    "ledger_key": "order-7",
    "ledger_tier": "default",
    "ledger_workflow": None,
    "eta": None,
    "expires": None,
    "retries": 0,
}
BODY = (
    (7, Decimal("10.50"), datetime(2026, 1, 1, tzinfo=UTC)),
    {"currency": "EUR", "lines": {1: "a"}},
    {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
)


def signed(signer: Signer) -> dict[str, Any]:
    return {**HEADERS, HEADER: signer.sign(HEADERS, BODY)}


def as_received(value: Any) -> Any:
    """What the worker decodes: the value after kombu's JSON on the wire."""
    return kombu_json.loads(kombu_json.dumps(value))


def test_a_signed_message_verifies_as_the_worker_decodes_it() -> None:
    signer = Signer([NEW])
    assert signer.problem(as_received(signed(signer)), as_received(BODY)) is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("task", "shop.refund"),
        ("id", "5b0c6c1e-0000-4000-8000-000000000002"),
        ("ledger_key", "order-8"),  # a new identity: the same call would run again
        ("ledger_workflow", "wf-1"),
        ("eta", "2026-01-01T00:00:00+00:00"),
        ("expires", "2030-01-01T00:00:00+00:00"),
        ("retries", 5),
    ],
)
def test_changing_a_bound_header_breaks_the_signature(name: str, value: Any) -> None:
    signer = Signer([NEW])
    received = as_received(signed(signer))
    received[name] = value
    assert "bad message signature" in str(signer.problem(received, as_received(BODY)))


@pytest.mark.parametrize("part", ["args", "kwargs", "callbacks"])
def test_changing_the_body_breaks_the_signature(part: str) -> None:
    signer = Signer([NEW])
    body = copy.deepcopy(as_received(BODY))
    if part == "args":
        body[0][0] = 8
    elif part == "kwargs":
        body[1]["currency"] = "USD"
    else:
        body[2]["callbacks"] = [{"task": "shop.payout", "args": [], "kwargs": {}}]
    assert "bad message signature" in str(signer.problem(as_received(signed(signer)), body))


def test_headers_not_bound_may_change() -> None:
    """The tier, the ledger's bookkeeping and tracing headers change on the way legitimately."""
    signer = Signer([NEW])
    received = {**as_received(signed(signer)), "ledger_tier": "bulk", "sentry-trace": "x"}
    assert signer.problem(received, as_received(BODY)) is None


def test_rotation_verifies_either_listed_key_and_refuses_a_dropped_one() -> None:
    before, during, after = Signer([OLD]), Signer([NEW, OLD]), Signer([NEW])
    from_before = as_received(signed(before))
    assert during.problem(from_before, as_received(BODY)) is None
    assert "not listed in LEDGER_SIGNING_KEYS" in str(after.problem(from_before, BODY))
    assert after.problem(as_received(signed(during)), as_received(BODY)) is None


@pytest.mark.parametrize(
    ("signature", "reason"),
    [
        (None, "unsigned message"),
        ("", "malformed message signature"),
        ("v2:abc:def", "malformed message signature"),
        ("v1::def", "malformed message signature"),
        ("v1:000000000000:" + "0" * 64, "not listed in LEDGER_SIGNING_KEYS"),
    ],
)
def test_unsigned_or_malformed_signatures_are_refused(signature: Any, reason: str) -> None:
    message_headers = dict(HEADERS)
    if signature is not None:
        message_headers[HEADER] = signature
    assert reason in str(Signer([NEW]).problem(message_headers, BODY))


def test_a_rollout_accepts_unsigned_messages_but_never_a_bad_signature() -> None:
    rollout = Signer([NEW], required=False)
    assert rollout.problem(HEADERS, BODY) is None
    forged = {**HEADERS, HEADER: Signer([OLD]).sign(HEADERS, BODY)}
    assert rollout.problem(forged, BODY) is not None


def test_without_keys_nothing_is_signed_or_checked() -> None:
    off = Signer([])
    assert not off.enabled and off.problem(HEADERS, BODY) is None
    with pytest.raises(ConfigurationError):
        off.sign(HEADERS, BODY)
    with pytest.raises(ConfigurationError, match="same key twice"):
        Signer([NEW, NEW])


@pytest.mark.parametrize("key", ["short", "change-me-ledger-signing-key-0000000000"])
def test_a_weak_or_placeholder_signing_key_is_refused_without_echoing_it(key: str) -> None:
    from pydantic import ValidationError

    from celery_ledger import Settings

    with pytest.raises(ValidationError, match="signing_keys") as refused:
        Settings(signing_keys=[key])
    assert key not in str(refused.value)
