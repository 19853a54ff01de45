"""``celery -A APP ledger triggers ...``: see change-stream triggers, reset a stopped one."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from .. import audit
from ..ledger.trigger_store import TriggerStore
from .options import actor_option

console = Console(soft_wrap=True)


@click.group(name="triggers", short_help="Change-stream triggers: list, reset.")
def triggers() -> None:
    """Change-stream triggers (@app.on_change): where each is, and whether it stopped."""


@triggers.command(name="list", short_help="List triggers: place, count, problem.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """Every declared trigger with its watched collection, saved place and problem."""
    app = ctx.obj.app
    app.loader.import_default_modules()  # the modules that declare triggers
    stored = {state.name: state for state in TriggerStore(app.ledger).all()}
    rows = []
    for name, trigger in sorted(app.triggers.items()):
        state = stored.get(name)
        rows.append(
            {
                "trigger": name,
                "collection": trigger.namespace,
                "status": "not watched yet"
                if state is None or (state.token is None and not state.problem)
                else (state.problem or "watching"),
                "changes": 0 if state is None else state.changes,
                "saved_at": None if state is None else state.updated_at,
                "detail": None if state is None else state.detail,
            }
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    table = Table("trigger", "collection", "status", "changes", "saved at", "detail")
    for row in rows:
        table.add_row(
            *(str(row[k] or "") for k in ("trigger", "collection", "status")),
            str(row["changes"]),
            str(row["saved_at"] or ""),
            str(row["detail"] or ""),
        )
    console.print(table)


@triggers.command(short_help="Restart a stopped trigger from now.")
@click.argument("name")
@actor_option
@click.pass_context
def reset(ctx: click.Context, name: str, actor_name: str | None) -> None:
    """Forget NAME's place and problem: its next watcher starts from now. Changes made
    before that are not turned into jobs: run a backfill over the collection for them."""
    app = ctx.obj.app
    app.loader.import_default_modules()
    if name not in app.triggers:
        raise click.UsageError(f"no trigger {name!r} is declared (see `ledger triggers list`)")
    store = TriggerStore(app.ledger)
    before = store.load(name)
    with audit.action(
        app.ledger,
        "trigger_reset",
        name,
        actor=audit.current_actor(actor_name),
        problem=None if before is None else before.problem,
    ) as entry:
        entry.note(reset=store.reset(name))
    console.print(
        f"trigger {name}: reset; its next watcher starts from now. Backfill the collection"
        f" {app.triggers[name].namespace} for the changes before."
    )


__all__: list[Any] = ["triggers"]
