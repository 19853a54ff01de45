"""Sealing for sensitive tasks: rotation and failure modes."""

from __future__ import annotations

import logging

import pytest
from cryptography.fernet import Fernet

from celery_ledger.crypto import REDACTED, RedactSensitive, Sealer
from celery_ledger.errors import ConfigurationError, StoreError


def test_rotation_opens_data_sealed_with_an_older_key() -> None:
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    sealed_before = Sealer([old]).seal('{"card": "4111"}')
    rotated = Sealer([new, old])
    assert rotated.open(sealed_before) == '{"card": "4111"}'
    assert rotated.open(rotated.seal("x")) == "x"
    with pytest.raises(StoreError):
        Sealer([new]).open(sealed_before)  # the old key was dropped too early


def test_plain_text_passes_through_and_a_missing_key_is_a_configuration_error() -> None:
    assert Sealer([]).open('{"a": 1}') == '{"a": 1}'
    with pytest.raises(ConfigurationError, match="LEDGER_ENCRYPTION_KEYS"):
        Sealer([]).seal("x")
    with pytest.raises(ConfigurationError, match="not a Fernet key"):
        Sealer(["not-a-key"])


def test_celery_trace_lines_of_sensitive_tasks_are_redacted() -> None:
    record = logging.LogRecord(
        "celery.app.trace",
        logging.INFO,
        __file__,
        1,
        "Task %(name)s succeeded: %(return_value)s",
        None,
        None,
    )
    record.args = {"name": "secret.task", "return_value": "4111", "id": "1"}
    record.__dict__["data"] = record.args  # (Celery's copy of the same, for custom handlers)
    assert RedactSensitive(lambda name, _id: name == "secret.task").filter(record)
    assert record.getMessage() == f"Task secret.task succeeded: {REDACTED}"
    assert record.__dict__["data"] == {"name": "secret.task", "return_value": REDACTED, "id": "1"}


# -- the sealed message codec ---------------------------------------------------------------------


def test_a_sealed_body_round_trips_through_kombu_and_rotation_still_opens_it() -> None:
    from kombu.serialization import dumps, loads

    from celery_ledger.crypto import (
        SEALED_CONTENT_TYPE,
        SEALED_SERIALIZER,
        register_sealed_codec,
        sealing,
    )

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    before = Sealer([old])
    register_sealed_codec(before)
    body = ([7, "4111111111111111"], {"cvv": "123"}, {"callbacks": None})
    with sealing(before):
        content_type, encoding, data = dumps(body, serializer=SEALED_SERIALIZER)
    assert content_type == SEALED_CONTENT_TYPE
    assert "4111" not in str(data) and "cvv" not in str(data)
    register_sealed_codec(Sealer([new, old]))  # a rotated worker opens the old message
    opened = loads(data, content_type, encoding, accept={SEALED_CONTENT_TYPE})
    assert opened == [[7, "4111111111111111"], {"cvv": "123"}, {"callbacks": None}]


def test_a_sealed_body_no_key_opens_or_an_unsealed_one_is_a_decode_error() -> None:
    from kombu.exceptions import DecodeError
    from kombu.serialization import loads

    from celery_ledger.crypto import SEALED_CONTENT_TYPE, register_sealed_codec

    register_sealed_codec(Sealer([Fernet.generate_key().decode()]))
    stranger = Sealer([Fernet.generate_key().decode()]).seal("[[1], {}, {}]")
    with pytest.raises(DecodeError, match="cannot be opened with LEDGER_ENCRYPTION_KEYS"):
        loads(stranger, SEALED_CONTENT_TYPE, "utf-8", accept={SEALED_CONTENT_TYPE})
    # plain JSON claiming to be sealed is refused (a sealed task's body is never in clear)
    with pytest.raises(DecodeError, match="is not sealed"):
        loads("[[1], {}, {}]", SEALED_CONTENT_TYPE, "utf-8", accept={SEALED_CONTENT_TYPE})


def test_the_codec_seals_only_inside_a_ledger_publish() -> None:
    from kombu.exceptions import EncodeError
    from kombu.serialization import dumps

    from celery_ledger.crypto import SEALED_SERIALIZER, register_sealed_codec

    register_sealed_codec(Sealer([Fernet.generate_key().decode()]))
    with pytest.raises(EncodeError, match="only inside a ledger task's publish"):
        dumps(([1], {}, {}), serializer=SEALED_SERIALIZER)
