"""Sentinel configuration: the URL list, the transport options the LEDGER_SENTINEL_* settings
make, the clients made from them, and a broker connection that keeps its transport when kombu
would move to another URL of the list."""

from __future__ import annotations

import ssl

import pytest
from redis.sentinel import SentinelConnectionPool, SentinelManagedSSLConnection

from celery_ledger import ConfigurationError, Settings, create_app
from celery_ledger.conf_check import conf_problems
from celery_ledger.sentinel import (
    RedisTarget,
    for_workers,
    fresh_client,
    parse_sentinel_url,
    redis_client,
)
from celery_ledger.transport import Connection, SentinelChannel, SentinelTransport, Transport

URL = (
    "sentinel://ledger:p%40ss@s1:26379/2?ssl_ca_certs=/ca.pem&ssl_cert_reqs=required;sentinel://s2"
)


def test_the_first_entry_holds_the_data_nodes_user_password_database_and_tls() -> None:
    parsed = parse_sentinel_url(URL)
    assert parsed.sentinels == (("s1", 26379), ("s2", 26379))
    assert (parsed.username, parsed.password, parsed.db) == ("ledger", "p@ss", 2)
    assert parsed.tls == {"ssl_ca_certs": "/ca.pem", "ssl_cert_reqs": ssl.CERT_REQUIRED}


def test_every_broker_connection_waits_at_most_the_broker_timeout() -> None:
    # Given a broker timeout, a plain URL and a Sentinel one
    for url in ("redis://localhost:6379/0", URL):
        settings = Settings(broker_url=url, sentinel_master="ledger", broker_timeout_seconds=2.5)
        app = create_app("timeouts", settings=settings, set_as_current=False)
        # Then kombu's connections (a publish, a worker's take) time out after it
        options = app.conf.broker_transport_options
        assert (options["socket_timeout"], options["socket_connect_timeout"]) == (2.5, 2.5)
        assert options["socket_keepalive"] is True
        # (a worker's own wait six times longer: a stall must not cut a take in two)
        assert for_workers(options, settings)["socket_timeout"] == 15.0
        # and so do the platform's own clients (a publish's checks), and their sentinels
        pool = app.runtime.redis.connection_pool
        assert pool.connection_kwargs["socket_timeout"] == 2.5
        if isinstance(pool, SentinelConnectionPool):
            sentinel = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
            assert sentinel["socket_timeout"] == 2.5
            # (a client of a shorter wait of its own, the health check's, keeps it there too)
            short = RedisTarget(URL, options).client(socket_timeout=0.5)
            manager = short.connection_pool.sentinel_manager  # type: ignore[attr-defined]
            kwargs = manager.sentinels[0].connection_pool.connection_kwargs
            assert kwargs["socket_timeout"] == 0.5


def test_the_settings_fill_kombus_transport_options() -> None:
    # Given a Sentinel URL and the LEDGER_SENTINEL_* settings
    settings = Settings(
        broker_url=URL,
        sentinel_master="ledger",
        sentinel_username="watcher",
        sentinel_password="a-sentinel-password",
        sentinel_tls=True,
    )
    # When an app is made
    app = create_app("sentinel-options", settings=settings, set_as_current=False)
    # Then Celery gets the Sentinel transport and kombu's options, the pinned ones kept
    options = app.conf.broker_transport_options
    assert app.conf.broker_transport == "celery_ledger.transport:SentinelTransport"
    assert options["master_name"] == "ledger"
    assert options["sentinel_kwargs"] == {
        "socket_timeout": 5.0,  # (LEDGER_BROKER_TIMEOUT_SECONDS: a sentinel that hangs fails)
        "socket_connect_timeout": 5.0,
        "retry": None,  # (asked once each: redis-py's default asks one that hangs ten more times)
        "username": "watcher",
        "password": "a-sentinel-password",
        "ssl": True,
        "ssl_ca_certs": "/ca.pem",
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }
    assert "ledger_poison_key" in options
    assert conf_problems(app.conf, app.pinned_conf) == []
    # And the platform's own clients reach the primary through the same sentinels
    client = app.runtime.redis
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "ledger"
    assert pool.connection_class is SentinelManagedSSLConnection
    assert pool.connection_kwargs["password"] == "p@ss"
    assert pool.connection_kwargs["db"] == 2
    sentinel = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
    assert (sentinel["username"], sentinel["password"]) == ("watcher", "a-sentinel-password")
    # And a forked child's client is its own, alike
    fresh = fresh_client(client)
    assert fresh.connection_pool is not pool
    fresh_pool = fresh.connection_pool
    assert isinstance(fresh_pool, SentinelConnectionPool)
    assert fresh_pool.service_name == "ledger"
    assert fresh_pool.sentinel_manager is not pool.sentinel_manager
    assert fresh_pool.connection_class is SentinelManagedSSLConnection
    assert (fresh_pool.connection_kwargs["password"], fresh_pool.connection_kwargs["db"]) == (
        "p@ss",
        2,
    )


def test_a_master_name_set_in_the_apps_transport_options_is_the_platforms_too() -> None:
    app = create_app("sentinel-conf", settings=Settings(broker_url=URL), set_as_current=False)
    app.conf.broker_transport_options["master_name"] = "from-conf"
    assert conf_problems(app.conf, app.pinned_conf) == []
    assert app.runtime.redis.connection_pool.service_name == "from-conf"


def test_a_sentinel_url_without_a_master_name_says_which_setting_is_missing() -> None:
    with pytest.raises(ConfigurationError, match="LEDGER_SENTINEL_MASTER"):
        redis_client(RedisTarget(URL))


def test_a_plain_url_keeps_the_plain_transport_and_client() -> None:
    app = create_app(
        "plain", settings=Settings(broker_url="redis://127.0.0.1:6379/0"), set_as_current=False
    )
    assert app.conf.broker_transport == "celery_ledger.transport:Transport"
    assert not isinstance(app.runtime.redis.connection_pool, SentinelConnectionPool)
    assert app.runtime.broker_target.primary(app.runtime.redis) == "127.0.0.1:6379"


def test_the_sentinel_transport_keeps_what_the_ledgers_adds() -> None:
    assert issubclass(SentinelTransport, Transport)
    for option in ("master_name", "sentinel_kwargs", "ledger_poison_key", "unacked_key"):
        assert option in SentinelChannel.from_transport_options


def test_a_sentinel_connection_never_moves_to_another_entry_of_its_list() -> None:
    # Given Celery's connection of a Sentinel app (its URL lists three sentinels)
    app = create_app(
        "moves",
        settings=Settings(broker_url=URL + ";sentinel://s3", sentinel_master="ledger"),
        set_as_current=False,
    )
    with app.connection_for_write() as connection:
        assert isinstance(connection, Connection)
        # When kombu would move to the next entry after a connection error
        connection.maybe_switch_next()
        # Then it stays, with the ledger's transport and the data nodes' password
        assert connection.transport_cls == "celery_ledger.transport:SentinelTransport"
        assert (connection.hostname, connection.password) == ("s1", "p@ss")


def test_a_switch_keeps_the_transport_the_connection_was_given() -> None:
    app = create_app("switch", settings=Settings(), set_as_current=False)
    with app.connection_for_write("redis://a:6379/0;redis://b:6379/0") as connection:
        connection.maybe_switch_next()
        assert connection.hostname == "b"
        assert connection.transport_cls == "celery_ledger.transport:Transport"


def test_a_worker_refuses_a_sentinel_url_without_the_primarys_name() -> None:
    app = create_app("nameless", settings=Settings(broker_url=URL), set_as_current=False)
    app.conf.broker_transport_options.pop("master_name", None)
    problems = conf_problems(app.conf, app.pinned_conf)
    assert any("LEDGER_SENTINEL_MASTER" in problem for problem in problems)
