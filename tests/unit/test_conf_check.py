"""Celery settings changed after create_app, and task options, that would break a guarantee:
refused where they are declared, at a worker's start and at a producer's first publish, each
naming the setting and why; the changes that are the app's to make pass."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

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


def test_a_task_class_with_such_an_attribute_is_refused_too(app: LedgerCelery) -> None:
    with pytest.raises(ConfigurationError, match="acks_late"):

        class Early(app.Task):  # type: ignore[name-defined,misc]
            name = "conf.early"
            acks_late = False

            def run(self) -> None:
                pass

        app.register_task(Early())
