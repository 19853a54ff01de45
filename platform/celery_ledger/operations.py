"""Operator actions, audited: the one implementation behind the CLI and the console.

Each action writes its audit entry before it runs and its outcome after (``audit.action``), so
an action from the command line and the same action from the web console leave the same trail.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import audit
from .deadletter import ReplayOutcome
from .errors import ConfigurationError
from .ledger.schedule_controls import ScheduleControls
from .policies.breaker import BreakerState
from .schedule_definitions import sealed_definition
from .schedules import entry_of, fleet_entries, send_slot, slots_between

BREAKER_ACTIONS: dict[str, tuple[BreakerState | None, str]] = {
    "open": (BreakerState.OPEN, "forced open"),
    "close": (BreakerState.CLOSED, "forced closed"),
    "clear": (None, "force cleared"),
}


def replay_dead(
    app: Any,
    docs: Iterable[dict[str, Any]],
    *,
    actor: str,
    dry_run: bool = False,
    force_unsigned: bool = False,
) -> Iterable[ReplayOutcome]:
    """Replay dead records one by one (a dry run says what would be sent, and changes
    nothing); each real replay is audited before it is sent. Lazy: the caller may show
    progress as it goes."""
    dead = app.dead_letters
    for doc in docs:
        if dry_run:
            yield dead.replay(doc, dry_run=True, actor=actor, force_unsigned=force_unsigned)
            continue
        details = {"force_unsigned": True} if force_unsigned else {}
        with audit.action(app.ledger, "replay", str(doc["_id"]), actor=actor, **details) as e:
            outcome = dead.replay(doc, dry_run=False, actor=actor, force_unsigned=force_unsigned)
            e.note(replayed=outcome.replayed, detail=outcome.detail, forced=outcome.forced)
        yield outcome


@dataclass
class Purged:
    removed: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # no longer dead when purged: kept


def purge_dead(
    app: Any, docs: list[dict[str, Any]], *, actor: str, filters: Mapping[str, Any]
) -> Purged:
    """Delete dead records; the audit entry lists every id selected, removed and left."""
    selected = [str(d["_id"]) for d in docs]
    with audit.action(
        app.ledger,
        "purge",
        f"{len(selected)} dead records",
        actor=actor,
        filters=dict(filters),
        selected_ids=selected,
    ) as entry:
        # A record replayed since it was listed is no longer dead and stays.
        removed = app.dead_letters.purge_ids(docs, actor=actor)
        left = sorted(set(selected) - set(removed))
        entry.note(purged=len(removed), record_ids=removed, left_ids=left)
    return Purged(removed, left)


def force_breaker(app: Any, name: str, action: str, *, actor: str) -> str:
    """``open``, ``close`` or ``clear`` breaker ``name``, audited; the action's audit name."""
    state, label = BREAKER_ACTIONS[action]
    with audit.action(app.ledger, label, f"breaker:{name}", actor=actor):
        app.breakers[name].force(state)
    return label


def pause_schedule(app: Any, name: str, *, actor: str, reason: str = "") -> bool:
    """Pause schedule entry ``name`` (its slots pass without runs until resumed), audited;
    False if it was paused already."""
    entry_of(app, name, opened=False)  # a name the schedule declares
    with audit.action(app.ledger, "schedule paused", f"schedule:{name}", actor=actor) as e:
        changed = ScheduleControls(app.ledger).set_paused(name, True, actor=actor, reason=reason)
        e.note(changed=changed, reason=reason)
    return changed


def resume_schedule(app: Any, name: str, *, actor: str) -> bool:
    """Resume schedule entry ``name`` from its next slot, audited; False if it was not
    paused."""
    entry_of(app, name, opened=False)
    with audit.action(app.ledger, "schedule resumed", f"schedule:{name}", actor=actor) as e:
        changed = ScheduleControls(app.ledger).set_paused(name, False, actor=actor)
        e.note(changed=changed)
    return changed


def trigger_schedule(app: Any, name: str, *, actor: str) -> str:
    """Run schedule entry ``name`` now, outside its slots (a run keyed by this second: a
    second trigger within it is the same run), audited; returns the run's message id."""
    entry = entry_of(app, name)
    slot = float(math.floor(app.runtime.message_time()))
    with audit.action(app.ledger, "schedule triggered", f"schedule:{name}", actor=actor) as e:
        sent = send_slot(app, entry, slot)
        e.note(slot=slot, message_id=sent)
    return sent


def backfill_schedule(
    app: Any, name: str, start: float, end: float, *, actor: str, dry_run: bool = False
) -> list[float]:
    """Send the runs of schedule entry ``name`` for each of its slots from ``start`` to
    ``end`` (unix seconds): a slot that already ran is a duplicate the ledger suppresses, so
    only the missed ones run. Audited (unless a dry run); returns the slots."""
    entry = entry_of(app, name)
    slots = slots_between(entry, start, end)
    if dry_run:
        return slots
    with audit.action(
        app.ledger, "schedule backfilled", f"schedule:{name}", actor=actor, start=start, end=end
    ) as e:
        for slot in slots:
            send_slot(app, entry, slot)
        e.note(slots=len(slots))
    return slots


def create_schedule(app: Any, name: str, definition: dict[str, Any], *, actor: str) -> bool:
    """Declare entry ``name`` at run time (``definition``: ``schedules.definition_of``), kept in
    the ledger; every scheduler takes it up within seconds. Audited; False if an entry of that
    name is declared at run time already. A name the code declares is refused (its entry in
    code would win)."""
    if name in fleet_entries(app.conf.beat_schedule):
        raise ConfigurationError(f"{name!r} is declared in the app's code: choose another name")
    if definition["task"] not in app.tasks:
        known = ", ".join(sorted(t for t in app.tasks if not t.startswith("celery.")))
        raise ConfigurationError(f"no task {definition['task']!r} in this app (tasks: {known})")
    if getattr(app.tasks[definition["task"]], "sensitive", False):  # (the audit's copy too)
        definition = sealed_definition(definition, app.runtime.sealer)
    with audit.action(app.ledger, "schedule created", f"schedule:{name}", actor=actor) as e:
        created = ScheduleControls(app.ledger).declare(name, definition, actor=actor)
        # (a sealed definition's token is the ledger's to keep, and to reseal: not the trail's)
        e.note(created=created, definition={**definition, "sealed": bool(definition.get("sealed"))})
    return created


def delete_schedule(app: Any, name: str, *, actor: str) -> bool:
    """Delete entry ``name`` declared at run time (its runs already sent stay jobs); audited.
    False if there was none. An entry declared in code is refused: pause it instead."""
    if name in fleet_entries(app.conf.beat_schedule):
        raise ConfigurationError(f"{name!r} is declared in the app's code: pause it instead")
    with audit.action(app.ledger, "schedule deleted", f"schedule:{name}", actor=actor) as e:
        deleted = ScheduleControls(app.ledger).remove(name)
        e.note(deleted=deleted)
    return deleted


def drain_lanes(app: Any, tiers: Iterable[str], *, actor: str) -> dict[str, int]:
    """Move every tenant's waiting jobs of ``tiers`` to their queues (fairness.py's drain),
    audited; how many moved, by tier."""
    fair = app.runtime.fair
    if fair is None:
        raise ConfigurationError("fair dispatch is off here (LEDGER_FAIR_QUEUE_DEPTH=0)")
    moved: dict[str, int] = {}
    for tier in tiers:
        queue = app.tiers.queue(tier)
        with audit.action(app.ledger, "tenant lanes drained", f"queue:{queue}", actor=actor) as e:
            moved[tier] = 0
            while drained := fair.drain(queue):  # (a batch at a time)
                moved[tier] += drained
            e.note(moved=moved[tier])
    return moved
