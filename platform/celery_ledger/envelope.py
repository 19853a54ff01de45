"""The shape a queue item must have before kombu and Celery may touch it.

kombu and Celery trust the envelope they pop: a field of the wrong type raises out of the
worker's event loop ("Unrecoverable error", the worker exits) or out of a pool callback (the
message is dropped). These pure checks say what is wrong, as a reason for the dead letter, or
None; the transport (:mod:`celery_ledger.transport`) applies :func:`envelope_problem` to each
item it pops, and the consumer (:class:`celery_ledger.worker.LedgerConsumer`) applies
:func:`body_problem` to each decoded task body.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

# The embedded signatures of a protocol 2 body (celery/app/amqp.py as_task_v2).
_SIGNATURE_LISTS = ("callbacks", "errbacks", "chain")


class BodyCodec(Protocol):
    """A kombu body codec (``kombu.transport.virtual.base.Base64``)."""

    def decode(self, s: str) -> bytes: ...


def envelope_problem(envelope: object, codecs: Mapping[str, BodyCodec]) -> str | None:
    """Why a decoded queue item cannot be delivered as a message, or None.

    Checks what kombu's virtual transport and Redis QoS read (``properties``, its
    ``delivery_tag``, ``delivery_info`` and ``body_encoding``, the body itself) and, for a
    Celery task message, the headers Celery reads before any error handler of its own.
    """
    if not isinstance(envelope, dict):
        return f"envelope is {_kind(envelope)}, not an object"
    body = envelope.get("body")
    if not isinstance(body, str):
        return f"body is {_kind(body)}, not a string"
    for name in ("content-type", "content-encoding"):
        if envelope.get(name) is not None and not isinstance(envelope[name], str):
            return f"{name} is {_kind(envelope[name])}, not a string"
    properties = envelope.get("properties")
    if not isinstance(properties, dict):
        return f"properties is {_kind(properties)}, not an object"
    if not isinstance(properties.get("delivery_tag"), str):
        return "properties.delivery_tag is missing or not a string"
    delivery_info = properties.get("delivery_info")
    if not isinstance(delivery_info, dict) or not all(
        name in delivery_info and isinstance(delivery_info[name], str | None)
        for name in ("exchange", "routing_key")
    ):
        return "properties.delivery_info needs 'exchange' and 'routing_key' (strings)"
    problem = _body_encoding_problem(body, properties.get("body_encoding"), codecs)
    if problem is not None:
        return problem
    headers = envelope.get("headers")
    if headers is None:
        return None
    if not isinstance(headers, dict):
        return f"headers is {_kind(headers)}, not an object"
    if "task" not in headers:
        return None  # not a protocol 2 task message: Celery's own checks apply
    if body == "":
        return "task message with an empty body"
    return task_headers_problem(headers)


def task_headers_problem(headers: Mapping[str, Any]) -> str | None:
    """Why the headers of a Celery protocol 2 task message are unusable, or None."""
    task, ident = headers.get("task"), headers.get("id")
    if not isinstance(task, str):
        return f"header 'task' is {_kind(task)}, not a string"
    if not isinstance(ident, str) or not ident or not _utf8(ident):
        return "header 'id' is missing, empty or not a UTF-8 string"
    shadow = headers.get("shadow")  # the request's name: a key of Celery's worker state
    if shadow is not None and not isinstance(shadow, str):
        return f"header 'shadow' is {_kind(shadow)}, not a string"
    timelimit = headers.get("timelimit")
    if timelimit is not None and not (
        isinstance(timelimit, list | tuple)
        and len(timelimit) == 2
        and all(limit is None or _seconds(limit) for limit in timelimit)
    ):
        return "header 'timelimit' is not [hard, soft] seconds (non-negative numbers or null)"
    stamped, stamps = headers.get("stamped_headers"), headers.get("stamps")
    if stamped is not None and not (
        isinstance(stamped, list) and all(isinstance(name, str) for name in stamped)
    ):
        return "header 'stamped_headers' is not a list of strings"
    if stamps is not None and not isinstance(stamps, dict):
        return f"header 'stamps' is {_kind(stamps)}, not an object"
    if stamped and not set(stamped) <= set(stamps or ()):  # a retry re-sends each stamp
        return "header 'stamped_headers' names stamps missing from header 'stamps'"
    return None


def body_problem(body: object) -> str | None:
    """Why a decoded protocol 2 body is not ``[args, kwargs, embed]``, or None."""
    if not isinstance(body, list | tuple) or len(body) != 3:
        return "body is not an [args, kwargs, embed] triple"
    args, kwargs, embed = body
    if not isinstance(args, list | tuple):
        return f"args is {_kind(args)}, not a list"
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        return f"kwargs is {_kind(kwargs)}, not an object"
    if not isinstance(embed, dict):
        return f"embed is {_kind(embed)}, not an object"
    for name in _SIGNATURE_LISTS:
        value = embed.get(name)
        if value is not None and not (
            isinstance(value, list) and all(isinstance(item, dict) for item in value)
        ):
            return f"embed {name!r} is not a list of signatures"
    chord = embed.get("chord")
    if chord is not None and not isinstance(chord, dict):
        return "embed 'chord' is not a signature"
    return None


def _body_encoding_problem(
    body: str, encoding: object, codecs: Mapping[str, BodyCodec]
) -> str | None:
    """kombu decodes the body with ``codecs[encoding]`` (no codec for None or utf-8)."""
    if encoding is None or not body:
        return None
    if not isinstance(encoding, str):
        return f"properties.body_encoding is {_kind(encoding)}, not a string"
    if encoding.lower() == "utf-8":
        return None
    codec = codecs.get(encoding)
    if codec is None:
        return f"unknown body_encoding {encoding!r}"
    try:
        codec.decode(body)
    except (ValueError, TypeError) as exc:  # binascii.Error is a ValueError
        return f"body is not valid {encoding}: {exc}"
    return None


def _seconds(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:  # an int too large for a float
        return False


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _kind(value: object) -> str:
    return "missing" if value is None else f"of type {type(value).__name__}"
