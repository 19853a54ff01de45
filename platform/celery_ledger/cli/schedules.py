"""``celery -A APP ledger schedules ...``: the app's periodic tasks and where each one is."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..schedules import fleet_state

console = Console(soft_wrap=True)


@click.group(name="schedules")
def schedules() -> None:
    """Periodic tasks (the app's beat_schedule): last slot sent, next due, who fires them."""


@schedules.command(name="list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """Every entry of the app's schedule with its last slot sent and its next one."""
    app = ctx.obj.app
    app.loader.import_default_modules()  # (modules may add entries when imported)
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
            }
            for s in states
        ]
        listed = {"fired_by": holder, "foreign_beat": foreign, "schedules": rows}
        click.echo(json.dumps(listed, indent=2, default=str))
        return
    console.print(f"fired by: {fired_by}")
    table = Table("schedule", "task", "every", "last slot sent", "next due")
    for s in states:
        table.add_row(
            s.name,
            s.task,
            s.schedule,
            "never" if s.last_slot is None else s.last_slot.isoformat(),
            "" if s.next_due is None else s.next_due.isoformat(),
        )
    console.print(table)


__all__: list[Any] = ["schedules"]
