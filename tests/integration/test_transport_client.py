"""The transport keeps one Redis client per connection pool: publishes and acknowledgements make
no client each (the saving), and still reach the broker after it restarts."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import redis

from celery_ledger.transport import Channel

from .conftest import make_isolated_stack, producer_app


def test_publishes_share_one_client_and_go_on_after_the_broker_restarts(
    tmp_path: Path, stack: Any
) -> None:
    isolated = make_isolated_stack(tmp_path)
    try:
        producer = producer_app(isolated, "transport_producer")
        with producer.connection_for_write() as conn:
            name = f"transport-{uuid.uuid4().hex[:8]}"
            queue = conn.SimpleQueue(name)
            channel = queue.channel
            assert isinstance(channel, Channel)
            made: list[Any] = []
            create = channel._create_client

            def counted(*args: Any, **kwargs: Any) -> Any:
                made.append(kwargs.get("asynchronous", False))
                return create(*args, **kwargs)

            channel._create_client = counted  # type: ignore[method-assign]
            for i in range(5):
                queue.put({"i": i})
            got = [queue.get(timeout=5) for _ in range(2)]
            for message in got:
                message.ack()
            # Five publishes, two reads and two acknowledgements: at most one client made
            assert made.count(False) <= 1
            assert [m.payload["i"] for m in got] == [0, 1]

            # When kombu drops the channel's pool (as after a fork), the next command makes a
            # client of the new pool, once
            channel._after_fork()
            made.clear()
            for i in range(5, 8):
                queue.put({"i": i})
            assert made.count(False) == 1
            with channel.conn_or_acquire() as client:
                assert client.connection_pool is channel.pool

            # And threads sending at once share it
            seen: list[int] = []

            def ping() -> None:
                with channel.conn_or_acquire() as client:
                    assert client.ping()
                    seen.append(id(client))

            threads = [threading.Thread(target=ping) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert len(seen) == 8 and len(set(seen)) == 1 and made.count(False) == 1
            queue.close()

        # When the broker restarts, the kept client's pooled connections are gone: the next
        # publishes open new ones and reach the new broker process
        again = f"transport-{uuid.uuid4().hex[:8]}"
        for i in range(3):  # the app's producer channel, its client kept
            producer.send_task("transport.probe", (i,), queue=again)
        assert isolated.broker is not None
        isolated.broker.stop()
        isolated.broker.restart()
        for i in range(3, 6):
            producer.send_task("transport.probe", (i,), queue=again)
        with redis.Redis.from_url(isolated.broker.url) as broker:
            assert broker.llen(again) == 6
            assert broker.llen(name) == 6  # 2, 3, 4 and 5, 6, 7
        producer.close()
    finally:
        isolated.stop()
