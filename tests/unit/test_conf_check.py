"""Celery settings changed after create_app, and task options, that would break a guarantee:
refused where they are declared, at a worker's start and at a producer's first publish, each
naming the setting and why; the changes that are the app's to make pass."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from celery.schedules import crontab
from celery.schedules import schedule as celery_schedule

from celery_ledger import ConfigurationError, LedgerCelery, Settings, create_app
from celery_ledger.crypto import SEALED_CONTENT_TYPE
from celery_ledger.transport import Transport
from celery_ledger.worker import LedgerWorkerStep

SEALED = SEALED_CONTENT_TYPE
UNREACHABLE = {"broker_url": "redis://127.0.0.1:1/0", "mongo_uri": "mongodb://127.0.0.1:1/"}


class MyTransport(Transport):  # a subclass of celery-ledger's: the app's to use
    pass


@pytest.fixture
def app() -> LedgerCelery:
    return create_app("unit", settings=Settings(**UNREACHABLE), set_as_current=False)


BREAKING = [
    ({"accept_content": ["json", SEALED, "pickle"]}, "accept_content"),
    ({"accept_content": ["json"]}, "accept_content"),  # every sensitive job would end dead
    ({"accept_content": ["json", SEALED_CONTENT_TYPE, "no-such-serializer"]}, "accept_content"),
    ({"task_serializer": "pickle"}, "task_serializer"),
    ({"task_serializer": "yaml"}, "task_serializer"),
    ({"task_protocol": 1}, "task_protocol"),
    ({"broker_transport": "redis"}, "broker_transport"),
    ({"broker_transport": "no.such.module:Transport"}, "broker_transport"),
    ({"worker_consumer": "celery.worker.consumer:Consumer"}, "worker_consumer"),
    ({"broker_transport_options": {"visibility_timeout": 600}}, "broker_transport_options"),
]


@pytest.mark.parametrize(
    "option", [{"priority_steps": list(range(10))}, {"sep": ":"}, {"global_keyprefix": "pfx:"}]
)
def test_kombu_options_that_rename_its_lists_are_refused(
    app: LedgerCelery, option: dict[str, Any]
) -> None:
    # (the reconciler and fair dispatch read the lists by kombu's default names: a message in a
    # list named otherwise was fed to one no worker reads)
    app.conf.broker_transport_options.update(option)
    step = LedgerWorkerStep(SimpleNamespace(app=app))
    with pytest.raises(ConfigurationError, match=next(iter(option))):
        step.create(SimpleNamespace(app=app, hostname="w@h"))


@pytest.mark.parametrize(
    ("conf", "named"), BREAKING, ids=[f"{n}={next(iter(c.values()))}" for c, n in BREAKING]
)
def test_a_setting_that_breaks_a_guarantee_is_refused_naming_it(
    app: LedgerCelery, conf: dict[str, Any], named: str
) -> None:
    @app.task(name="conf.t", shared=False)
    def t(x: int) -> int:
        return x

    app.conf.update(**conf)
    # a worker refuses to start with it (before it connects anywhere)
    step = LedgerWorkerStep(SimpleNamespace(app=app))
    with pytest.raises(ConfigurationError, match=named):
        step.create(SimpleNamespace(app=app, hostname="w@h"))
    # a producer refuses its first publish (before anything is written or sent)
    with pytest.raises(ConfigurationError, match=named):
        t.apply_async((1,))


@pytest.mark.parametrize(
    "change",
    [
        lambda app: app.conf.broker_transport_options.update(visibility_timeout=600),
        lambda app: app.conf.update(task_compression="gzip"),
        lambda app: app.conf.update(worker_prefetch_multiplier=4),
        lambda app: app.conf.update(broker_transport=f"{__name__}:MyTransport"),
        lambda app: app.conf.update(accept_content=[SEALED, "application/json"]),
        lambda app: app.conf.update(task_ignore_result=True),  # (plain tasks' business)
        lambda app: app.conf.update(task_acks_late=False),  # (ledger tasks set their own)
    ],
    ids=[
        "visibility-timeout",
        "compression",
        "prefetch",
        "transport-subclass",
        "content-types",
        "ignore-result-conf",
        "acks-late-conf",
    ],
)
def test_the_apps_own_changes_pass(app: LedgerCelery, change: Any) -> None:
    change(app)
    assert app.configuration_problems() == []


def test_ledger_tasks_keep_json_and_their_results_whatever_the_task_settings_say(
    app: LedgerCelery,
) -> None:
    app.conf.update(task_ignore_result=True, task_acks_late=False)

    @app.task(name="conf.kept", shared=False)
    def kept(x: int) -> int:
        return x

    assert kept.ignore_result is False and kept.acks_late is True
    assert kept.serializer == "json"


@pytest.mark.parametrize(
    "option",
    [
        {"acks_late": False},
        {"reject_on_worker_lost": False},
        {"serializer": "pickle"},
        {"serializer": "yaml"},
        {"ignore_result": True},
        {"max_retries": None},
        # values that cannot work: a lease lost as soon as taken, a string for a number
        {"lease_seconds": -1},
        {"lease_seconds": "sixty"},
        {"max_attempts": 0},
        {"heartbeat_seconds": -5},
        {"deadline_seconds": float("nan")},
        # templates that fail at every publish: malformed, or naming no argument
        {"idempotency_key": "order-{order_id"},
        {"idempotency_key": "order-{order_id}"},
        {"idempotency_key": "o-{0}"},
        {"tenant": "{customer!z}"},
    ],
    ids=lambda o: "=".join(map(str, next(iter(o.items())))),
)
def test_a_task_option_that_breaks_a_guarantee_is_refused_where_it_is_declared(
    app: LedgerCelery, option: dict[str, Any]
) -> None:
    name = next(iter(option))
    with pytest.raises(ConfigurationError, match=name):

        @app.task(name="conf.bad", shared=False, **option)
        def bad() -> None:
            pass

        app.tasks["conf.bad"]


def test_options_that_work_are_not_refused(app: LedgerCelery) -> None:
    @app.task(
        name="conf.good",
        shared=False,
        idempotency_key="order-{order_id}-{item[sku]}",
        tenant="{order_id.__class__}",
        lease_seconds=0.5,
        heartbeat_seconds=0,  # (off)
        max_attempts=1,
    )
    def good(order_id: int, item: dict[str, str]) -> None:
        pass

    @app.task(name="conf.open", shared=False, idempotency_key="{anything}")
    def open_ended(**fields: Any) -> None:
        pass

    app.tasks["conf.good"], app.tasks["conf.open"]
    assert app.configuration_problems() == []


def test_a_task_class_with_such_an_attribute_is_refused_too(app: LedgerCelery) -> None:
    with pytest.raises(ConfigurationError, match="acks_late"):

        class Early(app.Task):  # type: ignore[name-defined,misc]
            name = "conf.early"
            acks_late = False

            def run(self) -> None:
                pass

        app.register_task(Early())


@pytest.mark.parametrize(
    ("schedule", "ok"),
    [
        (60, True),
        (0.5, True),
        (timedelta(minutes=5), True),
        (crontab(minute="*/5"), True),
        (celery_schedule(timedelta(seconds=10)), True),
        (-60, False),
        (0, False),
        (timedelta(0), False),
        (celery_schedule(timedelta(seconds=-1)), False),
        ("every 5 minutes", False),
        ("*/5 * * * *", False),
        (True, False),
        (None, False),
    ],
    ids=repr,
)
def test_a_schedule_that_cannot_run_is_refused_where_it_is_declared_and_at_start(
    app: LedgerCelery, schedule: Any, ok: bool
) -> None:
    @app.task(name="conf.tick", shared=False)
    def tick() -> None:
        pass

    # @app.periodic refuses it at once
    if ok:
        app.periodic(schedule)(tick)
    else:
        with pytest.raises(ConfigurationError, match=r"@app\.periodic: schedule"):
            app.periodic(schedule)(tick)
    # and Celery's own beat_schedule entry with it stops a worker's start (and a first publish)
    app.conf.beat_schedule = {"by-hand": {"task": "conf.tick", "schedule": schedule}}
    problems = app.configuration_problems()
    assert problems == [] if ok else (len(problems) == 1 and "'by-hand'" in problems[0])


def test_a_schedule_entrys_misspelt_option_stops_the_start(app: LedgerCelery) -> None:
    # (beat passes an entry's options to each run's publish, which refuses a misspelt one: the
    # entry would never run; Celery's own publish sent it as a message property, unheard)
    @app.task(name="conf.tick2", shared=False)
    def tick() -> None:
        pass

    app.periodic(60, options={"expire": 30})(tick)
    app.conf.beat_schedule["by-hand"] = {"task": "conf.tick2", "schedule": 5, "options": {}}
    problems = app.configuration_problems()
    assert len(problems) == 1 and "did you mean 'expires'?" in problems[0], problems
    assert "'by-hand'" not in problems[0]
