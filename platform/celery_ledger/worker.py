"""What every celery-ledger worker runs beside its pool (the Celery adapter of the engines):
housekeeping threads (due deliveries, poison drain, retention, the bulk throttle, the
reconciler) and a consumer that quarantines poison messages."""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from celery import bootsteps, signals
from celery.exceptions import InvalidTaskError
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from celery.worker.control import inspect_command
from kombu import serialization
from kombu.entity import Exchange, Queue
from kombu.exceptions import ContentDisallowed, DecodeError, OperationalError
from kombu.utils import json as kombu_json

from .clock import REPORT_EVERY_SECONDS
from .crypto import SealedKeyMissing, sealing
from .delayed import DelayedPublisher
from .depth_history import SAMPLE_EVERY_SECONDS
from .envelope import body_problem
from .errors import ConfigurationError, LedgerError
from .explain import exiting_on_mistakes
from .express import express_queues
from .handoff import LOOK_EVERY_SECONDS, Handoff, Parked, inbox_of
from .headers import PARKED, UNRUNNABLE_SINCE
from .policies.throttle import ThrottleSwitch
from .policies.unrunnable import unrunnable_delay
from .progress import serve_shutdown_flag
from .sentinel import for_workers
from .tenancy import worker_feeder
from .transport import broker_address
from .triggers import TriggerRunner, watchers_for

logger = logging.getLogger("celery_ledger.worker")
EXPIRE_EVERY_SECONDS = 60.0  # as MongoDB's TTL monitor (when ``ttl_index`` is off)
COPY_PENDING_EVERY_SECONDS = 10.0  # dead letters whose queue copy failed (broker away)
REAP_EVERY_SECONDS = 30.0  # transactions a dead worker left (Ledger.reap_abandoned_transactions)
PACED_FLOOR_SECONDS = 0.01  # a paced lane's shortest wait (a job that asks for none: 0)


class Housekeeping:
    """Daemon threads running small periodic jobs, one thread per lane.

    Jobs in one lane run one after another, so a lane is only as prompt as its slowest job.
    Due deliveries (every retry and countdown of the app) get a lane of their own: a ledger
    outage (each ledger call waits out its server selection), a long retention pass or a
    reconciler sweep over a large ledger must not hold back a retry that only needs the broker.
    """

    def __init__(
        self,
        lanes: dict[str, list[Callable[[], object]]],
        *,
        interval: float,
        on_stop: tuple[Callable[[float], object], ...] = (),
    ) -> None:
        self._lanes = {name: jobs for name, jobs in lanes.items() if jobs}
        self._interval = interval
        # What the worker's stop runs before the lanes end (the trigger watchers save their
        # place and give up their leases): from the worker's shutdown sequence, never from the
        # signal handler that starts it, where waiting on a lane's lock blocks the worker. Each
        # hook is given what is left of the stop's time: a cold stop (terminate) must not wait
        # out a warm stop's patience for a hook stuck behind an outage.
        self._on_stop = on_stop
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, jobs in self._lanes.items():
            thread = threading.Thread(
                target=self._run, args=(jobs,), name=f"ledger-housekeeping-{name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for hook in self._on_stop:
            try:
                hook(max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # the worker stops anyway; leases end by themselves
                logger.warning(
                    "housekeeping stop %s failed: %s", getattr(hook, "__qualname__", hook), exc
                )
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def terminate(self) -> None:
        self.stop(timeout=1.0)

    def _run(self, jobs: list[Callable[[], object]]) -> None:
        failing_since: dict[int, float] = {}
        last_warning: dict[int, float] = {}
        wait = self._interval
        while not self._stop.wait(wait):
            wait = self._interval
            for index, job in enumerate(jobs):
                try:
                    asked = job()
                    if isinstance(job, Paced) and isinstance(asked, float):
                        wait = min(wait, max(asked, PACED_FLOOR_SECONDS))
                except Exception as exc:  # keep going through broker or ledger outages
                    now = time.monotonic()
                    since = failing_since.setdefault(index, now)
                    if now - last_warning.get(index, 0.0) >= 30.0:  # not once per tick
                        logger.warning(
                            "housekeeping %s failing for %.0fs: %s",
                            getattr(job, "__qualname__", job),
                            now - since,
                            exc,
                        )
                        last_warning[index] = now
                else:
                    if failing_since.pop(index, None) is not None:
                        logger.info("housekeeping %s recovered", getattr(job, "__qualname__", job))


def report_clocks(runtime: Any, host: str) -> None:
    """Read both servers' clocks afresh and write this host's offsets to the fleet's book
    (``ledger health`` reads it): a worker whose host clock drifts is seen within a report."""
    clocks = (runtime.ledger.clock, runtime.broker_clock)
    for clock in clocks:
        clock.sync()
    runtime.clock_book.report(host, clocks, now=runtime.message_time())


class Paced:
    """A job that answers when it wants to run again (seconds, or None): its lane waits no
    longer than that. The fleet's scheduler: a lane that waited its interval after each pass
    would start every pass a pass's time later than the last, and skip 1-s windows."""

    def __init__(self, job: Callable[[], float | None]) -> None:
        self._job = job
        self.__qualname__ = getattr(job, "__qualname__", "job")

    def __call__(self) -> float | None:
        return self._job()


class Every:
    """Runs ``job`` at most once per ``seconds`` (housekeeping ticks may come faster)."""

    def __init__(self, seconds: float, job: Callable[[], object]) -> None:
        self._seconds = seconds
        self._job = job
        self._last = 0.0
        self.__qualname__ = getattr(job, "__qualname__", "job")

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._last >= self._seconds:
            self._last = now
            self._job()


class LedgerWorkerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Ensures the ledger's indexes and runs the housekeeping threads.

    The threads' owner is the step's ``obj``, so Celery's start, stop and terminate reach them.
    """

    requires: ClassVar[set[str]] = {"celery.worker.components:Pool"}

    def create(self, worker: Any) -> Housekeeping:
        app = worker.app
        runtime = app.runtime
        settings = runtime.settings
        # Its housekeeping reports this host's clocks (below), for its pool processes too:
        # they fork after this, and inherit the switch
        runtime.clock_reports.enabled = False
        # No broker named, keys it lacks (it could open, seal or key none of those jobs),
        # settings changed after create_app that break a guarantee: refuse to start, naming
        # each (on Celery's command line: the lines and exit 2, no traceback)
        with exiting_on_mistakes(settings):
            settings.require_broker_url()
            missing = app.missing_keys() + app.configuration_problems()
            if missing:
                raise ConfigurationError("; ".join(missing))
            app.check_configuration()  # (checked: its pool processes inherit the answer)
        # Its broker connections wait longer than a producer's (see sentinel.for_workers)
        app.conf.broker_transport_options = for_workers(app.conf.broker_transport_options, settings)
        flag = serve_shutdown_flag()
        flag.unlink(missing_ok=True)
        # On warm shutdown, tell running bodies (in the pool processes) to checkpoint and yield.
        signals.worker_shutting_down.connect(lambda **_: flag.touch(), weak=False)
        signals.worker_shutdown.connect(lambda **_: flag.unlink(missing_ok=True), weak=False)
        try:
            runtime.ledger.ensure_indexes()
            app.workflow_engine.log.ensure_indexes()
        except LedgerError as exc:  # the ledger may come up later; claims defer until then
            logger.warning("could not ensure ledger indexes at start-up: %s", exc)

        def send(name: str, args: Any, kwargs: Any, options: dict[str, Any]) -> None:
            with sealing(runtime.sealer):  # a sensitive task's entry names the sealed codec
                app.send_task(name, args, kwargs, **options)

        def keep_unopenable(name: str, options: dict[str, Any], sealed: str, reason: str) -> None:
            found = options.get("headers")
            app.dead_letters.push_poison(
                queue=str(options.get("queue") or ""),
                reason=reason,
                raw=sealed.encode(),  # the body the codec would send, still sealed
                message_headers={
                    **(found if isinstance(found, dict) else {}),
                    "task": name,
                    "id": options.get("task_id"),
                },
            )

        publishers = [
            DelayedPublisher(
                deliveries, send, sealer=runtime.sealer, keep_unopenable=keep_unopenable
            )
            for deliveries in (runtime.delayed, runtime.legacy_delayed)
            if deliveries is not None
        ]
        # Lanes: broker-only deliveries; the ledger's upkeep (its calls wait out an outage); the
        # throttle (a broadcast waits for replies); the reconciler; fair dispatch (tenancy.py).
        deliveries: list[Callable[[], object]] = [p.publish_due for p in publishers]
        upkeep: list[Callable[[], object]] = [
            app.dead_letters.drain_poison,
            Every(COPY_PENDING_EVERY_SECONDS, app.dead_letters.copy_pending),
            Every(COPY_PENDING_EVERY_SECONDS, app.dead_letters.trim_copies),
            Every(EXPIRE_EVERY_SECONDS, app.workflow_engine.log.expire),
            Every(REAP_EVERY_SECONDS, runtime.ledger.reap_abandoned_transactions),
            Every(settings.escalation_check_seconds, app.escalation.check),
            Every(REPORT_EVERY_SECONDS, lambda: report_clocks(runtime, worker.hostname)),
        ]
        if not settings.ttl_index:
            upkeep.append(Every(EXPIRE_EVERY_SECONDS, runtime.ledger.expire))
        throttle: list[Callable[[], object]] = []
        bulk_queue = runtime.tiers.queue("bulk")
        switch: ThrottleSwitch | None = None
        if bulk_queue in app.amqp.queues.consume_from:
            switch = ThrottleSwitch(app, worker.hostname, bulk_queue)
            throttle.append(Every(settings.throttle_check_seconds, switch.tick))
        # The handoff (celery_ledger.handoff): what another worker parked and this one can run
        # comes to this worker's inbox, a queue only it consumes (as Celery's worker_direct),
        # bound to an exchange of its own (no publish to a tier reads its binding)
        at_start = frozenset(app.amqp.queues.consume_from)
        inbox = inbox_of(runtime.tiers.namespace, worker.hostname)
        app.amqp.queues.select_add(Queue(inbox, Exchange(inbox, type="direct"), routing_key=inbox))

        def serving() -> frozenset[str]:
            """The queues it consumes now (a throttle or an operator may cancel one)."""
            consumer = getattr(getattr(worker, "consumer", None), "task_consumer", None)
            queues = getattr(consumer, "queues", None)
            return frozenset(q.name for q in queues) if queues else at_start

        def fed() -> frozenset[str]:  # (a queue cancelled for a while is fed all the same)
            return serving() | at_start

        def express() -> frozenset[str]:  # (those its express process takes from: express.py)
            return serving() & express_queues(getattr(worker, "consumer", None))

        def not_runnable(entry: Parked) -> str | None:
            headers = entry.raw.get("headers")
            verdict, _why, problem = check_message(
                app, headers if isinstance(headers, dict) else {}, raw_decoder(app, entry.raw)
            )
            return None if verdict == "run" else (problem or verdict)

        def held(entry: Parked) -> bool:  # not now (looked at again at the next look)
            return entry.queue not in serving()

        def room() -> int:
            return int(worker.concurrency or 1) - len(worker_state.reserved_requests)

        handoff = Handoff(runtime.parking, inbox, not_runnable, held=held, room=room)
        reconcile: list[Callable[[], object]] = []
        outbox: list[Callable[[], object]] = []
        schedules: list[Callable[[], object]] = []
        stops: tuple[Callable[[float], object], ...] = ()
        # (entries may be declared at run time, in the ledger: the lane runs without any in code)
        if app.schedules_in_workers():
            # A lane of its own: a slot is due to the second, whatever else housekeeping does
            schedules.append(Paced(app.fleet_scheduler.tick_if_leader))
            stops += (app.fleet_scheduler.stop,)  # give the lease up: the next slot is on time
        if settings.reconcile_in_workers:
            sweep = app.reconciler.sweep_if_leader
            reconcile.append(Every(settings.reconcile_every_seconds, sweep))
        if settings.outbox_relay_in_workers:
            # A lane of its own: within seconds of a committer's death, whatever a reconciler
            # sweep over a large ledger costs
            outbox.append(Every(settings.outbox_relay_seconds, app.outbox.relay_if_leader))
        # Change-stream triggers: the lease holder of each reads in a lane of its own (its
        # reads wait on the server); every worker competes, whatever tiers it consumes.
        triggers: list[Callable[[], object]] = []
        watchers = watchers_for(app, (OperationalError,))  # (the broker away: not stuck)
        if watchers:
            runner = TriggerRunner(watchers)
            triggers.append(runner)
            stops += (runner.stop,)  # save each watcher's place, give up its lease
        return Housekeeping(
            {
                "triggers": triggers,
                "deliveries": deliveries,
                "fair": [Paced(job) for job in worker_feeder(app, fed, express)],
                "upkeep": upkeep,
                "throttle": throttle,
                "reconcile": reconcile,
                "outbox": outbox,
                "schedules": schedules,
                "handoff": [Every(LOOK_EVERY_SECONDS, handoff.look)],
                # the queue depths' history (the console's chart): broker-only, like deliveries
                "depths": [Every(SAMPLE_EVERY_SECONDS, runtime.sample_depths)],
            },
            interval=settings.defer_poll_seconds,
            on_stop=stops,
        )


@inspect_command()  # type: ignore[untyped-decorator]
def ledger_broker(state: Any) -> dict[str, str | None]:
    """The broker server this worker's consumer uses (through Sentinel: the primary)."""
    return {"broker": broker_address(state.consumer.connection)}


class LedgerConsumer(Consumer):  # type: ignore[misc]
    """Celery's consumer, keeping every message it cannot run instead of dropping it.

    Celery logs and drops (acks or rejects) undecodable bodies, refused content types, unknown
    tasks and invalid task messages. Here:

    - a message this worker cannot run and another worker may (a task it does not know,
      arguments its version of the task does not bind, a body signed or sealed with a key it
      does not hold) is parked, as it was sent, for a worker that can run it to take (the
      handoff: celery_ledger.handoff), for ``LEDGER_UNRUNNABLE_WINDOW_SECONDS`` (a rolling
      deploy adds tasks before every worker has them; another app's worker may share the queue
      by mistake), and only then dead-lettered with its reason;
    - everything else that cannot run is kept in the dead-letter flow with its reason.

    A message is acknowledged only once it is kept (put off, or quarantined); if that fails it
    goes back to the queue. A task body that is not ``[args, kwargs, embed]`` is refused here as
    an invalid task message, before Celery's strategy and pool unpack it (where it would stop
    the worker or be dropped); the transport has already refused malformed envelopes and headers.
    """

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        on_task_received: Callable[[Any], Any] = super().create_task_handler(*args, **kwargs)

        def on_valid_task_received(message: Any) -> Any:
            headers = message.headers if isinstance(message.headers, dict) else {}
            name = headers.get("task")
            if not (isinstance(name, str) and name in self.strategies):
                return on_task_received(message)  # Celery's checks: on_unknown_task, ...
            verdict, why, problem = check_message(self.app, headers, message.decode)
            if verdict == "park":
                if self._park(message, str(why), str(problem)):
                    return None
                # its window is over: a dead letter, by the path its kind takes, and its job's
                # waiting record with it (see _keep_or_requeue)
                verdict = {"arguments": "run", "signature": "refuse"}.get(str(why), "pass")
                message.ledger_given_up = True
            if verdict == "refuse":
                return self.on_invalid_task(None, message, InvalidTaskError(problem))
            if verdict == "run":
                self._received_from_parking(message, headers)
            return on_task_received(message)  # ("pass": Celery refuses it, on_decode_error)

        return on_valid_task_received

    def _received_from_parking(self, message: Any, headers: dict[str, Any]) -> None:
        """A copy this worker took from the parked messages arrived, sound and booked as taken:
        the parked entry is done (see celery_ledger.handoff). Not while its take is held in
        this process only (a full broker): the entry stays parked, and its take lease ends. A
        failure leaves it parked too: taken again later, a duplicate the ledger suppresses."""
        properties = message.properties if isinstance(message.properties, dict) else {}
        parked = properties.get(PARKED)
        if not isinstance(parked, str) or not 0 < len(parked) <= 64:
            return
        qos = getattr(getattr(message, "channel", None), "qos", None)
        booked = getattr(qos, "booked", None)
        if callable(booked) and not booked(message.delivery_tag):
            return
        try:
            self.app.runtime.parking.release(parked, str(headers.get("id")))
        except Exception as exc:
            logger.warning("could not mark parked message %s as received: %s", parked, exc)

    def _park(self, message: Any, why: str, problem: str) -> bool:
        """Put off a message this worker cannot run and another worker may (a deploy under
        way): parked for the handoff, and due back on its queue with backoff. False once its
        window is over (the caller keeps it as a dead letter, with its reason)."""
        headers = message.headers if isinstance(message.headers, dict) else {}
        runtime = self.app.runtime
        now = runtime.message_time()
        later = unrunnable_delay(
            headers, window_seconds=runtime.settings.unrunnable_window_seconds, now=now
        )
        if later is None:
            return False
        delay, held_headers = later
        queue = str((message.delivery_info or {}).get("routing_key") or "")
        try:
            runtime.parking.park(
                queue,
                _envelope(message, held_headers),
                due_at=now + delay,
                why=why,
                since=float(held_headers[UNRUNNABLE_SINCE]),
            )
        except Exception as exc:
            logger.error("could not park %s (%s: %s); requeued", headers.get("id"), why, exc)
            message.reject(requeue=True)
            return True
        logger.warning(
            "%s (%s): parked for a worker that can run it (back on its queue in %.1fs)",
            problem,
            headers.get("id"),
            delay,
        )
        message.ack()
        return True

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        reason = f"undecodable or refused content ({message.content_type}): {exc}"
        logger.error("%s; headers %r", reason, message.headers)
        self._keep_or_requeue(message, reason)

    def on_unknown_message(self, body: Any, message: Any) -> None:
        self._keep_or_requeue(message, "unknown message format (no task header)")
        signals.task_rejected.send(sender=self, message=message, exc=None)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        logger.error("invalid task message: %s", exc)
        self._keep_or_requeue(message, f"invalid task message: {exc}")
        signals.task_rejected.send(sender=self, message=message, exc=exc)

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        headers = message.headers if isinstance(message.headers, dict) else {}
        name = headers.get("task", "?")
        if not isinstance(name, str) or not name.strip():  # no deploy will ever know it
            self._keep_or_requeue(message, f"unknown task {name!r}: not a task name")
            return
        if not self._park(message, "unknown-task", f"unknown task {name!r}: not registered here"):
            message.ledger_given_up = True
            window = self.app.runtime.settings.unrunnable_window_seconds
            self._keep_or_requeue(
                message, f"unknown task {name!r}: no worker ran it within {window:.0f}s"
            )

    def _keep_or_requeue(self, message: Any, reason: str) -> None:
        """Quarantine the message as poison and acknowledge it; if it cannot be kept, hand it
        back to the queue instead (it is never dropped). One no worker could run within the
        window (``ledger_given_up``) ends its job: a record written at its publish, still
        waiting, is dead with it (else the reconciler would publish it again, for ever)."""
        try:
            body = message.body
            raw = body if isinstance(body, bytes) else str(body).encode("utf-8", "backslashreplace")
            queue = (message.delivery_info or {}).get("routing_key", "")
            self.app.dead_letters.push_poison(
                queue=str(queue),
                reason=reason,
                raw=raw,
                kind="body",
                message_headers=message.headers,
                final=getattr(message, "ledger_given_up", False),
            )
        except Exception:
            logger.exception("could not quarantine a poison message (%s); requeued", reason)
            message.reject(requeue=True)
            return
        message.ack()


# check_message's verdicts: run it; park it for a worker that can (why, problem); refuse it
# as an invalid task message here and everywhere (problem); pass it to Celery's own refusals.
Verdict = tuple[str, str | None, str | None]
RUN: Verdict = ("run", None, None)
PASS: Verdict = ("pass", None, None)


def check_message(app: Any, message_headers: dict[str, Any], decode: Callable[[], Any]) -> Verdict:
    """Whether this worker can run a task message, as (verdict, why, problem):

    - ``("run", None, None)``: it can;
    - ``("park", why, problem)``: it cannot, and another worker of the fleet may (a deploy or
      a key rotation under way): ``why`` is ``unknown-task`` (not registered here),
      ``sealed`` (sealed with a key it does not hold), ``signature`` (signed with a key it
      does not list), ``arguments`` (its version of the task does not bind them);
    - ``("refuse", None, problem)``: an invalid task message, for every worker (a body that is
      not ``[args, kwargs, embed]``, a signature that does not check);
    - ``("pass", None, None)``: Celery's own checks refuse it (undecodable, content refused).

    The order is the point: a message is parked only once every check this worker can make
    has passed, so a changed, forged or oversized message is refused at once, never parked
    for the window; a sealed body cannot be checked without its key, so it is parked first.
    One owner for "can this worker run it": the consumer parks what it finds unrunnable here,
    and the handoff takes what it finds runnable (see celery_ledger.handoff).
    ``decode``: the body, as kombu decodes it (memoized by kombu's message)."""
    name = message_headers.get("task")
    if not isinstance(name, str) or not name.strip():
        return PASS
    task = app.tasks.get(name)
    if task is None:
        return "park", "unknown-task", f"unknown task {name!r}: not registered here"
    try:
        body = decode()
    except DecodeError as exc:
        if any(isinstance(e, SealedKeyMissing) for e in (exc.__cause__, *exc.args)):
            return "park", "sealed", f"task {name!r}: sealed with a key this worker does not hold"
        return PASS
    except ContentDisallowed:
        return PASS
    problem = body_problem(body)
    if problem is not None:
        return "refuse", None, problem
    signer = app.runtime.signer
    problem = signer.problem(message_headers, body)
    if problem is not None:
        if signer.lacks_key(message_headers):
            return "park", "signature", problem
        return "refuse", None, problem
    binding = getattr(task, "binding_problem", None)  # (a ledger task's)
    unbound = binding(tuple(body[0]), dict(body[1])) if callable(binding) else None
    if unbound is None:
        return RUN
    try:
        size = len(kombu_json.dumps([body[0], body[1]]))
    except (TypeError, ValueError):
        return RUN  # (the guard says what is wrong with them)
    if size > app.settings.max_payload_bytes:
        return RUN  # oversized everywhere: the guard keeps it as a dead letter at once
    return "park", "arguments", f"task {name!r}: arguments do not bind this version: {unbound}"


def raw_decoder(app: Any, raw: dict[str, Any]) -> Callable[[], Any]:
    """``decode`` for :func:`check_message` of a message as the transport stores it."""

    def decode() -> Any:
        properties = raw.get("properties") or {}
        body = raw.get("body")
        if properties.get("body_encoding") == "base64":
            body = base64.b64decode(str(body))
        return serialization.loads(
            body,
            raw.get("content-type"),
            raw.get("content-encoding"),
            accept=serialization.prepare_accept_content(app.conf.accept_content),
        )

    return decode


def _envelope(message: Any, message_headers: dict[str, Any]) -> dict[str, Any]:
    """The message as kombu's Redis transport stores it in a queue's list."""
    body = message.body if isinstance(message.body, bytes) else str(message.body).encode()
    properties = dict(message.properties or {})
    properties.update(
        {
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
            "delivery_info": {
                "exchange": (message.delivery_info or {}).get("exchange", ""),
                "routing_key": (message.delivery_info or {}).get("routing_key", ""),
            },
        }
    )
    return {
        "body": base64.b64encode(body).decode(),
        "content-encoding": message.content_encoding,
        "content-type": message.content_type,
        "headers": message_headers,
        "properties": properties,
    }
