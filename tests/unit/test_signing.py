"""Message authentication: what a signature binds, rotation, and every way a message fails."""

from __future__ import annotations

import copy
import hashlib
import hmac
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from kombu.utils import json as kombu_json

from celery_ledger import headers as ledger_headers
from celery_ledger.envelope import CELERY_HEADER_CHECKS, LEDGER_HEADER_CHECKS
from celery_ledger.errors import ConfigurationError
from celery_ledger.signing import (
    BOUND_HEADERS,
    HEADER,
    UNBOUND_HEADERS,
    V1_BOUND_HEADERS,
    Signer,
    key_id,
    signed_text,
)

OLD, NEW = "o" * 40, "n" * 40
# A message as Celery's as_task_v2 and the ledger's apply_async publish it.
HEADERS: dict[str, Any] = {
    "lang": "py",
    "task": "shop.charge",
    "id": "5b0c6c1e-0000-4000-8000-000000000001",
    "shadow": None,
    "eta": None,
    "expires": None,
    "group": None,
    "group_index": None,
    "retries": 0,
    "timelimit": [None, None],
    "root_id": "5b0c6c1e-0000-4000-8000-000000000001",
    "parent_id": None,
    "argsrepr": "(7, Decimal('10.50'))",
    "kwargsrepr": "{}",
    "origin": "gen1@host",
    "ignore_result": False,
    "replaced_task_nesting": 0,
    "stamped_headers": None,
    "stamps": {},
    "ledger_key": "order-7",
    "ledger_tier": "default",
    "ledger_enqueued_at": 1767225600.25,
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


# What a writer to the broker would change each bound header to, and what it would do.
TAMPERED: dict[str, Any] = {
    "task": "shop.refund",  # another task with these arguments
    "id": "5b0c6c1e-0000-4000-8000-000000000002",
    "ledger_key": "order-8",  # a new identity: the same call would run again
    "ledger_workflow": "wf-1",  # wake another workflow
    "eta": "2026-01-01T00:00:00+00:00",
    "expires": "2000-01-01T00:00:00+00:00",  # expired before it runs: dead
    "retries": 5,  # its retry budget spent
    "ledger_tier": "bulk",  # another tier's lease, retries and time limit
    "ledger_enqueued_at": 0.0,  # past its max age: retired dead
    "ledger_deferrals": 10_000,  # the longest backoff
    "ledger_previous_delay": 3600.0,  # a decorrelated backoff from an hour
    "ledger_workflow_tier": "bulk",
    "timelimit": [1, 1],  # killed by the time limit: retired dead
    "group": "another-group",  # counted in another chord
    "group_index": 3,
    "ignore_result": True,
    "replaced_task_nesting": 2**30,
    "stamped_headers": ["mark"],
    "stamps": {"mark": "revoked-stamp"},  # revoked by another job's stamp
    "headers": {"ledger_enqueued_at": 0.0},  # what a retry would copy, signed again
}


@pytest.mark.parametrize("name", BOUND_HEADERS)
def test_changing_any_bound_header_breaks_the_signature(name: str) -> None:
    """Every header that decides what happens to a job: changed, the message is refused (and
    dead-lettered under its own digest, never the job's: test_dead_letter_authentication)."""
    signer = Signer([NEW])
    received = as_received(signed(signer))
    received[name] = TAMPERED.get(name, {"changed": name})
    assert "bad message signature" in str(signer.problem(received, as_received(BODY)))


@pytest.mark.parametrize("name", [name for name in BOUND_HEADERS if name not in ("task", "id")])
def test_adding_a_bound_header_the_message_did_not_carry_breaks_the_signature(
    name: str,
) -> None:
    """A message of another producer (``send_task``) may leave ledger headers out: one added
    on the way (a key, an age, nested ``headers`` a retry would copy) is refused too."""
    signer = Signer([NEW])
    bare = {"task": HEADERS["task"], "id": HEADERS["id"]}
    received = as_received({**bare, HEADER: signer.sign(bare, BODY)})
    received[name] = TAMPERED.get(name, {"added": name})
    assert "bad message signature" in str(signer.problem(received, as_received(BODY)))


def test_every_header_is_bound_or_says_why_not() -> None:
    """A header Celery or the ledger reads is either covered by the signature or listed with
    the reason it may change unsigned: a new header has to take a side."""
    known = {
        *CELERY_HEADER_CHECKS,
        *LEDGER_HEADER_CHECKS,
        *(
            value
            for name, value in vars(ledger_headers).items()
            if name.isupper() and isinstance(value, str)
        ),
    } - set(ledger_headers.PROPERTIES)  # a property is not signed: it is only a write's hint
    assert not set(BOUND_HEADERS) & set(UNBOUND_HEADERS)
    assert known - set(BOUND_HEADERS) - set(UNBOUND_HEADERS) == set()
    assert set(V1_BOUND_HEADERS) <= set(BOUND_HEADERS)


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


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ledger_sent_at", 1767225601.0),  # stamped after the signature
        ("ledger_unrunnable_since", 1767225600.0),  # a put-off no worker here could run
        ("ledger_unrunnable_deferrals", 3),
        ("compression", "application/x-gzip"),  # added by kombu after the signature
        ("redelivered", True),  # kombu's restore of an unacknowledged message
        ("sentry-trace", "x"),  # tracing
    ],
)
def test_headers_not_bound_may_change(name: str, value: Any) -> None:
    """Headers our own path changes after the signature, and ones nothing decides by."""
    signer = Signer([NEW])
    received = {**as_received(signed(signer)), name: value}
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
        ("v3:abc:def", "malformed message signature"),
        ("v2::def", "malformed message signature"),
        ("v2:000000000000:" + "0" * 64, "not listed in LEDGER_SIGNING_KEYS"),
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


def _v1_signed(key: str) -> dict[str, Any]:
    """A message as an older release signed it (v1: identity, schedule, workflow, body)."""
    mac = hmac.new(key.encode(), signed_text(HEADERS, BODY, version="v1"), hashlib.sha256)
    return {**HEADERS, HEADER: f"v1:{key_id(key.encode())}:{mac.hexdigest()}"}


def test_a_new_signature_is_v2_and_an_older_releases_v1_is_accepted_only_in_a_rollout() -> None:
    assert Signer([NEW]).sign(HEADERS, BODY).startswith("v2:")
    from_older_release = as_received(_v1_signed(NEW))
    # accepted while unsigned messages are (an upgrade in progress)...
    assert Signer([NEW], required=False).problem(from_older_release, as_received(BODY)) is None
    # ...never once signatures are required: its age and tier are not bound
    refused = Signer([NEW]).problem(from_older_release, as_received(BODY))
    assert "older release (v1 signature" in str(refused)


def test_a_v1_signature_still_binds_what_it_bound() -> None:
    rollout = Signer([NEW], required=False)
    changed = {**as_received(_v1_signed(NEW)), "ledger_key": "order-8"}
    assert "bad message signature" in str(rollout.problem(changed, as_received(BODY)))


def test_a_v2_text_can_never_be_read_as_a_v1_text() -> None:
    """Relabelling a v2 signature as v1 (or back) never verifies: the texts differ."""
    signer = Signer([NEW], required=False)
    v2 = as_received(signed(signer))
    relabelled = {**v2, HEADER: "v1:" + v2[HEADER].split(":", 1)[1]}
    assert "bad message signature" in str(signer.problem(relabelled, as_received(BODY)))


def test_a_strict_check_requires_a_signature_even_in_a_rollout() -> None:
    rollout = Signer([NEW], required=False)
    assert "unsigned message" in str(rollout.problem(HEADERS, BODY, strict=True))
    assert "older release" in str(rollout.problem(as_received(_v1_signed(NEW)), BODY, strict=True))
    assert Signer([]).problem(HEADERS, BODY, strict=True) is None  # no keys: nothing to check
