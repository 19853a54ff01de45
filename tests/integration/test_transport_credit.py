"""A consumer without an event loop (Celery's loop for the gevent and eventlet pools) takes the
next message as soon as an acknowledgement made elsewhere returns its credit, instead of sitting
out the drain's whole timeout with a free slot."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from kombu.entity import Queue
from kombu.messaging import Consumer, Producer

from celery_ledger.poller import MultiChannelPoller

from .conftest import producer_app


def test_credit_returned_during_a_drain_lets_the_next_message_in(stack: Any) -> None:
    app = producer_app(stack, "transport_credit")
    with app.connection_for_read() as connection:
        assert isinstance(connection.transport.cycle, MultiChannelPoller)
        queue = Queue(f"credit-{uuid.uuid4().hex[:8]}")
        with connection.channel() as publishing:
            producer = Producer(publishing)
            for i in range(2):
                producer.publish({"i": i}, routing_key=queue.name, declare=[queue])
        received: list[Any] = []
        consumer = Consumer(
            connection, [queue], on_message=received.append, prefetch_count=1, accept=["json"]
        )
        with consumer:
            connection.drain_events(timeout=10)
            assert [m.payload["i"] for m in received] == [0]
            # Its one slot is taken: the second message waits until the first is acknowledged,
            # which another thread does (as a gevent task's greenlet does) while the drain waits
            acker = threading.Timer(0.3, received[0].ack)
            acker.start()
            try:
                # Before the repair the drain waited on its sockets for its whole timeout and
                # then raised a timeout with the second message still in the queue
                connection.drain_events(timeout=10)
            except TimeoutError:
                pytest.fail("the credit returned during the drain was not seen")
            finally:
                acker.join()
            assert [m.payload["i"] for m in received] == [0, 1]
            received[1].ack()
