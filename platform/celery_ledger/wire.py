"""The wire's JSON: kombu's type-tagged JSON, the encoding of Celery's messages (a datetime, a
date, a UUID, a Decimal or bytes travels as ``{"__type__": ..., "__value__": ...}`` and comes
back as itself).

One owner: every module that encodes or decodes what travels in a message or is kept as one
(signatures, sealed bodies, kept arguments, the delayed set, parked messages, dead letters)
goes through here, so the platform's bytes are always the ones Celery's producers and consumers
write and read. It is the one import of kombu below the adapters that is not Celery's own
machinery (see the import contracts in ``pyproject.toml``)."""

from __future__ import annotations

from typing import Any

from kombu.utils import json as kombu_json
from kombu.utils.json import loads

# kombu's ``dumps`` makes a new encoder for every call (``json.dumps(cls=...)``); a task's
# delivery encodes three values, its publish two more. One encoder made with the same options
# gives the same text (it keeps no state between calls, and reads kombu's registered types on
# each one).
_ENCODER = kombu_json.JSONEncoder()


def dumps(value: Any, **options: Any) -> str:
    """kombu's ``dumps`` of ``value`` (with ``options``: its ``json.dumps`` keyword arguments)."""
    if options:
        return str(kombu_json.dumps(value, **options))
    return _ENCODER.encode(value)


__all__ = ["dumps", "loads"]
