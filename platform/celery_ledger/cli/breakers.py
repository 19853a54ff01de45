"""``celery -A APP ledger breakers ...``: see circuit breakers, force one open or closed."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from .. import audit
from ..operations import force_breaker
from .options import actor_option

console = Console(soft_wrap=True)


@click.group(name="breakers", short_help="Circuit breakers shared by all workers.")
def breakers() -> None:
    """Circuit breakers shared by all workers (state lives in Redis)."""


@breakers.command(name="list", short_help="List breakers, their state and counts.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """Every breaker with its state, counts and when it admits calls again."""
    statuses = ctx.obj.app.breakers.statuses()
    if as_json:
        click.echo(json.dumps([s.__dict__ for s in statuses], indent=2, default=str))
        return
    table = Table(
        "name",
        "state",
        "forced",
        "consecutive failures",
        "window calls/failures",
        "opened at",
        "retry at",
    )
    for status in statuses:
        table.add_row(
            status.name,
            status.state.value,
            "yes" if status.forced else "",
            str(status.consecutive_failures),
            f"{status.calls_in_window}/{status.failures_in_window}",
            _when(status.opened_at),
            _when(status.retry_at),
        )
    console.print(table)


def _force(ctx: click.Context, name: str, action: str, actor: str | None) -> None:
    app = ctx.obj.app
    app.loader.import_default_modules()
    seen = {status.name for status in app.breakers.statuses()}  # (before this one is written)
    declared = {str(t.breaker) for t in app.tasks.values() if getattr(t, "breaker", None)}
    label = force_breaker(app, name, action, actor=audit.current_actor(actor))
    console.print(f"breaker {name}: {label}")
    if name not in seen | declared:
        # Forced all the same (a step's breaker may be named only in code), but most often a
        # typo: say which breakers exist
        known = ", ".join(sorted(seen | declared)) or "none"
        console.print(f"[yellow]note: no task declares breaker {name!r} (known: {known})[/]")


@breakers.command(name="open", short_help="Force a breaker open until cleared.")
@click.argument("name")
@actor_option
@click.pass_context
def open_(ctx: click.Context, name: str, actor_name: str | None) -> None:
    """Force NAME open (tasks using it are deferred) until `clear`."""
    _force(ctx, name, "open", actor_name)


@breakers.command(short_help="Force a breaker closed until cleared.")
@click.argument("name")
@actor_option
@click.pass_context
def close(ctx: click.Context, name: str, actor_name: str | None) -> None:
    """Force NAME closed (calls go through whatever happens) until `clear`."""
    _force(ctx, name, "close", actor_name)


@breakers.command(short_help="Remove a breaker's forced state.")
@click.argument("name")
@actor_option
@click.pass_context
def clear(ctx: click.Context, name: str, actor_name: str | None) -> None:
    """Remove a forced state: the breaker decides again from its counts."""
    _force(ctx, name, "clear", actor_name)


def _when(value: float | None) -> str:
    if value is None:
        return ""
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S")


__all__: list[Any] = ["breakers"]
