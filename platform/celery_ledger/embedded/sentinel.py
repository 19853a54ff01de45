"""A Redis failover group on loopback: a primary, its replicas and the sentinels that watch
them, each a ``valkey-server`` (a sentinel is the same binary with ``--sentinel``).

For tests and trials of a Sentinel deployment (``sentinel://`` broker URLs): the data nodes
share one password (``requirepass``, and ``masterauth`` for the replication of whichever is the
primary), the sentinels another (clients and the sentinels themselves authenticate with it).
:attr:`SentinelGroup.env` is what an app needs (``LEDGER_BROKER_URL`` and the
``LEDGER_SENTINEL_*`` settings).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus

import redis

from .servers import (
    LOOPBACK,
    ServerProcess,
    ServerStartError,
    _config_string,
    _spawn,
    _wait_ready,
    free_port,
    private_dir,
    start_valkey,
    valkey_binary,
)

MASTER_NAME = "ledger"


@dataclass
class SentinelGroup:
    """Data nodes (the first started as the primary) and sentinels; ``stop()`` ends them."""

    master_name: str
    password: str  # the data nodes'
    sentinel_password: str
    nodes: list[ServerProcess] = field(default_factory=list)
    sentinels: list[ServerProcess] = field(default_factory=list)
    # Where clients reach a server, by its own port, when something stands in front of it
    fronts: dict[int, int] = field(default_factory=dict)

    def reached_at(self, server: ServerProcess) -> int:
        return self.fronts.get(server.port, server.port)

    @property
    def url(self) -> str:
        """The broker URL: every sentinel, the data nodes' password on the first entry."""
        auth = f":{quote_plus(self.password)}@"
        return ";".join(
            f"sentinel://{auth if index == 0 else ''}{LOOPBACK}:{self.reached_at(server)}/0"
            for index, server in enumerate(self.sentinels)
        )

    @property
    def env(self) -> dict[str, str]:
        return {
            "LEDGER_BROKER_URL": self.url,
            "LEDGER_SENTINEL_MASTER": self.master_name,
            "LEDGER_SENTINEL_PASSWORD": self.sentinel_password,
        }

    def primary_port(self) -> int | None:
        """The primary's port as a majority of the sentinels name it now (None: no majority)."""
        votes: dict[int, int] = {}
        for sentinel in self.sentinels:
            if not sentinel.alive():
                continue
            try:
                client = redis.Redis(
                    host=LOOPBACK,
                    port=sentinel.port,
                    password=self.sentinel_password,
                    socket_timeout=1,
                )
                with client:
                    address: Any = client.sentinel_get_master_addr_by_name(self.master_name)
            except redis.RedisError:
                continue
            if address:
                port = int(address[1])
                votes[port] = votes.get(port, 0) + 1
        for port, count in votes.items():
            if count > len(self.sentinels) // 2:
                return port
        return None

    def primary(self) -> ServerProcess:
        port = self.primary_port()
        for node in self.nodes:
            if self.reached_at(node) == port:
                return node
        raise ServerStartError(f"the sentinels name no primary of ours (port {port})")

    def wait_for_new_primary(self, old_port: int, timeout: float = 60.0) -> ServerProcess:
        """The node the sentinels promoted in place of ``old_port``, once it takes writes."""
        deadline = time.monotonic() + timeout
        old_port = self.fronts.get(old_port, old_port)  # (the sentinels name the fronts)
        while time.monotonic() < deadline:
            port = self.primary_port()
            if port is not None and port != old_port:
                node = next(n for n in self.nodes if self.reached_at(n) == port)
                client = redis.Redis(
                    host=LOOPBACK, port=node.port, password=self.password, socket_timeout=1
                )
                try:
                    with client:
                        if client.role()[0] in (b"master", "master"):
                            return node
                except redis.RedisError:
                    pass
            time.sleep(0.1)
        raise ServerStartError(f"no primary promoted in place of port {old_port} in {timeout}s")

    def stop(self) -> None:
        for server in (*self.sentinels, *self.nodes):
            server.stop()


def start_sentinel_group(
    base: Path,
    *,
    replicas: int = 2,
    sentinels: int = 3,
    master_name: str = MASTER_NAME,
    down_after_ms: int = 1000,
    failover_timeout_ms: int = 5000,
    front: Callable[[str, int], int] | None = None,
) -> SentinelGroup:
    """Start the group under ``base``: the primary, ``replicas`` replicas of it, then
    ``sentinels`` sentinels (a quorum of a majority) watching it.

    ``front(kind, port)`` (kind ``node`` or ``sentinel``), if given, puts something in front of
    each server before it starts (a TLS proxy, for a valkey built without TLS) and returns the
    port the others reach it at: the data nodes announce theirs (the sentinels and their
    clients then know only those) and replicate through them, and :attr:`SentinelGroup.url`
    lists the sentinels' ones."""
    private_dir(base)
    group = SentinelGroup(
        master_name=master_name,
        password=secrets.token_hex(16),
        sentinel_password=secrets.token_hex(16),
    )

    def fronted(kind: str) -> tuple[int, int | None]:
        port = free_port()
        if front is None:
            return port, None
        group.fronts[port] = front(kind, port)
        return port, group.fronts[port]

    try:
        port, announced = fronted("node")
        primary = start_valkey(
            base / "node-0", port=port, password=group.password, announce_port=announced
        )
        group.nodes.append(primary)
        for index in range(1, replicas + 1):
            port, announced = fronted("node")
            group.nodes.append(
                start_valkey(
                    base / f"node-{index}",
                    port=port,
                    password=group.password,
                    replica_of=group.reached_at(primary),
                    announce_port=announced,
                )
            )
        quorum = sentinels // 2 + 1
        for index in range(sentinels):
            port, _ = fronted("sentinel")
            group.sentinels.append(
                _start_sentinel(
                    base / f"sentinel-{index}",
                    group,
                    group.reached_at(primary),
                    port=port,
                    quorum=quorum,
                    down_after_ms=down_after_ms,
                    failover_timeout_ms=failover_timeout_ms,
                )
            )
        _wait_watching(group, timeout=30.0, replicas=replicas)
    except BaseException:
        group.stop()
        raise
    return group


def _start_sentinel(
    data_dir: Path,
    group: SentinelGroup,
    primary_port: int,
    *,
    port: int,
    quorum: int,
    down_after_ms: int,
    failover_timeout_ms: int,
) -> ServerProcess:
    private_dir(data_dir)
    name = group.master_name
    config = data_dir / "sentinel.conf"  # (the sentinel rewrites it: its state)
    config.touch(mode=0o600)
    config.write_text(
        "\n".join(
            [
                f"port {port}",
                f"bind {LOOPBACK}",
                f"dir {_config_string(str(data_dir))}",
                f"requirepass {_config_string(group.sentinel_password)}",
                f"sentinel sentinel-pass {_config_string(group.sentinel_password)}",
                f"sentinel monitor {name} {LOOPBACK} {primary_port} {quorum}",
                f"sentinel auth-pass {name} {_config_string(group.password)}",
                f"sentinel down-after-milliseconds {name} {down_after_ms}",
                f"sentinel failover-timeout {name} {failover_timeout_ms}",
                f"sentinel parallel-syncs {name} 1",
                "",
            ]
        )
    )
    argv = [str(valkey_binary()), str(config), "--sentinel"]
    auth = f":{quote_plus(group.sentinel_password)}@"
    server = ServerProcess(
        "valkey",  # (answers PING as a server does: the readiness check is the same)
        port,
        f"redis://{auth}{LOOPBACK}:{port}/0",
        data_dir,
        argv,
        data_dir / "sentinel.log",
        _spawn(argv, data_dir / "sentinel.log"),
    )
    _wait_ready(server, 15.0)
    return server


def _wait_watching(group: SentinelGroup, *, timeout: float, replicas: int) -> None:
    """Until every sentinel knows the others and the replicas (a failover needs both)."""
    deadline = time.monotonic() + timeout
    others = len(group.sentinels) - 1
    while time.monotonic() < deadline:
        ready = 0
        for sentinel in group.sentinels:
            client = redis.Redis(
                host=LOOPBACK, port=sentinel.port, password=group.sentinel_password
            )
            with client:
                master: Any = client.sentinel_master(group.master_name)
            if (
                int(master.get("num-other-sentinels", 0)) >= others
                and int(master.get("num-slaves", 0)) >= replicas
            ):
                ready += 1
        if ready == len(group.sentinels):
            return
        time.sleep(0.2)
    raise ServerStartError(f"the sentinels did not find each other and the replicas in {timeout}s")
