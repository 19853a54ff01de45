"""The wire's JSON: kombu's type-tagged JSON, the encoding of Celery's messages (a datetime, a
date, a UUID, a Decimal or bytes travels as ``{"__type__": ..., "__value__": ...}`` and comes
back as itself).

One owner: every module that encodes or decodes what travels in a message or is kept as one
(signatures, sealed bodies, kept arguments, the delayed set, parked messages, dead letters)
goes through here, so the platform's bytes are always the ones Celery's producers and consumers
write and read. It is the one import of kombu below the adapters that is not Celery's own
machinery (see the import contracts in ``pyproject.toml``)."""

from __future__ import annotations

from kombu.utils.json import dumps, loads

__all__ = ["dumps", "loads"]
