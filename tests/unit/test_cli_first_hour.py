"""The ``ledger`` commands a new user meets first, over fakes: ``show`` by job id or short task
name, the group's one error handler (a mistake is a line, a bug a traceback), ``stack``'s
``--console`` flag and the extras it skips, and ``stack.env`` exporting every login."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shlex
import socket
import subprocess
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

from celery_ledger import create_app
from celery_ledger.cli import ledger
from celery_ledger.embedded.stack import EmbeddedStack
from celery_ledger.errors import ConfigurationError, NotApplied
from celery_ledger.identity import derive_task_id
from celery_ledger.ledger.record import LedgerRecord, State
from celery_ledger.settings import Settings

TASKS = ("myapp.billing.charge", "myapp.mail.send", "other.mail.send")


class Records:
    """The ledger's two reads ``show`` uses, over a dict of records by id."""

    def __init__(self, *records: LedgerRecord) -> None:
        self.by_id = {record.id: record for record in records}

    def get(self, task_name: str, key: str) -> LedgerRecord | None:
        return self.by_id.get(derive_task_id(task_name, key))

    def get_by_id(self, record_id: str) -> LedgerRecord | None:
        return self.by_id.get(record_id)


def record(task: str, key: str) -> LedgerRecord:
    return LedgerRecord(id=derive_task_id(task, key), task=task, key=key, state=State.SUCCEEDED)


def fake_app(ledger: Any = None, **more: Any) -> SimpleNamespace:
    return SimpleNamespace(
        ledger=ledger or Records(),
        tasks=dict.fromkeys(TASKS),
        loader=SimpleNamespace(import_default_modules=lambda: None),
        settings=Settings(mongo_uri="mongodb://ledger:pw@mongo.internal:27017/"),
        **more,
    )


@click.group()
@click.option("-A", "--app")
@click.pass_context
def celery(ctx: click.Context, app: str) -> None:
    """Celery's root command, as far as the ``ledger`` group reads it."""


celery.add_command(ledger)


def run(app: Any, *args: str) -> Result:
    return CliRunner().invoke(celery, ["-A", "myapp", "ledger", *args], obj=Namespace(app=app))


def test_show_takes_a_job_id() -> None:
    # Given a job whose key nobody could guess (a keyless job's is a hash of its arguments)
    charged = record("myapp.billing.charge", "args:9f86d081884c7d65")
    # When it is shown by its Celery task id (AsyncResult.id)
    result = run(fake_app(Records(charged)), "show", charged.id, "--json")
    # Then its record is printed
    assert result.exit_code == 0, result.output
    assert '"key": "args:9f86d081884c7d65"' in result.output


def test_show_takes_a_short_task_name_when_only_one_task_has_it() -> None:
    charged = record("myapp.billing.charge", "order-7")

    result = run(fake_app(Records(charged)), "show", "charge", "order-7", "--json")

    assert result.exit_code == 0, result.output
    assert '"task": "myapp.billing.charge"' in result.output


def test_show_refuses_an_ambiguous_short_name_naming_the_candidates() -> None:
    result = run(fake_app(), "show", "send", "k")

    assert result.exit_code == 2
    assert "myapp.mail.send, other.mail.send" in result.output


def test_show_of_an_unknown_id_says_how_else_to_look_a_job_up() -> None:
    result = run(fake_app(), "show", "no-such-id")

    assert result.exit_code == 1
    assert "ledger show TASK KEY" in result.output


class Unreachable(Records):
    def get_by_id(self, record_id: str) -> LedgerRecord | None:
        raise NotApplied("ledger unreachable during read: mongo.internal:27017: timed out")


def test_a_mistake_in_any_command_is_one_error_line_without_a_traceback() -> None:
    result = run(fake_app(Unreachable()), "show", "some-id")

    assert result.exit_code == 1
    assert result.output.startswith("Error: the ledger (MongoDB) at scheme mongodb://")
    assert "host mongo.internal is unreachable" in result.output
    assert "LEDGER_MONGO_URI" in result.output
    assert "pw" not in result.output  # the URI's password
    assert len(result.output.strip().splitlines()) == 2


def test_a_bug_keeps_its_traceback() -> None:
    class Broken(Records):
        def get_by_id(self, record_id: str) -> LedgerRecord | None:
            raise KeyError("a bug")

    result = run(fake_app(Broken()), "show", "some-id")

    assert result.exit_code == 1
    assert isinstance(result.exception, KeyError)


# -- ledger stack ------------------------------------------------------------------------------


class FakeRunning:
    """What ``running_stack`` yields, with one worker already gone (the command returns)."""

    workers = (SimpleNamespace(name="default@127.0.0.1", alive=lambda: False),)

    def write_env_file(self) -> Path:
        return Path("stack.env")

    def describe(self) -> str:
        return "(the stack)"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The options ``ledger stack`` started the stack with (no server is started)."""
    options: dict[str, Any] = {}

    @contextlib.contextmanager
    def running_stack(app_path: str, data_dir: Path, **given: Any) -> Iterator[FakeRunning]:
        options.update(given)
        yield FakeRunning()

    monkeypatch.setattr("celery_ledger.embedded.stack.running_stack", running_stack)
    return options


def stack_app() -> SimpleNamespace:
    tiers = SimpleNamespace(namespace="myapp", queues=["myapp.default"])
    return fake_app(tiers=tiers, main="myapp")


def test_stack_names_the_flag_console_and_keeps_web_console_hidden(
    started: dict[str, Any],
) -> None:
    assert run(stack_app(), "stack", "--no-console", "--no-flower").exit_code == 0
    assert started["console"] is False
    old_name = run(stack_app(), "stack", "--web-console", "--no-flower")
    assert old_name.exit_code == 0
    assert started["console"] is True
    assert "now --console" in old_name.output

    shown = run(stack_app(), "stack", "--help").output
    assert "--console / --no-console" in shown
    assert "web-console" not in shown


def test_stack_says_which_extras_it_skipped_and_how_to_add_them(
    started: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given neither Flower nor the console installed
    missing = {"flower", "starlette"}
    real = importlib.util.find_spec
    monkeypatch.setattr(
        "importlib.util.find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )
    # When the stack starts with its defaults
    result = run(stack_app(), "stack")
    # Then it starts neither, and says so with the pip command of each
    assert result.exit_code == 0, result.output
    assert started["flower"] is False and started["console"] is False
    assert "Flower not started" in result.output
    assert "pip install 'celery-ledger[flower]'" in result.output
    assert "pip install 'celery-ledger[console]'" in result.output


def test_stack_env_exports_every_login(tmp_path: Path) -> None:
    # Given a stack with Flower and the console, each with a login made for it
    stack = EmbeddedStack("myapp", tmp_path)
    stack.broker = SimpleNamespace(url="redis://:broker-pw@127.0.0.1:6390/0")  # type: ignore[assignment]
    stack.ledger = SimpleNamespace(url="mongodb://u:ledger-pw@127.0.0.1:27090/")  # type: ignore[assignment]
    stack.flower = SimpleNamespace(  # type: ignore[assignment]
        url="http://127.0.0.1:5599", user="flower", password="flower-pw-123"
    )
    stack.console = SimpleNamespace(  # type: ignore[assignment]
        url="http://127.0.0.1:8099", user="operator", password="console-pw-1234"
    )
    # When its env file is sourced by a shell
    path = stack.write_env_file()
    shown = subprocess.run(
        [
            "sh",
            "-c",
            f". {shlex.quote(str(path))}; echo $FLOWER_BASIC_AUTH; echo $STACK_CONSOLE_PASSWORD;"
            " echo $LEDGER_CONSOLE_USERS; echo $STACK_FLOWER_URL",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    # Then every login is an exported variable, none a comment to grep for
    assert shown[0] == "flower:flower-pw-123"
    assert shown[1] == "console-pw-1234"
    users = Settings(console_users=json.loads(shown[2])).console_users
    assert users["operator"].password.get_secret_value() == "console-pw-1234"
    assert shown[3] == "http://127.0.0.1:5599"
    assert "# flower" not in path.read_text() and "# console" not in path.read_text()
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_unset_broker_url_is_refused_by_name_before_any_connection() -> None:
    # Given settings without LEDGER_BROKER_URL
    settings = Settings()
    # Then whatever needs the broker names the setting (no default Redis is tried)
    with pytest.raises(ConfigurationError, match="LEDGER_BROKER_URL is not set"):
        settings.require_broker_url()


def test_a_publish_without_a_broker_url_connects_to_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given an app without LEDGER_BROKER_URL (a Redis may well listen on localhost:6379)
    app = create_app("nobroker", Settings(mongo_uri="mongodb://127.0.0.1:1/"), set_as_current=False)

    @app.task
    def add(x: int, y: int) -> int:
        return x + y

    def no_connection(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a connection was tried: {args}")

    monkeypatch.setattr(socket, "create_connection", no_connection)
    monkeypatch.setattr(socket.socket, "connect", no_connection)
    # When a task is published, or Celery's own connection is opened
    # Then each is refused by the setting's name, before any connection
    with pytest.raises(ConfigurationError, match="LEDGER_BROKER_URL is not set"):
        add.delay(1, 2)
    with pytest.raises(ConfigurationError, match="LEDGER_BROKER_URL is not set"):
        app.send_task("nobroker.add", (1, 2))
    with pytest.raises(ConfigurationError, match="LEDGER_BROKER_URL is not set"):
        app.connection_for_write().connect()


def test_a_misspelt_workflow_status_names_the_statuses() -> None:
    log = SimpleNamespace(count_by_status=lambda: {"running": 2}, listing=lambda **_: [])
    app = fake_app(workflow_engine=SimpleNamespace(log=log))
    result = run(app, "workflows", "list", "--status", "runing")
    assert result.exit_code == 2 and "'runing': one of" in result.output
    assert "running" in result.output and "Traceback" not in result.output
    assert run(app, "workflows", "list", "--limit", "-1").exit_code == 2


def test_forcing_a_breaker_no_task_declares_says_which_exist(monkeypatch: Any) -> None:
    import celery_ledger.cli.breakers as breakers_cli

    forced: list[str] = []

    def force(app: Any, name: str, action: str, *, actor: str) -> str:
        forced.append(name)
        return "forced open"

    monkeypatch.setattr(breakers_cli, "force_breaker", force)
    app = fake_app(breakers=SimpleNamespace(statuses=lambda: [SimpleNamespace(name="mail")]))
    result = run(app, "breakers", "open", "mial")
    assert result.exit_code == 0 and forced == ["mial"]  # (forced all the same)
    assert "no task declares breaker 'mial' (known: mail)" in result.output
    assert "no task declares" not in run(app, "breakers", "open", "mail").output


def test_a_misspelt_tier_is_named_before_anything_else_is_said() -> None:
    # (fair dispatch off here: that was said instead, as if the tier were fine)
    app = create_app(
        "tiers_cli",
        settings=Settings(broker_url="redis://127.0.0.1:1/0", mongo_uri="mongodb://127.0.0.1:1"),
        set_as_current=False,
    )
    for command in (["tenants", "list"], ["tenants", "drain", "--yes"]):
        result = run(app, *command, "--tier", "urgent")
        assert result.exit_code == 1, result.output
        assert "urgent" in result.output and "critical, default, bulk" in result.output
        assert "fair dispatch is off" not in result.output and "Traceback" not in result.output
