"""Queue depths, shared token buckets and foreground pressure against a real valkey-server."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_ledger import pressure
from celery_ledger.embedded.servers import ServerProcess
from celery_ledger.policies.backpressure import QueueDepths
from celery_ledger.policies.rate_limit import RateLimit, RateLimits, TokenBucket
from celery_ledger.pressure import Pressure


class CountingConnection(redis.Connection):
    """Counts the packets sent: one per command, or one per pipeline (a round trip each)."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        super().send_packed_command(command, check_health)


@pytest.fixture
def client(valkey: ServerProcess) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(valkey.url, connection_class=CountingConnection)
    connection.ping()
    try:
        yield connection
    finally:
        connection.close()


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def test_queue_depths_are_real_llen_in_one_round_trip(client: redis.Redis) -> None:
    queues = [unique("critical"), unique("default"), unique("bulk")]
    client.lpush(queues[0], *range(3))
    client.lpush(queues[2], *range(40))
    depths = QueueDepths(client, queues, ttl_seconds=60.0)

    before = CountingConnection.sends
    assert depths.refresh() == {queues[0]: 3, queues[1]: 0, queues[2]: 40}
    assert CountingConnection.sends == before + 1

    client.lpush(queues[1], "x")
    assert [depths.depth(queues[1]) for _ in range(100)] == [0] * 100  # cached
    assert CountingConnection.sends == before + 2  # the lpush only
    assert depths.refresh()[queues[1]] == 1


def test_token_bucket_waits_and_expires_when_idle(client: redis.Redis) -> None:
    bucket = TokenBucket(client, unique("api"), rate_per_second=10.0, burst=3)

    assert [bucket.try_acquire() for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = bucket.try_acquire()
    assert 0.05 < wait <= 0.1
    assert 0.0 < bucket.try_acquire(3) <= 0.3
    assert 0 < client.pttl(bucket.key) <= 1300
    assert not bucket.acquire(3, timeout=0.01)  # the wait is known to exceed the timeout
    assert bucket.acquire(timeout=1.0)
    with pytest.raises(ValueError):
        bucket.try_acquire(4)

    limits = RateLimits(
        client, {"a": RateLimit(1.0, 1), "b": RateLimit(5.0, 2)}, key_prefix=unique("test")
    )
    assert sorted(limits) == ["a", "b"]
    assert (limits["b"].rate_per_second, limits["b"].burst) == (5.0, 2)


WORKER = """
import sys, time
import redis
from celery_ledger.policies.rate_limit import TokenBucket

url, name = sys.argv[1], sys.argv[2]
bucket = TokenBucket(redis.Redis.from_url(url), name, rate_per_second=20.0, burst=5)
print("ready", flush=True)
start, end = (float(x) for x in sys.stdin.readline().split())
while time.time() < start:
    time.sleep(0.001)
got = 0
while (now := time.time()) < end:
    wait = bucket.try_acquire()
    if wait == 0.0:
        got += 1
    else:
        time.sleep(min(wait, end - now))
print(got, flush=True)
"""


def test_two_processes_share_one_bucket(valkey: ServerProcess) -> None:
    name, duration = unique("shared"), 1.0
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, valkey.url, name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "ready"
        start = time.time() + 0.1
        for worker in workers:  # both get the start line before either is waited on
            assert worker.stdin is not None
            worker.stdin.write(f"{start} {start + duration}\n")
            worker.stdin.flush()
        counts = [int(worker.communicate(timeout=10)[0]) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()

    allowed = 5 + 20.0 * duration
    assert allowed - 4 <= sum(counts) <= allowed + 2, counts
    assert min(counts) > 0, counts


def test_p95_over_the_window(client: redis.Redis) -> None:
    latency = Pressure(client, window_seconds=30.0, key_prefix=unique("test"))
    assert latency.p95_ms() is None

    latency.server_now()  # the clock's first sync (once per resync_seconds)
    before = CountingConnection.sends
    for ms in range(1, 101):
        latency.report_latency(float(ms))
    latency.report_latency(100.5)
    assert CountingConnection.sends == before  # a report is no broker round trip

    assert latency.flush() == 101
    assert CountingConnection.sends == before + 1  # ZADD + ZREMRANGEBYSCORE + EXPIRE, pipelined
    assert latency.p95_ms() == 96.0
    assert client.zcard(latency.key) == 101
    assert 0 < client.ttl(latency.key) <= 31


def test_reported_samples_reach_redis_by_themselves_within_a_flush(client: redis.Redis) -> None:
    latency = Pressure(client, window_seconds=30.0, key_prefix=unique("test"), flush_seconds=0.2)
    for ms in (10.0, 20.0, 30.0):
        latency.report_latency(ms)
    deadline = time.monotonic() + 5
    while client.zcard(latency.key) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.zcard(latency.key) == 3  # sent by the flusher thread, nobody read
    latency.close()


def test_samples_older_than_the_window_drop_out(client: redis.Redis) -> None:
    latency = Pressure(client, window_seconds=1.0, key_prefix=unique("test"))
    for _ in range(5):
        latency.report_latency(900.0)
    assert latency.p95_ms() == 900.0

    time.sleep(1.1)
    assert latency.p95_ms() is None
    latency.report_latency(20.0)

    assert latency.p95_ms() == 20.0
    assert client.zcard(latency.key) == 1


def test_report_latency_configured_from_the_environment(
    valkey: ServerProcess, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pressure, "_default", None)
    monkeypatch.setenv("LEDGER_BROKER_URL", valkey.url)
    client.delete("celery_ledger:pressure:latency")
    try:
        pressure.report_latency(42.0)
        assert pressure._default is not None
        assert pressure._default.p95_ms() == 42.0

        configured = pressure.configure(valkey.url, window_seconds=5.0)
        assert pressure._default is configured
        pressure.report_latency(43.0)
        assert configured.p95_ms() == 43.0
    finally:
        if pressure._default is not None:
            pressure._default.client.close()
