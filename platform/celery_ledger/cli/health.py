"""``celery -A APP ledger health``: is the platform up? Exit 1 when something required is down.

Checks, each with a short timeout: the broker (PING), the ledger (ping and a read), workers per
tier (``inspect active_queues``: which tiers have a worker consuming), dead letters, open
breakers and the broker's replicas a publish waits for while the ledger is away (reported, never
failing), the clocks. ``--tiers`` names the tiers that must have a worker.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..health import run_checks

STYLE = {"ok": "green", "warn": "yellow", "down": "bold red", "skipped": "dim"}

console = Console(soft_wrap=True)


@click.command(name="health", short_help="Check broker, ledger, workers and clocks.")
@click.option(
    "--tiers",
    default=None,
    help="Tiers that must have a worker, comma-separated (default: every tier).",
)
@click.option("--timeout", type=float, default=2.0, show_default=True, help="Seconds per check.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def health(ctx: click.Context, tiers: str | None, timeout: float, as_json: bool) -> None:
    """Broker, ledger, workers per tier, dead letters, breakers; exit 1 if something is down."""
    app = ctx.obj.app
    required = [t.strip() for t in tiers.split(",") if t.strip()] if tiers else app.tiers.names
    for tier in required:
        if tier not in app.tiers.names:
            raise click.BadParameter(
                f"unknown tier {tier!r}; known: {', '.join(app.tiers.names)}", param_hint="--tiers"
            )
    checks = run_checks(app, required=required, timeout=timeout)
    healthy = all(check.status != "down" for check in checks)
    if as_json:
        click.echo(json.dumps({"ok": healthy, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        table = Table("check", "status", "detail", title="celery-ledger health")
        for check in checks:
            style = STYLE[check.status]
            table.add_row(check.name, f"[{style}]{check.status}[/]", escape(check.detail))
        console.print(table)
        console.print("[green]healthy[/]" if healthy else "[bold red]UNHEALTHY[/]")
    ctx.exit(0 if healthy else 1)
