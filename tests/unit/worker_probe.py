"""A celery-ledger worker's main process, without a broker or a pool: what it does with a queue
item that the transport accepted, run with kombu's and Celery's own objects.

- kombu: the virtual transport's ``Message``, the Redis QoS bookkeeping of an unacked message
  (``QoS.append``) and its restore (``Channel._do_restore_message``, which runs at shutdown and
  on a requeue: a raise there loses the message);
- Celery: :class:`celery_ledger.worker.LedgerConsumer` itself (its task handler, Celery's
  ``on_task_received``, the error handlers that quarantine), the task's real strategy
  (``celery.worker.strategy.default``: ``Request``, the received log line, ``revoked()``, events,
  the eta's conversion for the timer), the request's hand-over to the pool
  (``execute_using_pool``) and what the pool's callbacks do in the main process (accepted, soft
  time limit, success), plus ``info()`` (remote control), ``str``/``repr``, the task context
  and ``as_execution_options`` (a retry);
- the ledger: its header readers in :mod:`celery_ledger.untrusted`.

I/O is replaced by recorders: the result backend, the dead-letter list, events (serialised as
kombu would send them) and the pool (which pickles each job, as billiard does).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from celery.backends.base import DisabledBackend
from celery.exceptions import TaskRevokedError
from celery.worker import state as worker_state
from kombu.serialization import prepare_accept_content
from kombu.transport.virtual.base import Base64
from kombu.transport.virtual.base import Channel as VirtualChannel
from kombu.transport.virtual.base import Message as VirtualMessage
from kombu.utils.json import dumps, loads
from redis.connection import Encoder

from celery_ledger import Settings, create_app, headers
from celery_ledger.untrusted import float_or_none, valid_key_or_none
from celery_ledger.worker import LedgerConsumer

LEDGER_TASK = "probe.ledger_task"
PLAIN_TASK = "celery_ledger.reconcile"  # a plain celery.Task (base=Task) of every ledger app
REVOKED_ID = "revoked-by-id"
REVOKED_STAMP = ("probe_stamp", "revoked")  # a stamp the worker was told to revoke
REDIS = Encoder("utf-8", "strict", False)  # how redis-py writes keys and values


class ProbeBackend(DisabledBackend):  # type: ignore[misc]
    """Records what a result backend is asked to store, reading the request as the ledger's
    backend does (``ledger_settled``, ``task``, ``chord``), without storing anything."""

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        self.calls: list[tuple[str, str, Any]] = []

    def _read(self, request: Any) -> None:
        if request is not None:
            getattr(request, "ledger_settled", False)
            getattr(request, "task", None)
            getattr(request, "chord", None)

    def mark_as_failure(self, task_id: str, exc: Any, *args: Any, **kwargs: Any) -> None:
        self._read(kwargs.get("request"))
        self.calls.append(("failure", task_id, exc))

    def mark_as_revoked(self, task_id: str, reason: str = "", *args: Any, **kwargs: Any) -> None:
        self._read(kwargs.get("request"))
        self.calls.append(("revoked", task_id, reason))


class ProbeEventer:
    """The event dispatcher, on: each event is serialised as kombu's JSON would send it."""

    enabled = True

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, type: str, **fields: Any) -> None:
        REDIS.encode(dumps({"type": type, **fields}))
        self.sent.append(type)


class ProbeJob:
    """billiard's ApplyResult as far as the worker's main process touches it."""

    def __init__(self, **callbacks: Any) -> None:
        self.__dict__.update(callbacks)


class ProbePool:
    """``Pool.apply_async`` of billiard's asynpool: the job is pickled for the child process,
    and the time limits become timers (``monotonic() + float(seconds)``)."""

    soft_timeout = None
    timeout = None

    def __init__(self) -> None:
        self.jobs: list[ProbeJob] = []

    def apply_async(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...] = (),
        *,
        soft_timeout: Any = None,
        timeout: Any = None,
        **callbacks: Any,
    ) -> ProbeJob:
        soft_timeout = soft_timeout or self.soft_timeout
        timeout = timeout or self.timeout
        pickle.dumps((func, args))
        for seconds in (soft_timeout, timeout):
            if seconds:
                time.monotonic() + float(seconds)
        if soft_timeout and timeout:
            float(timeout) - float(soft_timeout)  # the hard timer starts at the soft one
        job = ProbeJob(soft_timeout=soft_timeout, timeout=timeout, **callbacks)
        self.jobs.append(job)
        return job


class ProbeChannel:
    """The virtual channel's side of a message: body codecs, ack and reject."""

    no_ack_consumers = None

    def __init__(self) -> None:
        self.codecs = {"base64": Base64()}
        self.acked: list[str] = []
        self.rejected: list[tuple[str, bool]] = []

    def decode_body(self, body: Any, encoding: Any = None) -> Any:
        return VirtualChannel.decode_body(self, body, encoding)  # type: ignore[arg-type]

    def basic_ack(self, delivery_tag: str, multiple: bool = False) -> None:
        self.acked.append(delivery_tag)

    def basic_reject(self, delivery_tag: str, requeue: bool = False) -> None:
        self.rejected.append((delivery_tag, requeue))


class ProbeDeadLetters:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def push_poison(self, *, reason: str, **_: Any) -> None:
        self.reasons.append(reason)


@dataclass
class Outcome:
    """What became of one queue item."""

    quarantined: list[str] = field(default_factory=list)  # reasons, as the dead record has them
    jobs: int = 0  # handed to the pool
    revoked: int = 0
    refused: list[Any] = field(default_factory=list)  # failures Celery stored itself

    def summary(self) -> str:
        if self.jobs:
            return "handled: ran"
        if self.revoked:
            return "handled: revoked"
        if self.quarantined:
            return f"handled: dead-lettered ({self.quarantined[0].split(':')[0][:40]})"
        return "handled: dropped" if not self.refused else "handled: refused by Celery"


class ProbeConsumer(LedgerConsumer):
    """LedgerConsumer with the worker around it replaced by recorders (no blueprint, no hub)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.hostname = "probe@127.0.0.1"
        self.connection_errors = ()
        self.channel_errors = ()
        self.hub = None
        self.event_dispatcher = ProbeEventer()
        self.pool = ProbePool()
        self.timer = SimpleNamespace(call_at=self._call_at)
        self.disable_rate_limits = True
        self.task_buckets: defaultdict[str, Any] = defaultdict(lambda: None)
        self.controller = SimpleNamespace(state=worker_state)
        self.on_task_request = self._process_task
        self.on_task_message: set[Any] = set()
        self.qos = SimpleNamespace(increment_eventually=int, decrement_eventually=int)
        self._maximum_prefetch_restored = True
        self.restart_count = 0
        self.strategies: dict[str, Any] = {}
        self._scheduled: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.update_strategies()
        self.on_message = self.create_task_handler()

    def _call_at(self, eta: float, fun: Callable[..., Any], args: tuple[Any, ...], **_: Any) -> Any:
        float(eta)
        self._scheduled.append((fun, args))
        return SimpleNamespace(cancel=lambda: None)

    def _process_task(self, request: Any) -> None:
        """WorkController._process_task (any other error is only logged there, and the message
        is left unacknowledged: stuck)."""
        with contextlib.suppress(TaskRevokedError):
            request.execute_using_pool(self.pool)


class Worker:
    """One app and its consumer; :meth:`handle` runs an envelope through them."""

    def __init__(self) -> None:
        app = create_app(
            "envelope_probe",
            settings=Settings(
                broker_url="redis://127.0.0.1:1/0", mongo_uri="mongodb://127.0.0.1:1/"
            ),
            set_as_current=False,
        )

        @app.task(name=LEDGER_TASK, shared=False)  # type: ignore[untyped-decorator]
        def ledger_task(*args: Any, **kwargs: Any) -> None:
            return None

        app.finalize()
        self.backend = ProbeBackend(app)
        app._local.backend = self.backend  # the consumer's app.backend (unknown tasks)
        for task in app.tasks.values():
            task.backend = self.backend
        self.dead_letters = ProbeDeadLetters()
        app.__dict__["dead_letters"] = self.dead_letters  # a cached_property of the app
        self.app = app
        self.accept = prepare_accept_content(app.conf.accept_content)
        logging.getLogger("celery.worker.strategy").setLevel(logging.INFO)  # the received line
        self.consumer = ProbeConsumer(app)

    def handle(self, raw: dict[str, Any]) -> Outcome:
        """Deliver ``raw`` (a decoded queue item) as kombu and the worker would; raises whatever
        the worker's main process would raise."""
        self._reset()
        consumer, channel = self.consumer, ProbeChannel()
        # kombu: virtual Channel.basic_consume's callback, then Consumer._receive_callback
        message = VirtualMessage(raw, channel=channel)
        unacked = self._qos_append(message)
        message.accept = self.accept
        try:
            if message.errors:
                message._reraise_error(consumer.on_decode_error)
                delivered = False
            else:
                delivered = True
        except Exception as exc:
            consumer.on_decode_error(message, exc)
            delivered = False
        if delivered:
            consumer.on_message(message)
        for fun, args in consumer._scheduled:  # the timer fires: Consumer.apply_eta_task
            fun(*args)
        outcome = Outcome(quarantined=list(self.dead_letters.reasons))
        for job in consumer.pool.jobs:
            self._run_job(job)
        outcome.jobs = len(consumer.pool.jobs)
        outcome.revoked = sum(1 for call in self.backend.calls if call[0] == "revoked")
        outcome.refused = [call for call in self.backend.calls if call[0] == "failure"]
        self._restore(*unacked)
        self._read_ledger_headers(message.headers)
        return outcome

    def _run_job(self, job: ProbeJob) -> None:
        """What the pool's callbacks make the main process do, and what else reads a request."""
        request = job.accept_callback.__self__
        job.accept_callback(4242, time.monotonic())
        for safe in (False, True):  # remote control: inspect active/reserved
            REDIS.encode(dumps(request.info(safe=safe)))
        str(request), repr(request), request.humaninfo()
        context = request._context
        request.task.signature_from_request(context)
        job.timeout_callback(True, job.soft_timeout or 1.0)
        job.callback((False, None, 0.01))

    def _qos_append(self, message: Any) -> tuple[Any, Any, Any]:
        """kombu.transport.redis.QoS.append: the unacked hash and index."""
        delivery = message.delivery_info
        exchange, routing_key = delivery["exchange"], delivery["routing_key"]
        REDIS.encode(message.delivery_tag)
        REDIS.encode(dumps([message._raw, exchange, routing_key]))
        return dumps([message._raw, exchange, routing_key]), exchange, routing_key

    def _restore(self, stored: str, exchange: Any, routing_key: Any) -> None:
        """kombu.transport.redis.Channel._do_restore_message, without its catch-all (which logs
        "Could not restore message" and loses the message)."""
        payload, exchange, routing_key = loads(stored)
        try:
            payload["headers"]["redelivered"] = True
            payload["properties"]["delivery_info"]["redelivered"] = True
        except KeyError:
            pass
        # Channel._lookup: the anonymous exchange routes by the routing key, or to the dead-letter
        # queue (None unless configured); a named (direct) exchange to the queues bound with the
        # routing key, taken here to be named like it (the layout of every celery-ledger queue).
        queues = [routing_key or None] if not exchange else ([routing_key] if routing_key else [])
        assert queues, f"the restore finds no queue for {exchange!r}/{routing_key!r}: lost"
        limits = SimpleNamespace(max_priority=9, min_priority=0, default_priority=0)
        for queue in queues:
            priority = VirtualChannel._get_message_priority(limits, payload)  # type: ignore[arg-type]
            REDIS.encode(queue if not priority or queue is None else f"{queue}\x06\x16{priority}")
            REDIS.encode(dumps(payload))

    def _read_ledger_headers(self, message_headers: dict[str, Any]) -> None:
        """The ledger reads its headers as they came (a value it drops is a value lost)."""
        key = message_headers.get(headers.KEY)
        if key is not None:
            assert valid_key_or_none(key, LEDGER_TASK) == key
        for name in (
            headers.DEFERRALS,
            headers.PREVIOUS_DELAY,
            headers.ENQUEUED_AT,
            headers.SENT_AT,
        ):
            value = message_headers.get(name)
            if value is not None:
                assert float_or_none(value) == float(value), (name, value)

    def _reset(self) -> None:
        self.dead_letters.reasons.clear()
        self.backend.calls.clear()
        self.consumer.pool.jobs.clear()
        self.consumer._scheduled.clear()
        for collection in (
            worker_state.requests,
            worker_state.reserved_requests,
            worker_state.active_requests,
            worker_state.scheduled_requests,
            worker_state.total_count,
        ):
            collection.clear()
        worker_state.all_total_count[0] = 0
        worker_state.revoked.clear()
        worker_state.revoked.add(REVOKED_ID)
        worker_state.revoked_stamps.clear()
        worker_state.revoked_stamps.update({REVOKED_STAMP[0]: [REVOKED_STAMP[1]]})
