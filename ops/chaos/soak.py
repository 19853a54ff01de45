"""Chaos soak: exactly-once effects under crashes, restarts and a bad network, and plain Celery.

    python -m ops.chaos.soak --profile ci|long|failover [--seed N] [--only ledger|plain]
    python -m ops.chaos.soak --profile long --seeds 2811,1,2,3,4,5 --parallel 2 --only ledger

Both systems run side by side, under the same faults: the same task body (``apps/world.py``:
record the attempt; fail, sleep or not as designed; then record one effect, on a server of its
own that no fault touches) on celery-ledger workers and on plain Celery workers (``acks_late``,
``reject_on_worker_lost``, no ledger). Jobs: quick, flaky (retryable errors, then success),
permanent failures (must end dead) and long (a few seconds), published in waves to mixed tiers.
celery-ledger also runs durable workflows beside its jobs (``soak.flow``, 3-5 steps of the same
body, a compensation registered after each step; some designed to fail for good at their last
step, so their compensations must run); plain Celery has no workflows. Most of celery-ledger's
jobs and workflows name a tenant (``plan.py``: a big one that floods, one of weight 3, one held
to 2 bodies at once per tier, a small one; some none), so every fault also runs through fair
dispatch: the tier queues fed from per-tenant lanes (``tenants.py`` says what must hold).

Faults, while the jobs run: SIGKILL of a random pool process of each system every few seconds;
SIGKILL of a whole worker (restarted; its unacked messages come back after the visibility
timeout); SIGKILL and restart of the broker (valkey, AOF) and of the ledger (SecantusDB, same
port and data); and through an asyncio TCP proxy between the workers and both servers: delays,
connection resets and a partition. Plain Celery does not use the ledger server. The long
profile also wipes the broker once (restarted without its data). The failover profile is the
long one with celery-ledger's broker a Sentinel group (a primary, two replicas, three
sentinels; ``--only ledger``): its broker faults are failovers, the primary SIGKILLed or
stopped past the sentinels' timeout and continued (the writes it took meanwhile are lost); the
proxy's faults then reach the ledger only, as the workers reach the primary the sentinels name.

At the end every job must reach its designed terminal state (succeeded, or dead for the
permanent failures) with exactly one effect per succeeded job, nothing lost, and the dead
letters exactly the designed failures. Every workflow must end as designed (``completed``, or
``compensated``) by the end of the drain, with each step's effect exactly once (for a compensated
one: the steps before the failed one, then their compensations newest first, each once).
Every tenant's jobs must end, each record keeping its tenant, the lanes must be empty at the
end, and the capped tenant never ran more bodies at once than its limit allows (tenants.py).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from celery import Celery
from pymongo import MongoClient
from pymongo.errors import AutoReconnect
from redis import Redis

from celery_ledger import LedgerCelery, Settings
from celery_ledger.app import WAKE_TASK
from celery_ledger.embedded.sentinel import SentinelGroup, start_sentinel_group
from celery_ledger.embedded.servers import ServerProcess, start_secantus, start_valkey
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess
from celery_ledger.fairness import FairDispatch
from celery_ledger.identity import derive_task_id
from celery_ledger.routing import unacked_keys

from ..bench.common import REPO, RESULTS, console, machine, print_table
from .apps import plain_soak
from .apps.ledger_soak import TICK_SECONDS
from .forensics import broker_fate, dead_letter_key, last_error, message_key
from .plan import (
    CAPPED,
    PROFILES,
    TENANT_POLICIES,
    TIERS,
    Job,
    Profile,
    WorkflowJob,
    plan_jobs,
    plan_workflows,
)
from .proxy import Proxy, ProxyLoop
from .report import Kill, SoakReport, SystemReport, TenantsReport, WorkflowReport
from .tenants import HOLDING_FAULTS, account_tenants, lane_depth, lane_leftovers

__all__ = ["PROFILES", "Profile", "SoakReport", "SystemReport", "run"]

SYSTEMS = ("ledger", "plain")
FAIR_QUEUE_DEPTH = 1  # LEDGER_FAIR_QUEUE_DEPTH of the soak's workers and producer
RECONCILE_EVERY_SECONDS = 3.0
# A queued job untouched this long is republished (the ledger dedupes a second copy).
RECONCILE_STALE_AFTER_SECONDS = 12.0
# The drain goes on past its timeout while jobs still end (see Soak.drain), to this many times it.
DRAIN_CAP = 3.0
PROGRESS_SECONDS = 60.0
# The drain reads every job's state (a scan of the ledger: the embedded server has no index on
# ``task``, and holds every worker's write while it reads) this often, not at every look: read
# twice a second it took a share of the ledger's one core from the drain it measured.
OUTCOMES_EVERY_SECONDS = 3.0
LEDGER_DELAYED_KEY = "soak_ledger:ledger:delayed"
# The reconciler wakes an active workflow nothing woke for this long (a lost wake is found
# within the drain, not after the 120 s default).
WORKFLOW_CHECK_SECONDS = 5.0
WORKFLOW_ENDS = ("completed", "failed", "compensated", "cancelled", "dead")
WORKFLOW_START_PATIENCE_SECONDS = 30.0  # a start retried through a ledger or broker outage
WATCH_QUEUES_EVERY_SECONDS = 2.0
JOB_TASKS = ["soak.work", "soak.newer"]  # the ledger's jobs (``Job.ledger_task``)
# The periodic task's slots counted: up to this long before the count (a slot whose publish
# failed, or whose scheduler died, is sent within seconds; a minute is its latest)
SCHEDULE_SETTLE_SECONDS = 30.0


def queued_item(raw: bytes) -> tuple[str, str]:
    """(wake, its workflow id) or (step, its key) or (job, "") for a queued message."""
    try:
        envelope = json.loads(raw)
        found = envelope["headers"]
        if found.get("task") == WAKE_TASK:
            return "wake", str(json.loads(base64.b64decode(envelope["body"]))[0][0])
        key = found.get("ledger_key")
        if isinstance(key, str) and key.startswith("wf:"):
            return "step", key
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        pass
    return "job", ""


@contextlib.contextmanager
def without_ledger_environment() -> Iterator[None]:
    """Hide this process's ``LEDGER_*`` variables (workers inherit the environment)."""
    saved = {name: value for name, value in os.environ.items() if name.startswith("LEDGER_")}
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)


class Soak:
    """One soak run: servers, proxies, workers, jobs, faults, then the accounting."""

    def __init__(
        self,
        profile: Profile,
        *,
        seed: int,
        data_dir: Path,
        systems: tuple[str, ...] = SYSTEMS,
        plain_reject_on_worker_lost: bool = True,
        log: Callable[[str], None] = print,
    ) -> None:
        self.profile = profile
        self.seed = seed
        self.rng = random.Random(seed)
        self.data_dir = data_dir
        self.systems = systems
        self.plain_reject_on_worker_lost = plain_reject_on_worker_lost
        self.log = log
        self.run_id = f"s{seed % 100000:05d}{int(time.time()) % 100000:05d}"
        self.jobs = plan_jobs(profile, self.rng, self.run_id)
        # Their own random source: a seed plans the same jobs and faults as before workflows.
        self.flows: list[WorkflowJob] = (
            plan_workflows(profile, random.Random(seed + 1), self.run_id)
            if "ledger" in systems
            else []
        )
        self.flow_ids: dict[str, str] = {}  # workflow key -> id, once started
        self.flows_ended: float | None = None  # seconds after the faults, once all ended
        # wake, step: most copies queued at once; depth: most messages queued at once (in the
        # tier queues and the tenants' lanes); capped: most live concurrency entries of CAPPED
        self.most_waiting: Counter[str] = Counter()
        self.published_at: dict[str, float] = {}  # celery-ledger's jobs, wall clock
        self.holding: list[tuple[float, float]] = []  # HOLDING_FAULTS' windows, wall clock
        self.ended_jobs: dict[str, str] = {}  # the ledger's jobs seen ended (ledger_ended)
        self.faults: Counter[str] = Counter()
        self.faults_repaired: Counter[str] = Counter()  # what the reconciler brought back
        self._ledger_app: LedgerCelery | None = None
        self.kills: list[Kill] = []
        self.ledger_outages: list[tuple[float, float]] = []  # wall-clock windows
        self.workers: dict[str, list[WorkerProcess]] = {s: [] for s in systems}
        self.stacks: dict[str, EmbeddedStack] = {}
        self.publish_lock = threading.Lock()
        self.workers_lock = threading.Lock()
        self.retired: set[int] = set()  # pids of workers we killed or replaced
        self.release = 1  # of the ledger's workers started now (a rolling deploy makes it 2)
        self.crashes: list[str] = []  # workers that exited by themselves
        self.fault_log: list[str] = []
        self.started = 0.0
        self.wall_started = 0.0
        self.broker: ServerProcess
        # celery-ledger's broker when the profile says ``sentinel`` (plain Celery keeps its own)
        self.group: SentinelGroup | None = None
        self.publish_refusals = 0  # publishes refused (a failover under way), tried again
        self.refused_by: Counter[str] = Counter()  # ...by the refusal's exception type
        self.ledger: ServerProcess
        self.world_server: ServerProcess
        self.broker_proxy: Proxy
        self.ledger_proxy: Proxy

    # -- set-up -----------------------------------------------------------------------------

    def worker_env(self, system: str) -> dict[str, str]:
        broker = f"redis://127.0.0.1:{self.broker_proxy.listen_port}"
        common = {
            # The library of the tree the soak runs from (a snapshot being soaked while the
            # working tree changes: see README, "The long soak")
            "PYTHONPATH": os.pathsep.join((str(REPO / "platform"), str(REPO))),
            "SOAK_WORLD_URI": self.world_server.url,
            "SOAK_VISIBILITY_TIMEOUT_SECONDS": str(self.profile.visibility_timeout),
            "SOAK_PLAIN_BROKER_URL": f"{broker}/1",
            "SOAK_PLAIN_REJECT_ON_WORKER_LOST": "1" if self.plain_reject_on_worker_lost else "0",
        }
        ledger_uri = (
            f"mongodb://127.0.0.1:{self.ledger_proxy.listen_port}/"
            "?retryWrites=false&directConnection=true"
        )
        sentinel = self.group.env if self.group is not None else {}
        return (
            common
            | {
                "SOAK_RELEASE": str(self.release),
                "LEDGER_BROKER_URL": f"{broker}/0",
                "LEDGER_MONGO_URI": ledger_uri,
                "LEDGER_MONGO_DB": "soak",
                "LEDGER_LEASE_SECONDS": str(self.profile.lease_seconds),
                "LEDGER_VISIBILITY_TIMEOUT_SECONDS": str(self.profile.visibility_timeout),
                "LEDGER_BUSY_RECHECK_SECONDS": "2",
                "LEDGER_DEFER_POLL_SECONDS": "0.25",
                "LEDGER_UNAVAILABLE_BACKOFF_BASE_SECONDS": "0.5",
                "LEDGER_UNAVAILABLE_BACKOFF_CAP_SECONDS": "3",
                "LEDGER_MONGO_TIMEOUT_MS": "2000",
                "LEDGER_DEDUPE_ON_PUBLISH": "true",
                # The workers' own reconciler, one sweeper at a time: no beat, no operator
                "LEDGER_RECONCILE_IN_WORKERS": "true",
                "LEDGER_RECONCILE_EVERY_SECONDS": str(RECONCILE_EVERY_SECONDS),
                "LEDGER_RECONCILE_STALE_AFTER_SECONDS": str(RECONCILE_STALE_AFTER_SECONDS),
                "LEDGER_RECONCILE_LEASE_GRACE_SECONDS": str(self.profile.lease_seconds / 2),
                "LEDGER_WORKFLOW_CHECK_SECONDS": str(WORKFLOW_CHECK_SECONDS),
                # Fair dispatch on (the guide's depth, 1) for plan.py's tenants
                "LEDGER_FAIR_QUEUE_DEPTH": str(FAIR_QUEUE_DEPTH),
                "LEDGER_TENANTS": json.dumps(TENANT_POLICIES),
            }
            | sentinel
        )

    def queues(self, system: str) -> tuple[str, ...]:
        """The tier queues of a system (celery-ledger's are named after its app)."""
        if system == "ledger":
            return self.ledger_app().tiers.queues
        return tuple(plain_soak.queue_of(t) for t in TIERS)

    def unacked_key(self, system: str) -> str:
        if system == "ledger":
            return unacked_keys(self.ledger_app().tiers.namespace).get("unacked_key", "unacked")
        return "unacked"

    def ledger_broker(self) -> ServerProcess:
        """celery-ledger's broker now: the Sentinel group's primary, or the one broker."""
        return self.group.primary() if self.group is not None else self.broker

    def redis_url(self, system: str) -> str:
        """A URL of a system's broker database, to read it (the primary's, under Sentinel)."""
        if system == "ledger":
            return self.ledger_broker().url.rsplit("/", 1)[0] + "/0"
        return self.broker.url.rsplit("/", 1)[0] + "/1"

    def start_worker(self, system: str, index: int | None = None) -> WorkerProcess:
        index = len(self.workers[system]) if index is None else index
        queues = ",".join(self.queues(system))
        worker = self.stacks[system].start_worker(
            queues,
            concurrency=self.profile.concurrency,
            name=f"{system}-{index}@127.0.0.1",
            env=self.worker_env(system),
            extra_args=("--loglevel", "INFO"),  # the logs explain a lost or duplicated job
            wait=False,
        )
        self.workers[system].append(worker)
        return worker

    def wait_ready(self, system: str, worker: WorkerProcess, timeout: float = 120.0) -> None:
        """Until the worker answers a ping (on its system's broker database)."""
        probe = Celery(broker=self.redis_url(system), set_as_current=False)
        try:
            deadline = time.monotonic() + timeout
            while not probe.control.ping(destination=[worker.name], timeout=0.5):
                if not worker.alive() or time.monotonic() > deadline:
                    log = worker.log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"worker {worker.name} did not come up:\n{log}")
        finally:
            probe.close()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self.broker = start_valkey(self.data_dir / "valkey")
        if self.profile.sentinel:
            self.group = start_sentinel_group(self.data_dir / "sentinel")
        self.ledger = start_secantus(self.data_dir / "secantus")
        # No fault touches the world's server: its commits need no fsync.
        self.world_server = start_secantus(self.data_dir / "world", sync_on_commit=False)
        modules = {"ledger": "ops.chaos.apps.ledger_soak", "plain": "ops.chaos.apps.plain_soak"}
        try:
            with ProxyLoop() as proxies:
                self.broker_proxy = proxies.add("broker", target_port=self.broker.port)
                self.ledger_proxy = proxies.add("ledger", target_port=self.ledger.port)
                for system in self.systems:
                    self.stacks[system] = EmbeddedStack(
                        modules[system], self.data_dir, broker=self.broker, ledger=self.ledger
                    )
                    for index in range(self.profile.workers):
                        self.start_worker(system, index)
                for system in self.systems:
                    for worker in self.workers[system]:
                        self.wait_ready(system, worker)
                try:
                    yield
                finally:
                    for workers in self.workers.values():
                        for worker in workers:
                            worker.kill()
        finally:
            for server in (self.world_server, self.ledger, self.broker):
                server.stop()
            if self.group is not None:
                self.group.stop()

    # -- publishing -------------------------------------------------------------------------

    def publishers(self) -> dict[str, Callable[[Job], None]]:
        out: dict[str, Callable[[Job], None]] = {}
        if "ledger" in self.systems:
            tasks = self.ledger_app().tasks

            def ledger_publish(job: Job) -> None:
                if job.outbox:
                    self.enqueue_in_transaction(job)
                else:
                    task = tasks[job.ledger_task]
                    by_call = {"tenant": job.tenant} if job.tenant and job.tenant_by_call else {}
                    # Refused while a failover is under way: tried again, as a producer would
                    # (the job's key makes a second try harmless)
                    deadline = time.monotonic() + WORKFLOW_START_PATIENCE_SECONDS
                    while True:
                        try:
                            task.apply_async(
                                (job.key, job.kind, job.param), tier=job.tier, **by_call
                            )
                            break
                        except Exception as exc:
                            self.publish_refusals += 1
                            self.refused_by[type(exc).__name__] += 1
                            if time.monotonic() > deadline:
                                self.log(f"job {job.key} not published: {exc!r}")
                                break
                            time.sleep(0.2)
                self.published_at.setdefault(job.key, time.time())

            out["ledger"] = ledger_publish
        if "plain" in self.systems:
            plain_broker = self.broker.url.rsplit("/", 1)[0] + "/1"
            plain_task = plain_soak.build(plain_broker).tasks["soak.work"]
            out["plain"] = lambda job: plain_task.apply_async(
                (job.key, job.kind, job.param), queue=plain_soak.queue_of(job.tier)
            )
        return out

    def ledger_app(self) -> LedgerCelery:
        """The soak's own ledger app (publisher and reconciler), built once."""
        if self._ledger_app is None:
            from .apps.ledger_soak import build

            self._ledger_app = build(
                Settings(
                    broker_url=self.broker.url if self.group is None else self.group.url,
                    sentinel_master=None if self.group is None else self.group.master_name,
                    sentinel_password=None if self.group is None else self.group.sentinel_password,
                    mongo_uri=self.ledger.url,
                    mongo_db="soak",
                    mongo_timeout_ms=2000,
                    dedupe_on_publish=True,
                    workflow_check_seconds=WORKFLOW_CHECK_SECONDS,
                    tenants=TENANT_POLICIES,
                    fair_queue_depth=FAIR_QUEUE_DEPTH,
                ),
                release=2,  # (the producer publishes the newer release's task from the start)
            )
        return self._ledger_app

    def close_ledger_app(self) -> None:
        if self._ledger_app is not None:
            self._ledger_app.close()

    def brought_back(self) -> dict[str, int]:
        """What the workers' own reconciler brought back (no beat, no operator)."""
        records = self.ledger_app().ledger.collection
        return {
            "jobs": records.count_documents({"reconciled": {"$gt": 0}}),
            "times": sum(d.get("reconciled", 0) for d in records.find({"reconciled": {"$gt": 0}})),
            # jobs enqueued in a transaction (the outbox), every one of them run or dead
            "outbox jobs": records.count_documents({"outbox": True}),
        }

    def publish_all(self) -> None:
        publish = self.publishers()
        waves = self.profile.waves
        for wave in range(waves):
            self.sleep_until(wave * self.profile.publish_seconds / waves)
            chunk = self.jobs[wave::waves]
            with self.publish_lock:  # never while the broker is down (a kill holds the lock)
                for job in chunk:
                    for system in self.systems:
                        publish[system](job)
            for flow in self.flows[wave::waves]:
                self.start_workflow(flow)

    def enqueue_in_transaction(self, job: Job) -> None:
        """The job enqueued in a transaction beside the app's own write (an order document in
        the world's database would be the usual one; here a marker in the ledger's), retried
        while the ledger is away, as a producer would: a retry after a commit whose reply was
        lost finds the job known, and the relay publishes it."""
        app = self.ledger_app()
        task = app.tasks[job.ledger_task]

        def checkout(session: Any) -> None:
            orders = session.client.get_database("soak").get_collection("orders")
            orders.update_one(
                {"_id": job.key}, {"$inc": {"tries": 1}}, upsert=True, session=session
            )
            by_call = {"tenant": job.tenant} if job.tenant and job.tenant_by_call else {}
            task.apply_async(
                (job.key, job.kind, job.param), tier=job.tier, session=session, **by_call
            )

        deadline = time.monotonic() + WORKFLOW_START_PATIENCE_SECONDS
        while True:
            try:
                app.outbox.transaction(checkout)
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    self.log(f"job {job.key} not enqueued in a transaction: {exc!r}")
                    return
                time.sleep(0.5)

    def start_workflow(self, flow: WorkflowJob) -> None:
        """Start a workflow (once per key: a start repeated after an error finds the first);
        retried while the ledger or the broker is away, as a producer would."""
        workflow = self.ledger_app().workflows["soak.flow"]
        deadline = time.monotonic() + WORKFLOW_START_PATIENCE_SECONDS
        while True:
            try:
                with self.publish_lock:
                    handle = workflow.start(flow.key, [list(s) for s in flow.steps], flow.tier)
                self.flow_ids[flow.key] = handle.id
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    self.log(f"workflow {flow.key} not started: {exc!r}")
                    return
                time.sleep(0.5)

    def sleep_until(self, offset: float) -> None:
        time.sleep(max(0.0, self.started + offset - time.monotonic()))

    # -- faults -----------------------------------------------------------------------------

    def timeline(self) -> list[tuple[float, str]]:
        p, rng = self.profile, self.rng
        events: list[tuple[float, str]] = []
        t = 2.0
        while t < p.fault_seconds:
            events.append((t, "pool kill"))
            t += p.pool_kill_every
        # Whole-worker kills early enough that the visibility timeout brings their messages back
        # before the drain ends.
        for i in range(p.worker_kills):
            share = (i + rng.random()) / p.worker_kills
            events.append((p.fault_seconds * (0.1 + 0.4 * share), "worker kill"))
        for name, count in (
            ("broker kill", p.broker_kills),
            ("ledger kill", p.ledger_kills),
            ("broker wipe", p.broker_wipes),
        ):
            events += [(rng.uniform(0.2, 0.8) * p.fault_seconds, name) for _ in range(count)]
        for _ in range(p.delays):
            start = rng.uniform(0.05, 0.8) * p.fault_seconds
            events += [(start, "proxy delay"), (start + 4.0, "delay end")]
        events += [
            (rng.uniform(0.1, 0.9) * p.fault_seconds, "proxy reset") for _ in range(p.resets)
        ]
        events += [
            (rng.uniform(0.3, 0.85) * p.fault_seconds, "partition") for _ in range(p.partitions)
        ]
        # Failovers spread over the faults (each takes a few seconds), SIGKILL and stop in turn
        for i in range(p.broker_failovers if self.group is not None else 0):
            at = p.fault_seconds * (0.15 + 0.7 * (i + rng.random()) / p.broker_failovers)
            events.append((at, "broker failover" if i % 2 == 0 else "broker stop"))
        if p.deploy_at is not None and "ledger" in self.systems:  # (drawn from no rng)
            events.append((p.deploy_at * p.fault_seconds, "rolling deploy"))
            if p.deploy_done_at is not None:
                events.append((p.deploy_done_at * p.fault_seconds, "rolling deploy rest"))
        return sorted(events)

    def inject(self) -> None:
        for offset, kind in self.timeline():
            self.sleep_until(offset)
            self.fault_log.append(f"{time.monotonic() - self.started:6.2f}s {kind}")
            began = time.time()
            try:
                getattr(self, "fault_" + kind.replace(" ", "_"))()
            except Exception as exc:  # a fault that could not be injected is reported, not fatal
                self.log(f"fault {kind} failed: {exc!r}")
                self.faults[f"{kind} (failed)"] += 1
            if kind in HOLDING_FAULTS:  # (a delay lasts until its end, 4 s on)
                self.holding.append((began, began + 4.0 if kind == "proxy delay" else time.time()))
        self.ledger_proxy.delay(0)
        self.broker_proxy.delay(0)

    def fault_pool_kill(self) -> None:
        for system in self.systems:
            candidates = [(w, w.pool_pids()) for w in self.workers[system] if w.alive()]
            candidates = [(w, pids) for w, pids in candidates if pids]
            if not candidates:
                continue
            _, pids = self.rng.choice(candidates)
            pid = self.rng.choice(pids)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.kills.append(Kill(time.time(), system, "pool", [pid]))
            self.faults[f"pool process SIGKILL ({system})"] += 1

    def fault_worker_kill(self) -> None:
        for system in self.systems:
            alive = [w for w in self.workers[system] if w.alive()]
            if not alive:
                continue
            victim = self.rng.choice(alive)
            pids = [victim.pid, *victim.pool_pids()]
            with self.workers_lock:  # (retired first: the supervisor must not take it for a crash)
                self.retired.add(victim.pid)
                victim.kill()
                self.kills.append(Kill(time.time(), system, "worker", pids))
                self.faults[f"whole worker SIGKILL + restart ({system})"] += 1
                self.start_worker(system)

    def fault_rolling_deploy(self, rest: bool = False) -> None:
        """Half the ledger's workers restarted, one at a time (a warm stop, then the next
        release's worker in its place, up before the next one stops), into release 2, while
        the load runs: its jobs of ``soak.newer``, parked by release 1 until then, reach it.
        ``rest``: the deploy's second half, the workers of release 1 left."""
        self.release = 2
        victims = [
            w for w in self.workers["ledger"] if w.alive() and w.env.get("SOAK_RELEASE") != "2"
        ]
        for victim in victims if rest else victims[: max(1, len(victims) // 2)]:
            with self.workers_lock:
                self.retired.add(victim.pid)
            victim.stop(timeout=30)  # (warm: its jobs end first; a kill after that long)
            with self.workers_lock:
                worker = self.start_worker("ledger")
            try:  # (up before the next one stops; a broker fault meanwhile delays no more)
                self.wait_ready("ledger", worker)
            except Exception as exc:
                self.log(f"rolling deploy: {worker.name} not seen ready: {exc!r}")
        what = "the rest of" if rest else "half"
        self.faults[f"rolling deploy of {what} the workers into release 2 (ledger)"] += 1

    def fault_rolling_deploy_rest(self) -> None:
        self.fault_rolling_deploy(rest=True)

    def supervise(self, stop: threading.Event) -> None:
        """Restart a worker that exited by itself, as a process supervisor would; note why."""
        while not stop.wait(0.5):
            for system in self.systems:
                with self.workers_lock:
                    for worker in list(self.workers[system]):
                        if worker.alive() or worker.pid in self.retired:
                            continue
                        self.retired.add(worker.pid)
                        self.crashes.append(f"{system}: {worker.name}: {last_error(worker)}")
                        self.log(f"worker {worker.name} exited by itself; restarting it")
                        self.start_worker(system)

    def fault_broker_kill(self) -> None:
        with self.publish_lock:
            self.broker.kill()
            time.sleep(1.0)
            self.broker.restart()
        self.faults["broker SIGKILL + restart"] += 1

    def fault_broker_wipe(self) -> None:
        """SIGKILL, the broker's files deleted, a restart: a broker without AOF, a wiped disk,
        or a failover to a replica that had none of the last writes, all at once. Every
        queue, delayed retry, unacknowledged booking, lane, lock and workflow wake is gone;
        the ledger's records bring the jobs back (the reconciler notices its marker gone)."""
        with self.publish_lock:
            self.broker.kill()
            for path in self.broker.data_dir.iterdir():
                if path.name == "appendonlydir":
                    shutil.rmtree(path)
                elif path.suffix in (".rdb", ".aof"):
                    path.unlink()
            self.broker.restart()
        self.faults["broker SIGKILL + restart without its data"] += 1

    def fault_broker_failover(self) -> None:
        """The Sentinel group's primary SIGKILLed: the sentinels promote a replica (the writes
        it had not received are lost); the old primary, restarted, rejoins as a replica."""
        assert self.group is not None
        primary = self.group.primary()
        primary.kill()
        began = time.monotonic()
        promoted = self.group.wait_for_new_primary(primary.port)
        self.log(f"failover: {primary.port} -> {promoted.port} in {time.monotonic() - began:.1f}s")
        primary.restart()
        self.faults["broker failover (primary SIGKILL)"] += 1

    def fault_broker_stop(self) -> None:
        """The primary stopped (SIGSTOP) past the sentinels' timeout, until a replica is
        promoted, then continued: it takes writes from the clients still connected to it until
        the sentinels make it a replica, and those writes are lost with its data."""
        assert self.group is not None
        primary = self.group.primary()
        os.kill(primary.pid, signal.SIGSTOP)
        try:
            promoted = self.group.wait_for_new_primary(primary.port)
        finally:
            os.kill(primary.pid, signal.SIGCONT)
        self.log(f"failover by a stopped primary: {primary.port} -> {promoted.port}")
        self.faults["broker failover (primary stopped, then back)"] += 1

    def fault_ledger_kill(self) -> None:
        began = time.time()
        self.ledger.kill()
        time.sleep(1.0)
        self.ledger.restart()
        self.ledger_outages.append((began, time.time()))
        self.faults["ledger SIGKILL + restart"] += 1

    def fault_proxy_delay(self) -> None:
        seconds = self.rng.uniform(0.02, 0.08)
        self.ledger_proxy.delay(seconds)
        self.broker_proxy.delay(seconds)
        self.faults["proxy delay (4s)"] += 1

    def fault_delay_end(self) -> None:
        self.ledger_proxy.delay(0)
        self.broker_proxy.delay(0)

    def fault_proxy_reset(self) -> None:
        began = time.time()
        self.ledger_proxy.reset()
        self.broker_proxy.reset()
        self.ledger_outages.append((began, time.time()))
        self.faults["proxy connection reset"] += 1

    def fault_partition(self) -> None:
        began = time.time()
        seconds = self.profile.partition_seconds
        other = threading.Thread(target=self.broker_proxy.partition, args=(seconds,))
        other.start()
        self.ledger_proxy.partition(seconds)
        other.join()
        self.ledger_outages.append((began, time.time()))
        self.faults[f"partition ({seconds:.0f}s)"] += 1

    # -- accounting -------------------------------------------------------------------------

    def world(self) -> MongoClient[dict[str, Any]]:
        return MongoClient(self.world_server.url)

    def ledger_client(self) -> MongoClient[dict[str, Any]]:
        return MongoClient(self.ledger.url, serverSelectionTimeoutMS=3000)

    def outcomes(self, system: str, *, whole: bool = True) -> dict[str, str]:
        """key -> succeeded | dead | pending, as the system knows it now. ``whole=False`` (the
        drain's looks): the ledger's jobs read as :meth:`ledger_ended` reads them."""
        if system == "ledger" and not whole:
            ended = self.ledger_ended()
            return {j.key: ended.get(j.key, "pending") for j in self.jobs}
        with self.world() as world_client:
            world = world_client.soak_world
            if system == "ledger":
                with self.ledger_client() as client:
                    docs = client.soak.ledger.find(
                        {"task": {"$in": JOB_TASKS}}, {"key": 1, "state": 1}
                    )
                    states = {d["key"]: d["state"] for d in docs}
                return {
                    j.key: states.get(j.key, "missing")
                    if states.get(j.key) in ("succeeded", "dead")
                    else "pending"
                    for j in self.jobs
                }
            done = set(world.effects.distinct("key", {"system": "plain"}))
            failed = set(world.failures.distinct("key", {"system": "plain"}))
            return {
                j.key: "succeeded"
                if j.key in done
                else "dead"
                if j.key in failed and j.kind == "permanent"
                else "pending"
                for j in self.jobs
            }

    def ledger_ended(self) -> dict[str, str]:
        """The ledger's jobs seen ended (succeeded or dead: final, nothing in the soak replays
        one), key -> state, read a little at a time. Every record read in one scan (the
        embedded server has no index on ``task``) took 1.7 s at 6,000 records on a loaded
        machine and held every worker's write meanwhile: read every few seconds it took half of
        the ledger's time from the drain it measured. So: the records still waiting (queued,
        running, retrying: equalities on the sweepers' index), and by ``_id`` those of the jobs
        neither seen waiting now nor seen ended before (a few: the ones that ended since the
        last look; in pages of 100, as the embedded server's ``$in`` costs the square of its
        length). A job without a record yet stays pending. A look the ledger does not answer (a
        restart, a stall under load) leaves the jobs as last seen: the next look reads them."""
        try:
            self._look_for_ended()
        except AutoReconnect as exc:
            self.log(f"ledger: a look for ended jobs failed, left to the next one: {exc}")
        return self.ended_jobs

    def _look_for_ended(self) -> None:
        with self.ledger_client() as client:
            ledger = client.soak.ledger
            waiting = {
                str(d.get("key"))
                for state in ("queued", "running", "retrying")
                for d in ledger.find({"state": state}, {"key": 1, "task": 1})
                if d.get("task") in JOB_TASKS
            }
            unsure = {
                derive_task_id(j.ledger_task, j.key): j.key
                for j in self.jobs
                if j.key not in self.ended_jobs and j.key not in waiting
            }
            ids = list(unsure)
            for start in range(0, len(ids), 100):
                for doc in ledger.find({"_id": {"$in": ids[start : start + 100]}}, {"state": 1}):
                    if doc.get("state") in ("succeeded", "dead"):
                        self.ended_jobs[unsure[str(doc["_id"])]] = str(doc["state"])

    def broker_quiet(self, system: str) -> bool:
        with Redis.from_url(self.redis_url(system)) as redis:
            waiting = sum(int(redis.llen(q)) for q in self.queues(system))
            waiting += int(redis.hlen(self.unacked_key(system)))
            if system == "ledger":
                waiting += int(redis.zcard(LEDGER_DELAYED_KEY))
                waiting += len(lane_leftovers(redis, self.queues(system)))  # (tenants' lanes)
            return waiting == 0

    def broker_leftovers(self, system: str) -> list[str]:
        """What the broker still holds for a system (queues, unacked, delayed), by job key."""
        lines = []
        with Redis.from_url(self.redis_url(system)) as redis:
            for queue in self.queues(system):
                items = redis.lrange(queue, 0, -1)
                if items:
                    lines.append(f"queue {queue}: {[message_key(i) for i in items][:10]}")
            unacked = redis.hgetall(self.unacked_key(system))
            index = "unacked_index"
            if system == "ledger":  # (the ledger's are in its namespace: app.unacked_keys)
                keys = unacked_keys(self.ledger_app().tiers.namespace)
                index = keys.get("unacked_index_key", index)
            scores = dict(redis.zrange(index, 0, -1, withscores=True))
            for tag, raw in list(unacked.items())[:10]:
                age = time.time() - scores.get(tag, 0.0)
                lines.append(f"unacked {message_key(raw)} for {age:.0f}s")
            if system == "ledger":
                lines += lane_leftovers(redis, self.queues(system))
                for member, due in redis.zrange(LEDGER_DELAYED_KEY, 0, 9, withscores=True):
                    args = json.loads(member).get("args") or ["?"]
                    lines.append(f"delayed {args[0]} due in {due - time.time():.0f}s")
        return lines

    def broker_now(self, system: str) -> dict[str, str]:
        """Where each job's message is at the end (a queue, taken, the delayed set), by key:
        a job not terminal with its message still queued was slow, not lost."""
        try:
            return self._broker_now(system)
        except Exception as exc:  # the broker is down: the report says so, and goes on
            reason = f"unknown (broker unreadable: {exc!r})"
            return defaultdict(lambda: reason)

    def _broker_now(self, system: str) -> dict[str, str]:
        found: dict[str, str] = {}
        with Redis.from_url(self.redis_url(system)) as redis:
            for queue in self.queues(system):
                for raw in redis.lrange(queue, 0, -1):
                    found.setdefault(message_key(raw), f"waiting in {queue}")
            for raw in redis.hvals(self.unacked_key(system)):
                found.setdefault(message_key(raw), "taken by a worker, not acknowledged")
            if system == "ledger":
                for raw in lane_depth(redis, self.queues(system))[1]:
                    found.setdefault(message_key(raw), "waiting in its tenant's lane")
                for member in redis.zrange(LEDGER_DELAYED_KEY, 0, -1):
                    with contextlib.suppress(ValueError, TypeError, IndexError, AttributeError):
                        args = json.loads(member).get("args") or []
                        found.setdefault(str(args[0]), "in the delayed set")
        return found

    def flow_statuses(self) -> dict[str, str]:
        """Workflow id -> status, from the workflows' state documents (one read)."""
        log = self.ledger_app().workflow_engine.log
        return {
            str(d["_id"]): str(d.get("status")) for d in log.listing(limit=len(self.flows) + 100)
        }

    def flows_pending(self) -> int:
        """Workflows not ended yet (an unreadable ledger counts them all)."""
        try:
            statuses = self.flow_statuses()
        except Exception:
            return len(self.flows)
        return sum(
            statuses.get(self.flow_ids.get(f.key, ""), "missing") not in WORKFLOW_ENDS
            for f in self.flows
        )

    def drain(self, faults_ended: float) -> dict[str, tuple[float | None, bool]]:
        """Wait until every job (and celery-ledger's every workflow) is terminal and the broker
        holds nothing more, per system."""
        drained: dict[str, float | None] = dict.fromkeys(self.systems)
        quiet: dict[str, bool] = dict.fromkeys(self.systems, False)
        started = time.monotonic()
        deadline = started + self.profile.drain_timeout
        cap = started + self.profile.drain_timeout * DRAIN_CAP
        # A drain still ending jobs at its deadline is slow, not lost: past the deadline it goes
        # on while the count left falls from one look to the next (PROGRESS_SECONDS apart), up
        # to DRAIN_CAP times the timeout. The report gives the drain's time.
        looked_at, left_then = started, None
        read_at = started
        while not all(quiet.values()):
            now = time.monotonic()
            if now >= cap:
                break
            if left_then is None or now - looked_at >= PROGRESS_SECONDS:
                left = sum(self.left(s) for s in self.systems if drained[s] is None)
                if now >= deadline and left_then is not None:
                    if left >= left_then:
                        break  # no job ended in a whole look: stuck, not slow
                    self.log(f"still draining {now - started:.0f}s on: {left} left, going on")
                looked_at, left_then = now, left
            read = now >= read_at
            read_at = now + OUTCOMES_EVERY_SECONDS if read else read_at
            for system in self.systems:
                if quiet[system]:
                    continue
                if drained[system] is None and not read:
                    continue  # (its jobs' states are read again at the next read)
                states = self.outcomes(system, whole=False) if drained[system] is None else {}
                waiting = system == "ledger" and self.flows and self.flows_ended is None
                if waiting and self.flows_pending() == 0:
                    self.flows_ended = time.monotonic() - faults_ended
                    self.log(f"ledger: every workflow ended {self.flows_ended:.1f}s after faults")
                jobs_done = all(s != "pending" for s in states.values())
                flows_done = system != "ledger" or not self.flows or self.flows_ended is not None
                if drained[system] is None and jobs_done and flows_done:
                    drained[system] = time.monotonic() - faults_ended
                    self.log(f"{system}: every job terminal {drained[system]:.1f}s after faults")
                if drained[system] is not None and self.broker_quiet(system):
                    quiet[system] = True
            time.sleep(0.5)
        return {s: (drained[s], quiet[s]) for s in self.systems}

    def left(self, system: str) -> int:
        """Jobs (and celery-ledger's workflows) not ended yet."""
        pending = sum(s == "pending" for s in self.outcomes(system, whole=False).values())
        return pending + (self.flows_pending() if system == "ledger" and self.flows else 0)

    def account_schedule(self, report: SystemReport) -> None:
        """The periodic task's slots: each from its first run until half a minute before now
        ran exactly once."""
        with self.ledger_client() as client:
            runs = {
                doc["_id"]: int(doc.get("runs", 0))
                for doc in client.soak_world.ticks.find({"_id": {"$ne": "unscheduled"}})
            }
        if not runs:
            report.schedule_missing = [0.0]  # (not one ran: the scheduler never fired)
            return
        first = min(float(slot) for slot in runs)
        last = time.time() - SCHEDULE_SETTLE_SECONDS
        slots = [first + TICK_SECONDS * n for n in range(int((last - first) // TICK_SECONDS) + 1)]
        report.schedule_slots = len(slots)
        report.schedule_missing = [slot for slot in slots if f"{slot:.0f}" not in runs]
        report.schedule_duplicates = sum(max(0, n - 1) for n in runs.values())

    def account(self, system: str, drained: float | None, quiet: bool) -> SystemReport:
        report = SystemReport(system, tasks=len(self.jobs), drain_seconds=drained, quiet=quiet)
        if system == "ledger":
            self.account_schedule(report)
        states = self.outcomes(system)
        effects: dict[str, list[dict[str, Any]]] = defaultdict(list)
        with self.world() as world_client:
            found = world_client.soak_world.effects.find({"system": system})
            for doc in found.sort("at", 1):
                effects[doc["key"]].append(doc)
        if system == "ledger":  # its effects commit in atomic steps on the ledger's server
            with self.ledger_client() as client:
                for doc in client.soak_world.effects.find({"system": system}).sort("at", 1):
                    effects[doc["key"]].append(doc)
        records: dict[str, dict[str, Any]] = {}
        dead_docs: list[dict[str, Any]] = []
        if system == "ledger":
            with self.ledger_client() as client:
                jobs_of = {"task": {"$in": JOB_TASKS}}
                records = {d["key"]: d for d in client.soak.ledger.find(jobs_of)}
                dead_docs = list(client.soak.ledger.find({"state": "dead", **jobs_of}))
        if not quiet:
            report.details += [f"broker: {line}" for line in self.broker_leftovers(system)]
        where: dict[str, str] | None = None  # job key -> where its message is now
        for job in self.jobs:
            state = states[job.key]
            report.succeeded += state == "succeeded"
            report.dead += state == "dead"
            report.designed_dead += job.designed == "dead"
            if state == "pending":
                report.lost.append(job.key)
                where = self.broker_now(system) if where is None else where
                record = records.get(job.key)
                report.details.append(
                    f"not terminal: {job.key} ({job.kind}) record="
                    + (
                        "none"
                        if record is None
                        else f"{record.get('state')} attempts={record.get('attempts')}"
                        f" inflight={record.get('inflight')} reason={record.get('dead_reason')}"
                    )
                    + f"; its message now: {where.get(job.key, 'nowhere in the broker')}"
                    + "; in the broker's AOF: "
                    + broker_fate(
                        self.ledger_broker() if system == "ledger" else self.broker,
                        job.key,
                        system,
                        unacked_key=self.unacked_key(system),
                    )
                )
            elif state != job.designed:
                reason = records.get(job.key, {}).get("dead_reason")
                killed = self.killed_at_every_attempt(system, job, reason)
                if killed is not None:
                    report.killed_to_dead.append(job.key)
                    report.details.append(f"dead by the soak's kills: {job.key} {killed}")
                else:
                    report.wrong_outcome.append(job.key)
                    report.details.append(
                        f"wrong outcome: {job.key} ({job.kind}) {state}: {reason}"
                    )
            runs = effects.get(job.key, [])
            if job.kind == "permanent":
                report.effects_of_failed_jobs += len(runs)
            elif len(runs) > 1:
                report.duplicates += len(runs) - 1
                report.duplicate_keys.append(job.key)
                final_fence = records.get(job.key, {}).get("fence")
                # The extra runs: for the ledger every run but the one that completed; for plain
                # Celery (no fences) every run but the last.
                extra = (
                    [r for r in runs if r.get("fence") != final_fence]
                    if system == "ledger"
                    else runs[:-1]
                )
                for run in extra:
                    cause = self.cause_of(system, run)
                    report.duplicate_causes[cause] = report.duplicate_causes.get(cause, 0) + 1
                report.details.append(
                    f"duplicate: {job.key} ({job.kind}) effects at "
                    + ", ".join(
                        f"{r['at'] - self.wall_started:.2f}s pid {r['pid']} fence {r.get('fence')}"
                        for r in runs
                    )
                    + (f"; completed with fence {final_fence}" if system == "ledger" else "")
                )
        if system == "ledger":
            designed = {j.key for j in self.jobs if j.designed == "dead"}
            # (a job the soak killed at every delivery is a dead letter as designed: poison)
            killed_keys = set(report.killed_to_dead)
            dead_docs = [d for d in dead_docs if str(d.get("key")) not in killed_keys]
            dead_keys = {str(d.get("key")) for d in dead_docs}
            reasons_ok = all("permanent error" in str(d.get("dead_reason")) for d in dead_docs)
            with Redis.from_url(self.redis_url("ledger")) as redis:
                poison = int(redis.llen(self.ledger_app().dead_letters.poison_key))
                queue = self.ledger_app().tiers.dead_letter_queue
                copies = {dead_letter_key(raw) for raw in redis.lrange(queue, 0, -1)}
            # every dead letter's copy reached the dead letters' queue (published later if the
            # broker was away when the job died)
            report.dead_letters_match = (
                dead_keys == designed and reasons_ok and poison == 0 and copies >= designed
            )
            report.dead_letter_detail = (
                f"dead records {len(dead_keys)} (designed {len(designed)},"
                f" extra {sorted(dead_keys - designed)[:5]}, missing"
                f" {sorted(designed - dead_keys)[:5]}), reasons ok {reasons_ok}, poison {poison},"
                f" dead_letter queue copies {len(copies & designed)}/{len(designed)}"
            )
            report.details.insert(0, report.dead_letter_detail)
            if self.flows:
                report.workflows = self.account_workflows(effects)
            report.tenants = self.account_tenants(
                states, records, effects, set(report.killed_to_dead)
            )
            if not report.tenants.ok:
                report.details.append("tenants: see the tenants' table")
        return report

    def effect_tiers(self) -> dict[str, str]:
        """The tier of each effect key: a job's, and each step's and compensation's of a
        workflow (its steps' tier)."""
        tiers = {job.key: job.tier for job in self.jobs}
        for flow in self.flows:
            for index in range(len(flow.steps)):
                tiers[flow.step_key(index)] = tiers[flow.undo_key(index)] = flow.tier
        return tiers

    def account_tenants(
        self,
        states: dict[str, str],
        records: dict[str, dict[str, Any]],
        effects: dict[str, list[dict[str, Any]]],
        killed_to_dead: set[str],
    ) -> TenantsReport:
        """celery-ledger's tenants: per tenant its jobs' ends, and fair dispatch's invariants
        (tenants.py): lanes empty, the capped tenant's bodies at once within its bound."""
        with self.world() as world_client, Redis.from_url(self.redis_url("ledger")) as redis:
            world = world_client.soak_world
            attempts = list(world.attempts.find({"system": "ledger"}))
            ends = list(world.ends.find({"system": "ledger"}))
            leftovers = lane_leftovers(redis, self.queues("ledger"))
        duplicates = {
            job.key: max(0, len(effects.get(job.key, [])) - 1)
            for job in self.jobs
            if job.kind != "permanent"
        }
        return account_tenants(
            self.jobs,
            states,
            records,
            duplicates,
            killed_to_dead,
            self.published_at,
            attempts,
            ends,
            [k for k in self.kills if k.system == "ledger"],
            tiers=self.effect_tiers(),
            now=time.time(),
            holding=self.holding,
            lease_seconds=self.profile.lease_seconds,
            leftovers=leftovers,
            most_entries=self.most_waiting["capped"],
        )

    def account_workflows(self, effects: dict[str, list[dict[str, Any]]]) -> WorkflowReport:
        """Each workflow's end (its handle's status) and its steps' effects in the world."""
        report = WorkflowReport(
            workflows=len(self.flows),
            designed_compensated=sum(f.designed == "compensated" for f in self.flows),
            terminal_seconds=self.flows_ended,
        )
        app = self.ledger_app()
        prefix = f"{self.run_id}-flow-"
        for flow in self.flows:
            workflow_id = self.flow_ids.get(flow.key)
            if workflow_id is None:
                report.lost.append(flow.key)
                report.details.append(f"never started: {flow.key}")
                continue
            status = app.workflow_handle(workflow_id).status()
            report.completed += status.status == "completed"
            report.compensated += status.status == "compensated"
            where = (
                f"{flow.key} ({workflow_id}, steps {[k for k, _ in flow.steps]}): {status.status},"
                f" {status.steps_done} steps done, pending {status.steps_pending},"
                f" {status.events} events, error {str(status.error)[:200]!r}"
            )
            if status.status not in WORKFLOW_ENDS:
                report.lost.append(flow.key)
                report.details.append(f"not ended: {where}")
            elif status.status != flow.designed:
                report.wrong_status.append(flow.key)
                report.details.append(f"wrong end (designed {flow.designed}): {where}")
            expected = flow.expected_effects()
            report.expected_effects += len(expected)
            firsts = []
            for key in expected:
                runs = effects.get(key, [])
                if not runs:
                    report.missing_effects += 1
                    report.details.append(f"missing effect {key}: {where}")
                    continue
                firsts.append((runs[0]["at"], key))
                if len(runs) > 1:
                    report.duplicates += len(runs) - 1
                    for run in runs[:-1]:
                        cause = self.cause_of("ledger", run)
                        report.duplicate_causes[cause] = report.duplicate_causes.get(cause, 0) + 1
                    report.details.append(
                        f"duplicate effect {key}: "
                        + ", ".join(
                            f"{r['at'] - self.wall_started:.2f}s pid {r['pid']}"
                            f" fence {r.get('fence')}"
                            for r in runs
                        )
                    )
            if [key for _, key in sorted(firsts)] != [key for _, key in firsts]:
                report.out_of_order.append(flow.key)
                report.details.append(f"effects out of order: {[k for _, k in firsts]}: {where}")
        self.count_wakes(report)
        expected_keys = {key for flow in self.flows for key in flow.expected_effects()}
        for key, runs in effects.items():
            if key.startswith(prefix):
                report.step_effects += len(runs)
                if key not in expected_keys:
                    report.unexpected_effects += len(runs)
                    report.details.append(f"unexpected effect {key} ({len(runs)}x)")
        # A step's key is ``wf:<workflow id>:<generation>:<position>``.
        failing = {self.flow_ids.get(f.key) for f in self.flows if f.designed == "compensated"}
        with self.ledger_client() as client:
            fields = {"key": 1, "state": 1, "attempts": 1}
            steps = list(client.soak.ledger.find({"task": "soak.step"}, fields))
        # A claim per job, one more per designed retry; beyond that a crash or an outage made a
        # job run again (its effect still once: the faults did reach the workflows).
        report.step_claims = sum(int(d.get("attempts", 0)) for d in steps)
        report.designed_claims = sum(
            len(f.steps) + sum(kind == "flaky" for kind, _ in f.steps) for f in self.flows
        ) + sum(len(f.steps) - 1 for f in self.flows if f.designed == "compensated")
        dead = [d for d in steps if d.get("state") == "dead"]
        owners = [str(d.get("key", "")).split(":")[1:2] for d in dead]
        report.dead_steps = len(dead)
        report.dead_steps_match = sorted(o[0] if o else "" for o in owners) == sorted(
            str(f) for f in failing
        )
        if not report.dead_steps_match:
            report.details.append(
                f"dead step records {len(dead)}, designed {len(failing)}:"
                f" {[d.get('key') for d in dead][:5]}"
            )
        return report

    def watch_queues(self, stop: threading.Event) -> None:
        """Every few seconds, the most copies of one workflow's wake and of one step's message
        waiting in the ledger's queues and its tenants' lanes at once (a backlog must not
        multiply them), and the capped tenant's live concurrency entries."""
        queues = self.queues("ledger")
        while not stop.wait(WATCH_QUEUES_EVERY_SECONDS):
            wakes: Counter[str] = Counter()
            steps: Counter[str] = Counter()
            depth = 0
            try:
                with Redis.from_url(self.redis_url("ledger")) as redis:
                    waiting = [m for queue in queues for m in redis.lrange(queue, 0, -1)]
                    waiting += lane_depth(redis, queues)[1]  # (a tenant's wait in its lanes)
                    fair = FairDispatch(redis, depth=1, lease_seconds=self.profile.lease_seconds)
                    # (a tenant's limit holds on each tier: the most of one tier's entries)
                    entries = max(fair.running(queue).get(CAPPED, 0) for queue in queues)
                    self.most_waiting["capped"] = max(self.most_waiting["capped"], entries)
            except Exception:  # the broker is being killed: the next look
                continue
            for raw in waiting:
                depth += 1
                kind, name = queued_item(raw)
                if kind == "wake":
                    wakes[name] += 1
                elif kind == "step":
                    steps[name] += 1
            self.most_waiting["wake"] = max(
                self.most_waiting["wake"], max(wakes.values(), default=0)
            )
            self.most_waiting["step"] = max(
                self.most_waiting["step"], max(steps.values(), default=0)
            )
            self.most_waiting["depth"] = max(self.most_waiting["depth"], depth)

    def count_wakes(self, report: WorkflowReport) -> None:
        """The wakes the workers ran (the soak app records each one's workflow as it starts):
        in all, the most of one workflow, the most of one within any minute."""
        times: dict[str, list[float]] = defaultdict(list)
        with self.world() as world_client:
            for doc in world_client.soak_world.wakes.find({}, {"workflow": 1, "at": 1}):
                times[str(doc.get("workflow"))].append(float(doc.get("at") or 0.0))
        report.wakes = sum(len(at) for at in times.values())
        report.wakes_most = max((len(at) for at in times.values()), default=0)
        most = 0
        for at in times.values():
            at.sort()
            first = 0
            for last, moment in enumerate(at):
                while moment - at[first] > 60.0:
                    first += 1
                most = max(most, last - first + 1)
        report.wakes_most_in_a_minute = most
        report.wakes_waiting_most = self.most_waiting["wake"]
        report.step_copies_waiting_most = self.most_waiting["step"]
        report.deepest_backlog = self.most_waiting["depth"]

    def killed_at_every_attempt(self, system: str, job: Job, reason: Any) -> str | None:
        """How the soak killed ``job``'s process at each of its attempts, if it did, for a job
        dead as poison ("the worker was lost each time"); else None.

        The platform cannot tell a process killed from outside while it ran a job from a job
        that kills its process (the OOM killer's SIGKILL looks the same): after
        ``LEDGER_MAX_DELIVERIES`` such deliveries the job is a dead letter, replayable. That is
        the design, not a wrong outcome, when the soak's own kills account for every attempt
        the world recorded (each within the attempt's run: its sleep and a lease).
        """
        if "lost each time" not in str(reason):
            return None
        with self.world() as world_client:
            attempts = list(
                world_client.soak_world.attempts.find({"system": system, "key": job.key})
            )
        if not attempts:
            return None
        window = job.param + self.profile.lease_seconds
        found = []
        for attempt in attempts:
            kill = next(
                (
                    k
                    for k in self.kills
                    if k.system == system
                    and attempt["pid"] in k.pids
                    and attempt["at"] <= k.at <= attempt["at"] + window
                ),
                None,
            )
            if kill is None:
                return None
            found.append(f"{kill.kind} kill {kill.at - attempt['at']:.1f}s into attempt")
        return f"{len(attempts)} attempts, each killed: " + "; ".join(found)

    def cause_of(self, system: str, run: dict[str, Any]) -> str:
        """Why a run's effect was not its job's last: a kill soon after it, or a ledger outage.

        "Soon" is within a lease: a holder that outlives its effect by longer has either
        recorded its completion or lost its lease anyway.
        """
        window = self.profile.lease_seconds
        for kill in self.kills:
            if (
                kill.system == system
                and run["pid"] in kill.pids
                and run["at"] <= kill.at <= run["at"] + window
            ):
                return f"{kill.kind} SIGKILL after the effect"
        if system == "ledger":
            for began, ended in self.ledger_outages:
                if began - window <= run["at"] <= ended:
                    return "ledger unreachable after the effect"
            return "UNEXPLAINED"
        return "redelivered (no ledger)"

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> SoakReport:
        began = time.monotonic()
        with self.running(), contextlib.ExitStack() as cleanup:
            cleanup.callback(self.close_ledger_app)
            flows = Counter(f.designed for f in self.flows)
            self.log(
                f"soak {self.profile.name}: {len(self.jobs)} jobs per system"
                f" {dict(Counter(j.kind for j in self.jobs))}"
                + (f", {len(self.flows)} ledger workflows {dict(flows)}" if self.flows else "")
                + f", systems {self.systems}, seed {self.seed};"
                f" workers up in {time.monotonic() - began:.1f}s"
            )
            self.started = time.monotonic()
            self.wall_started = time.time()
            stop = threading.Event()
            supervisor = threading.Thread(target=self.supervise, args=(stop,), name="supervisor")
            supervisor.start()
            watcher = threading.Thread(target=self.watch_queues, args=(stop,), name="queues")
            if self.flows:
                watcher.start()
            injector = threading.Thread(target=self.inject, name="chaos-faults")
            injector.start()
            try:
                self.publish_all()
                injector.join()
                faults_ended = time.monotonic()
                self.log(
                    f"faults over after {faults_ended - self.started:.1f}s: {dict(self.faults)}"
                    f"; publishes refused and tried again: {self.publish_refusals}"
                    f" {dict(self.refused_by)}"
                )
                drained = self.drain(faults_ended)
            finally:
                stop.set()
                supervisor.join()
                if watcher.is_alive():
                    watcher.join()
                if "ledger" in self.systems:
                    self.faults_repaired.update(self.brought_back())
            reports = {s: self.account(s, *drained[s]) for s in self.systems}
        return SoakReport(
            profile=self.profile.name,
            seed=self.seed,
            faults=dict(self.faults),
            repaired=dict(self.faults_repaired),
            systems=reports,
            crashes=self.crashes,
            fault_log=self.fault_log,
            fault_seconds=faults_ended - self.started,
            total_seconds=time.monotonic() - began,
            config=asdict(self.profile),
        )


def run(
    profile: Profile,
    *,
    seed: int | None = None,
    data_dir: Path | None = None,
    systems: tuple[str, ...] = SYSTEMS,
    log: Callable[[str], None] = print,
) -> SoakReport:
    """Run a soak; servers and workers live in ``data_dir`` (a temporary one by default)."""
    seed = random.SystemRandom().randrange(1 << 30) if seed is None else seed
    with contextlib.ExitStack() as stack:
        stack.enter_context(without_ledger_environment())
        if data_dir is None:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        return Soak(profile, seed=seed, data_dir=data_dir, systems=systems, log=log).run()


def passed(report: SoakReport) -> bool:
    """The soak's verdict on celery-ledger (plain Celery's figures are for comparison)."""
    ledger = report.systems.get("ledger")
    return ledger is None or (
        not ledger.lost
        and not ledger.wrong_outcome
        and ledger.duplicates == 0
        and bool(ledger.dead_letters_match)
        and (ledger.workflows is None or ledger.workflows.ok)
        and (ledger.tenants is None or ledger.tenants.ok)
        and ledger.schedule_ok
    )


def run_seeds(
    profile: Profile, seeds: list[int], *, parallel: int, only: str | None, keep: Path | None
) -> int:
    """One soak per seed, ``parallel`` at a time (each its own process, servers and ports),
    then a line per seed; 0 if every one passed. Each run's report is kept in ``RESULTS``
    and its output in ``<keep or a temporary folder>/seed-N.log``."""
    base = keep or Path(tempfile.mkdtemp(prefix="soaks-"))
    base.mkdir(parents=True, exist_ok=True)
    seeds = list(dict.fromkeys(seeds))  # each seed once
    pending = list(seeds)
    running: dict[int, tuple[Any, Path, float]] = {}  # seed -> (its process, report, start)
    finished: dict[int, tuple[int, Path, float]] = {}
    try:
        _run_all(profile, pending, running, finished, parallel=parallel, only=only, keep=keep,
                 base=base)  # fmt: skip
    finally:  # (Ctrl-C: the runs end with this process)
        for process, _, _ in running.values():
            process.terminate()
    return _summary(profile, seeds, finished, parallel)


def _run_all(
    profile: Profile,
    pending: list[int],
    running: dict[int, tuple[Any, Path, float]],
    finished: dict[int, tuple[int, Path, float]],
    *,
    parallel: int,
    only: str | None,
    keep: Path | None,
    base: Path,
) -> None:
    import subprocess
    import sys

    while pending or running:
        while pending and len(running) < parallel:
            seed = pending.pop(0)
            report_path = base / f"seed-{seed}.json"
            command = [
                sys.executable, "-m", "ops.chaos.soak", "--profile", profile.name,
                "--seed", str(seed), "--report", str(report_path),
            ]  # fmt: skip
            if only:
                command += ["--only", only]
            if keep:
                command += ["--keep", str(base / f"seed-{seed}")]
            with (base / f"seed-{seed}.log").open("wb") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
            running[seed] = (process, report_path, time.monotonic())
            console.print(f"seed {seed}: started (output in {base}/seed-{seed}.log)")
        time.sleep(2.0)
        for seed, (process, report_path, began) in list(running.items()):
            if process.poll() is not None:
                del running[seed]
                finished[seed] = (process.returncode, report_path, time.monotonic() - began)
                console.print(f"seed {seed}: exit {process.returncode}")


def _summary(
    profile: Profile, seeds: list[int], finished: dict[int, tuple[int, Path, float]], parallel: int
) -> int:
    rows = []
    for seed in seeds:
        code, report_path, seconds = finished[seed]
        try:
            found = json.loads(report_path.read_text())["systems"]["ledger"]
        except (OSError, ValueError, KeyError):
            rows.append([seed, code, "-", "-", "-", "-", "-", "-", f"{seconds:.0f}s"])
            continue
        flows = found.get("workflows") or {}
        drain = found.get("drain_seconds")
        wakes = flows.get("wakes", 0) / max(flows.get("workflows", 0), 1)
        rows.append(
            [
                seed,
                "passed" if code == 0 else f"FAILED ({code})",
                len(found["lost"]),
                found["duplicates"],
                len(found["wrong_outcome"]),
                f"{len(flows.get('lost', []))}/{flows.get('workflows', 0)}",
                f"{wakes:.1f} / {flows.get('wakes_most_in_a_minute', 0)}",
                "-" if drain is None else f"{drain:.0f}s",
                f"{seconds:.0f}s",
            ]
        )
    print_table(
        f"chaos soak, profile {profile.name}: {len(seeds)} seeds, {parallel} at a time",
        [
            "seed",
            "verdict",
            "lost",
            "duplicates",
            "wrong outcome",
            "workflows not ended",
            "wakes per workflow (mean / most in a minute)",
            "drained after the faults",
            "run",
        ],
        rows,
    )
    return 0 if all(finished[seed][0] == 0 for seed in seeds) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="ci")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--only", choices=SYSTEMS, default=None, help="run one system only")
    parser.add_argument("--keep", type=Path, default=None, help="keep data and logs here")
    parser.add_argument(
        "--seeds",
        type=lambda text: [int(seed) for seed in text.split(",")],
        default=None,
        help="several runs, one per seed (comma-separated), --parallel at a time",
    )
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (--seeds)")
    parser.add_argument("--report", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    if args.seeds:
        return run_seeds(
            profile, args.seeds, parallel=max(args.parallel, 1), only=args.only, keep=args.keep
        )
    facts = machine()
    console.print(
        f"[bold]chaos soak[/], profile {profile.name}: {profile.tasks} jobs per system,"
        f" {profile.workers} workers x {profile.concurrency} processes per system,"
        f" lease {profile.lease_seconds}s, visibility timeout {profile.visibility_timeout}s;"
        f" machine: {facts['cores']} cores, load average {facts['loadavg_at_start']}",
        highlight=False,
    )
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    report = run(
        profile,
        seed=args.seed,
        data_dir=args.keep,
        systems=(args.only,) if args.only else SYSTEMS,
    )
    report.render()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"soak-{profile.name}-seed{report.seed}-{stamp}.json"
    text = json.dumps(asdict(report) | {"machine": facts}, indent=2, default=str)
    for where in (path, args.report):
        if where is not None:
            where.write_text(text)
            console.print(f"wrote {where}", highlight=False)
    return 0 if passed(report) else 1


if __name__ == "__main__":
    raise SystemExit(main())
