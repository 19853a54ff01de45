"""The ``ledger`` group's one error handler: a mistake is one or two lines, never a traceback.

Every ``celery -A APP ledger ...`` command, nested groups included, runs inside
:meth:`LedgerGroup.invoke`; an exception :func:`celery_ledger.explain.explain` knows (a
setting, an unreachable server, a missing extra, any :class:`~celery_ledger.errors.LedgerError`)
becomes click's own error: ``Error: <what is wrong>`` and what to do, exit 1. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
from collections.abc import MutableMapping
from typing import Any

import click

from ..explain import explain


class LedgerGroup(click.Group):
    """A click group whose commands' mistakes are shown as click errors (see the module).

    ``commands_from``: a module that adds the group's commands when imported, imported at the
    first read of :attr:`commands` (the root group: cli/__init__.py says why)."""

    def __init__(self, *args: Any, commands_from: str | None = None, **kwargs: Any) -> None:
        self._commands_from = commands_from
        super().__init__(*args, **kwargs)

    @property
    def commands(self) -> MutableMapping[str, click.Command]:
        """The group's commands, loaded at the first read (click's lookups, help, and any
        tool that reads the mapping itself)."""
        if self._commands_from is not None:
            # (its commands are added while it runs: their reads here find it in sys.modules;
            # a module that fails to import is tried again, and says why, at the next read)
            importlib.import_module(self._commands_from)
            self._commands_from = None
        return self._commands

    @commands.setter
    def commands(self, value: MutableMapping[str, click.Command]) -> None:
        self._commands = value

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
