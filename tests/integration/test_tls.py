"""TLS to both servers, with the certificates of ``ops/tls/make-certs.sh``: the ledger (a real
SecantusDB) requires TLS, and the broker is reached only through TLS, and a worker and a
producer run jobs (a countdown through the delayed set, a breaker's scripts) over it. A
``rediss://`` URL is verified against its CA: a server whose certificate another CA signed is
refused, by Celery's connection as by the platform's own Redis clients.

The valkey build here has no TLS (``tls-*`` directives are refused), so the broker's TLS is
terminated by a proxy in front of it (``ops/chaos/proxy.py``, the script's ``redis.pem``): what
is tested is every client of the platform; the Redis server's own TLS settings are the compose
override's (``docker-compose.tls.yml``, checked by the compose tests)."""

from __future__ import annotations

import secrets
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus

import pytest
import redis
from pymongo import MongoClient
from pymongo.errors import ServerSelectionTimeoutError

from celery_ledger.embedded.servers import start_secantus, start_valkey
from ops.chaos.proxy import ProxyLoop

from .conftest import APP_MODULE, NAMESPACE, producer_app
from .helpers import shared_task
from .watchdog import WATCH, WatchedStack

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "tls" / "make-certs.sh"


def make_certs(directory: Path) -> Path:
    result = subprocess.run(
        ["sh", str(SCRIPT), str(directory)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    return directory


@pytest.fixture
def tls_stack(tmp_path: Path, stack: Any) -> Iterator[WatchedStack]:
    certs = make_certs(tmp_path / "certs")
    (tmp_path / "stack").mkdir(mode=0o700)
    running = WatchedStack(APP_MODULE, tmp_path / "stack", auth=False, queue_namespace=NAMESPACE)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certs / "redis.pem", certs / "redis.key")
    with ProxyLoop() as proxies:
        try:
            password = secrets.token_hex(16)
            running.broker = start_valkey(tmp_path / "valkey", password=password)
            front = proxies.add("broker", target_port=running.broker.port, tls=tls)
            ca = quote_plus(str(certs / "ca.pem"))
            running.extra_env["LEDGER_BROKER_URL"] = (
                f"rediss://:{password}@127.0.0.1:{front.listen_port}/0?ssl_ca_certs={ca}"
            )
            running.ledger = start_secantus(
                tmp_path / "secantus", password=secrets.token_hex(16), tls_dir=certs
            )
            WATCH.watch(running)
            yield running
        finally:
            WATCH.unwatch(running)
            running.stop()


def test_the_certificate_script_makes_a_ca_and_server_certificates_with_private_keys(
    tmp_path: Path,
) -> None:
    certs = make_certs(tmp_path / "certs")
    for name in ("ca.key", "redis.key", "mongo.pem", "client.key"):
        assert (certs / name).stat().st_mode & 0o077 == 0, name
    for name in ("redis.pem", "mongo.pem", "client.pem"):
        verified = subprocess.run(
            ["openssl", "verify", "-CAfile", str(certs / "ca.pem"), str(certs / name)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr


def test_jobs_run_over_tls_to_both_servers(tls_stack: WatchedStack) -> None:
    assert tls_stack.ledger is not None
    broker_url = tls_stack.env["LEDGER_BROKER_URL"]
    assert broker_url.startswith("rediss://") and "tls=true" in tls_stack.ledger.url
    tls_stack.start_worker(tls_stack.queues_of(), concurrency=1, name="tls@127.0.0.1")
    producer = producer_app(tls_stack, "tls_producer", broker_url=broker_url)
    token = f"tls-{time.time_ns()}"
    try:
        results = [
            shared_task(producer, "tests.integration.ledger_app.record").delay(token),
            shared_task(producer, "tests.integration.ledger_app.record").apply_async(
                (f"{token}-later",), countdown=0.5
            ),
            shared_task(producer, "tests.integration.ledger_app.call_payments").delay(f"{token}-p"),
        ]
        assert [r.get(timeout=60) is not None for r in results] == [True, True, True]
        record = producer.ledger.get("tests.integration.ledger_app.record", token)
        assert record is not None and record.state.value == "succeeded"
    finally:
        producer.close()
    # Every broker connection went through TLS: a plain client gets no answer there
    plain = broker_url.replace("rediss://", "redis://").split("?")[0]
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(plain, socket_timeout=2, socket_connect_timeout=2).ping()


def test_a_server_certificate_of_another_ca_is_refused(
    tls_stack: WatchedStack, tmp_path: Path
) -> None:
    assert tls_stack.ledger is not None
    other = make_certs(tmp_path / "other-ca")
    own_ca, wrong_ca = (quote_plus(str(d / "ca.pem")) for d in (tmp_path / "certs", other))
    assert own_ca in tls_stack.env["LEDGER_BROKER_URL"] and own_ca in tls_stack.ledger.url
    broker_url = tls_stack.env["LEDGER_BROKER_URL"].replace(own_ca, wrong_ca)

    # The broker: refused by the platform's Redis clients and by its Celery connection
    with pytest.raises(redis.exceptions.ConnectionError, match="certificate verify failed"):
        redis.Redis.from_url(broker_url).ping()
    app = producer_app(tls_stack, "wrong_ca", broker_url=broker_url)
    try:
        with pytest.raises(Exception, match="certificate verify failed"):
            app.connection_for_write().ensure_connection(max_retries=1)
    finally:
        app.close()

    # The ledger: a client trusting another CA does not connect
    ledger_url = tls_stack.ledger.url.replace(own_ca, wrong_ca)
    with (
        MongoClient(ledger_url, serverSelectionTimeoutMS=2000) as client,
        pytest.raises(ServerSelectionTimeoutError, match="certificate verify failed"),
    ):
        client.admin.command("ping")
