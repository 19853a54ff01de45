"""Schedule entries declared at run time: their stored definition (a plain document in the
ledger's schedule controls, ``ledger/schedule_controls.py``), checked when declared, and read
back as ``beat_schedule`` entries by every scheduler.

A sensitive task's arguments are sealed in the definition (one token for both), as its jobs'
are in their records: an entry lives as long as the schedule, and the ledger's other readers
(a backup, the console) see ciphertext; the audit trail notes that they were sealed, not the
token. ``ledger reseal`` finds the token with every other sealed value of the ledger.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from celery.schedules import BaseSchedule, crontab

from . import wire
from .crypto import REDACTED, Sealer
from .errors import ConfigurationError, StoreError
from .policies.schedule import SchedulePolicy
from .publish_checks import misspelt_option

logger = logging.getLogger("celery_ledger.schedules")  # (where these lines were before)


def schedule_problem(schedule: Any) -> str | None:
    """What is wrong with an entry's schedule, or None: seconds or a ``timedelta`` of more than
    0, or one of Celery's schedules. (Celery takes a negative number as due at every tick, and
    fails on a string only when it first asks it when it is due.)"""
    if isinstance(schedule, BaseSchedule) or callable(getattr(schedule, "is_due", None)):
        every = getattr(schedule, "run_every", None)  # (an app's own class: Celery's duck type)
        if isinstance(every, timedelta) and not every.total_seconds() > 0:
            return f"schedule {schedule!r}: its period must be more than 0 seconds"
        return None
    if isinstance(schedule, timedelta):
        seconds = schedule.total_seconds()
    elif type(schedule) is not bool and isinstance(schedule, numbers.Real):  # (any number)
        seconds = float(schedule)
    else:
        return (
            f"schedule {schedule!r}: seconds, a timedelta, a crontab or a solar (a cron"
            " expression: crontab.from_string('*/5 * * * *'))"
        )
    return None if seconds > 0 else f"schedule {schedule!r}: more than 0 seconds"


def beat_problems(beat_schedule: Mapping[str, Any] | None) -> list[str]:
    """The entries of ``beat_schedule`` (``@app.periodic`` or Celery's own) whose schedule
    cannot run, or whose options name one misspelt, one line each."""
    problems = []
    for name, entry in (beat_schedule or {}).items():
        schedule = entry.get("schedule") if isinstance(entry, Mapping) else None
        problem = schedule_problem(schedule)
        if problem is None and isinstance(entry, Mapping):
            # (beat passes them to every run's publish, which refuses a misspelt one)
            options = entry.get("options")
            problem = misspelt_option(options) if isinstance(options, Mapping) else None
        if problem is not None:
            problems.append(f"beat_schedule entry {name!r}: {problem}")
    return problems


def definition_of(
    task: str,
    *,
    every: float | None = None,
    cron: str | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    queue: str | None = None,
    policy: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The stored definition of an entry declared at run time (a plain document), checked:
    a mistake is a ``ConfigurationError`` saying what is wrong."""
    if (every is None) == (cron is None):
        raise ConfigurationError("a schedule is every N seconds or a cron expression: one of them")
    if every is not None and not (isinstance(every, int | float) and every >= 1):
        raise ConfigurationError(f"every must be at least 1 second, not {every!r}")
    stored_policy = {
        name: value.isoformat() if isinstance(value, datetime) else value
        for name, value in (policy or {}).items()
    }
    definition = {
        "task": task,
        "every": None if every is None else float(every),
        "cron": cron,
        "args": list(args),
        "kwargs": dict(kwargs or {}),
        "options": {"queue": queue} if queue else {},
        "policy": stored_policy,
    }
    stored_spec(definition)  # (every check of the stored form: the schedule and the policy)
    return definition


def sealed_definition(definition: Mapping[str, Any], sealer: Sealer) -> dict[str, Any]:
    """A sensitive task's definition as stored: its arguments sealed (one token), and its
    timing under ``timing``, where a release before sealing does not look: such a scheduler
    leaves the entry out (a definition it cannot read) instead of running it without them."""
    both = wire.dumps({"args": definition["args"], "kwargs": definition["kwargs"]})
    kept = {k: v for k, v in definition.items() if k not in ("args", "kwargs", "every", "cron")}
    timing = {"every": definition.get("every"), "cron": definition.get("cron")}
    return {**kept, "timing": timing, "sealed": sealer.seal(both)}


def stored_spec(definition: Mapping[str, Any], sealer: Sealer | None = None) -> dict[str, Any]:
    """A stored definition as a ``beat_schedule`` entry (raises ``ConfigurationError``, and
    ``StoreError`` for sealed arguments no key of ``sealer`` opens). ``sealer`` None: sealed
    arguments are not opened but shown as the redaction marker (to list or pause an entry,
    never to send it)."""
    args, kwargs = definition.get("args") or (), definition.get("kwargs") or {}
    if definition.get("sealed"):
        args, kwargs = (REDACTED,), {}
        if sealer is not None:
            opened = wire.loads(sealer.open(str(definition["sealed"])))
            args, kwargs = opened["args"], opened["kwargs"]
        definition = {**definition, **definition["timing"]}
    cron = definition.get("cron")
    if cron is not None:
        try:
            when: Any = crontab.from_string(str(cron))
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(
                f"cron {cron!r}: {exc} (five fields: minute hour day-of-month month day-of-week)"
            ) from None
    else:
        when = float(definition["every"])
    policy = dict(definition.get("policy") or {})
    for name in ("start", "end"):
        if isinstance(policy.get(name), str):
            try:
                policy[name] = datetime.fromisoformat(policy[name])
            except ValueError:
                raise ConfigurationError(f"schedule policy: {name} {policy[name]!r}") from None
    return {
        "task": str(definition["task"]),
        "schedule": when,
        "args": tuple(args),
        "kwargs": dict(kwargs),
        "options": dict(definition.get("options") or {}),
        "policy": SchedulePolicy.of(policy or None),
    }


def stored_entries(
    definitions: Mapping[str, Mapping[str, Any]], sealer: Sealer | None = None
) -> dict[str, dict[str, Any]]:
    """The entries of the stored definitions; one that no longer reads (stored by a later
    release, or damaged, or sealed with no key here) is left out with a warning, never fails
    the others."""
    found = {}
    for name, definition in definitions.items():
        try:
            found[name] = stored_spec(definition, sealer)
        except (ConfigurationError, StoreError, KeyError, TypeError, ValueError) as exc:
            logger.warning("schedule %s stored in the ledger does not read: %s", name, exc)
    return found


__all__ = [
    "beat_problems",
    "definition_of",
    "schedule_problem",
    "sealed_definition",
    "stored_entries",
    "stored_spec",
]
