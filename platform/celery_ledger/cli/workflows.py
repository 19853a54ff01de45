"""``celery -A APP ledger workflows ...``: list, inspect, time-travel and act on workflows.

``signal``, ``cancel`` and ``retry`` are audited (the handle writes the entry, with user@host).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..errors import LedgerError
from ..ledger.workflow_log import ACTIVE
from ..workflow.history import TERMINAL
from .dlq import parse_since
from .options import actor_option

console = Console(soft_wrap=True)


def _handle(ctx: click.Context, workflow_id: str) -> Any:
    app = ctx.obj.app
    if app.workflow_engine.log.get_state(workflow_id) is None:
        raise click.ClickException(f"no workflow {workflow_id!r} (not started, or expired)")
    return app.workflow_handle(workflow_id)


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def _when(value: Any) -> str:
    return value.isoformat(timespec="seconds") if isinstance(value, datetime) else str(value or "")


def _brief(data: dict[str, Any], width: int = 90) -> str:
    text = ", ".join(f"{k}={v}" for k, v in data.items() if k != "state")
    return text if len(text) <= width else text[: width - 1] + "…"


def _acting(func: Any) -> Any:
    """Turn the platform's errors into a clear message and exit status 1."""

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except LedgerError as exc:
            raise click.ClickException(str(exc)) from exc

    run.__name__ = func.__name__
    run.__doc__ = func.__doc__
    return run


@click.group(name="workflows", short_help="Durable workflows: inspect, signal, cancel.")
def workflows() -> None:
    """Durable workflows: list, show, history, state, signal, cancel, retry."""


@workflows.command(name="list", short_help="List workflows, most recent first.")
@click.option("--status", help="Only this status (running, stuck, completed, failed, ...).")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@_acting
def list_(ctx: click.Context, status: str | None, limit: int, as_json: bool) -> None:
    """Workflows, most recently changed first, and how many there are by status."""
    log = ctx.obj.app.workflow_engine.log
    counts = log.count_by_status()
    known = {*ACTIVE, *TERMINAL, *counts}  # (a misspelt one listed none, as if all were well)
    if status is not None and status not in known:
        choices = ", ".join(sorted(known))
        raise click.BadParameter(f"{status!r}: one of {choices}", param_hint="--status")
    docs = log.listing(status=status, limit=limit)
    rows = [
        {
            "id": d["_id"],
            "workflow": d.get("workflow"),
            "key": d.get("key"),
            "status": d.get("status"),
            "updated_at": d.get("updated_at"),
            "error": d.get("error"),
        }
        for d in docs
    ]
    if as_json:
        _echo_json({"counts": counts, "workflows": rows})
        return
    summary = ", ".join(f"{name} {count}" for name, count in sorted(counts.items())) or "none"
    table = Table("id", "workflow", "key", "status", "updated", "error", title=summary)
    for row in rows:
        table.add_row(
            str(row["id"]),
            str(row["workflow"]),
            str(row["key"]),
            str(row["status"]),
            _when(row["updated_at"]),
            str(row["error"] or "")[:60],
        )
    console.print(table)


@workflows.command(short_help="Show where a workflow stands.")
@click.argument("workflow_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@_acting
def show(ctx: click.Context, workflow_id: str, as_json: bool) -> None:
    """Where a workflow stands: status, result or error, steps done and pending, waits."""
    status = _handle(ctx, workflow_id).status()
    fields = dataclasses.asdict(status)
    if as_json:
        _echo_json(fields)
        return
    table = Table(show_header=False, box=None)
    for name, value in fields.items():
        shown = ", ".join(value) if isinstance(value, list) else _when(value)
        table.add_row(name, shown if value is not None else "")
    console.print(table)


@workflows.command(short_help="Show every event of a workflow's log.")
@click.argument("workflow_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@_acting
def history(ctx: click.Context, workflow_id: str, as_json: bool) -> None:
    """Every event of the log: sequence, time, kind, worker, fence (the position it was
    decided from) and what it recorded."""
    events = _handle(ctx, workflow_id).history()
    if as_json:
        _echo_json([dataclasses.asdict(e) for e in events])
        return
    table = Table("seq", "at", "kind", "worker", "fence", "data", title=workflow_id)
    for event in events:
        table.add_row(
            str(event.seq),
            event.at.isoformat(timespec="milliseconds"),
            event.kind,
            event.worker,
            str(event.fence),
            _brief(event.data),
        )
    console.print(table)


@workflows.command(short_help="Show a workflow's state, now or as of then.")
@click.argument("workflow_id")
@click.option("--as-of", "as_of", help="Rebuild the state at this moment: ISO time, or 30m ago.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@_acting
def state(ctx: click.Context, workflow_id: str, as_of: str | None, as_json: bool) -> None:
    """The state folded from the log, now or as it was at a moment (time travel)."""
    # "30m ago" on the clock the events were stamped on (the ledger's), not this host's
    moment = parse_since(as_of, ctx.obj.app.runtime.ledger.now)
    rebuilt = _handle(ctx, workflow_id).state(moment)
    if as_json:
        _echo_json(rebuilt.to_dict())
        return
    when = f" as of {as_of}" if as_of else ""
    console.print(f"[bold]{workflow_id}[/] {rebuilt.workflow}: {rebuilt.status}{when}")
    if rebuilt.error:
        console.print(f"error: {rebuilt.error}")
    table = Table("pos", "kind", "name", "status", "result / error", "compensation")
    for pos in sorted(rebuilt.commands):
        command = rebuilt.commands[pos]
        outcome = command.error if command.status == "failed" else command.result
        if command.kind == "version":
            outcome = f"version {command.version}"
        table.add_row(
            str(pos),
            command.kind,
            command.name,
            command.status,
            str(outcome or "")[:60],
            str(command.run_status or ""),
        )
    console.print(table)


@workflows.command(short_help="Send a signal to a workflow.")
@click.argument("workflow_id")
@click.argument("name")
@click.option("--payload", default="null", help="The signal's payload, as JSON.")
@click.option("--signal-id", help="Makes the send idempotent: a repeat of this id counts once.")
@click.option("--json", "as_json", is_flag=True)
@actor_option
@click.pass_context
@_acting
def signal(
    ctx: click.Context,
    workflow_id: str,
    name: str,
    payload: str,
    signal_id: str | None,
    as_json: bool,
    actor_name: str | None,
) -> None:
    """Send signal NAME (kept until a wait for it consumes it; delivered once)."""
    try:
        value = json.loads(payload)
    except ValueError as exc:
        raise click.BadParameter(f"--payload is not JSON: {exc}") from exc
    added = _handle(ctx, workflow_id).signal(name, value, signal_id=signal_id, actor=actor_name)
    if as_json:
        _echo_json({"id": workflow_id, "action": "signal", "signal": name, "added": added})
        return
    console.print(f"signal {name} " + ("sent" if added else "was sent before (not repeated)"))


@workflows.command(short_help="Cancel a workflow (its steps compensated).")
@click.argument("workflow_id")
@click.option("--reason", default="", help="Why (kept in the log and the audit trail).")
@click.option("--json", "as_json", is_flag=True)
@actor_option
@click.pass_context
@_acting
def cancel(
    ctx: click.Context, workflow_id: str, reason: str, as_json: bool, actor_name: str | None
) -> None:
    """Cancel: raised into the code at its next wait or new step, once the steps in flight
    have ended (each step that ran is compensated); child workflows are cancelled at once."""
    _handle(ctx, workflow_id).cancel(reason, actor=actor_name)
    if as_json:
        _echo_json({"id": workflow_id, "action": "cancel", "reason": reason})
        return
    console.print(f"cancel requested for {workflow_id}")


@workflows.command(short_help="Resume a stuck workflow, or run it again.")
@click.argument("workflow_id")
@click.option("--from-step", type=int, default=None, help="Run again from this position.")
@click.option("--json", "as_json", is_flag=True)
@actor_option
@click.pass_context
@_acting
def retry(
    ctx: click.Context,
    workflow_id: str,
    from_step: int | None,
    as_json: bool,
    actor_name: str | None,
) -> None:
    """Resume a stuck workflow, or run an ended one again from a step (default: its first
    failed step), under a new generation of step jobs."""
    event = _handle(ctx, workflow_id).retry(from_step, actor=actor_name)
    if as_json:
        _echo_json({"id": workflow_id, "action": "retry", "event": event})
        return
    resumed_from = (event.get("data") or {}).get("from_pos")
    console.print(
        f"{workflow_id} resumed" + ("" if resumed_from is None else f" from step {resumed_from}")
    )
