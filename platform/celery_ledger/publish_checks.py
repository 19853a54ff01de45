"""The checks a publish makes of its call before anything leaves the process: the arguments'
JSON (for the size limit), when the job is due (a countdown or an eta that is no time is the
caller's error, not a date that overflows later in the ledger or a worker), and the options'
names (a misspelt one is an error, not a message property that does nothing).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping, MutableMapping
from datetime import UTC, datetime
from typing import Any

from celery import Celery
from celery.app.amqp import AMQP
from celery.app.task import Task
from kombu.exceptions import OperationalError
from kombu.messaging import Producer
from kombu.utils import json as kombu_json

from .errors import Backpressure, ConfigurationError, NotReplicated, PayloadError
from .identity import canonical_json

# What a task body's own publish (a child, a replace) raises while the platform's servers are
# away or full: the broker past kombu's publish retries, the tier above its high-water mark, no
# replica confirming a job the ledger could not record. It passes by itself: the body is
# retried with backoff, not dead-lettered as an unknown bug would be; it is not the failure of
# the task's own dependency (its breaker counts nothing), and once the retries are spent the
# job is dead, to be replayed, never hidden behind a fallback.
PUBLISH_OUTAGES: tuple[type[BaseException], ...] = (OperationalError, Backpressure, NotReplicated)

# The latest time a publish may be due: every due time is kept as a date (in the ledger and
# its records' leases, which add to it), and a countdown that is no time (infinite, or of
# billions of years) must be a clear error, not a date that overflows later.
LATEST_DUE = datetime(9000, 1, 1, tzinfo=UTC).timestamp()


def due_time(countdown: Any, eta: Any, *, now: float) -> float | None:
    """When a publish with ``countdown`` (seconds) or ``eta`` (a datetime, or its ISO text) is
    due, in seconds since the epoch; None: now.

    Raises:
        PayloadError: neither is a time (not a number, not finite, not a date), or it is
            later than ``LATEST_DUE``: the ledger keeps every due time as a date.
    """
    if countdown is not None:
        try:
            due = now + float(countdown)
        except (TypeError, ValueError, OverflowError) as exc:
            raise PayloadError(f"countdown={countdown!r} is not a number of seconds") from exc
    elif eta is not None:
        try:
            when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
            if not isinstance(when, datetime):
                raise TypeError(type(eta).__name__)
            # A naive eta is UTC, as Celery reads it (the app's timezone is UTC).
            due = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
        except (TypeError, ValueError, OverflowError) as exc:
            raise PayloadError(f"eta={eta!r} is not a date ({exc})") from exc
    else:
        return None
    if not due <= LATEST_DUE:  # (NaN and infinity included)
        raise PayloadError(
            f"a publish due at {countdown=}, {eta=} is later than the ledger can keep (the"
            " year 9000)"
        )
    return due


def payload_json(args: tuple[Any, ...], kwargs: dict[str, Any], *, republish: bool) -> str:
    """The arguments' JSON, for the size limit: strict JSON for a new publish (the README's
    rule), kombu's JSON (with its type markers) for a delivery's arguments published again."""
    if not republish:
        return canonical_json([list(args), kwargs])
    try:
        return str(kombu_json.dumps([list(args), kwargs]))
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"not JSON-serialisable: {exc}") from exc


# Celery's message sender is made per app (a closure), so its own keywords are named here.
_SENDER_OPTIONS = ("queue", "exchange_type", "event_dispatcher")


def _options_of(*calls: Any) -> frozenset[str]:
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(
        name
        for call in calls
        for name, parameter in inspect.signature(call).parameters.items()
        if parameter.kind in named
    )


# Every option a publish passes on by name: Celery's task and app calls, its message building
# and sending, kombu's publish. Read from their signatures (a Celery release's new option is
# known as soon as it is installed) once, at import: a test or an app that replaces one of them
# later (a fake publish taking **kwargs) must not make its names unknown.
_CELERY_OPTIONS = _options_of(
    Task.apply_async, Celery.send_task, AMQP.as_task_v2, Producer.publish
).union(_SENDER_OPTIONS)


# The options celery-ledger's parts pass one another (a deferral's count of hand-backs, a
# republish, an admitted publish, a workflow's step) are named with this prefix; an app's
# caller never passes one.
INTERNAL_PREFIX = "ledger_"

# The options celery-ledger adds to a publish (its docstring in task.py says what each does).
LEDGER_CALL_OPTIONS = ("idempotency_key", "tier", "tenant", "session")


def check_call_options(
    task: str, options: MutableMapping[str, Any], *, owned: Iterable[str]
) -> None:
    """Drop the ``owned`` options (the ledger sets them itself), and refuse a misspelt one
    (see :func:`misspelt_option`).

    Raises:
        ConfigurationError: naming the option and the one meant.
    """
    owned = tuple(owned)
    for name in owned:
        options.pop(name, None)
    problem = misspelt_option(options, owned)
    if problem is not None:
        raise ConfigurationError(f"{task}: {problem}")


def misspelt_option(options: Mapping[str, Any], owned: Iterable[str] = ()) -> str | None:
    """What is wrong with the first option whose name is close to one a publish knows
    (celery-ledger's, Celery's, kombu's, ``owned``) but is none of them, or None. Celery sends
    an option it does not know as a message property, so ``countdwn=5`` ran the job at once,
    silently. A name near none of them is left alone (a message property of the app's own),
    and so is a stamp."""
    celery_names = _CELERY_OPTIONS
    for name in options:
        if not isinstance(name, str) or name in celery_names or name in LEDGER_CALL_OPTIONS:
            continue  # (the usual case, on every publish: no set is built)
        if name.startswith(INTERNAL_PREFIX):
            continue  # (a mark one part of celery-ledger passes another: a deferral's count)
        stamped = options.get("stamped_headers")  # (a stamp is an option its visitor named)
        if isinstance(stamped, (list, tuple)) and name in stamped:
            continue
        known = celery_names.union(LEDGER_CALL_OPTIONS, owned)
        meant = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if meant:
            return (
                f"no publish option is named {name!r}; did you mean {meant[0]!r}? (Celery"
                " would send it as a message property, where it does nothing)"
            )
    return None
