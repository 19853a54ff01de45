"""Encryption for sensitive tasks: Fernet tokens, keys rotated with MultiFernet.

``LEDGER_ENCRYPTION_KEYS`` lists Fernet keys, newest first: new data is sealed with the first,
and any listed key opens old data, so a rotation is "prepend the new key, re-deploy, drop the
old key once old records have expired and old messages have been consumed".

Two uses: the ledger's fields at rest (:class:`Sealer`), and the task message itself (the
``ledger-sealed`` kombu serializer below), so a sensitive task's arguments are sealed by the
publisher before they leave its process and are opened only by a worker: the broker's lists,
its AOF, the delayed set and anything reading messages on the way hold ciphertext.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from kombu.serialization import register

from . import wire
from .errors import ConfigurationError, StoreError

PREFIX = "fernet:"
REDACTED = "[redacted: sensitive task]"


class Sealer:
    """Seals and opens text; text without the prefix passes through unchanged."""

    def __init__(self, keys: Sequence[str]) -> None:
        try:
            fernets = [Fernet(key) for key in keys]
        except ValueError as exc:
            raise ConfigurationError(f"LEDGER_ENCRYPTION_KEYS: not a Fernet key: {exc}") from exc
        self._fernet = MultiFernet(fernets) if fernets else None
        self._newest = fernets[0] if fernets else None

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

    def reseal(self, text: str) -> str | None:
        """``text`` sealed again with the newest key, or None if it needs no change (it is not
        sealed, or the newest key sealed it). The token keeps its timestamp, so its age reads
        the same after a key rotation.

        Raises:
            StoreError: no listed key opens it.
        """
        if not text.startswith(PREFIX):
            return None
        if self._fernet is None or self._newest is None:
            raise StoreError("a sealed value was found but LEDGER_ENCRYPTION_KEYS is empty")
        token = text[len(PREFIX) :].encode()
        try:
            self._newest.decrypt(token)
            return None
        except InvalidToken:
            pass
        try:
            return PREFIX + self._fernet.rotate(token).decode()
        except InvalidToken as exc:
            raise StoreError("a sealed value cannot be opened with LEDGER_ENCRYPTION_KEYS") from exc


class RedactSensitive(logging.Filter):
    """Redacts return values, arguments and exception text of sensitive tasks in Celery's own
    task log lines (``celery.app.trace``), which would otherwise print them.
    ``is_sensitive(name, task_id)`` is asked with the line's task name and id."""

    def __init__(self, is_sensitive: Callable[[Any, Any], bool]) -> None:
        super().__init__()
        self._is_sensitive = is_sensitive

    def filter(self, record: logging.LogRecord) -> bool:
        data = record.args
        if isinstance(data, dict) and (self._is_sensitive(data.get("name"), data.get("id"))):
            redacted = ("return_value", "args", "kwargs", "exc", "description")
            record.args = {**data, **{k: REDACTED for k in redacted if k in data}}
            shown = record.__dict__.get("data")  # (Celery's copy, for custom handlers)
            if isinstance(shown, dict):
                record.__dict__["data"] = {**shown, **{k: REDACTED for k in redacted if k in shown}}
            record.exc_info = None  # a traceback ends with the exception's message
            record.exc_text = None
        return True


# -- the sealed message codec -------------------------------------------------------------------
#
# A kombu serializer rather than our own wrapping of the arguments: Celery then carries the body
# opaque through every path it already has (retries, canvas callbacks, the pool's own decoding
# in the child process), and a worker without the key refuses the message through kombu's
# DecodeError, which the consumer keeps as a poison message with its reason (replayable once
# the key is configured).

SEALED_SERIALIZER = "ledger-sealed"
SEALED_CONTENT_TYPE = "application/x-celery-ledger-sealed"

# The sealer of the publish in progress: kombu's encoder takes no context, and one process may
# hold apps with different keys.
_publishing: ContextVar[Sealer | None] = ContextVar("celery_ledger_sealing", default=None)
# Every sealer of an app in this process: a worker opens what any of its apps' keys open.
_openers: list[Sealer] = []


class SealedMessageError(ValueError):
    """A sealed message body cannot be opened here (kombu reports it as a DecodeError)."""


class SealedKeyMissing(SealedMessageError):
    """A sealed body that no key of this process opens: sealed with a key it does not hold
    (another worker of the fleet may), or changed in flight."""


def register_sealed_codec(sealer: Sealer) -> None:
    """Make ``sealer`` usable for sealed message bodies in this process (idempotent)."""
    if sealer.enabled and all(opener is not sealer for opener in _openers):
        _openers.append(sealer)
    register(
        SEALED_SERIALIZER,
        _encode,
        _decode,
        content_type=SEALED_CONTENT_TYPE,
        content_encoding="utf-8",
    )


@contextlib.contextmanager
def sealing(sealer: Sealer) -> Iterator[None]:
    """Seal the bodies of the messages published inside this block with ``sealer``."""
    token = _publishing.set(sealer)
    try:
        yield
    finally:
        _publishing.reset(token)


def _encode(body: Any) -> str:
    sealer = _publishing.get()
    if sealer is None:
        raise ConfigurationError(
            f"the {SEALED_SERIALIZER} serializer seals only inside a ledger task's publish"
            " (publish sensitive tasks through the task, not with serializer= by hand)"
        )
    return sealer.seal(wire.dumps(body))


def _decode(text: str | bytes) -> Any:
    token = text.decode() if isinstance(text, bytes) else text
    if not Sealer.is_sealed(token):
        raise SealedMessageError(f"a message of type {SEALED_CONTENT_TYPE} is not sealed")
    if not _openers:
        raise SealedKeyMissing(
            "a sealed task message arrived but LEDGER_ENCRYPTION_KEYS is empty here"
        )
    for opener in _openers:
        try:
            return wire.loads(opener.open(token))
        except StoreError:
            continue
    raise SealedKeyMissing(
        "a sealed task message cannot be opened with LEDGER_ENCRYPTION_KEYS"
        " (sealed with a key that is not listed, or rotated out too early)"
    )
