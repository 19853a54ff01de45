"""``celery -A APP ledger ...``: celery-ledger's commands, a Celery sub-command group.

Installed through the ``celery.commands`` entry point, so they run with the app that ``-A``
names (``ctx.obj.app``). Celery loads every such plugin when its command line starts, for
``celery worker`` and ``celery beat`` too: this module is the group alone, and its commands
(rich, the console, every sub-group) are imported when a ``ledger`` command is asked for (a
worker's start read them for nothing: about 60 ms of CPU, a tenth of its imports).
"""

from __future__ import annotations

import click

from .. import __version__
from .group import LedgerGroup


@click.group(
    name="ledger",
    cls=LedgerGroup,
    commands_from="celery_ledger.cli.commands",
    short_help="Exactly-once tasks with a MongoDB ledger.",
)
@click.version_option(__version__, prog_name="celery-ledger", message="%(prog)s %(version)s")
@click.pass_context
def ledger(ctx: click.Context) -> None:
    """celery-ledger: exactly-once tasks with a MongoDB ledger."""


__all__ = ["ledger"]
