"""Encryption at rest for sensitive tasks: Fernet tokens, keys rotated with MultiFernet.

``LEDGER_ENCRYPTION_KEYS`` lists Fernet keys, newest first: new data is sealed with the first,
and any listed key opens old data, so a rotation is "prepend the new key, re-deploy, drop the
old key once old records have expired".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from .errors import ConfigurationError, StoreError

PREFIX = "fernet:"
REDACTED = "[redacted: sensitive task]"


class Sealer:
    """Seals and opens text; text without the prefix passes through unchanged."""

    def __init__(self, keys: Sequence[str]) -> None:
        try:
            self._fernet = MultiFernet([Fernet(key) for key in keys]) if keys else None
        except ValueError as exc:
            raise ConfigurationError(f"LEDGER_ENCRYPTION_KEYS: not a Fernet key: {exc}") from exc

    @staticmethod
    def is_sealed(text: str) -> bool:
        return text.startswith(PREFIX)

    @property
    def enabled(self) -> bool:
        return self._fernet is not None

    def seal(self, text: str) -> str:
        if self._fernet is None:
            raise ConfigurationError(
                "a sensitive task needs LEDGER_ENCRYPTION_KEYS (a JSON list of keys from "
                "cryptography.fernet.Fernet.generate_key())"
            )
        return PREFIX + self._fernet.encrypt(text.encode()).decode()

    def open(self, text: str) -> str:
        if not text.startswith(PREFIX):
            return text
        if self._fernet is None:
            raise StoreError("a sealed value was found but LEDGER_ENCRYPTION_KEYS is empty")
        try:
            return self._fernet.decrypt(text[len(PREFIX) :].encode()).decode()
        except InvalidToken as exc:
            raise StoreError("a sealed value cannot be opened with LEDGER_ENCRYPTION_KEYS") from exc


class RedactSensitive(logging.Filter):
    """Redacts return values, arguments and exception text of sensitive tasks in Celery's own
    task log lines (``celery.app.trace``), which would otherwise print them."""

    def __init__(self, is_sensitive: Any) -> None:
        super().__init__()
        self._is_sensitive = is_sensitive

    def filter(self, record: logging.LogRecord) -> bool:
        data = record.args
        if isinstance(data, dict) and self._is_sensitive(data.get("name")):
            redacted = ("return_value", "args", "kwargs", "exc", "description")
            record.args = {**data, **{k: REDACTED for k in redacted if k in data}}
            record.exc_info = None  # a traceback ends with the exception's message
            record.exc_text = None
        return True
