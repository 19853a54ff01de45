"""celery_ledger.app.create_app and celery_ledger.settings.Settings (no broker, no MongoDB)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import celery
import pytest
from celery import Task
from pydantic import ValidationError

from celery_ledger import ConfigurationError, LedgerCelery, LedgerTask, Settings, create_app
from celery_ledger.crypto import SEALED_CONTENT_TYPE
from celery_ledger.errors import LedgerUnavailable
from celery_ledger.ledger.store import Ledger

UNREACHABLE = {"broker_url": "redis://127.0.0.1:1/0", "mongo_uri": "mongodb://127.0.0.1:1/"}


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Any attempt to open a connection fails the test (and is recorded)."""
    attempts: list[Any] = []
    test_thread = threading.current_thread()
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guarded(real: Any) -> Any:
        def connect(self: socket.socket, address: Any) -> Any:
            if threading.current_thread() is not test_thread:
                return real(self, address)  # other tests' background threads (pymongo monitors)
            attempts.append(address)
            raise AssertionError(f"unit test tried to connect to {address}")

        return connect

    monkeypatch.setattr(socket.socket, "connect", guarded(real_connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guarded(real_connect_ex))
    yield attempts
    assert attempts == []


@pytest.fixture
def app() -> LedgerCelery:
    return create_app("unit", settings=Settings(**UNREACHABLE), set_as_current=False)


# -- the app ----------------------------------------------------------------------------------


def test_create_app_returns_a_celery_app_with_the_ledger_attached(app: LedgerCelery) -> None:
    assert isinstance(app, celery.Celery)
    assert app.main == "unit"
    assert isinstance(app.ledger, Ledger)
    assert app.ledger.uri == UNREACHABLE["mongo_uri"]
    assert app.conf.broker_url == UNREACHABLE["broker_url"]


def test_conf_is_json_only_and_acks_late(app: LedgerCelery) -> None:
    conf = app.conf

    assert conf.task_serializer == "json"
    assert conf.result_serializer == "json"
    assert list(conf.accept_content) == ["json", SEALED_CONTENT_TYPE]  # JSON, or sealed JSON
    assert list(conf.result_accept_content) == ["json"]
    assert conf.task_acks_late is True
    assert conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport == "celery_ledger.transport:Transport"
    assert conf.broker_transport_options == {
        "visibility_timeout": 3600,
        # a worker killed while restoring unacked messages blocks the others for this long
        "unacked_mutex_expire": 60,
        # the app's own unacknowledged messages: only its reconciler restores them
        "unacked_key": "unit.unacked",
        "unacked_index_key": "unit.unacked_index",
        "unacked_mutex_key": "unit.unacked_mutex",
        "ledger_poison_key": "unit:ledger:poison",
        # workers put back messages abandoned past the visibility timeout (Flower does not)
        "ledger_restore_visible": True,
        # fair dispatch of tenants' jobs (a tier queue fed from their lanes): off until set
        "ledger_fair_depth": 0,
        "ledger_fair_lease": 60.0,
        # a broker that hangs fails each call after LEDGER_BROKER_TIMEOUT_SECONDS
        "socket_timeout": 5.0,
        "socket_connect_timeout": 5.0,
        "socket_keepalive": True,
    }
    # a publish is tried once more on a new connection, not three times more
    assert conf.task_publish_retry_policy["max_retries"] == 1
    assert conf.enable_utc is True
    # a worker reconnects to a broker away for however long (Celery's 100 attempts, then exit)
    assert conf.broker_connection_max_retries is None
    assert conf.broker_connection_retry is True


def test_each_tier_and_the_dead_letter_queue_is_declared(app: LedgerCelery) -> None:
    # named after the app, so that two apps on one broker never take each other's messages
    assert [q.name for q in app.conf.task_queues] == [
        "unit.critical",
        "unit.default",
        "unit.bulk",
        "unit.dead_letter",
    ]
    assert app.conf.task_default_queue == "unit.default"


def test_queue_names_can_be_chosen_or_left_bare_for_old_deployments() -> None:
    chosen = create_app("a", settings=Settings(**UNREACHABLE, queue_namespace="billing-v2"))
    assert chosen.tiers.queue("bulk") == "billing-v2.bulk"
    bare = create_app("b", settings=Settings(**UNREACHABLE, queue_namespace=""))
    assert [q.name for q in bare.conf.task_queues] == ["critical", "default", "bulk", "dead_letter"]
    assert "unacked_key" not in bare.conf.broker_transport_options  # kombu's own names
    with pytest.raises(ValidationError, match="queue namespace"):
        Settings(queue_namespace="a,b")


def test_settings_flow_into_the_app() -> None:
    settings = Settings(
        **UNREACHABLE,
        default_tier="bulk",
        worker_prefetch_multiplier=3,
        visibility_timeout_seconds=120,
        lease_seconds=9.5,
        mongo_db="db1",
    )

    app = create_app("unit", settings=settings, set_as_current=False)

    assert app.settings is settings
    assert app.conf.task_default_queue == "unit.bulk"
    assert app.conf.worker_prefetch_multiplier == 3
    assert app.conf.broker_transport_options["visibility_timeout"] == 120
    assert app.ledger.lease_seconds == 9.5
    assert app.ledger.database_name == "db1"
    assert app.tiers.default == "bulk"


def test_set_as_current_false_leaves_the_current_app_alone(app: LedgerCelery) -> None:
    assert celery.current_app._get_current_object() is not app


# -- tasks ------------------------------------------------------------------------------------


def test_declared_tasks_are_ledger_tasks(app: LedgerCelery) -> None:
    @app.task(name="shop.charge", shared=False)
    def charge(order_id: int) -> int:
        return order_id

    assert isinstance(app.tasks["shop.charge"], LedgerTask)
    assert isinstance(charge, LedgerTask)
    assert charge.acks_late is True
    assert charge.reject_on_worker_lost is True


def test_bare_decorator_declares_a_ledger_task(app: LedgerCelery) -> None:
    @app.task(shared=False)
    def ping() -> str:
        return "pong"

    assert isinstance(app.tasks[ping.name], LedgerTask)


def test_ledger_and_celery_task_options_are_accepted(app: LedgerCelery) -> None:
    @app.task(
        name="shop.refund",
        idempotency_key="refund-{order_id}",
        tier="critical",
        lease_seconds=5.0,
        dedupe_on_publish=True,
        max_retries=3,
        bind=True,
        shared=False,
        autoretry_for=(KeyError,),
        retry_backoff=True,
    )
    def refund(self: Any, order_id: int) -> None:
        pass

    declared = app.tasks["shop.refund"]
    assert declared.tier == "critical"
    assert declared.lease_seconds == 5.0
    assert declared.dedupe_on_publish is True
    assert declared.max_retries == 3
    assert declared.key_spec() == "refund-{order_id}"


def test_celery_builtin_tasks_stay_plain_tasks(app: LedgerCelery) -> None:
    builtins = {name: t for name, t in app.tasks.items() if name.startswith("celery.")}

    assert "celery.backend_cleanup" in builtins
    assert "celery.chord_unlock" in builtins
    assert not [name for name, t in builtins.items() if isinstance(t, LedgerTask)]


def test_base_task_option_opts_out_of_the_ledger(app: LedgerCelery) -> None:
    @app.task(name="plain.thing", base=Task, shared=False)
    def thing() -> None:
        pass

    assert not isinstance(app.tasks["plain.thing"], LedgerTask)


def test_misspelt_task_option_is_refused_with_a_hint(app: LedgerCelery) -> None:
    with pytest.raises(ConfigurationError, match=r"did you mean 'idempotency_key'\?"):

        @app.task(idempotency_kye="order-{order_id}")
        def charge(order_id: int) -> None:
            pass


def test_unknown_task_option_without_a_close_match_is_refused(app: LedgerCelery) -> None:
    with pytest.raises(ConfigurationError, match="unknown task option 'zzzzzz'"):
        app.task(zzzzzz=1)(lambda: None)


def test_unknown_tier_in_a_task_declaration_is_refused(app: LedgerCelery) -> None:
    with pytest.raises(ConfigurationError, match="unknown tier 'urgent'") as info:

        @app.task(tier="urgent")
        def charge() -> None:
            pass

    assert "known tiers: critical, default, bulk" in str(info.value)


def test_an_app_left_with_a_refused_task_does_not_break_another_apps_task_log_lines(
    app: LedgerCelery,
) -> None:
    # Given an app whose task was refused at its binding (it stays declared, not finalized)
    class Urgent(LedgerTask):
        tier = "urgent"

    with pytest.raises(ConfigurationError):

        @app.task(name="shop.urgent", shared=False, base=Urgent)
        def urgent() -> None:
            pass

        urgent.delay()
    # When its log filter is asked about another app's task (every app's filter is)
    # Then it answers without finalizing itself, which would raise the refusal again
    assert not app.finalized and app.is_sensitive("other.task") is False


def test_declaring_tasks_and_finalizing_connects_to_nothing(
    app: LedgerCelery, no_network: list[Any]
) -> None:
    @app.task(name="shop.charge", shared=False)
    def charge(order_id: int) -> None:
        pass

    app.finalize()
    assert "shop.charge" in app.tasks
    assert no_network == []


# -- settings from LEDGER_* -------------------------------------------------------------------


def test_defaults_without_environment() -> None:
    settings = Settings()

    assert settings.lease_seconds == 60.0
    assert settings.default_tier == "default"
    assert settings.routing_rules == {}
    assert settings.dedupe_on_publish is True
    assert settings.max_payload_bytes == 1_000_000


def test_settings_read_ledger_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEDGER_LEASE_SECONDS", "12.5")
    monkeypatch.setenv("LEDGER_ROUTING_RULES", '{"reports.*":"bulk"}')
    monkeypatch.setenv("LEDGER_DEDUPE_ON_PUBLISH", "true")
    monkeypatch.setenv("LEDGER_MONGO_DB", "ledger_test")

    settings = Settings()

    assert settings.lease_seconds == 12.5
    assert settings.routing_rules == {"reports.*": "bulk"}
    assert settings.dedupe_on_publish is True
    assert settings.mongo_db == "ledger_test"


def test_create_app_uses_env_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEDGER_BROKER_URL", UNREACHABLE["broker_url"])
    monkeypatch.setenv("LEDGER_MONGO_URI", UNREACHABLE["mongo_uri"])
    monkeypatch.setenv("LEDGER_LEASE_SECONDS", "12.5")
    monkeypatch.setenv("LEDGER_ROUTING_RULES", '{"reports.*":"bulk"}')

    app = create_app("unit", set_as_current=False)

    assert app.ledger.lease_seconds == 12.5
    assert app.tiers.resolve(SimpleNamespace(name="reports.daily", tier=None)) == "bulk"
    assert app.tiers.resolve(SimpleNamespace(name="mail.send", tier=None)) == "default"


@pytest.mark.parametrize(
    ("var", "value", "setting"),
    [
        ("LEDGER_LEASE_SECONDS", "-1", "lease_seconds"),
        ("LEDGER_LEASE_SECONDS", "abc", "lease_seconds"),
        ("LEDGER_MAX_PAYLOAD_BYTES", "10", "max_payload_bytes"),
        ("LEDGER_MONGO_WRITE_CONCERN", "2", "mongo_write_concern"),
        ("LEDGER_ROUTING_RULES", '["reports.*"]', "routing_rules"),
        pytest.param(
            "LEDGER_ROUTING_RULES",
            "not json",
            "routing_rules",
            id="LEDGER_ROUTING_RULES-not-json",
        ),
    ],
)
def test_broken_env_value_is_a_configuration_error_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, setting: str
) -> None:
    monkeypatch.setenv(var, value)

    with pytest.raises(ConfigurationError, match="invalid setting") as info:
        create_app("unit", set_as_current=False)
    assert var in str(info.value)  # the variable, as the user set it
    assert setting in str(info.value).lower()


def test_unknown_default_tier_in_env_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEDGER_DEFAULT_TIER", "urgent")

    with pytest.raises(ConfigurationError, match="LEDGER_DEFAULT_TIER") as info:
        create_app("unit", set_as_current=False)
    assert "known tiers: critical, default, bulk" in str(info.value)


def test_unknown_tier_in_env_routing_rules_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEDGER_ROUTING_RULES", '{"reports.*":"urgent"}')

    with pytest.raises(
        ConfigurationError, match=r"unknown tier 'urgent' in routing rule 'reports\.\*'"
    ):
        create_app("unit", set_as_current=False)


def test_a_misspelt_ledger_variable_is_refused_with_a_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEDGER_LEASE_SECOND", "30")
    with pytest.raises(ConfigurationError, match="did you mean LEDGER_LEASE_SECONDS"):
        create_app("misspelt", set_as_current=False)


def test_a_ledger_variable_like_no_setting_is_refused_without_a_far_fetched_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LEDGER_FOO", "1")
    with pytest.raises(ConfigurationError, match="unknown setting LEDGER_FOO") as refused:
        create_app("foo", set_as_current=False)
    assert "did you mean" not in str(refused.value)  # (LEDGER_MONGO_DB was offered)


def test_settings_given_as_a_dict_are_refused_without_showing_them() -> None:
    given = {"broker_url": "redis://:s3cret@broker:6379/0"}
    expected = r"settings=Settings\(\.\.\.\), not a dict"
    with pytest.raises(ConfigurationError, match=expected) as refused:
        create_app("dict", given, set_as_current=False)  # type: ignore[arg-type]
    assert "s3cret" not in str(refused.value)


def test_recording_a_revocation_never_raises_in_the_workers_main_process(
    app: LedgerCelery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Celery's strategy marks a revoked message in the worker's main process: an exception
    # there ends the worker. Whatever the ledger says, the revocation is logged, not raised.
    @app.task(name="unit.charge")
    def charge(order_id: int) -> None: ...

    def down(*args: Any, **kwargs: Any) -> Any:
        raise LedgerUnavailable("ledger unreachable")

    monkeypatch.setattr(app.ledger, "resolve", down)
    monkeypatch.setattr(app.ledger, "bury", down)
    app.backend.mark_as_revoked("revoked-before-any-message")
    request = SimpleNamespace(
        task="unit.charge", headers={}, args=[7], kwargs={}, chord=None, id="m-1"
    )
    app.backend.mark_as_revoked("m-1", request=request)
    monkeypatch.setattr(charge, "identity_of_message", lambda *a: (_ for _ in ()).throw(KeyError))
    app.backend.mark_as_revoked("m-1", request=request)


def test_delayed_deliveries_belong_to_the_queue_namespace_not_the_apps_name() -> None:
    # Apps of different names publishing to one namespace share its delayed set
    web = create_app(
        "web", settings=Settings(**UNREACHABLE, queue_namespace="shop"), set_as_current=False
    )
    workers = create_app("shop", settings=Settings(**UNREACHABLE), set_as_current=False)
    assert web.runtime.delayed.key == workers.runtime.delayed.key == "shop:ledger:delayed"
    # The set older releases keyed by the name is drained too, where it differs
    assert web.runtime.legacy_delayed is not None
    assert web.runtime.legacy_delayed.key == "web:ledger:delayed"
    assert workers.runtime.legacy_delayed is None
    bare = create_app(
        "bare", settings=Settings(**UNREACHABLE, queue_namespace=""), set_as_current=False
    )
    assert bare.runtime.delayed.key == "ledger:delayed"


def test_a_bare_task_declaration_stays_lazy_until_the_app_is_finalized() -> None:
    # Celery binds a task declared bare (@app.task) when the app finalizes, after the module
    # has set its configuration; binding it at declaration loses what is set after it
    app = create_app("lazy", set_as_current=False)

    @app.task
    def add(x: int, y: int) -> int:
        return x + y

    app.conf.task_annotations = {"*": {"rate_limit": "10/s"}}
    assert not app.finalized and not add.__evaluated__()
    assert app.tasks[add.name].rate_limit == "10/s"


def test_a_template_that_cannot_format_a_calls_arguments_is_a_payload_error() -> None:
    from celery_ledger.errors import PayloadError
    from celery_ledger.identity import apply_spec

    def charge(order: dict[str, int]) -> None: ...

    with pytest.raises(PayloadError, match=r"'o-\{order\.id\}' of shop\.charge does not format"):
        apply_spec(
            "o-{order.id}",
            "idempotency_key",
            task_name="shop.charge",
            run=charge,
            args=({"id": 1},),
            kwargs={},
        )
