"""``celery -A APP ledger dlq ...``: triage and replay of dead-lettered jobs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import click
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .. import audit
from ..deadletter import PAGE_SIZE, PURGE_LIMIT, since_of
from ..ledger.record import tenant_of_document
from ..operations import purge_dead, replay_dead
from .options import actor_option

console = Console(soft_wrap=True)


def parse_since(value: str | None, now: Callable[[], datetime] | None = None) -> datetime | None:
    """``30m``, ``2h``, ``7d`` ago (from ``now``), or an ISO time (UTC if naive)."""
    try:
        return since_of(value, now)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def _dead_letters(ctx: click.Context) -> Any:
    return ctx.obj.app.dead_letters


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


filters = [
    click.option("--task", "task_name", help="Only this task."),
    click.option("--reason", help="Only reasons containing this text."),
    click.option("--since", help="Only dead since: 30m, 2h, 7d or an ISO time."),
    click.option("--tenant", help="Only this tenant's jobs (the record's, or its message's)."),
]


def with_filters(func: Any) -> Any:
    for option in reversed(filters):
        func = option(func)
    return func


@click.group(name="dlq")
def dlq() -> None:
    """Dead letters: list, show, replay, purge."""


@dlq.command(name="list", short_help="List dead jobs grouped by fingerprint.")
@with_filters
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--records", is_flag=True, help="One row per record instead of per fingerprint.")
@click.pass_context
def list_(
    ctx: click.Context,
    task_name: str | None,
    reason: str | None,
    since: str | None,
    tenant: str | None,
    limit: int,
    as_json: bool,
    records: bool,
) -> None:
    """Dead jobs grouped by error fingerprint (exception type and the frame that raised it)."""
    dead = _dead_letters(ctx)
    # One more than asked for: whether the listing is all there is, or its newest part.
    docs = dead.find(
        task=task_name,
        reason=reason,
        since=parse_since(since, dead.ledger_now),
        tenant=tenant,
        limit=limit + 1,
    )
    more = len(docs) > limit
    docs = docs[:limit]
    if more:  # on stderr, so that --json output stays one document
        click.echo(
            f"showing the newest {limit} dead jobs; more exist: raise --limit, or narrow with"
            " --task, --reason, --since or --tenant (replay and purge by filter take every match)",
            err=True,
        )
    shown = (
        f"{len(docs)} dead jobs (newest {limit}; more exist)" if more else f"{len(docs)} dead jobs"
    )
    if records:
        rows = [
            {
                "id": d["_id"],
                "task": d.get("task"),
                "key": d.get("key"),
                "tenant": tenant_of_document(d),
                "reason": d.get("dead_reason"),
                "fingerprint": d.get("fingerprint"),
                "dead_at": d.get("finished_at"),
                "attempts": d.get("attempts"),
            }
            for d in docs
        ]
        if as_json:
            _echo_json(rows)
            return
        table = Table("id", "task", "key", "tenant", "reason", "dead at", title=shown)
        for row in rows:
            table.add_row(
                row["id"],
                str(row["task"]),
                str(row["key"]),
                str(row["tenant"] or "-"),
                str(row["reason"])[:60],
                _when(row["dead_at"]),
            )
        console.print(table)
        return
    groups = dead.groups(docs)
    if as_json:
        _echo_json(groups)
        return
    table = Table(
        "fingerprint",
        "count",
        "task",
        "reason",
        "error",
        "first",
        "last",
        "example key",
        title=f"{shown} in {len(groups)} groups",
    )
    for group in groups:
        table.add_row(
            group["fingerprint"],
            str(group["count"]),
            ", ".join(map(str, group["tasks"])),
            ", ".join(group["reasons"]),
            str(group["fingerprint_text"])[:60],
            _when(group["first"]),
            _when(group["last"]),
            str(group["example"]),
        )
    console.print(table)


@dlq.command(short_help="Show one dead job and its message.")
@click.argument("ident")
@click.option("--task", "task_name", help="The task, when IDENT is a key used by several.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def show(ctx: click.Context, ident: str, task_name: str | None, as_json: bool) -> None:
    """A dead job by record id or idempotency key: reason, errors, original message."""
    doc = _dead_letters(ctx).get(ident, task=task_name)
    if doc is None:
        raise click.ClickException(f"no record {ident!r}")
    if as_json:
        _echo_json(doc)
        return
    table = Table(show_header=False, box=None)
    for name in (
        "_id",
        "task",
        "key",
        "tier",
        "state",
        "attempts",
        "dead_reason",
        "fingerprint",
        "fingerprint_text",
        "finished_at",
        "replays",
    ):
        table.add_row(name, str(doc.get(name, "")))
    if doc.get("unauthenticated"):  # filed under its digest: what it claims is not trusted
        table.add_row("unauthenticated", str(doc["unauthenticated"]))
        table.add_row("claims to be", json.dumps(doc.get("claimed"), default=str))
    message = doc.get("message") or {}
    table.add_row("args", str(message.get("args_json", "(raw message)")))
    table.add_row("kwargs", str(message.get("kwargs_json", "")))
    console.print(table)
    errors = Table("at", "attempt", "action", "type", "message", "delay", title="error history")
    for error in doc.get("errors", []):
        delay = error.get("planned_delay_seconds")
        errors.add_row(
            _when(error.get("at")),
            str(error.get("attempt")),
            error.get("action", ""),
            error.get("type", ""),
            str(error.get("message", ""))[:70],
            "" if delay is None else f"{delay:.1f}s",
        )
    console.print(errors)


@dlq.command(short_help="Republish dead jobs to their tier.")
@click.argument("ident", required=False)
@with_filters
@click.option("--dry-run", is_flag=True, help="Say what would be replayed; change nothing.")
@click.option(
    "--force-unsigned",
    is_flag=True,
    help="Also replay messages that failed authentication (unsigned or badly signed): the"
    " replay signs them as they are, so check each first (`dlq show`). Audited.",
)
@click.option(
    "--page-size",
    type=click.IntRange(min=1),
    default=PAGE_SIZE,
    show_default=True,
    help="Dead records read per ledger query (a filter replays every match).",
)
@click.option("--json", "as_json", is_flag=True)
@actor_option
@click.pass_context
def replay(
    ctx: click.Context,
    ident: str | None,
    task_name: str | None,
    reason: str | None,
    since: str | None,
    tenant: str | None,
    dry_run: bool,
    force_unsigned: bool,
    page_size: int,
    as_json: bool,
    actor_name: str | None,
) -> None:
    """Republish dead jobs to their tier, attempts reset, same key (so nothing runs twice).

    A filter replays every dead record that matches, however many."""
    dead = _dead_letters(ctx)
    docs: Iterable[dict[str, Any]]
    if ident:
        doc = dead.get(ident, task=task_name)
        if doc is None:
            raise click.ClickException(f"no record {ident!r}")
        docs = [doc]
    elif task_name or reason or since or tenant:
        docs = dead.each(
            task=task_name,
            reason=reason,
            since=parse_since(since, dead.ledger_now),
            tenant=tenant,
            page_size=page_size,
        )
    else:
        raise click.UsageError(
            "name a record (ID or KEY) or a filter (--task/--reason/--since/--tenant)"
        )
    if force_unsigned:
        click.echo(
            "--force-unsigned: messages that failed authentication are signed and run as the"
            " jobs they claim to be; each replay is audited as forced",
            err=True,
        )
    outcomes = []
    actor = audit.current_actor(actor_name)
    with Progress(console=console, transient=True, disable=as_json or bool(ident)) as progress:
        bar = progress.add_task("replaying", total=None)
        for outcome in replay_dead(
            ctx.obj.app, docs, actor=actor, dry_run=dry_run, force_unsigned=force_unsigned
        ):
            outcomes.append(outcome)
            progress.advance(bar)
    if as_json:
        _echo_json([o.__dict__ for o in outcomes])
        return
    for outcome in outcomes:
        done_label = "would replay" if dry_run else "replayed"
        if outcome.forced:
            done_label += " (forced, unauthenticated)"
        mark = f"[green]{done_label}[/]" if outcome.replayed else "[yellow]skipped[/]"
        console.print(f"{mark} {outcome.record_id}: {outcome.detail}")
    done = sum(o.replayed for o in outcomes)
    console.print(f"{done} of {len(outcomes)} {'would be ' if dry_run else ''}replayed")


@dlq.command(short_help="Delete dead records, after asking.")
@with_filters
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@actor_option
@click.pass_context
def purge(
    ctx: click.Context,
    task_name: str | None,
    reason: str | None,
    since: str | None,
    tenant: str | None,
    yes: bool,
    actor_name: str | None,
) -> None:
    """Delete dead records (after asking; the audit entry lists every record id removed)."""
    dead = _dead_letters(ctx)
    docs = dead.find(
        task=task_name,
        reason=reason,
        since=parse_since(since, dead.ledger_now),
        tenant=tenant,
        limit=PURGE_LIMIT,
    )
    if not docs:
        console.print("nothing to purge")
        return
    if len(docs) == PURGE_LIMIT:
        console.print(f"at most {PURGE_LIMIT} records per purge: run it again for the rest")
    if not yes:
        every = not (task_name or reason or since or tenant)
        what = f"{len(docs)} dead records" + (" (every one, no filter given)" if every else "")
        click.confirm(f"Delete {what} for good?", abort=True)
    purged = purge_dead(
        ctx.obj.app,
        docs,
        actor=audit.current_actor(actor_name),
        filters={"task": task_name, "reason": reason, "since": since, "tenant": tenant},
    )
    console.print(f"purged {len(purged.removed)} dead records")
    if purged.left:
        console.print(
            f"{len(purged.left)} of the {len(docs)} selected were no longer dead (replayed or"
            " purged meanwhile) and were left as they are"
        )


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if isinstance(value, datetime) else str(value or "")
