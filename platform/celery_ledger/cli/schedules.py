"""``celery -A APP ledger schedules ...``: the app's periodic tasks and where each one is."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from .. import audit
from ..errors import ConfigurationError
from ..operations import (
    backfill_schedule,
    create_schedule,
    delete_schedule,
    pause_schedule,
    resume_schedule,
    trigger_schedule,
)
from ..schedule_definitions import definition_of
from ..schedules import fleet_state
from .dlq import parse_since
from .options import actor_option

console = Console(soft_wrap=True)


@click.group(name="schedules", short_help="Periodic tasks: list, pause, run, declare.")
def schedules() -> None:
    """Periodic tasks (the app's beat_schedule, and entries declared at run time): list and
    show them (last slot sent, next due, who fires them), create and delete one at run time,
    pause and resume them, trigger a run, backfill missed slots (each change audited)."""


@schedules.command(name="list", short_help="List entries, last slot sent and next due.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """Every entry of the app's schedule with its last slot sent and its next one."""
    app = ctx.obj.app
    holder, foreign, states = fleet_state(app)
    if foreign:
        fired_by = (
            f"a celery beat of another scheduler class (on {foreign}): each tick a job of its"
            " own; the workers stand down"
        )
    elif holder:
        fired_by = f"the workers (now {holder})"
    elif app.schedules_in_workers():
        fired_by = "the workers (none holds the schedule's lease right now)"
    else:
        fired_by = "celery beat only (the workers do not run the schedule)"
    if as_json:
        rows = [
            {
                "schedule": s.name,
                "task": s.task,
                "every": s.schedule,
                "last_slot": s.last_slot,
                "next_due": s.next_due,
                "paused": s.paused,
                "policy": s.policy,
                "origin": s.origin,
            }
            for s in states
        ]
        listed = {"fired_by": holder, "foreign_beat": foreign, "schedules": rows}
        click.echo(json.dumps(listed, indent=2, default=str))
        return
    console.print(f"fired by: {fired_by}")
    table = Table("schedule", "task", "every", "policy", "last slot sent", "next due", "paused")
    for s in states:
        table.add_row(
            s.name,
            s.task,
            s.schedule,
            s.policy,
            "never" if s.last_slot is None else s.last_slot.isoformat(),
            "" if s.next_due is None else s.next_due.isoformat(),
            "" if s.paused is None else f"by {s.paused['changed_by']}: {s.paused['reason'] or ''}",
        )
    console.print(table)


def _actor(actor_name: str | None) -> str:
    return audit.current_actor(actor_name)


def _checked(action: Callable[[], Any]) -> Any:
    try:
        return action()
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc


@schedules.command(short_help="Pause an entry: its slots pass without runs.")
@click.argument("name")
@click.option("--reason", default="", help="Why (kept with the pause, and in the audit trail).")
@actor_option
@click.pass_context
def pause(ctx: click.Context, name: str, reason: str, actor_name: str | None) -> None:
    """Pause entry NAME: its slots pass without runs (counted as skipped) until resumed."""
    app = ctx.obj.app
    app.loader.import_default_modules()
    changed = _checked(lambda: pause_schedule(app, name, actor=_actor(actor_name), reason=reason))
    console.print(f"{name}: {'paused' if changed else 'already paused'}")


@schedules.command(short_help="Resume an entry from its next slot.")
@click.argument("name")
@actor_option
@click.pass_context
def resume(ctx: click.Context, name: str, actor_name: str | None) -> None:
    """Resume entry NAME from its next slot (backfill runs the ones it skipped)."""
    app = ctx.obj.app
    app.loader.import_default_modules()
    changed = _checked(lambda: resume_schedule(app, name, actor=_actor(actor_name)))
    console.print(f"{name}: {'resumed' if changed else 'was not paused'}")


@schedules.command()
@click.argument("name")
@actor_option
@click.pass_context
def trigger(ctx: click.Context, name: str, actor_name: str | None) -> None:
    """Run entry NAME now, once, outside its slots."""
    app = ctx.obj.app
    app.loader.import_default_modules()
    sent = _checked(lambda: trigger_schedule(app, name, actor=_actor(actor_name)))
    console.print(f"{name}: sent {sent}")


@schedules.command(short_help="Run an entry's missed slots in a range.")
@click.argument("name")
@click.option("--from", "start", required=True, help="First slot: an ISO time, or 6h (ago).")
@click.option("--to", "end", default=None, help="Last slot: an ISO time, or 1h (ago); now.")
@click.option("--dry-run", is_flag=True, help="List the slots, send nothing.")
@actor_option
@click.pass_context
def backfill(
    ctx: click.Context,
    name: str,
    start: str,
    end: str | None,
    dry_run: bool,
    actor_name: str | None,
) -> None:
    """Run entry NAME for each of its slots in a range: a slot that already ran is not run
    again (its run's key is the slot's), so only the missed ones run."""
    app = ctx.obj.app
    app.loader.import_default_modules()
    now = app.runtime.ledger.now  # "6h" ago on the records' clock
    first = parse_since(start, now)
    last = parse_since(end, now) or now()
    assert first is not None
    slots = _checked(
        lambda: backfill_schedule(
            app,
            name,
            first.timestamp(),
            last.timestamp(),
            actor=_actor(actor_name),
            dry_run=dry_run,
        )
    )
    verb = "would send" if dry_run else "sent"
    console.print(f"{name}: {verb} {len(slots)} slot(s) (slots already run are not run again)")
    for slot in slots[:20]:
        console.print(f"  {datetime.fromtimestamp(slot, UTC).isoformat()}")
    if len(slots) > 20:
        console.print(f"  ... and {len(slots) - 20} more")


__all__: list[Any] = ["schedules"]


def _json_option(text: str | None, what: str) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON ({exc})", param_hint=what) from None


@schedules.command(short_help="Declare an entry at run time.")
@click.argument("name")
@click.option("--task", "task_name", required=True, help="The task each run runs (its name).")
@click.option("--every", type=float, default=None, help="Every N seconds (an interval).")
@click.option("--cron", default=None, help="A cron expression: 'minute hour dom month dow'.")
@click.option("--args", "args_json", default=None, help="Its positional arguments (JSON list).")
@click.option("--kwargs", "kwargs_json", default=None, help="Its keyword arguments (JSON).")
@click.option("--queue", default=None, help="The queue its runs go to (the task's tier's).")
@click.option(
    "--policy",
    "policy_json",
    default=None,
    help='Its policy (JSON): {"catch_up": "all", "overlap": "skip", "jitter_seconds": 30, ...}.',
)
@actor_option
@click.pass_context
def create(
    ctx: click.Context,
    name: str,
    task_name: str,
    every: float | None,
    cron: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    queue: str | None,
    policy_json: str | None,
    actor_name: str | None,
) -> None:
    """Declare entry NAME at run time, kept in the ledger (it survives restarts and deploys):
    every scheduler runs it within seconds, each slot once."""
    app = ctx.obj.app
    app.loader.import_default_modules()
    args = _json_option(args_json, "--args") or []
    if not isinstance(args, list):
        raise click.BadParameter("a JSON list", param_hint="--args")
    kwargs = _json_option(kwargs_json, "--kwargs") or {}
    policy = _json_option(policy_json, "--policy") or {}
    if not isinstance(kwargs, dict) or not isinstance(policy, dict):
        raise click.BadParameter("a JSON object", param_hint="--kwargs/--policy")
    definition = _checked(
        lambda: definition_of(
            task_name, every=every, cron=cron, args=args, kwargs=kwargs, queue=queue, policy=policy
        )
    )
    created = _checked(lambda: create_schedule(app, name, definition, actor=_actor(actor_name)))
    console.print(f"{name}: {'created' if created else 'exists already (delete it first)'}")


@schedules.command(short_help="Delete an entry declared at run time.")
@click.argument("name")
@actor_option
@click.pass_context
def delete(ctx: click.Context, name: str, actor_name: str | None) -> None:
    """Delete entry NAME declared at run time (its runs already sent stay jobs)."""
    app = ctx.obj.app
    app.loader.import_default_modules()
    deleted = _checked(lambda: delete_schedule(app, name, actor=_actor(actor_name)))
    console.print(f"{name}: {'deleted' if deleted else 'no such entry declared at run time'}")


@schedules.command(short_help="Show an entry: schedule, task, policy.")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def show(ctx: click.Context, name: str, as_json: bool) -> None:
    """Entry NAME: its schedule, task, policy, origin, last slot sent, next due, pause."""
    app = ctx.obj.app
    _holder, _foreign, states = fleet_state(app)
    found = [s for s in states if s.name == name]
    if not found:
        known = ", ".join(s.name for s in states) or "none"
        raise click.UsageError(f"no schedule entry {name!r} (entries: {known})")
    state = found[0]
    shown = {
        "schedule": state.name,
        "task": state.task,
        "every": state.schedule,
        "policy": state.policy,
        "origin": state.origin,
        "last_slot": state.last_slot,
        "next_due": state.next_due,
        "paused": state.paused,
    }
    if as_json:
        click.echo(json.dumps(shown, indent=2, default=str))
        return
    for field, value in shown.items():
        console.print(f"{field:>10}: {'' if value is None else value}")
