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
    assert RedactSensitive(lambda name: name == "secret.task").filter(record)
    assert record.getMessage() == f"Task secret.task succeeded: {REDACTED}"
