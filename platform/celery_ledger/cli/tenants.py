"""``celery -A APP ledger tenants ...``: each tier's tenants with work, and the lanes' drain."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from .. import audit
from ..errors import ConfigurationError
from ..operations import drain_lanes
from ..tenancy import policy_of
from .options import actor_option

console = Console(soft_wrap=True)


@click.group(name="tenants", short_help="Tenants' waiting jobs (fair dispatch).")
def tenants() -> None:
    """Tenants and fair dispatch: each tier's tenants with work, their policies, the drain."""


@tenants.command(name="list", short_help="Each tier's tenants with work.")
@click.option("--tier", default=None, help="One tier (default: every tier).")
@click.option("--top", default=20, show_default=True, type=click.IntRange(0, 10_000))
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def list_(ctx: click.Context, tier: str | None, top: int, as_json: bool) -> None:
    """The tenants with jobs waiting in each tier's lanes or running (limited tenants), the
    most waiting first, the rest summed as ``other``; and each one's policy."""
    app = ctx.obj.app
    names = _tiers(app, tier)  # (a tier misspelt is the first thing to say)
    fair = _fair(app)
    policies = app.settings.tenants
    rows: list[dict[str, Any]] = []
    for name in names:
        for share in fair.shares(app.tiers.queue(name), top=top):
            policy = policy_of(policies, share.tenant)
            rows.append(
                {
                    "tier": name,
                    "tenant": share.tenant,
                    "tenants": share.tenants,
                    "waiting": share.waiting,
                    "running": share.running,
                    "weight": policy.weight,
                    "concurrency": policy.concurrency,
                    "max_waiting": policy.max_waiting,
                }
            )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print("no tenant has jobs waiting or running")
        return
    table = Table("tier", "tenant", "waiting", "running", "weight", "concurrency", "max waiting")
    for row in rows:
        name = row["tenant"] if row["tenants"] == 1 else f"{row['tenant']} ({row['tenants']})"
        table.add_row(
            row["tier"],
            name,
            str(row["waiting"]),
            str(row["running"]),
            str(row["weight"]),
            _limit(row["concurrency"]),
            _limit(row["max_waiting"]),
        )
    console.print(table)


@tenants.command(short_help="Move the lanes' jobs to their queues.")
@click.option("--tier", default=None, help="One tier (default: every tier).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@actor_option
@click.pass_context
def drain(ctx: click.Context, tier: str | None, yes: bool, actor_name: str | None) -> None:
    """Move the jobs waiting in the tenants' lanes to their tier queue as they are (fairness
    given up for them), audited. Before rolling the workers back to a release without fair
    dispatch: its workers never feed the lanes (a publish does it too, once no worker of this
    release marks the tier as fed)."""
    app = ctx.obj.app
    names = _tiers(app, tier)
    if not yes:
        click.confirm(
            f"Move every tenant's waiting jobs of {', '.join(names)} to the queue?", abort=True
        )
    moved = drain_lanes(app, names, actor=audit.current_actor(actor_name))
    for name, count in moved.items():
        console.print(f"{name}: {count} moved to {app.tiers.queue(name)}")


def _fair(app: Any) -> Any:
    fair = app.runtime.fair
    if fair is None:
        raise ConfigurationError(
            "fair dispatch is off here (LEDGER_FAIR_QUEUE_DEPTH=0): no tenant lanes to read"
        )
    return fair


def _tiers(app: Any, tier: str | None) -> list[str]:
    if tier is None:
        return list(app.tiers.names)
    return [app.tiers.check(tier, where="--tier")]


def _limit(value: int | None) -> str:
    return "-" if value is None else str(value)


__all__: list[Any] = ["tenants"]
