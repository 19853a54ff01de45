"""``celery -A APP ledger keys ...``: rotate encryption keys (see ``celery_ledger.rotation``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from .. import audit
from ..errors import ConfigurationError
from ..rotation import RotationReport, rotate_keys
from ..routing import DEAD_LETTER, unacked_keys
from .options import actor_option

console = Console(soft_wrap=True)


@click.group(name="keys", short_help="Encryption and signing keys: check, reseal.")
def keys() -> None:
    """Encryption and signing keys: seal stored values again with the newest encryption key,
    sign held delayed entries again with the newest signing key; say when an old key can go."""


@keys.command(short_help="Count values an older key still seals.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def check(ctx: click.Context, as_json: bool) -> None:
    """Count sealed values the newest key alone cannot open, by place. Exit status 0: none
    (the older keys can be dropped); 1: some (run `keys reseal`, or wait for queued messages)."""
    report = _rotate(ctx, apply=False)
    _show(report, as_json, verb="sealed with an older key")
    if not report.old_keys_unused:
        ctx.exit(1)


@keys.command(short_help="Seal and sign again with the newest keys.")
@click.option("--json", "as_json", is_flag=True)
@actor_option
@click.pass_context
def reseal(ctx: click.Context, as_json: bool, actor_name: str | None) -> None:
    """Seal every value sealed with an older key again with the newest (audited): the ledger,
    the delayed deliveries, the queues. Then `keys check` says whether an old key can go."""
    app = ctx.obj.app
    actor = audit.current_actor(actor_name)
    with audit.action(app.ledger, "reseal", "encryption keys", actor=actor) as entry:
        report = _rotate(ctx, apply=True)
        total = report.total
        entry.note(
            resealed=total.stale - total.changed_meanwhile,
            unopenable=total.unopenable,
            changed_meanwhile=total.changed_meanwhile,
        )
    _show(report, as_json, verb="sealed again")
    if total.changed_meanwhile:
        console.print("some values changed under the pass: run `keys reseal` again")
    if total.unopenable:
        console.print("some values no listed key opens (sealed with a key dropped too early)")


def _rotate(ctx: click.Context, *, apply: bool) -> RotationReport:
    app = ctx.obj.app
    runtime = app.runtime
    if not runtime.sealer.enabled and not runtime.signer.enabled:
        raise click.ClickException(
            "LEDGER_ENCRYPTION_KEYS and LEDGER_SIGNING_KEYS are empty here: nothing to rotate"
        )
    try:
        return rotate_keys(
            sealer=runtime.sealer,
            ledger=app.ledger,
            delayed=[d for d in (runtime.delayed, runtime.legacy_delayed) if d is not None],
            broker=runtime.redis,
            queues=[*runtime.tiers.queues, runtime.tiers.queue(DEAD_LETTER)],
            unacked_key=unacked_keys(runtime.tiers.namespace).get("unacked_key", "unacked"),
            poison_key=app.dead_letters.poison_key,
            apply=apply,
        )
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from exc


def _show(report: RotationReport, as_json: bool, *, verb: str) -> None:
    if as_json:
        places = {place: asdict(tally) for place, tally in report.places.items()}
        click.echo(json.dumps({"places": places, "total": asdict(report.total)}, indent=2))
        return
    table = Table("place", verb, "no key opens", "changed meanwhile")
    for place, tally in report.places.items():
        table.add_row(place, str(tally.stale), str(tally.unopenable), str(tally.changed_meanwhile))
    total = report.total
    table.add_row(
        "total", str(total.stale), str(total.unopenable), str(total.changed_meanwhile), style="bold"
    )
    console.print(table)


__all__: list[Any] = ["keys"]
