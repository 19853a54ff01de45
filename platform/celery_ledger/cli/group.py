"""The ``ledger`` group's one error handler: a mistake is one or two lines, never a traceback.

Every ``celery -A APP ledger ...`` command, nested groups included, runs inside
:meth:`LedgerGroup.invoke`; an exception :func:`celery_ledger.explain.explain` knows (a
setting, an unreachable server, a missing extra, any :class:`~celery_ledger.errors.LedgerError`)
becomes click's own error: ``Error: <what is wrong>`` and what to do, exit 1. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from ..explain import explain


class LedgerGroup(click.Group):
    """A click group whose commands' mistakes are shown as click errors (see the module).

    ``commands_from``: a module that adds the group's commands when imported, imported when
    the group first lists or looks up a command (the root group: cli/__init__.py says why)."""

    def __init__(self, *args: Any, commands_from: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._commands_from = commands_from

    def _load_commands(self) -> None:
        if self._commands_from is not None:
            module, self._commands_from = self._commands_from, None
            importlib.import_module(module)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._load_commands()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        self._load_commands()
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException:
            raise
        except Exception as exc:
            app = getattr(ctx.obj, "app", None)
            if isinstance(exc, AttributeError) and "ledger" not in dir(app):  # (no -A given)
                raise click.UsageError(
                    "name your app: celery -A your.module ledger ... (the module whose"
                    " create_app(...) made it)"
                ) from exc
            message = explain(exc, getattr(app, "settings", None))
            if message is None:
                raise
            raise click.ClickException(message) from exc
