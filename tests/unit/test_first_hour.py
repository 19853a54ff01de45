"""The first hour of a new user, walked as one: the wheel installed in a fresh virtualenv, an
app of one's own (one module, one task), and each early mistake made once.

Every mistake must end the command with one or two lines that say what is wrong and name the
fix (the setting, or the command to run), a non-zero exit, and no traceback (issue 38). The
servers are never started: unreachable ones are the point. No command may reach a server the
user did not name (this machine may run a Redis on 6379: without LEDGER_BROKER_URL nothing is
sent anywhere).

Slow for a unit test (a wheel, a virtualenv, a dozen ``celery`` processes: about a minute on 2
cores), and still part of ``./run test``: it is what a new user sees first.
"""

from __future__ import annotations

import dataclasses
import socket
import textwrap

import pytest

from tests.newcomer import PIP_MISSING, Newcomer, imported_from, make_newcomer

APP = textwrap.dedent(
    """
    from celery_ledger import create_app

    app = create_app("firsthour")


    @app.task
    def add(x: int, y: int) -> int:
        return x + y
    """
)

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(PIP_MISSING, reason="pip is not available"),
]


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory) -> Newcomer:
    found = make_newcomer(tmp_path_factory.mktemp("first-hour"))
    (found.home / "firsthour_app.py").write_text(APP)
    assert imported_from(found).startswith(str(found.python.parents[1]))  # the wheel's
    return found


def test_a_publish_without_a_broker_url_names_the_setting(newcomer: Newcomer) -> None:
    # Given a shell without the stack's variables (this machine may run a Redis on 6379)
    # When the user publishes from the command line
    ran = newcomer.run("call", "firsthour_app.add", "--args", "[1, 2]")
    # Then nothing is sent, and the message names the setting and the stack's command
    ran.refused("LEDGER_BROKER_URL", "ledger stack")


def test_a_worker_without_a_broker_url_refuses_to_start(newcomer: Newcomer) -> None:
    ran = newcomer.run("worker", "-P", "solo", "--without-mingle", "--without-gossip")
    ran.refused("LEDGER_BROKER_URL")


def test_show_with_the_ledger_unreachable_says_where_and_what_to_set(newcomer: Newcomer) -> None:
    ran = newcomer.run(
        "ledger",
        "show",
        "firsthour_app.add",
        "some-key",
        env={
            "LEDGER_BROKER_URL": f"redis://127.0.0.1:{closed_port()}/0",
            "LEDGER_MONGO_URI": f"mongodb://127.0.0.1:{closed_port()}/",
            "LEDGER_MONGO_TIMEOUT_MS": "300",
        },
    )
    ran.refused("LEDGER_MONGO_URI", "unreachable", "ledger stack")


@pytest.mark.parametrize(
    ("password", "says", "argv"),
    [
        ("...", "placeholder", ("ledger", "show", "some-id")),
        ("hunter2", "12 or more characters", ("worker", "-P", "solo")),
    ],
    ids=["readme-placeholder-ledger-show", "too-short-worker"],
)
def test_a_bad_console_password_is_one_line_for_every_command(
    newcomer: Newcomer, password: str, says: str, argv: tuple[str, ...]
) -> None:
    # Given the README's example login, its password left as "..." or too short
    users = f'{{"alice": {{"password": "{password}", "role": "operator"}}}}'
    # When any command loads the app (the console's setting is read for every one)
    ran = newcomer.run(*argv, env={"LEDGER_CONSOLE_USERS": users})
    # Then it names the setting and the rule, and never echoes the password
    ran.refused("LEDGER_CONSOLE_USERS", says)
    assert ran.code == 2
    if password != "...":
        assert password not in ran.output


def test_the_console_without_users_says_how_to_add_one(newcomer: Newcomer) -> None:
    ran = newcomer.run(
        "ledger",
        "console",
        "--port",
        str(closed_port()),
        env={"LEDGER_BROKER_URL": f"redis://127.0.0.1:{closed_port()}/0"},
    )
    ran.refused("LEDGER_CONSOLE_USERS")


def test_a_misspelt_setting_value_names_the_setting_and_the_choices(newcomer: Newcomer) -> None:
    ran = newcomer.run("ledger", "show", "some-id", env={"LEDGER_DEFAULT_TIER": "critcal"})
    ran.refused("LEDGER_DEFAULT_TIER", "critical, default, bulk")
    assert ran.code == 2


def test_a_misspelt_setting_name_suggests_the_right_one(newcomer: Newcomer) -> None:
    ran = newcomer.run("ledger", "show", "some-id", env={"LEDGER_LEASE_SECOND": "30"})
    ran.refused("LEDGER_LEASE_SECOND", "did you mean LEDGER_LEASE_SECONDS")


def test_a_worker_with_a_bad_setting_exits_with_its_name(newcomer: Newcomer) -> None:
    ran = newcomer.run(
        "worker",
        "-P",
        "solo",
        env={
            "LEDGER_BROKER_URL": f"redis://127.0.0.1:{closed_port()}/0",
            "LEDGER_LEASE_SECONDS": "-1",
        },
    )
    ran.refused("LEDGER_LEASE_SECONDS")
    assert ran.code == 2


def test_a_missing_extra_names_the_pip_command(newcomer: Newcomer) -> None:
    # A metrics port without prometheus-client: hidden from the app, as if never installed
    hide = newcomer.home / "hide_prometheus"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text(
        "import sys\nsys.modules['prometheus_client'] = None\n"  # import raises ImportError
    )
    ran = newcomer.run(
        "ledger",
        "show",
        "some-id",
        env={"LEDGER_METRICS_PORT": str(closed_port()), "PYTHONPATH": str(hide)},
    )
    ran.refused("pip install 'celery-ledger[metrics]'")


# A mistake in the app's own module (a declaration of a task, a workflow, a schedule): Celery's
# command line loads the module itself, and printed a traceback of whatever it raised.
MISTAKES = {
    "misspelt-option": (
        '@app.task(idempotncy_key="{x}")\ndef add(x):\n    return x\n',
        "did you mean 'idempotency_key'",
    ),
    "negative-period": (
        "@app.periodic(-60)\n@app.task\ndef tick():\n    pass\n",
        "more than 0 seconds",
    ),
    "period-in-words": (
        '@app.periodic("every 5 minutes")\n@app.task\ndef tick():\n    pass\n',
        "crontab.from_string",
    ),
    "periodic-below-task": (
        "@app.task\n@app.periodic(60)\ndef tick():\n    pass\n",
        "put it above @app.task",
    ),
    "workflow-tier": (
        '@app.workflow(tier="urgent")\ndef flow(wf):\n    pass\n',
        "urgent",
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_mistaken_declaration_is_one_line_not_a_traceback(
    newcomer: Newcomer, mistake: str
) -> None:
    code, says = MISTAKES[mistake]
    module = f"mistaken_{mistake.replace('-', '_')}"
    header = 'from celery_ledger import create_app\n\napp = create_app("mistaken")\n\n'
    (newcomer.home / f"{module}.py").write_text(header + code)
    ran = dataclasses.replace(newcomer, app=module).run("ledger", "show", "some-id")
    ran.refused(says)


def test_a_ledger_command_without_an_app_says_to_name_it(newcomer: Newcomer) -> None:
    ran = newcomer.shell("celery ledger show some-id")
    ran.refused("celery -A your.module ledger")
