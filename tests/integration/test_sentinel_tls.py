"""TLS through Sentinel: the sentinels and the data nodes reached only through TLS, verified
against the CA of ``ops/tls/make-certs.sh``, as ``LEDGER_SENTINEL_TLS=true`` and a broker URL
with ``ssl_*`` options configure it.

The valkey build here has no TLS, so each server's TLS is terminated by a proxy in front of it
(``ops/chaos/proxy.py``, as in test_tls.py): the data nodes announce their proxy's port, so the
sentinels name only those to clients, and the sentinels' own traffic and the replication pass
through the same ports in plain text (the proxy tells a TLS handshake by its first byte). What
is tested is every client of the platform: the worker's broker connection (kombu's Sentinel
channel under the ledger's transport), its own Redis clients (the delayed set, breakers, locks),
and a producer; each reaches the servers in TLS only, before and after a failover, and a client
that does not trust the servers' CA reaches neither.
"""

from __future__ import annotations

import ssl
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote_plus

import pytest
import redis

from celery_ledger.embedded.sentinel import SentinelGroup, start_sentinel_group
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess
from ops.chaos.proxy import Proxy, ProxyLoop

from .failover import SETTLE_SECONDS, group_producer, group_worker, runs_not_once
from .helpers import shared_task, wait_for
from .test_tls import make_certs

pytestmark = pytest.mark.integration
RECORD = "tests.integration.ledger_app.record"


class TLSGroup:
    """A failover group whose every server is reached through a TLS proxy."""

    def __init__(self, group: SentinelGroup, certs: Path, proxies: list[Proxy]) -> None:
        self.group = group
        self.certs = certs
        self.proxies = proxies

    def env(self, ca: Path | None = None) -> dict[str, str]:
        """An app's settings: the sentinels in TLS, the data nodes in TLS, both verified
        against ``ca`` (the servers' own by default)."""
        first, _, rest = self.group.url.partition(";")
        trusted = quote_plus(str(ca or self.certs / "ca.pem"))
        return {
            **self.group.env,
            "LEDGER_BROKER_URL": f"{first}?ssl_cert_reqs=required&ssl_ca_certs={trusted};{rest}",
            "LEDGER_SENTINEL_TLS": "true",
        }

    def tls_connections(self, kind: str) -> int:
        """Connections in TLS through the fronts of the sentinels or of the data nodes."""
        fronts = [p for p in self.proxies if p.name.startswith(kind)]
        return sum(p.counts["tls"] if p.plain_too else p.counts["connections"] for p in fronts)


@pytest.fixture
def tls_group(tmp_path: Path) -> Iterator[TLSGroup]:
    certs = make_certs(tmp_path / "certs")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certs / "redis.pem", certs / "redis.key")
    with ProxyLoop() as loop:

        def front(kind: str, port: int) -> int:
            # A data node's front passes the sentinels' and the replicas' plain text on; a
            # sentinel's is reached by clients only (the sentinels reach each other directly)
            proxy = loop.add(f"{kind}-{port}", target_port=port, tls=tls, plain_too=kind == "node")
            return proxy.listen_port

        group = start_sentinel_group(tmp_path / "sentinel", front=front)
        try:
            yield TLSGroup(group, certs, loop.proxies)
        finally:
            group.stop()


def test_a_worker_and_a_producer_run_jobs_through_sentinel_in_tls_across_a_failover(
    tmp_path: Path, stack: EmbeddedStack, tls_group: TLSGroup
) -> None:
    group = tls_group.group
    # (A client that trusts another CA reaches nothing: the certificates are verified)
    other = make_certs(tmp_path / "other-ca") / "ca.pem"
    distrusting = group_producer(
        stack,
        group,
        "sentinel-tls-distrust",
        broker_url=tls_group.env(ca=other)["LEDGER_BROKER_URL"],
        sentinel_tls=True,
    )
    with pytest.raises(redis.ConnectionError, match="No master found"):
        distrusting.runtime.redis.ping()
    distrusting.close()
    # Given a worker and a producer configured for TLS to the sentinels and the data nodes
    settings = tls_group.env()
    worker: WorkerProcess = group_worker(tmp_path / "worker", stack, group, env=settings)
    try:
        producer = group_producer(
            stack,
            group,
            "sentinel-tls",
            broker_url=settings["LEDGER_BROKER_URL"],
            sentinel_tls=True,
        )
        record = shared_task(producer, RECORD)
        run = uuid.uuid4().hex[:8]
        # When jobs are published now, and with a countdown (the delayed set, the worker's own
        # Redis client), all in TLS
        first = [f"tls-{run}-{n}" for n in range(10)]
        for token in first[:8]:
            record.delay(token=token)
        for token in first[8:]:
            record.apply_async(kwargs={"token": token}, countdown=1)
        # Then each runs once
        wait_for(lambda: not runs_not_once(first), timeout=60, what="the jobs in TLS")
        assert tls_group.tls_connections("sentinel") > 0 and tls_group.tls_connections("node") > 0
        # When the primary is killed and the sentinels promote a replica
        old = group.primary()
        old.kill()
        new = group.wait_for_new_primary(old.port)
        assert new is not old
        # Then jobs published after it run once too, through the new primary's TLS front
        after = [f"tls-{run}-after-{n}" for n in range(10)]
        for token in after:
            while True:
                try:
                    record.delay(token=token)
                    break
                except Exception:  # refused while the sentinels promote: tried again
                    time.sleep(0.2)
        wait_for(lambda: not runs_not_once(after), timeout=90, what="the jobs after the failover")
        promoted = next(p for p in tls_group.proxies if p.name == f"node-{new.port}")
        assert promoted.counts["tls"] > 0, "nothing reached the new primary in TLS"
        time.sleep(SETTLE_SECONDS)
        assert runs_not_once(first + after) == {}
        assert worker.alive(), "the worker ended"
        producer.close()
    finally:
        worker.stop()
