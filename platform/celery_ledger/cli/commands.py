"""The command implementations (click, with rich tables), added to the ``ledger`` group when
it first lists or finds a command (celery_ledger/cli/__init__.py says why)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ..ledger.record import State
from ..routing import TIER_WORKER_DEFAULTS, TIERS
from . import ledger
from .breakers import breakers
from .dlq import dlq
from .health import health
from .keys import keys
from .schedules import schedules
from .tenants import tenants
from .triggers import triggers
from .workflows import workflows

console = Console()


def _app(ctx: click.Context) -> Any:
    return ctx.obj.app


def _app_path(ctx: click.Context) -> str:
    """The ``-A`` value the user gave celery (workers we start import the same app)."""
    root = ctx.find_root()
    value = root.params.get("app")
    if not value:
        raise click.UsageError("name the app: celery -A your.module ledger ...")
    return str(value)


ledger.add_command(dlq)
ledger.add_command(breakers)
ledger.add_command(health)
ledger.add_command(keys)
ledger.add_command(workflows)
ledger.add_command(triggers)
ledger.add_command(schedules)
ledger.add_command(tenants)


@ledger.command(name="console", short_help="Serve the operator console.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8077, show_default=True, help="Port to listen on.")
@click.pass_context
def console_(ctx: click.Context, host: str, port: int) -> None:
    """Serve the operator console (logins from LEDGER_CONSOLE_USERS)."""
    try:
        import uvicorn

        from ..console import create_console
    except ImportError as exc:
        raise click.ClickException(
            f"the console needs the console extra: pip install 'celery-ledger[console]' ({exc})"
        ) from exc
    web = create_console(_app(ctx))
    console.print(f"console on http://{host}:{port}/", highlight=False)
    # No access log: a job search's query string may hold a sensitive task's key.
    uvicorn.run(web, host=host, port=port, log_level="info", proxy_headers=False, access_log=False)


@ledger.command(name="provision-users", short_help="Create the ledger's role and the app's user.")
@click.option("--user", default="ledger", show_default=True, help="The user the app connects as.")
@click.option(
    "--app-database",
    "app_databases",
    multiple=True,
    help="A database of the app's own data (atomic steps write it): readWrite. Repeatable.",
)
@click.pass_context
def provision_users(ctx: click.Context, user: str, app_databases: tuple[str, ...]) -> None:
    """Create or update the ledger's least-privilege MongoDB role and the app's user.

    Secrets come from the environment only, never a command line: the administrator's URI
    from $LEDGER_MONGO_ADMIN_URI, the user's password from $LEDGER_MONGO_APP_PASSWORD.
    Idempotent: run it before the workers on every deploy."""
    from ..ledger.access import ROLE, provision

    admin_uri = os.environ.get("LEDGER_MONGO_ADMIN_URI", "")
    password = os.environ.get("LEDGER_MONGO_APP_PASSWORD", "")
    if not admin_uri or not password:
        raise click.UsageError("set LEDGER_MONGO_ADMIN_URI and LEDGER_MONGO_APP_PASSWORD")
    settings = _app(ctx).settings
    provision(
        admin_uri,
        database=settings.mongo_db,
        collection=settings.ledger_collection,
        user=user,
        password=password,
        app_databases=app_databases,
    )
    console.print(
        f"user [bold]{user}[/] has role {ROLE} on {settings.mongo_db}.{settings.ledger_collection}*"
        + (f" and readWrite on {', '.join(app_databases)}" if app_databases else ""),
        highlight=False,
    )


@ledger.command(short_help="Run a worker for one tier.")
@click.option("--tier", type=click.Choice(TIERS), required=True, help="The tier to consume.")
@click.option("--concurrency", "-c", type=int, default=None, help="Pool processes (tier default).")
@click.argument("worker_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def worker(
    ctx: click.Context, tier: str, concurrency: int | None, worker_args: tuple[str, ...]
) -> None:
    """Run a worker for one tier: ``celery worker -Q TIER`` with the tier's defaults."""
    defaults = TIER_WORKER_DEFAULTS[tier]
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        _app_path(ctx),
        "worker",
        "-Q",
        _app(ctx).tiers.queue(tier),
        "-n",
        f"{tier}@%h",
        "-c",
        str(concurrency or defaults.concurrency),
        "--prefetch-multiplier",
        str(defaults.prefetch_multiplier),
        *worker_args,
    ]
    console.print(f"[bold]tier {tier}[/]: {' '.join(argv[2:])}", highlight=False)
    os.execv(sys.executable, argv)


@ledger.command(short_help="Run the embedded stack until Ctrl-C.")
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    default=Path(".ledger-dev"),
    show_default=True,
    help="Where the servers keep their data (survives restarts).",
)
@click.option("--broker-port", type=int, default=None, help="valkey-server port (default: free).")
@click.option("--ledger-port", type=int, default=None, help="SecantusDB port (default: free).")
@click.option("--workers/--no-workers", default=True, help="Start one worker per tier.")
@click.option("--auth/--no-auth", default=True, help="Random passwords for broker and ledger.")
@click.option("--flower/--no-flower", default=None, help="Start Flower (default: if installed).")
@click.option("--flower-port", type=int, default=None, help="Flower's port (default: free).")
@click.option("--flower-user", default=None, help="Flower basic-auth user (default: flower).")
@click.option("--flower-password", default=None, help="Flower password (default: random).")
@click.option(
    "--console/--no-console",
    "web_console",
    default=None,
    help="Start the operator console (default: if installed).",
)
@click.option(  # the flag's name until 2026-11: kept, hidden, for one release
    "--web-console/--no-web-console", "old_web_console", default=None, hidden=True
)
@click.option("--console-port", type=int, default=None, help="The console's port (default: free).")
@click.pass_context
def stack(
    ctx: click.Context,
    data_dir: Path,
    broker_port: int | None,
    ledger_port: int | None,
    workers: bool,
    auth: bool,
    flower: bool | None,
    flower_port: int | None,
    flower_user: str | None,
    flower_password: str | None,
    web_console: bool | None,
    old_web_console: bool | None,
    console_port: int | None,
) -> None:
    """Run the embedded stack (broker, ledger, a worker per tier, Flower, the console) until
    Ctrl-C."""
    import importlib.util

    from ..embedded.stack import running_stack

    app_path = _app_path(ctx)
    if web_console is None and old_web_console is not None:
        web_console = old_web_console
        console.print("(--web-console is now --console; the old name goes in the next release)")
    skipped = []  # what is not installed, so not started unless asked for by name
    if flower is None:
        flower = importlib.util.find_spec("flower") is not None
        if not flower:
            skipped.append(("Flower", "flower"))
    if web_console is None:
        web_console = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "jinja2"))
        if not web_console:
            skipped.append(("the console", "console"))
    # Ctrl-C and SIGTERM stop it (while it starts too: what started is stopped), whatever this
    # process inherited: a stack started as a script's background job (or by a test runner)
    # finds SIGINT ignored, and Python then installs no KeyboardInterrupt for it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    with running_stack(
        app_path,
        data_dir,
        queue_namespace=_app(ctx).tiers.namespace,
        workers=workers,
        broker_port=broker_port,
        ledger_port=ledger_port,
        auth=auth,
        flower=flower,
        flower_port=flower_port,
        flower_user=flower_user,
        flower_password=flower_password,
        console=web_console,
        console_port=console_port,
    ) as running:
        app = _app(ctx)
        console.print("[bold green]celery-ledger embedded stack is up[/]")
        console.print(
            f"Its workers run the app [bold]{app_path}[/] ({app.main}): queues"
            f" {', '.join(app.tiers.queues)}. Publish from a shell with the variables below.",
            highlight=False,
            soft_wrap=True,
        )
        env_file = running.write_env_file()
        console.print(running.describe(), highlight=False, soft_wrap=True)
        console.print(
            f"\nIn another shell: [bold]source {env_file}[/] (the URLs and the logins,"
            " readable by you only)",
            highlight=False,
            soft_wrap=True,
        )
        for what, extra in skipped:
            console.print(
                f"{what} not started: its extra is not installed"
                f" (pip install 'celery-ledger[{extra}]')",
                markup=False,  # [extra] is no style
                highlight=False,
                soft_wrap=True,
            )
        console.print("Ctrl-C stops every process listed above.")
        try:
            while True:
                time.sleep(0.5)
                dead = [w.name for w in running.workers if not w.alive()]
                if dead:
                    console.print(f"[red]worker(s) exited: {', '.join(dead)}[/]")
                    break
        except KeyboardInterrupt:  # (a second one interrupts a stop that hangs)
            pass
        console.print("stopping...")


def _task_named(app: Any, name: str) -> str:
    """The full name of the app's task ``name`` names: itself, or the one task whose last
    dotted part is ``name`` (``charge`` for ``myapp.tasks.charge``). A name the app does not
    know is taken as it is (a task of another service)."""
    if "." in name:
        return name
    app.loader.import_default_modules()  # the modules of its include=, as a worker imports
    found = sorted(task for task in app.tasks if task.rpartition(".")[2] == name)
    if len(found) > 1:
        raise click.UsageError(f"{name} names several tasks: {', '.join(found)}; give one in full")
    return found[0] if found else name


@ledger.command(name="finish-upgrade", short_help="Retire what an earlier release needed.")
@click.pass_context
def finish_upgrade(ctx: click.Context) -> None:
    """Retire what an earlier release needed, once none of its workers or producers runs.

    Today: the records' two sparse indexes of releases before 2026-11-26 (``objective``,
    ``replacement_due``), which every job's writes pay for; their open latency objectives are
    copied to the ledger's ``_objectives`` first. Until then, workers of this release read
    both. Idempotent."""
    report = _app(ctx).ledger.finish_upgrade()
    for what, count in report.items():
        console.print(f"{what}: {count}", highlight=False)


@ledger.command(name="reconcile", short_help="Republish jobs whose worker died.")
@click.option("--dry-run", is_flag=True, help="Report what would be done; change nothing.")
@click.option("--grace", type=float, default=None, help="Lease grace seconds (setting).")
@click.option("--stale-after", type=float, default=None, help="Stale seconds (setting).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def reconcile_command(
    ctx: click.Context, dry_run: bool, grace: float | None, stale_after: float | None, as_json: bool
) -> None:
    """Republish jobs whose worker died or whose message is gone (fencing keeps it safe)."""
    report = _app(ctx).reconciler.sweep(
        lease_grace_seconds=grace, stale_after_seconds=stale_after, dry_run=dry_run
    )
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
        return
    table = Table("found / done", "count", title="reconcile" + (" (dry run)" if dry_run else ""))
    for name, value in report.as_dict().items():
        table.add_row(name.replace("_", " "), str(len(value) if isinstance(value, list) else value))
    console.print(table)


@ledger.command(short_help="A job's record, or a tenant's records.")
@click.argument("job", required=False)
@click.argument("key", required=False)
@click.option(
    "--tenant",
    help="Without JOB: list this tenant's records, the most recently changed first. With JOB:"
    " show it only if it is this tenant's.",
)
@click.option(
    "--state",
    type=click.Choice([state.value for state in State]),
    help="With --tenant and no JOB: only records in this state.",
)
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the raw record as JSON.")
@click.pass_context
def show(
    ctx: click.Context,
    job: str | None,
    key: str | None,
    tenant: str | None,
    state: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """Show a job's ledger record: ``show JOB_ID`` (the Celery task id, ``AsyncResult.id``)
    or ``show TASK KEY`` (TASK: the task's full name, or its short name when only one task
    of the app has it); or list a tenant's records: ``show --tenant NAME [--state S]``."""
    app = _app(ctx)
    if job is None:
        if tenant is None:
            raise click.UsageError("name a job (JOB_ID, or TASK KEY), or a tenant: --tenant NAME")
        _list_tenant(app, tenant, State(state) if state else None, limit, as_json)
        return
    if key is None:
        record = app.ledger.get_by_id(job)
        if record is None:
            raise click.ClickException(
                f"no ledger record with the id {job}.\n"
                "Give the job's Celery task id, or its task and key: ledger show TASK KEY"
            )
    else:
        task_name = _task_named(app, job)
        record = app.ledger.get(task_name, key)
        if record is None:
            raise click.ClickException(f"no ledger record for {task_name} / {key}")
    if tenant is not None and record.tenant != tenant:
        owner = f"tenant {record.tenant!r}'s" if record.tenant else "no tenant's"
        raise click.ClickException(f"{record.id} is {owner}, not tenant {tenant!r}'s")
    if as_json:
        click.echo(json.dumps(record.model_dump(mode="json"), indent=2))
        return
    table = Table(show_header=False, box=None)
    table.add_row("status", record.status)  # what a poller sees: late, or degraded results served
    for name, value in record.model_dump(exclude={"errors", "result_json"}).items():
        table.add_row(name, str(value))
    table.add_row("result", record.result_json or "")
    console.print(table)
    if record.errors:
        errors = Table("at", "attempt", "type", "message", "worker", title="errors")
        for error in record.errors:
            errors.add_row(
                error.at.isoformat(timespec="seconds"),
                str(error.attempt),
                error.type,
                error.message[:80],
                error.worker,
            )
        console.print(errors)


def _list_tenant(app: Any, tenant: str, state: State | None, limit: int, as_json: bool) -> None:
    """``show --tenant``: the tenant's records (the ledger's ``of_tenant``), without their
    arguments or results (``show JOB_ID`` shows one whole)."""
    docs = app.ledger.of_tenant(tenant, state=state, limit=limit + 1)
    more, docs = len(docs) > limit, docs[:limit]
    rows = [
        {name: doc.get(name) for name in ("_id", "task", "key", "tier", "state", "updated_at")}
        for doc in docs
    ]
    if more:  # on stderr, so that --json output stays one document
        click.echo(f"the {limit} most recently changed; more exist: raise --limit", err=True)
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    title = f"tenant {tenant}: {len(rows)} records" + (" (more exist)" if more else "")
    table = Table("id", "task", "key", "tier", "state", "changed", title=title)
    for row in rows:
        changed = row["updated_at"]
        table.add_row(
            str(row["_id"]),
            str(row["task"]),
            str(row["key"]),
            str(row["tier"]),
            str(row["state"]),
            changed.isoformat(timespec="seconds") if hasattr(changed, "isoformat") else "",
        )
    console.print(table)
