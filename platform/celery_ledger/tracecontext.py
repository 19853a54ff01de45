"""A job's trace context, where the engine and the ledger meet tracing (off: nothing but a check).

The lower layers (the guard, the ledger's store, the publish path) call the functions here;
:mod:`celery_ledger.observability.tracing` fills them in when ``LEDGER_TRACING`` is on. Until
then each is a module-global ``None`` check: no OpenTelemetry import, no span, no header.

The context travels in the W3C ``traceparent`` and ``tracestate`` headers of every message.
Republishes carry them (:data:`celery_ledger.headers.CARRIED`), and :func:`stamp` moves them
to the current span when a copy is made inside an attempt (a retry, a deferral, the message the
ledger keeps), so the next attempt is a child of the one before it whatever path it takes.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping, MutableMapping
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
HEADERS = (TRACEPARENT, TRACESTATE)
MAX_HEADER = 512  # a longer value is no W3C header: not carried, not read

# ``version-traceid-parentid-flags`` (W3C Trace Context, level 1).
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")
_ZERO_TRACE = "0" * 32

# The ledger operation a pymongo command belongs to (set by the store around each call), so
# that its span is named after the operation ("ledger claim"), not the wire command.
LEDGER_OPERATION: ContextVar[str | None] = ContextVar("celery_ledger_operation", default=None)


class Hooks:
    """What tracing installs (all ``None`` while it is off)."""

    inject: Callable[[MutableMapping[str, Any]], None] | None = None
    continuing: Callable[[Mapping[str, Any]], AbstractContextManager[None]] | None = None
    span: Callable[[str, Mapping[str, Any]], AbstractContextManager[Any]] | None = None
    current_ids: Callable[[], tuple[str, str] | None] | None = None


HOOKS = Hooks()


def enabled() -> bool:
    return HOOKS.inject is not None


def carried(message_headers: Mapping[str, Any]) -> dict[str, str]:
    """The trace headers of a message worth carrying: a W3C ``traceparent`` and, with it, a
    ``tracestate`` string of a sane length; else none (a malformed or hostile value is
    dropped, never an error: tracing must not cost a job)."""
    if trace_id_of(message_headers) is None:
        return {}
    kept = {TRACEPARENT: str(message_headers[TRACEPARENT]).strip()}
    state = message_headers.get(TRACESTATE)
    if isinstance(state, str) and len(state) <= MAX_HEADER:
        kept[TRACESTATE] = state
    return kept


def stamp(message_headers: MutableMapping[str, Any]) -> None:
    """Point a copy's trace headers at the current span (a no-op with tracing off, or with no
    span current: then the copy keeps the context it carries)."""
    if HOOKS.inject is not None:
        HOOKS.inject(message_headers)


def continuing(message_headers: Mapping[str, Any]) -> AbstractContextManager[None]:
    """Around a publish: with no span current (a housekeeping thread publishing a due retry,
    the reconciler, a replay from the CLI), make the context the message carries current, so
    the publish belongs to the job's trace and not to a new one."""
    if HOOKS.continuing is None:
        return contextlib.nullcontext()
    return HOOKS.continuing(message_headers)


def span(name: str, **attributes: Any) -> AbstractContextManager[Any]:
    """A child span of the current one while the block runs (nothing with tracing off)."""
    if HOOKS.span is None:
        return contextlib.nullcontext()
    return HOOKS.span(name, attributes)


def ledger_operation(what: str) -> AbstractContextManager[None]:
    """Name the ledger commands sent inside the block (their spans, with tracing on)."""
    return _Operation(what)


class _Operation:
    # A class, not a generator's context manager (a quarter of its cost): every ledger
    # command of every task is sent inside one.
    __slots__ = ("_token", "_what")

    def __init__(self, what: str) -> None:
        self._what = what

    def __enter__(self) -> None:
        self._token = LEDGER_OPERATION.set(self._what)

    def __exit__(self, *exc_info: object) -> None:
        LEDGER_OPERATION.reset(self._token)


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span as hex, or ``None`` (off, or no span)."""
    if HOOKS.current_ids is None:
        return None
    return HOOKS.current_ids()


def trace_id_of(message_headers: Any) -> str | None:
    """The trace id a message's (or a kept message's) headers name, if a valid one."""
    if not isinstance(message_headers, Mapping):
        return None
    value = message_headers.get(TRACEPARENT)
    if not isinstance(value, str):
        return None
    match = _TRACEPARENT.match(value.strip())
    if match is None or match.group(1) == _ZERO_TRACE:
        return None
    return match.group(1)
