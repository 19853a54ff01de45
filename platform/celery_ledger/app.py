"""create_app: the one place that wires the platform to Celery.

It builds the settings, the tiers, the ledger store and the :class:`~celery_ledger.runtime.
Runtime`, and gives the engines (guard, dead letters, reconciler, observability) the services
they use; the app is a :class:`celery.Celery` whose tasks are LedgerTasks, whose result backend
is the ledger, whose transport and consumer quarantine bad messages, and whose workers run the
platform's housekeeping.
"""

from __future__ import annotations

import difflib
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from functools import cached_property
from types import MappingProxyType
from typing import Any

import redis
from celery import Celery, Task
from celery.app.amqp import AMQP
from celery.canvas import Signature
from celery.exceptions import Reject
from kombu.entity import Queue
from pymongo.client_session import ClientSession
from pymongo.monitoring import CommandListener

from . import headers, tracecontext, transport
from .admission import WORKFLOW_STEP
from .broker import RedisBroker, SweepLock
from .bulk_publish import BulkPublishing
from .conf_check import conf_problems, pinned, task_problems
from .crypto import (
    REDACTED,
    SEALED_CONTENT_TYPE,
    SEALED_SERIALIZER,
    Sealer,
    register_sealed_codec,
    sealing,
)
from .deadletter import DeadLetters, poison_key
from .errors import Backpressure, ConfigurationError, PayloadError, PermanentError
from .escalation import Escalation
from .events import Observers
from .explain import declaring, exiting_on_mistakes, install_excepthook
from .express import ExpressStep
from .guard import Guard
from .headers import TENANT
from .ledger.store import Ledger
from .ledger.workflow_log import WorkflowLog
from .observability import install as install_observability
from .observability import ledger_listeners
from .observability.logs import redact_task_logs
from .outbox import Outbox
from .policies.breaker import Breakers
from .policies.deadline import deadline
from .policies.schedule import SchedulePolicy
from .reconciler import Reconciler
from .routing import DEAD_LETTER, TIERS, Tiers, unacked_keys
from .runtime import Runtime, forget_after_fork
from .schedule_definitions import beat_problems, schedule_problem
from .schedules import (
    CELERY_BEAT_SCHEDULER,
    LEDGER_BEAT_SCHEDULER,
    FleetScheduler,
    LedgerScheduler,
)
from .sentinel import primary_of
from .settings import UNSET_BROKER_URL, Settings, settings_from_environment
from .task import KEY_SECRET_NEEDED, LedgerTask
from .triggers import Argument, Trigger
from .triggers import declare as declare_trigger
from .worker import LedgerWorkerStep
from .workflow.after_loss import wake_all_again
from .workflow.api import Workflow, WorkflowCall, WorkflowHandle
from .workflow.context import Call
from .workflow.engine import NOT_HERE, Definition, WorkflowEngine

logger = logging.getLogger("celery_ledger.app")

WAKE_TASK = "celery_ledger.workflow.wake"
# A schedule's run of a durable workflow (``@app.periodic`` on a workflow): starts it keyed by
# the run's slot
START_WORKFLOW_TASK = "celery_ledger.workflow.start"
_MAX_WAKE_FAILURES = 12  # a wake that fails this often in a row marks its workflow stuck

# Options of @app.task that Celery reads but that are not attributes of Task.
_DECORATOR_OPTIONS = frozenset(
    {
        "base",
        "bind",
        "name",
        "shared",
        "lazy",
        "filter",
        "autoretry_for",
        "dont_autoretry_for",
        "retry_kwargs",
        "retry_backoff",
        "retry_backoff_max",
        "retry_jitter",
        "pydantic",
        "pydantic_strict",
        "pydantic_context",
        "pydantic_dump_kwargs",
    }
)
# kombu sweeps unacknowledged messages back under a lock; a worker killed while sweeping holds
# it until it expires (300 s by default), stalling every other worker's sweep that long.
_UNACKED_MUTEX_EXPIRE_SECONDS = 60


class LedgerAMQP(AMQP):  # type: ignore[misc]
    """Celery's message factory, with every task message signed (``LEDGER_SIGNING_KEYS``).

    The one place every task message passes (``apply_async``, ``send_task``, republishes,
    retries, Celery's own chord tasks) once its headers are final, so each is signed once,
    and (tracing on) a publish with no span current continues the trace its message carries.
    """

    Connection = transport.Connection  # (keeps its transport through a failover)

    @cached_property
    def send_task_message(self) -> Callable[..., Any]:
        send: Callable[..., Any] = self._create_task_sender()
        signer = self.app.runtime.signer
        if not signer.enabled and not tracecontext.enabled():
            return send

        def send_ledger(producer: Any, name: str, message: Any, **options: Any) -> Any:
            message_headers, _properties, body, _sent_event = message
            message_headers.update(options.pop("headers", None) or {})
            if signer.enabled:
                message_headers.pop(headers.SIGNATURE, None)  # a republish is signed again
                message_headers[headers.SIGNATURE] = signer.sign(message_headers, body)
            with tracecontext.continuing(message_headers):
                return send(producer, name, message, **options)

        return send_ledger


class LedgerCelery(BulkPublishing, Celery):  # type: ignore[misc]
    """A :class:`celery.Celery` with the ledger attached (``app.ledger``)."""

    amqp_cls = "celery_ledger.app:LedgerAMQP"

    settings: Settings
    tiers: Tiers
    runtime: Runtime
    # create_app's (conf_check.pinned); none for an app made otherwise: nothing to check
    pinned_conf: Mapping[str, Any] = MappingProxyType({})

    @property
    def ledger(self) -> Ledger:
        """The ledger store: ``app.ledger.get(task_name, key)`` reads a job's record."""
        return self.runtime.ledger

    @property
    def sealer(self) -> Sealer:
        """Encryption at rest for sensitive tasks (``LEDGER_ENCRYPTION_KEYS``)."""
        return self.runtime.sealer

    @property
    def breakers(self) -> Breakers:
        """Circuit breakers shared through Redis by every worker: ``app.breakers["payments"]``."""
        return self.runtime.breakers

    @property
    def observers(self) -> Observers:
        """The platform's observers: ``app.observers.add(MyObserver())``."""
        return self.runtime.observers

    @cached_property
    def dead_letters(self) -> DeadLetters:
        return DeadLetters(self.runtime, self._publish_raw)

    @staticmethod
    def deadline(seconds: float | None) -> AbstractContextManager[None]:
        """``with app.deadline(2.0):`` calls through ``bounded``/``hedged`` inside wait at
        most 2 s in all (see :mod:`celery_ledger.policies.deadline`)."""
        return deadline(seconds)

    @cached_property
    def guard(self) -> Guard:
        return Guard(self.runtime, self.dead_letters)

    @cached_property
    def escalation(self) -> Escalation:
        """Reports jobs past their latency objective (every worker's housekeeping runs it)."""
        return Escalation(self.runtime)

    @cached_property
    def fleet_scheduler(self) -> FleetScheduler:
        """The app's ``beat_schedule``, run in the workers' housekeeping (schedules.py)."""
        return FleetScheduler(self)

    def schedules_in_workers(self) -> bool:
        """Whether the workers run the app's schedules (``LEDGER_SCHEDULES_IN_WORKERS``)."""
        setting = self.settings.schedules_in_workers
        if setting is not None:
            return setting
        return self.conf.beat_scheduler in (LEDGER_BEAT_SCHEDULER, LedgerScheduler)

    @cached_property
    def reconciler(self) -> Reconciler:
        runtime = self.runtime
        keys = unacked_keys(self.tiers.namespace)
        broker = RedisBroker(
            runtime.redis,
            queues=self.tiers.queues,
            delayed_key=runtime.delayed.key,
            unacked_key=keys.get("unacked_key", "unacked"),
            unacked_index_key=keys.get("unacked_index_key", "unacked_index"),
            now=runtime.message_time,
            marker_key=f"{runtime.name}:ledger:broker-marker",
            primary=primary_of(runtime.broker_target, runtime.redis),
        )
        ttl = runtime.settings.reconcile_every_seconds * 2.5
        lock = SweepLock(runtime.redis, f"{runtime.name}:ledger:reconciler", ttl_seconds=ttl)
        return Reconciler(
            runtime,
            broker,
            lock,
            wake_overdue_workflows=lambda held: self.workflow_engine.wake_overdue(held=held),
            wake_workflows_after_loss=lambda held: wake_all_again(self.workflow_engine, held),
            idempotent_tasks=(WAKE_TASK,),
            declare_queues=lambda: transport.declare_queues(self),
            unrecorded=runtime.unrecorded,
            copy_dead_letters_again=self.dead_letters.copy_again_after_loss,
        )

    @cached_property
    def outbox(self) -> Outbox:
        """Jobs and workflow starts made in the app's own MongoDB transaction (outbox.py)."""
        runtime = self.runtime
        ttl = runtime.settings.outbox_relay_seconds * 2.5
        lock = SweepLock(runtime.redis, f"{runtime.name}:ledger:outbox", ttl_seconds=ttl)
        return Outbox(
            runtime,
            publish_wake=lambda workflow_id, tier: self.workflow_ports.publish_wake(
                workflow_id, tier
            ),
            workflow_states=self.workflow_engine.log.running,
            lock=lock,
            announce_dead=lambda record_id: self.dead_letters.announce_record(record_id),
            wake_due_workflows=lambda limit, held: self.workflow_engine.wake_overdue(
                limit=limit, held=held
            ),
        )

    def enqueue(self, session: ClientSession, work: Signature | WorkflowCall) -> Any:
        """Enqueue ``work`` (a task's signature, ``charge.s(7, 100)``, or a workflow's,
        ``fulfil.s(order_id)``) in ``session``'s transaction: it exists, and runs once, only
        if the transaction commits (see outbox.py). Returns its ``AsyncResult`` or handle.

        Raises:
            ConfigurationError: ``session`` is not in a transaction, or the signature carries
                what an outbox job cannot (callbacks, a countdown).
        """
        if isinstance(work, WorkflowCall):
            return work.workflow.start_with(work.args, work.kwargs, session=session)
        if isinstance(work, Signature):
            return work.apply_async(session=session)
        raise ConfigurationError(
            f"app.enqueue takes a task's or a workflow's .s(...), not {type(work).__name__}"
        )

    # -- workflows ------------------------------------------------------------------------------

    @cached_property
    def workflows(self) -> dict[str, Workflow]:
        """The workflows declared on this app, by name."""
        return {}

    @cached_property
    def workflow_ports(self) -> _WorkflowPorts:
        return _WorkflowPorts(self)

    @cached_property
    def workflow_engine(self) -> WorkflowEngine:
        settings = self.settings
        definitions = _Definitions(self.workflows)
        return WorkflowEngine(
            WorkflowLog(self.ledger, retention_seconds=settings.workflow_retention_seconds),
            definitions,
            self.workflow_ports,
            default_tier=settings.default_tier,
            snapshot_every=settings.workflow_snapshot_every,
            check_seconds=settings.workflow_check_seconds,
            committer_grace_seconds=settings.outbox_grace_seconds,
            max_payload_bytes=settings.max_payload_bytes,
            max_result_bytes=settings.max_result_bytes,
            open_text=self.sealer.open,
            seal_text=self.sealer.seal if self.sealer.enabled else None,
            observers=self.runtime.observers,
            # Timers and waits are kept on the workflow's state: the ledger's clock
            clock=lambda: self.ledger.now().timestamp(),
        )

    @declaring
    def workflow(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        idempotency_key: Any = None,
        tier: str | None = None,
        snapshot_every: int | None = None,
        sensitive: bool = False,
    ) -> Any:
        """Declare a durable workflow: ``@app.workflow(idempotency_key="order-{order_id}")``.

        The function's first parameter is the workflow context (``wf``); the others are the
        workflow's arguments (JSON). ``tier`` is where its wakes run; ``snapshot_every`` how
        many events pass between snapshots of its log. ``sensitive``: its and its steps'
        arguments, signals and result sealed, its exception text withheld, its key an HMAC.
        """
        secret = self.settings.key_secret  # checked at a worker's start and at start()

        def declare(function: Callable[..., Any]) -> Workflow:
            if tier is not None:
                self.tiers.check(tier, where=f"workflow {function.__name__}")
            if snapshot_every is not None and snapshot_every < 10:
                raise ConfigurationError("snapshot_every must be at least 10")
            workflow_name = name or self.gen_task_name(function.__name__, function.__module__)
            if workflow_name in self.workflows or workflow_name in self.tasks:
                raise ConfigurationError(f"{workflow_name} is already declared on this app")
            declared = Workflow(
                self,
                Definition(
                    workflow_name,
                    function,
                    key_spec=idempotency_key,
                    tier=tier,
                    snapshot_every=snapshot_every,
                    sensitive=sensitive,
                    key_secret=secret.get_secret_value().encode() if secret else None,
                ),
            )
            self.workflows[workflow_name] = declared
            return declared

        return declare if fn is None else declare(fn)

    @declaring
    def periodic(
        self,
        schedule: Any,
        *,
        name: str | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        **policy: Any,
    ) -> Callable[[Any], Any]:
        """Run the task (or start the durable workflow) below on ``schedule`` (seconds or a
        ``timedelta`` of more than 0, a ``crontab``, a ``solar``), each slot once, whoever
        fires it (the workers, ``celery beat``, both; a workflow's id is keyed by the slot):

            @app.periodic(crontab(minute=5), overlap="skip", jitter_seconds=30)
            @app.task
            def hourly_rollup(): ...

        The keywords left are its policy (:class:`~celery_ledger.policies.schedule.
        SchedulePolicy`), checked here with the schedule. It is the entry ``name`` (the task's
        or workflow's name unless given) of ``beat_schedule``, by which ``ledger schedules``
        and the console manage it.
        """
        chosen = SchedulePolicy.of(policy or None)
        if (problem := schedule_problem(schedule)) is not None:
            raise ConfigurationError(f"@app.periodic: {problem}")

        def declare(target: Any) -> Any:
            if isinstance(target, Workflow):  # started by a task of its own, keyed by the slot
                workflow = target.definition.name
                task_name, entry_name = START_WORKFLOW_TASK, name or workflow
                run_args: tuple[Any, ...] = (workflow, list(args), dict(kwargs or {}))
                run_kwargs: dict[str, Any] = {}
                tier = target.definition.tier or self.settings.default_tier
                run_options = {"queue": self.tiers.queue(tier), **dict(options or {})}
            else:
                found = getattr(target, "name", None)
                if not isinstance(found, str) or not callable(getattr(target, "apply_async", None)):
                    raise ConfigurationError(
                        "@app.periodic schedules a task or a workflow of this app: put it above"
                        " @app.task or @app.workflow"
                    )
                task_name, entry_name, run_args = found, name or found, tuple(args)
                run_kwargs, run_options = dict(kwargs or {}), dict(options or {})
            entry = {
                "task": task_name,
                "schedule": schedule,
                "args": run_args,
                "kwargs": run_kwargs,
                "options": run_options,
                "policy": chosen,
            }
            self.conf.beat_schedule = {**(self.conf.beat_schedule or {}), entry_name: entry}
            return target

        return declare

    def missing_keys(self) -> list[str]:
        """What sensitive tasks and workflows need that the settings lack (a worker refuses)."""
        sensitive = [t for t in self.tasks.values() if getattr(t, "sensitive", False)]
        flows = [w.definition for w in self.workflows.values() if w.definition.sensitive]
        problems = []
        if (sensitive or flows) and not self.sealer.enabled:
            names = ", ".join(sorted([t.name for t in sensitive] + [d.name for d in flows]))
            problems.append(f"sensitive {names} need LEDGER_ENCRYPTION_KEYS (Fernet keys)")
        derived = [t.name for t in sensitive if t.key_spec() is None]
        derived += [d.name for d in flows if d.key_spec is None]
        if derived and self.settings.key_secret is None:
            problems += [KEY_SECRET_NEEDED.format(task=name) for name in sorted(derived)]
        return problems

    def configuration_problems(self) -> list[str]:
        """Celery settings changed after create_app, and ledger tasks' options, that would break
        a guarantee (:mod:`celery_ledger.conf_check`); a worker refuses to start with any."""
        problems = conf_problems(self.conf, self.pinned_conf)
        problems += beat_problems(self.conf.beat_schedule)
        for task in self.tasks.values():
            if isinstance(task, LedgerTask):
                problems += task_problems(task)
        return problems

    def check_configuration(self) -> None:
        """Raise :class:`ConfigurationError` naming every problem; a producer's first publish
        asks (once: the configuration does not change under a running app)."""
        if self._configuration_checked:
            return
        problems = self.configuration_problems()
        if problems:
            raise ConfigurationError("; ".join(problems))
        self._configuration_checked = True

    _configuration_checked = False

    def workflow_handle(self, workflow_id: str) -> WorkflowHandle:
        """The handle of a started workflow, by id."""
        return WorkflowHandle(self, workflow_id)

    # -- change-stream triggers (celery_ledger.triggers) ----------------------------------------

    @cached_property
    def triggers(self) -> dict[str, Trigger]:
        """The change-stream triggers declared on this app, by name (their task's name)."""
        return {}

    @declaring
    def on_change(
        self,
        namespace: str,
        *,
        match: Any = None,
        argument: Argument = "document",
        tier: str | None = None,
        name: str | None = None,
        lease_seconds: float | None = None,
        **task_options: Any,
    ) -> Callable[[Callable[..., Any]], Any]:
        """Run the decorated task once per change of ``"database.collection"`` that ``match``
        (a ``$match`` on the change event) selects: ``@app.on_change("shop.orders",
        match={"operationType": "insert"}, tier="bulk")``. ``argument``: the changed
        ``"document"`` (relaxed Extended JSON; None for a delete) or the whole ``"change"``
        event. Other options are the task's (see :mod:`celery_ledger.triggers`)."""
        return declare_trigger(
            self,
            namespace,
            match=match,
            argument=argument,
            tier=tier,
            name=name,
            lease_seconds=lease_seconds,
            **task_options,
        )

    def admit(self, tier: str) -> None:
        """The tier's backpressure for new work that has no record to be shed into (a
        workflow's start): refused above the high-water mark."""
        try:
            decision = self.runtime.gate.check(tier)
        except Exception as exc:  # the broker is down: publishing will say so
            logger.warning("backpressure check on %s skipped: %s", tier, exc)
            return
        if decision != "publish":
            limits = self.settings.tier_limits[tier]
            depth = self.runtime.queue_depths.depth(tier)
            raise Backpressure(tier, depth, getattr(limits, "high_water", depth))

    def wake_where_step_ended(self, workflow_id: str, tier: str) -> str:
        """Advance a workflow where one of its steps just ended: its next step is published at
        once, not after a wake has waited its turn in the tier's queue (under a backlog each
        step waited for the whole queue twice). A workflow this worker cannot advance (another
        app's, a newer release's), and any failure here, get a wake as before. Never raises."""
        try:
            try:  # (as any wake: later ones are sent again; one not cleared is only folded)
                self.runtime.pending_wakes.started(workflow_id)
            except redis.RedisError as exc:
                logger.debug("wake mark of workflow %s not cleared: %s", workflow_id, exc)
            outcome = self.workflow_engine.wake(workflow_id, here_only=True)
            if outcome not in (NOT_HERE, "conflict"):
                return outcome
        except Exception as exc:  # the step's outcome is recorded: a wake message does this
            logger.info("workflow %s not advanced where its step ended: %s", workflow_id, exc)
        try:
            self.workflow_ports.publish_wake(workflow_id, tier)
        except Exception as exc:  # the reconciler's check of the workflow wakes it
            logger.warning("wake of workflow %s not published: %s", workflow_id, exc)
            return "not woken"
        return "wake sent"

    def _run_wake(self, workflow_id: Any, attempt: Any, queue: str | None) -> str:
        """One wake of a workflow (the body of ``celery_ledger.workflow.wake``). Never lost:
        a wake that fails (the ledger or the broker away) is held in the delayed set and
        comes back, with backoff; one that fails every time marks the workflow stuck."""
        if not isinstance(workflow_id, str) or not 0 < len(workflow_id) <= 200:
            logger.warning("workflow wake with a malformed id %r ignored", workflow_id)
            return "ignored"
        tries = attempt if isinstance(attempt, int) and attempt >= 0 else 0
        try:
            # Before the wake reads anything: a wake sent from now on is sent, not folded
            self.runtime.pending_wakes.started(workflow_id)
        except redis.RedisError as exc:
            raise Reject(f"wake mark not cleared: {exc}", requeue=True) from exc
        try:
            outcome = self.workflow_engine.wake(workflow_id)
            if outcome == "conflict":  # other wakes kept winning: look again shortly
                self.runtime.delayed.schedule(
                    WAKE_TASK,
                    [workflow_id],
                    {},
                    {"queue": queue or self.tiers.queue(self.settings.default_tier)},
                    self.runtime.message_time() + random.uniform(0.2, 1.0),
                )
            return outcome
        except Exception as exc:
            logger.warning("wake of workflow %s failed (try %d): %s", workflow_id, tries + 1, exc)
            if tries + 1 >= _MAX_WAKE_FAILURES:
                self.workflow_engine.mark_stuck(workflow_id, f"every wake failed: {exc}")
                return "stuck"
            delay = min(2.0**tries, 60.0) * random.uniform(0.8, 1.2)
            try:
                self.runtime.delayed.schedule(
                    WAKE_TASK,
                    [workflow_id],
                    {"attempt": tries + 1},
                    {"queue": queue or self.tiers.queue(self.settings.default_tier)},
                    self.runtime.message_time() + delay,
                )
            except Exception as held:
                raise Reject(f"wake not held: {held}", requeue=True) from exc
            return "retrying"

    def is_sensitive(self, task_name: Any) -> bool:
        """Whether ``task_name`` is a sensitive task of this app. The task log filter asks each
        live app about every task log line: an app not finalized runs no task, so it answers
        without finalizing (a declaration of its own that fails would raise there)."""
        if not isinstance(task_name, str) or not self.finalized:
            return False
        task = self.tasks.get(task_name)
        return bool(getattr(task, "sensitive", False))

    def tier_of(self, task_name: str) -> str | None:
        """The tier a task is routed to, or None if no such task is registered here."""
        task = self.tasks.get(task_name)
        if task is None:
            return None
        return self.tiers.of_task(task_name, getattr(task, "tier", None))

    @declaring
    def task(self, *args: Any, **options: Any) -> Any:
        """Declare a task (a :class:`LedgerTask` unless ``base=`` says otherwise); an unknown
        option is refused, so a misspelt one never passes silently."""
        if str(options.get("name", "")).startswith("celery."):
            # Celery's own tasks (chord_unlock, backend_cleanup, ...) stay plain tasks.
            options.setdefault("base", Task)
        base = options.get("base") or self.Task
        known = _DECORATOR_OPTIONS | set(dir(base))
        unknown = sorted(set(options) - known)
        if unknown:
            hints = [difflib.get_close_matches(name, known, n=1) for name in unknown]
            hint = "; ".join(
                f"{name!r} (did you mean {h[0]!r}?)" if h else repr(name)
                for name, h in zip(unknown, hints, strict=True)
            )
            raise ConfigurationError(f"unknown task option {hint}")
        bucket = options.get("rate_bucket")
        if bucket is not None and bucket not in self.settings.rate_limits:
            configured = ", ".join(self.settings.rate_limits) or "none configured"
            raise ConfigurationError(
                f"rate_bucket {bucket!r} is not in LEDGER_RATE_LIMITS (known: {configured})"
            )
        if options.get("tier") is not None:
            self.tiers.check(options["tier"], where="a task declaration")
        ledger_task = isinstance(base, type) and issubclass(base, LedgerTask)
        if ledger_task and "max_retries" in options and options["max_retries"] is None:
            raise ConfigurationError(
                "max_retries=None (retry for ever, in Celery) is not supported: give a number;"
                " every job also has its attempts budget (max_attempts)"
            )
        # A sensitive task's keys are checked when a worker starts and when it is published,
        # not here: Flower and the CLI load the app's tasks without them (least privilege).
        return super().task(*args, **options)

    # -- the ports the engines publish through ---------------------------------------------------

    def _publish(
        self,
        task: str,
        args: list[Any],
        kwargs: dict[str, Any],
        *,
        task_id: str,
        tier: str,
        headers: dict[str, Any],
        retries: int = 0,
        expires: str | None = None,
        sealed: bool = False,
    ) -> None:
        """A task message to a tier's queue, bypassing the publish-side checks (a republish);
        ``sealed``: a sensitive task's (body sealed, no argument reprs)."""
        options: dict[str, Any] = {}
        if sealed:
            options["argsrepr"] = options["kwargsrepr"] = REDACTED
            options["serializer"] = SEALED_SERIALIZER
        headers = dict(headers)
        tenant = headers.pop(TENANT, None)  # kept with the headers, sent as a property
        if isinstance(tenant, str):
            options[TENANT] = tenant
        with sealing(self.sealer):
            self.send_task(
                task,
                args,
                kwargs,
                task_id=task_id,
                queue=self.tiers.queue(tier),
                headers=headers,
                retries=retries,
                expires=expires,
                **options,
            )

    def _publish_raw(self, queue: str, payload: dict[str, Any], headers: dict[str, Any]) -> None:
        """A plain JSON message (a dead letter's copy) to ``queue``."""
        with self.producer_or_acquire() as producer:
            producer.publish(
                payload,
                exchange="",
                routing_key=queue,
                serializer="json",
                declare=[Queue(queue)],
                retry=True,  # (as a task's publish: once more; kombu's own default is for ever)
                retry_policy=transport.PUBLISH_RETRY_POLICY,
                headers=headers,
            )


class _Definitions(dict):  # type: ignore[type-arg]
    """The engine's view of the app's workflows: name to definition, always current."""

    def __init__(self, workflows: dict[str, Workflow]) -> None:
        super().__init__()
        self._workflows = workflows

    def get(self, name: Any, default: Any = None) -> Any:
        declared = self._workflows.get(name)
        return default if declared is None else declared.definition

    def __contains__(self, name: object) -> bool:
        return name in self._workflows

    def values(self) -> Any:
        return [declared.definition for declared in self._workflows.values()]


class _WorkflowPorts:
    """How the workflow engine publishes: steps as ledger jobs, wakes as small messages."""

    def __init__(self, app: LedgerCelery) -> None:
        self.app = app

    def call_of(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        if isinstance(target, WorkflowCall):
            target, args, kwargs = target.workflow, target.args + args, {**target.kwargs, **kwargs}
        if isinstance(target, Workflow):
            definition = target.definition
            return Call(
                "child",
                target.name,
                tuple(args),
                dict(kwargs),
                definition.tier,
                sensitive=definition.sensitive,
            )
        tier = None
        if isinstance(target, Signature):
            name = str(target.task)
            args = tuple(target.args or ()) + tuple(args)
            kwargs = {**(target.kwargs or {}), **kwargs}
            tier = target.options.get("tier")
        elif isinstance(target, Task):
            name = str(target.name)
        elif isinstance(target, str):
            name = target
        else:
            raise TypeError(
                f"a workflow step is a task, a signature or a workflow, not {type(target).__name__}"
            )
        task = self.app.tasks.get(name)
        if task is not None and not isinstance(task, LedgerTask):
            raise ConfigurationError(
                f"{name} is not a ledger task: a workflow's step must be one (its ledger record"
                " holds the step's outcome)"
            )
        if tier is not None:
            self.app.tiers.check(tier, where=f"the step {name}")
        sensitive = bool(getattr(task, "sensitive", False))
        return Call("step", name, tuple(args), dict(kwargs), tier, sensitive=sensitive)

    def check_arguments(self, call: Call) -> None:
        """Refuse a new step whose task cannot take its arguments. Celery checks this at
        publish, which for a step comes after its decision is in the log: every wake would
        fail on it. Raised here instead, into the workflow's code, before it is recorded."""
        task = self.app.tasks.get(call.name)
        header = getattr(task, "__header__", None)
        if call.kind != "step" or task is None or not task.typing or not callable(header):
            return
        try:
            header(*call.args, **call.kwargs)
        except TypeError as exc:
            raise PayloadError(f"step {call.name} cannot take these arguments: {exc}") from exc

    def publish_step(
        self, call: Call, *, job_id: str, key: str, workflow_id: str, workflow_tier: str
    ) -> None:
        carried = {headers.WORKFLOW: workflow_id, headers.WORKFLOW_TIER: workflow_tier}
        task = self.app.tasks.get(call.name)
        if isinstance(task, LedgerTask):
            options: dict[str, Any] = {WORKFLOW_STEP: True}
            if call.tier:
                options["tier"] = call.tier
            task.apply_async(
                call.args, call.kwargs, idempotency_key=key, headers=carried, **options
            )
            return
        # A task of another service (not registered here): its workers' ledger claims it.
        tier = call.tier or self.app.tiers.of_task(call.name, None)
        self.app.send_task(
            call.name,
            list(call.args),
            call.kwargs,
            task_id=job_id,
            queue=self.app.tiers.queue(tier),
            headers={
                **carried,
                headers.KEY: key,
                headers.TIER: tier,
                headers.ENQUEUED_AT: self.app.runtime.message_time(),
            },
        )

    def publish_wake(self, workflow_id: str, tier: str, *, delay: float = 0.0) -> bool:
        """Send a wake (for later, with ``delay``); False if it was folded into the wake that
        already waits for the workflow (see :mod:`celery_ledger.wakes`)."""
        queue = self.app.tiers.queue(tier)
        if delay > 0:
            self.app.runtime.delayed.schedule(
                WAKE_TASK,
                [workflow_id],
                {},
                {"queue": queue},
                self.app.runtime.message_time() + delay,
            )
            return True
        pending = self.app.runtime.pending_wakes
        marked = False
        try:
            marked = pending.claim(workflow_id)
            if not marked:
                return False
        except redis.RedisError as exc:  # sent unmarked (the send will say if the broker is away)
            logger.debug("wake mark of workflow %s not set: %s", workflow_id, exc)
        try:
            self.app.send_task(WAKE_TASK, [workflow_id], queue=queue)
        except BaseException:
            if marked:  # (only its own: an unmarked send leaves another wake's mark alone)
                pending.withdraw(workflow_id)
            raise
        return True


def create_app(
    name: str,
    settings: Settings | None = None,
    *,
    command_listeners: Sequence[CommandListener] = (),
    **celery_options: Any,
) -> LedgerCelery:
    """Build a Celery app wired to the ledger; settings from ``LEDGER_*`` unless given.
    ``command_listeners`` are pymongo command listeners for the ledger's client (to count or
    time its round trips); ``celery_options`` go to :class:`celery.Celery`.

    Raises:
        ConfigurationError: the settings are invalid (the message names the setting); on
            Celery's command line it is printed, and the command exits 2 (see ``explain``).
    """
    with exiting_on_mistakes(settings if isinstance(settings, Settings) else None):
        if settings is None:
            settings = settings_from_environment()
        elif not isinstance(settings, Settings):  # (a dict, say; not shown: it holds passwords)
            raise ConfigurationError(f"settings=Settings(...), not a {type(settings).__name__}")
        app = _create_app(name, settings, command_listeners, celery_options)
    install_excepthook(settings)
    return app


def _create_app(
    name: str,
    settings: Settings,
    command_listeners: Sequence[CommandListener],
    celery_options: dict[str, Any],
) -> LedgerCelery:
    namespace = name if settings.queue_namespace is None else settings.queue_namespace
    tiers = Tiers(
        TIERS, default=settings.default_tier, rules=settings.routing_rules, namespace=namespace
    )
    app = LedgerCelery(
        name,
        # No broker named: one that cannot be reached, which the transport refuses by name
        broker=settings.broker_url or UNSET_BROKER_URL,
        backend="celery_ledger.backend:LedgerBackend",
        task_cls=LedgerTask,
        set_as_current=celery_options.pop("set_as_current", True),
        **celery_options,
    )
    app.settings = settings
    app.tiers = tiers
    ledger = Ledger(
        uri=settings.mongo_uri,
        database=settings.mongo_db,
        collection=settings.ledger_collection,
        write_concern=settings.mongo_write_concern,
        timeout_ms=settings.mongo_timeout_ms,
        lease_seconds=settings.lease_seconds,
        result_retention_seconds=settings.result_retention_seconds,
        dead_retention_seconds=settings.dead_retention_seconds,
        error_history_limit=settings.error_history_limit,
        max_deliveries=settings.max_deliveries,
        ttl_index=settings.ttl_index,
        group_commit_max=settings.group_commit_max,
        event_listeners=[*ledger_listeners(settings), *command_listeners],
        fleet=tiers.namespace,
    )
    app.runtime = Runtime(
        settings,
        name=name,
        tiers=tiers,
        ledger=ledger,
        publish=app._publish,
        tier_of=app.tier_of,
        transport_options=lambda: app.conf.broker_transport_options,
    )
    # The reconciler and the outbox hold the broker's Redis client and a sweep lock owned by
    # this process: a pool process that runs a sweep (the beat task) builds its own (runtime.py).
    forget_after_fork(app, ("reconciler", "outbox"))
    register_sealed_codec(app.runtime.sealer)
    app.conf.update(
        # JSON only: pickle is refused on both sides.
        task_serializer="json",
        result_serializer="json",
        accept_content=["json", SEALED_CONTENT_TYPE],  # sealed: a sensitive task's body
        result_accept_content=["json"],
        # A message is acknowledged only after its outcome is recorded; a lost worker requeues.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=settings.worker_prefetch_multiplier,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_transport=transport.path_for(settings.broker_url),  # (through Sentinel or not)
        worker_consumer="celery_ledger.worker:LedgerConsumer",
        worker_pool="celery_ledger.prefork:TaskPool",  # (prefork: a process killed at start)
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_seconds,
            "unacked_mutex_expire": _UNACKED_MUTEX_EXPIRE_SECONDS,
            **unacked_keys(namespace),
            "ledger_poison_key": poison_key(name),
            "ledger_restore_visible": settings.restore_unacked,
            "ledger_fair_depth": settings.fair_queue_depth,
            "ledger_fair_lease": settings.lease_seconds,
            **transport.broker_options(settings),  # (timeouts; master_name, sentinel_kwargs)
        },
        broker_connection_retry_on_startup=True,
        # Reconnect for as long as the broker is away (Celery's default, 100 attempts, ended
        # the worker with "Unrecoverable error"), and after an error reply (a primary without
        # enough replicas refuses every write, NOREPLICAS) as after a lost connection
        broker_connection_max_retries=None,
        broker_channel_error_retry=True,
        result_backend_always_retry=True,
        result_backend_max_retries=10,
        task_default_queue=tiers.queue(settings.default_tier),
        task_queues=[Queue(queue) for queue in (*tiers.queues, tiers.queue(DEAD_LETTER))],
        task_create_missing_queues=True,
        task_publish_retry_policy=transport.PUBLISH_RETRY_POLICY,
        enable_utc=True, timezone="UTC",
    )  # fmt: skip
    if app.conf.beat_scheduler == CELERY_BEAT_SCHEDULER:  # (another one chosen: it stays)
        app.conf.beat_scheduler = LEDGER_BEAT_SCHEDULER
    app.pinned_conf = pinned(app.conf)  # (held at a worker's start, a first publish: conf_check)
    app.steps["worker"].add(LedgerWorkerStep)
    app.steps["consumer"].add(ExpressStep)  # (fair dispatch's express process: express.py)
    redact_task_logs(app)
    install_observability(app, app.runtime)  # metrics, Sentry, JSON logs: as the settings say

    @app.task(name="celery_ledger.reconcile", base=Task, shared=False)  # type: ignore[untyped-decorator]
    def reconcile_task() -> dict[str, Any]:
        """The reconciler, for celery beat (one sweeper at a time with the workers' own)."""
        report = app.reconciler.sweep_if_leader()
        return {"swept": False} if report is None else report.as_dict()

    @app.task(  # type: ignore[untyped-decorator]
        name=WAKE_TASK,
        base=Task,
        shared=False,
        bind=True,
        ignore_result=True,
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def workflow_wake(self: Task, workflow_id: Any, attempt: Any = 0, **_: Any) -> str:
        """One wake of a workflow (other keywords, an earlier version's, are ignored)."""
        delivery = self.request.delivery_info or {}
        queue = delivery.get("routing_key") if isinstance(delivery, dict) else None
        return app._run_wake(workflow_id, attempt, queue if isinstance(queue, str) else None)

    @app.task(name=START_WORKFLOW_TASK, bind=True, shared=False)  # type: ignore[untyped-decorator]
    def start_workflow(self: LedgerTask, workflow: str, args: Any = (), kwargs: Any = None) -> str:
        """A schedule's run of the durable workflow ``workflow``: starts it with the run's key
        (``schedule:<entry>@<slot>``), so each slot starts one workflow however often its
        run is delivered; answers its id."""
        declared = app.workflows.get(workflow)
        if declared is None:
            raise PermanentError(f"no workflow {workflow!r} is declared in this app")
        started = declared.start_with(tuple(args or ()), dict(kwargs or {}), key=self.job_key)
        return str(started.id)

    app.conf.beat_schedule = {
        "celery-ledger-reconcile": {
            "task": "celery_ledger.reconcile",
            "schedule": settings.reconcile_every_seconds,
            "options": {"queue": tiers.queue(settings.default_tier)},
        },
        **(app.conf.beat_schedule or {}),
    }
    return app


__all__ = ["LedgerCelery", "create_app"]
