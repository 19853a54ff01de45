"""The shape a queue item must have before kombu and Celery may touch it.

kombu and Celery trust the envelope they pop: a field of the wrong type raises out of the
worker's event loop ("Unrecoverable error", the worker exits, and the message comes back to
kill the next one) or out of a pool callback (the message is dropped or stuck). These pure
checks say what is wrong, as a reason for the dead letter, or None; the transport
(:mod:`celery_ledger.transport`) applies :func:`envelope_problem` to each item it pops, and the
consumer (:class:`celery_ledger.worker.LedgerConsumer`) applies :func:`body_problem` to each
decoded task body.

Everything a worker reads from a message is checked, as the reader would read it:

- the envelope (kombu's virtual transport, its Redis QoS and restore): ``body``,
  ``content-type``, ``content-encoding``, ``headers``, ``properties``, and the properties in
  :data:`PROPERTY_CHECKS` (delivery tag, routing, body encoding, priority, reply address);
- a task message's headers (Celery's consumer, strategy, ``Request``, tracer and task
  ``Context``): :data:`CELERY_HEADER_CHECKS`. The worker overwrites the names in
  :data:`WORKER_SET_HEADERS` with its own values, so they may carry anything; any other name
  of Celery's task ``Context`` (its methods, private fields, fields protocol 2 never sends) is
  refused, since a header becomes an attribute of the task's request;
- the ledger's headers: :data:`LEDGER_HEADER_CHECKS`, one row per name (any other ``ledger_``
  name is refused: the ledger keeps its own per-run state on the request under that prefix);
- the stamps (``stamped_headers`` name stamps that Celery's retry re-sends as publish options,
  so none may be named like an option);
- the body: ``[args, kwargs, embed]`` with the embedded signatures (:func:`body_problem`).

Protocol 1 task messages (the task name in a JSON object body, no ``task`` header) are refused:
Celery reads their fields from the body, before any of these checks could run.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from celery import Celery
from celery.app.amqp import AMQP
from celery.app.task import Context, Task
from celery.utils.time import maybe_iso8601, maybe_make_aware, timezone
from kombu.asynchronous.timer import to_timestamp
from kombu.compression import decompress
from kombu.messaging import Producer
from kombu.utils.json import loads

from . import headers as ledger_headers
from .errors import PayloadError
from .identity import validate_key
from .untrusted import MAX_RETRIES_HEADER

# A check says what is wrong with one value ("is of type list, not a string"), or None.
Check = Callable[[Any], str | None]


class BodyCodec(Protocol):
    """A kombu body codec (``kombu.transport.virtual.base.Base64``)."""

    def decode(self, s: str) -> bytes: ...


# -- checks of one value ----------------------------------------------------------------------


def _text(value: Any) -> str | None:
    """A string that encodes as UTF-8 (Redis, BSON and log files refuse lone surrogates)."""
    if not isinstance(value, str):
        return f"is {_kind(value)}, not a string"
    if not _utf8(value):
        return "is not valid UTF-8 text"
    return None


def _string(value: Any) -> str | None:
    return None if isinstance(value, str) else f"is {_kind(value)}, not a string"


def _non_empty_text(value: Any) -> str | None:
    return _text(value) or (None if value else "is empty")


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"is {_kind(value)}, not true or false"


def _count(limit: int) -> Check:
    """An integer in ``range(limit)`` (not a bool, a float or a numeric string)."""

    def count(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"is {_kind(value)}, not an integer"
        return None if 0 <= value < limit else f"is not an integer from 0 to {limit - 1}"

    return count


def _optional(check: Check) -> Check:
    """``check``, with None (and so an absent name) allowed."""

    def optional(value: Any) -> str | None:
        return None if value is None else check(value)

    return optional


def _timelimit(value: Any) -> str | None:
    """``[hard, soft]``: Celery unpacks two, billiard and kombu's timers make floats of them."""
    if (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(limit is None or _seconds(limit) for limit in value)
    ):
        return None
    return "is not [hard, soft] seconds (non-negative numbers or null)"


# Celery's own reading of a moment, from the app's timezone (create_app sets UTC) to the worker's
# timer. A margin from the ends of Python's calendar keeps every timezone conversion in range.
_APP_TIMEZONE = "UTC"
_EARLIEST = datetime.min.replace(tzinfo=UTC) + timedelta(days=2)
_LATEST = datetime.max.replace(tzinfo=UTC) - timedelta(days=2)


def _eta(value: Any) -> str | None:
    """An ``eta`` header, read as the worker reads it, all of it.

    ``Request.__init__`` runs ``maybe_iso8601`` and ``maybe_make_aware`` (catching only some
    errors); the strategy converts the eta for its timer with ``to_timestamp(to_system_tz(eta))``
    (in the worker's own timezone) and sends it in events with ``isoformat()``. Any exception
    here would be raised there, in the worker's main process.
    """
    try:
        moment = maybe_make_aware(maybe_iso8601(value), _APP_TIMEZONE)
        if not _EARLIEST <= moment.astimezone(UTC) <= _LATEST:
            return "is a date at the edge of the calendar (timezone conversions overflow)"
        to_timestamp(timezone.to_system(moment))
        to_timestamp(moment, timezone.utc)
        moment.isoformat()
        str(moment)
    except Exception as exc:  # whatever Celery would raise in the worker's main process
        return f"is not a date Celery can read ({type(exc).__name__}: {_brief(str(exc))})"
    return None


def _expires(value: Any) -> str | None:
    """An ``expires`` header, read as the worker reads it: parsed as the eta is (above), sent in
    events with ``isoformat()``, compared with now by ``revoked()`` (and by the ledger's guard)."""
    try:
        moment = maybe_make_aware(maybe_iso8601(value), _APP_TIMEZONE)
        moment.isoformat()
        str(moment)
        _ = datetime.now(timezone.utc if moment.tzinfo else None) > moment
    except Exception as exc:  # whatever Celery would raise in the worker's main process
        return f"is not a date Celery can read ({type(exc).__name__}: {_brief(str(exc))})"
    return None


def _signature_list(value: Any) -> str | None:
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return None
    return "is not a list of signatures"


def _signature(value: Any) -> str | None:
    return None if isinstance(value, dict) else "is not a signature"


def _string_list(value: Any) -> str | None:
    if isinstance(value, list) and all(_text(item) is None for item in value):
        return None
    return "is not a list of strings"


def _object(value: Any) -> str | None:
    return None if isinstance(value, dict) else f"is {_kind(value)}, not an object"


def _ledger_key(value: Any) -> str | None:
    try:
        validate_key(value, task_name="the message")
    except PayloadError as exc:
        return f"is not a valid key ({_brief(str(exc))})"
    return None


# The ledger reads its numbers with untrusted.float_or_none: finite and below 1e12.
_LEDGER_NUMBER_LIMIT = 1e12


def _ledger_number(value: Any) -> str | None:
    """A count, a delay in seconds or a unix time: a finite number from 0 to 1e12."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"is {_kind(value)}, not a number"
    try:
        ok = math.isfinite(value) and 0 <= value < _LEDGER_NUMBER_LIMIT
    except OverflowError:  # an int too large for a float
        ok = False
    return None if ok else "is not a finite number from 0 to 1e12"


def _delivery_info(value: Any) -> str | None:
    """kombu's QoS indexes ``exchange`` and ``routing_key``, and restores the message by them
    (a requeue, a shutdown): with no routing key the restore finds no queue, and the message is
    lost ("Could not restore message")."""
    if not isinstance(value, dict):
        return f"is {_kind(value)}, not an object"
    for name, check in (("exchange", _optional(_text)), ("routing_key", _non_empty_text)):
        if name not in value:
            return f"has no {name!r}"
        problem = check(value[name])
        if problem is not None:
            return f"{name!r} {problem}"
    problem = _optional(_flag)(value.get("redelivered"))
    return None if problem is None else f"'redelivered' {problem}"


# -- what is checked, by name -----------------------------------------------------------------

_SIGNATURE_LISTS = ("callbacks", "errbacks", "chain")
# The embedded part of a protocol 2 body (celery/app/amqp.py as_task_v2). Celery merges the
# embed into the task's request, so any other key would replace a request field.
EMBED_CHECKS: dict[str, Check] = {
    **{name: _optional(_signature_list) for name in _SIGNATURE_LISTS},
    "chord": _optional(_signature),
}

# The headers of a protocol 2 task message that Celery reads ('task' and 'id' are required).
CELERY_HEADER_CHECKS: dict[str, Check] = {
    "task": _text,  # a key of the worker's strategies; empty is an unknown task
    "id": _non_empty_text,  # a key of the worker's state, the ledger's _id
    "shadow": _optional(_text),  # the request's name, a key of the worker's counters
    "root_id": _optional(_text),
    "parent_id": _optional(_text),
    "group": _optional(_text),
    "group_index": _optional(_count(2**31)),
    "retries": _optional(_count(MAX_RETRIES_HEADER)),
    "replaced_task_nesting": _optional(_count(2**31)),
    "timelimit": _optional(_timelimit),
    "eta": _optional(_eta),
    "expires": _optional(_expires),
    # Celery's reprs of the arguments: any text (they keep the arguments' lone surrogates).
    "argsrepr": _optional(_string),
    "kwargsrepr": _optional(_string),
    "origin": _optional(_text),
    "lang": _optional(_text),
    "ignore_result": _optional(_flag),
    "stamped_headers": _optional(_string_list),
    "stamps": _optional(_object),
    "compression": _optional(_text),  # kombu decompresses the body with it
    # The task request's headers (Celery's retry copies them): Sentry's Celery integration
    # sends its trace headers and a copy of the custom ones in it.
    "headers": _optional(_object),
    # Read from the headers when the body's embed leaves them out (a raw message's may).
    **EMBED_CHECKS,
}

# Request fields the worker sets itself (Request.__init__, the tracer) over any header of the
# same name: their header values are never read.
WORKER_SET_HEADERS = frozenset(
    {
        "args",
        "kwargs",
        "hostname",
        "delivery_info",
        "properties",
        "reply_to",
        "correlation_id",
        "is_eager",
        "called_directly",
    }
)

# The ledger's own headers: one row per name in celery_ledger.headers. A header added there
# needs its row here.
LEDGER_HEADER_CHECKS: dict[str, Check] = {
    ledger_headers.KEY: _optional(_ledger_key),
    ledger_headers.TIER: _optional(_text),
    ledger_headers.DEFERRALS: _optional(_ledger_number),
    ledger_headers.PREVIOUS_DELAY: _optional(_ledger_number),
    ledger_headers.ENQUEUED_AT: _optional(_ledger_number),
    ledger_headers.SENT_AT: _optional(_ledger_number),
    ledger_headers.UNRUNNABLE_SINCE: _optional(_ledger_number),
    ledger_headers.UNRUNNABLE_DEFERRALS: _optional(_ledger_number),
    ledger_headers.WORKFLOW: _optional(_ledger_key),
    ledger_headers.WORKFLOW_TIER: _optional(_text),
    ledger_headers.SIGNATURE: _optional(_text),
}
LEDGER_HEADER_PREFIX = "ledger_"

# Message properties kombu and Celery read ('delivery_tag' and 'delivery_info' are required).
PROPERTY_CHECKS: dict[str, Check] = {
    "delivery_tag": _non_empty_text,  # a field of Redis' unacked hash
    "delivery_info": _delivery_info,
    "body_encoding": _optional(_text),  # and a known codec that decodes the body, below
    "priority": _optional(_count(256)),  # kombu's restore makes an int of it
    "correlation_id": _optional(_text),
    "reply_to": _optional(_text),
    ledger_headers.NEW: _optional(_flag),
    ledger_headers.HANDED_BACK: _optional(_ledger_number),
    ledger_headers.TENANT: _optional(_text),
    ledger_headers.PARKED: _optional(_non_empty_text),
}
_REQUIRED_PROPERTIES = ("delivery_tag", "delivery_info")

# A header becomes an attribute of the task's request (celery.app.task.Context).
_CONTEXT_NAMES = frozenset(dir(Context))


def _parameters(*functions: Callable[..., Any]) -> set[str]:
    return {
        name
        for function in functions
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)
    }


# Names a stamp may not have: Celery re-sends stamps as publish options when it retries a task
# (Context.as_execution_options), where they would override the retry's own options.
RESERVED_STAMP_NAMES = frozenset(
    {
        *Context().as_execution_options(),
        *_parameters(Celery.send_task, AMQP.as_task_v2, Producer.publish, Task.apply_async),
        *_parameters(Task.retry),
        "queue",  # read by Celery's router
        "exchange_type",
        "idempotency_key",  # the ledger's publish options (LedgerTask.apply_async)
        "tier",
        *ledger_headers.PROPERTIES,  # publish options that become message properties
        *CELERY_HEADER_CHECKS,
        *LEDGER_HEADER_CHECKS,
        *WORKER_SET_HEADERS,
        *_CONTEXT_NAMES,
    }
    - {"self"}
)


# -- the checks the transport and the consumer call -------------------------------------------


def envelope_problem(envelope: object, codecs: Mapping[str, BodyCodec]) -> str | None:
    """Why a decoded queue item cannot be delivered as a message, or None.

    Checks what kombu's virtual transport and Redis QoS read (the body, its content type and
    encoding, the properties in :data:`PROPERTY_CHECKS`) and, for a Celery task message, the
    headers (:func:`task_headers_problem`).
    """
    if not isinstance(envelope, dict):
        return f"envelope is {_kind(envelope)}, not an object"
    body = envelope.get("body")
    if not isinstance(body, str):
        return f"body is {_kind(body)}, not a string"
    for name in ("content-type", "content-encoding"):
        problem = _optional(_text)(envelope.get(name))
        if problem is not None:
            return f"{name} {problem}"
    properties = envelope.get("properties")
    if not isinstance(properties, dict):
        return f"properties is {_kind(properties)}, not an object"
    problem = _named_problem(properties, PROPERTY_CHECKS, _REQUIRED_PROPERTIES, "properties.{}")
    if problem is not None:
        return problem
    problem = _body_encoding_problem(body, properties.get("body_encoding"), codecs)
    if problem is not None:
        return problem
    headers = envelope.get("headers")
    if "headers" in envelope and not isinstance(headers, dict):  # kombu's restore sets a field
        return f"headers is {_kind(headers)}, not an object"
    if headers is None or "task" not in headers:
        # Not a task message Celery runs; the ledger still reads its own headers of it (it
        # files the message as poison by them), so they must be values it can read.
        problem = _named_problem(headers or {}, LEDGER_HEADER_CHECKS, (), "header {!r}")
        if problem is not None:
            return problem
        return _protocol_1_problem(envelope, body, properties.get("body_encoding"), codecs)
    if body == "":
        return "task message with an empty body"
    return task_headers_problem(headers)


def task_headers_problem(headers: Mapping[Any, Any]) -> str | None:
    """Why the headers of a Celery protocol 2 task message are unusable, or None (any keys:
    they come from a message)."""
    problem = _named_problem(headers, CELERY_HEADER_CHECKS, ("task", "id"), "header {!r}")
    if problem is None:
        problem = _named_problem(headers, LEDGER_HEADER_CHECKS, (), "header {!r}")
    if problem is not None:
        return problem
    for name in headers:
        if not isinstance(name, str):
            return f"a header name is {_kind(name)}, not a string"
        if name in CELERY_HEADER_CHECKS or name in LEDGER_HEADER_CHECKS:
            continue
        if name.startswith(LEDGER_HEADER_PREFIX):
            return f"header {_brief(name)} is not a header of celery-ledger"
        if name in _CONTEXT_NAMES and name not in WORKER_SET_HEADERS:
            return f"header {_brief(name)} is reserved (a field or method of Celery's task request)"
    return _stamps_problem(headers.get("stamped_headers"), headers.get("stamps"))


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
    for name in embed:
        if name not in EMBED_CHECKS:
            return f"embed {_brief(name)} is not a signature field (it replaces a request field)"
    for name, check in EMBED_CHECKS.items():
        problem = check(embed.get(name))
        if problem is not None:
            return f"embed {name!r} {problem}"
    return None


# -- helpers ----------------------------------------------------------------------------------


def _named_problem(
    values: Mapping[str, Any], checks: Mapping[str, Check], required: Iterable[str], label: str
) -> str | None:
    """The first problem of ``values`` under ``checks`` (in the table's order), or None.

    ``label`` formats a name for the reason (``"header {!r}"``).
    """
    for name in required:
        if name not in values:
            return f"{label.format(name)} is missing"
    for name, check in checks.items():
        if name in values:
            problem = check(values[name])
            if problem is not None:
                return f"{label.format(name)} {problem}"
    return None


def _stamps_problem(stamped: Any, stamps: Any) -> str | None:
    if not stamped:
        return None
    for name in stamped:
        if name in RESERVED_STAMP_NAMES:
            return f"header 'stamped_headers' names {_brief(name)}, an option of Celery's retry"
    if not set(stamped) <= set(stamps or ()):  # a retry re-sends each stamp
        return "header 'stamped_headers' names stamps missing from header 'stamps'"
    return None


def _protocol_1_problem(
    envelope: Mapping[str, Any], body: str, encoding: Any, codecs: Mapping[str, BodyCodec]
) -> str | None:
    """A message without a ``task`` header whose JSON body names a task is Celery's protocol 1:
    Celery would read the task's id, eta, expiry... from the body, unchecked."""
    if envelope.get("content-type") != "application/json" or not body:
        return None  # Celery refuses other content types itself (JSON only)
    try:
        data: bytes | str = body
        if isinstance(encoding, str) and encoding.lower() != "utf-8":
            data = codecs[encoding].decode(body)
        compression = (envelope.get("headers") or {}).get("compression")
        if compression:
            data = decompress(data if isinstance(data, bytes) else data.encode(), compression)
        payload = loads(data)
    except Exception:
        return None  # Celery's own decoding fails too, and dead-letters it (on_decode_error)
    if isinstance(payload, dict) and "task" in payload:
        return "protocol 1 task message (the task in the body, no 'task' header): not accepted"
    return None


def _body_encoding_problem(
    body: str, encoding: object, codecs: Mapping[str, BodyCodec]
) -> str | None:
    """kombu decodes the body with ``codecs[encoding]``; without one (None or utf-8) it encodes
    the text as UTF-8 (and a failure there reaches error handlers that cannot cope with it)."""
    if not body:
        return None
    if encoding is not None and not isinstance(encoding, str):
        return f"properties.body_encoding is {_kind(encoding)}, not a string"
    if encoding is None or encoding.lower() == "utf-8":
        return None if _utf8(body) else "body is not valid UTF-8 text (and has no body_encoding)"
    codec = codecs.get(encoding)
    if codec is None:
        return f"unknown body_encoding {_brief(encoding)}"
    try:
        codec.decode(body)
    except (ValueError, TypeError) as exc:  # binascii.Error is a ValueError
        return f"body is not valid {encoding}: {_brief(str(exc))}"  # a codec's name: plain text
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


def _brief(value: object, limit: int = 60) -> str:
    """A short, ASCII-only representation of input, for a reason (logs, the ledger)."""
    try:
        text = ascii(value)
    except Exception:  # an int past Python's digit limit, or anything odd
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _kind(value: object) -> str:
    return "missing" if value is None else f"of type {type(value).__name__}"
