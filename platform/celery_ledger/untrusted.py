"""Values from messages, which may carry anything: read them soundly, store them safely.

A raw message can put any JSON in any header. The guard reads its headers through these
functions (a bad value reads as absent), and copies them into ledger records in a form any
BSON encoder accepts.
"""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime
from typing import Any

from celery.utils.time import maybe_iso8601

from .errors import PayloadError
from .identity import validate_key

logger = logging.getLogger("celery_ledger.guard")

INT64 = range(-(2**63), 2**63)  # what BSON stores as an integer
MAX_RETRIES_HEADER = 2**31  # a ``retries`` header at or past this is not a count


def request_header(request: Any, name: str) -> Any:
    """A custom header of the current message (Celery exposes them as request attributes)."""
    value = getattr(request, name, None)
    if value is None and isinstance(request.headers, dict):
        value = request.headers.get(name)
    return value


def request_property(request: Any, name: str) -> Any:
    """A property of the current message (``request.properties``), or None."""
    properties = getattr(request, "properties", None)
    return properties.get(name) if isinstance(properties, dict) else None


def redelivered(request: Any) -> bool:
    """Whether kombu marked the current message a restored copy (its worker died with it
    unacknowledged, or it was handed back): in its delivery info and, on Redis, its headers."""
    info = getattr(request, "delivery_info", None)
    marked = isinstance(info, dict) and info.get("redelivered") is True
    return marked or request_header(request, "redelivered") is True


def text_or_none(value: Any) -> str | None:
    """``value`` if it is a string, else None."""
    return value if isinstance(value, str) else None


def float_or_none(value: Any) -> float | None:
    """A finite number from a header, or None (raw messages may carry anything)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) and abs(number) < 1e12 else None


def retries_done(value: Any) -> int:
    """The retries a message has behind it, from its ``retries`` header (0 if not a count)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_RETRIES_HEADER:
        return value
    return 0


def expiry_of(value: Any) -> datetime | None:
    """When a message expires, from its ``expires`` header (ISO 8601; naive is UTC), or None."""
    try:
        expires = maybe_iso8601(value)
    except (AttributeError, TypeError, ValueError, OverflowError):
        return None
    if not isinstance(expires, datetime):
        return None
    return expires if expires.tzinfo else expires.replace(tzinfo=UTC)


def valid_key_or_none(value: Any, task_name: str) -> str | None:
    """A message's ledger key if it is a valid key (raw messages may carry anything)."""
    try:
        return validate_key(value, task_name=task_name) if value else None
    except PayloadError:
        logger.warning("ignoring an invalid ledger_key header on a %s message", task_name)
        return None


def storable(text: str) -> str:
    """Text any BSON encoder accepts: lone surrogates (from odd input) become escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def storable_value(value: Any) -> Any:
    """Decoded JSON (headers of raw messages) as any BSON encoder stores it.

    Integers past 64 bits become their text, and so does anything not JSON; strings lose lone
    surrogates; keys lose NUL and a leading ``$`` (escaped as ``\\x00`` and ``\\$``).
    """
    if value is None or isinstance(value, bool | float):
        return value
    if isinstance(value, int):
        return value if value in INT64 else str(value)
    if isinstance(value, list | tuple):
        return [storable_value(item) for item in value]
    if isinstance(value, dict):
        return {storable_key(name): storable_value(item) for name, item in value.items()}
    return storable(value if isinstance(value, str) else str(value))


def storable_key(name: Any) -> str:
    """A document key BSON and MongoDB accept, from any header name."""
    key = storable(str(name)).replace("\x00", "\\x00")
    return "\\" + key if key.startswith("$") else key


def utc_of_unix(value: Any) -> datetime | None:
    """A UTC datetime of a unix time from a header, or None (raw messages may carry anything)."""
    number = float_or_none(value)
    if number is None:
        return None
    try:
        return datetime.fromtimestamp(number, UTC)
    except (OverflowError, OSError, ValueError):
        return None
