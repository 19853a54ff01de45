"""Sealing stored values again with the newest encryption key (a key rotation's second half).

A rotation prepends a new key to ``LEDGER_ENCRYPTION_KEYS``: new values are sealed with it and
the old key still opens the rest. Before the old key can be dropped, every value it sealed must
be sealed again with the new one. Sealed values are ``fernet:`` strings anywhere in a stored
document, and inside a kept raw message (base64 of a task body, or of a queue item whose body is
base64 of the sealed text); this module finds them all and says what changed.

The functions take ``reseal``: a value sealed again with the newest key, or None if it needs no
change (``Sealer.reseal``); it raises StoreError for a value no listed key opens, which is
counted and left as it is (one unreadable record never stops the rotation of the others).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import StoreError

Reseal = Callable[[str], str | None]


@dataclass
class Tally:
    """What a pass over one place found: values sealed with an older key (sealed again, or on a
    survey, to be), values no listed key opens, and writes a writer beat (a field it changed
    under the pass, left for the next pass)."""

    stale: int = 0
    unopenable: int = 0
    changed_meanwhile: int = 0

    def add(self, other: Tally) -> None:
        self.stale += other.stale
        self.unopenable += other.unopenable
        self.changed_meanwhile += other.changed_meanwhile


def reseal_tree(value: Any, reseal: Reseal, tally: Tally) -> Any:
    """``value`` (a stored document or part of one) with its sealed values sealed again; the
    same object when nothing in it changed, so a caller can tell by identity."""
    if isinstance(value, str):
        return _resealed_text(value, reseal, tally)
    if isinstance(value, dict):
        changed = False
        out: dict[Any, Any] = {}
        for name, item in value.items():
            if name == "raw_base64" and isinstance(item, str):
                new = _resealed_raw(item, value.get("raw_kind"), reseal, tally)
            else:
                new = reseal_tree(item, reseal, tally)
            changed = changed or new is not item
            out[name] = new
        return out if changed else value
    if isinstance(value, list):
        items = [reseal_tree(item, reseal, tally) for item in value]
        changed = any(new is not old for new, old in zip(items, value, strict=True))
        return items if changed else value
    return value


def resealed_queue_item(item: Any, reseal: Reseal, tally: Tally) -> Any:
    """A queue item of kombu's Redis transport (a JSON object whose ``body`` is the message
    body, base64-encoded per its properties) with its sealed body, or the sealed values of its
    JSON body, sealed again; the same object when nothing in it changed."""
    if not isinstance(item, dict) or not isinstance(item.get("body"), str):
        return item
    properties = item.get("properties")
    encoded = isinstance(properties, dict) and properties.get("body_encoding") == "base64"
    try:
        body = base64.b64decode(item["body"], validate=True).decode() if encoded else item["body"]
    except (binascii.Error, UnicodeDecodeError):
        return item  # not a body this platform wrote; nothing sealed to find in it
    if item.get("content-type") == "application/json":  # a dead letter's copy holds records
        try:
            parsed = json.loads(body)
        except ValueError:
            return item
        resealed = reseal_tree(parsed, reseal, tally)
        new = body if resealed is parsed else json.dumps(resealed)
    else:
        new = _resealed_text(body, reseal, tally)
    if new is body:
        return item
    return {**item, "body": base64.b64encode(new.encode()).decode() if encoded else new}


def _resealed_text(text: str, reseal: Reseal, tally: Tally) -> str:
    try:
        new = reseal(text)
    except StoreError:
        tally.unopenable += 1
        return text
    if new is None:
        return text
    tally.stale += 1
    return new


def _resealed_raw(encoded: str, kind: Any, reseal: Reseal, tally: Tally) -> str:
    """A kept raw message (base64): a task body that is sealed text, or a queue item whose
    body is. An item is re-encoded as JSON: its bytes change, its content does not."""
    try:
        raw = base64.b64decode(encoded, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return encoded  # kept as received: not text, so not sealed by this platform
    if kind == "envelope":
        try:
            item = json.loads(raw)
        except ValueError:
            return encoded
        new_item = resealed_queue_item(item, reseal, tally)
        if new_item is item:
            return encoded
        return base64.b64encode(json.dumps(new_item).encode()).decode()
    new = _resealed_text(raw, reseal, tally)
    return encoded if new is raw else base64.b64encode(new.encode()).decode()


__all__ = ["Reseal", "Tally", "reseal_tree", "resealed_queue_item"]
