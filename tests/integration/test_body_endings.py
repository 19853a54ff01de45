"""Every way a task body ends, on each pool: the job ends recorded, the worker lives on.

For each case one job runs on a real worker (prefork, threads, solo) with the workers' own
reconciler: the job must end ``succeeded`` or ``dead`` with a reason, within the platform's
own recovery time (a lease of 4 s, a sweep every 2 s, 3 deliveries at most); its body must
have run once (twice where it retries once, up to the poison bound where it kills its own pool
process); the worker's main process must live on, and on prefork its pool processes too
(but where the body kills its own).

A body that ends its own process (``os._exit``, a signal) ends a threads or solo worker, whose
bodies run in the worker's main process: that is a limit of in-process pools (the README's
"Limits"), so those cases run on prefork only.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from celery_ledger import Settings, create_app
from celery_ledger.embedded.stack import EmbeddedStack
from celery_ledger.ledger.record import TERMINAL

from .apps.body_endings import NAMESPACE, register

MODULE = "tests.integration.apps.body_endings"
SETTLE_SECONDS = 40.0
MAX_DELIVERIES = 3
ENV = {
    "LEDGER_MONGO_DB": "body_endings",
    "LEDGER_LEASE_SECONDS": "4",
    "LEDGER_DEFER_POLL_SECONDS": "0.2",
    "LEDGER_UNAVAILABLE_BACKOFF_BASE_SECONDS": "0.5",
    "LEDGER_UNAVAILABLE_BACKOFF_CAP_SECONDS": "2",
    "LEDGER_MONGO_TIMEOUT_MS": "1500",
    "LEDGER_MAX_DELIVERIES": str(MAX_DELIVERIES),
    "LEDGER_RECONCILE_IN_WORKERS": "true",
    "LEDGER_RECONCILE_EVERY_SECONDS": "2",
    "LEDGER_RECONCILE_LEASE_GRACE_SECONDS": "1",
    "LEDGER_QUEUE_NAMESPACE": NAMESPACE,
}

# What each case must end as: (state, runs at most). A reason is required of every dead one.
RETURNS = {
    "ok": ("succeeded", 1),
    "ret_int64": ("succeeded", 1),  # (2**70: exact JSON)
    "ret_set": ("dead", 1),
    "ret_nan": ("dead", 1),
    "ret_deep": ("dead", 1),  # (nested past the stack)
    "ret_generator": ("dead", 1),
    "ret_badrepr": ("dead", 1),
    "ret_huge": ("dead", 1),  # (30 MB: over the result limit)
    "ret_bytes": ("dead", 1),
    "ret_inf": ("dead", 1),
    "ret_bigint": ("dead", 1),  # (past Python's int-to-text limit)
    "ret_tuple_keys": ("dead", 1),
    "ret_exception": ("dead", 1),
}
EXCEPTIONS = {
    "exc_needs_args": ("dead", 1),  # (cannot be rebuilt from its args)
    "exc_badstr": ("dead", 1),  # (its __str__ raises)
    "exc_badstr_both": ("dead", 1),
    "exc_retryable_badstr": ("dead", 1),
    "exc_unjson_args": ("dead", 1),
    "exc_memory": ("dead", 1),  # (Celery re-raises a MemoryError in the main process)
    "exc_recursion": ("dead", 1),
    "exc_inf_retry_after": ("dead", 2),  # (the hint ignored: retried once by backoff)
    "exc_huge_retry_after": ("dead", 2),
    "exc_unreadable_retry_after": ("dead", 2),  # (the hint's property raises)
    "exc_huge_msg": ("dead", 1),  # (20 MB of text)
    "exc_nul_msg": ("dead", 1),  # (NUL and a lone surrogate)
}
CONTROL = {
    "raise_retry_bare": ("dead", 1),  # (Retry by hand publishes nothing)
    "raise_retry_exc": ("dead", 1),
    "raise_ignore": ("succeeded", 1),
    "raise_reject": ("dead", 1),
    "raise_reject_badstr": ("dead", 1),  # (its reason's __str__ and __repr__ raise)
    "raise_ignore_badstr": ("succeeded", 1),
    "raise_revoked": ("dead", 1),
    "raise_worker_lost": ("dead", 1),
    "raise_time_limit": ("dead", 1),
    "raise_soft_limit": ("dead", 1),
}
RETRIES = {
    "retry_neg": ("succeeded", 2),
    "retry_nan": ("dead", 1),  # (a countdown that is no time)
    "retry_inf": ("dead", 1),
    "retry_huge": ("dead", 1),  # (the year 33658)
    "retry_eta_str": ("dead", 1),  # (it reran without limit: 849 runs in 25 s)
    "retry_eta_naive_past": ("succeeded", 2),
    "retry_max0": ("dead", 1),
    "retry_no_exc": ("succeeded", 2),
    "retry_nothrow": ("succeeded", 1),
    "retry_exc_str": ("succeeded", 2),
    "retry_exc_badstr": ("succeeded", 2),  # (its exception's __str__ and __repr__ raise)
    "retry_eta_far": ("dead", 1),  # (the year 9999: past what the ledger keeps)
}
NOT_EXCEPTIONS = {  # BaseExceptions that are not Exceptions
    "sys_exit": ("dead", 1),
    "system_exit_0": ("dead", 1),
    "keyboard_interrupt": ("dead", 1),
    "generator_exit": ("dead", 1),
    "custom_base": ("dead", 1),
    "raise_worker_shutdown": ("dead", 1),
    "raise_worker_terminate": ("dead", 1),
}
OWN_PROCESS = {  # the body ends its own pool process: poison after the bound
    "os_exit_0": ("dead", MAX_DELIVERIES),
    "os_exit_1": ("dead", MAX_DELIVERIES),
    "sigsegv": ("dead", MAX_DELIVERIES),
}
IN_PROCESS_SAMPLE = [
    "ok",
    "exc_memory",
    "exc_badstr",
    "raise_retry_bare",
    "retry_eta_str",
    *NOT_EXCEPTIONS,
]
EXPECTED = {**RETURNS, **EXCEPTIONS, **CONTROL, **RETRIES, **NOT_EXCEPTIONS, **OWN_PROCESS}
CASES = (
    [("prefork", mode) for mode in EXPECTED]
    + [("threads", mode) for mode in IN_PROCESS_SAMPLE]
    + [("solo", mode) for mode in IN_PROCESS_SAMPLE]
)


class Bench:
    """A stack of its own with one worker of the pool, and a producer."""

    def __init__(self, base: Path, pool: str) -> None:
        self.pool = pool
        self.stack = EmbeddedStack(MODULE, base, auth=True, queue_namespace=NAMESPACE)
        self.stack.extra_env.update(ENV)
        self.stack.start_servers()
        assert self.stack.broker is not None and self.stack.ledger is not None
        self.producer = create_app(
            "body_endings_probe",
            settings=Settings(
                queue_namespace=NAMESPACE,
                broker_url=self.stack.broker.url,
                mongo_uri=self.stack.ledger.url,
                mongo_db="body_endings",
            ),
            set_as_current=False,
        )
        self.task = register(self.producer)
        self.world = MongoClient(self.stack.ledger.url).get_database("reference_world")
        self.worker: Any = None
        self.ensure_worker()

    def ensure_worker(self) -> None:
        if self.worker is not None and self.worker.alive():
            return
        if self.worker is not None and self.worker in self.stack.workers:
            self.stack.workers.remove(self.worker)
        self.worker = self.stack.start_worker(
            self.stack.queues_of(),
            concurrency=1,
            pool=self.pool,
            name=f"endings-{self.pool}-{uuid.uuid4().hex[:4]}@127.0.0.1",
        )

    def close(self) -> None:
        self.world.client.close()
        self.producer.close()
        self.stack.stop()


@dataclass
class Seen:
    state: str | None
    dead_reason: str
    runs: int
    worker_died: bool
    pool_replaced: bool
    log: str


_benches: dict[str, Bench] = {}


@pytest.fixture(scope="module")
def bench_of(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One bench at a time (the cases are ordered by pool)."""

    def get(pool: str) -> Bench:
        if pool not in _benches:
            for other in list(_benches):
                _benches.pop(other).close()
            _benches[pool] = Bench(tmp_path_factory.mktemp(f"endings-{pool}"), pool)
        return _benches[pool]

    try:
        yield get
    finally:
        for other in list(_benches):
            _benches.pop(other).close()


def run_one(bench: Bench, mode: str) -> Seen:
    worker = bench.worker
    pool_before = set(worker.pool_pids())
    offset = worker.log_path.stat().st_size
    token = f"{mode}-{uuid.uuid4().hex[:8]}"
    bench.task.apply_async((token, mode))
    started, record, died = time.monotonic(), None, False
    while time.monotonic() - started < SETTLE_SECONDS:
        died = died or not worker.alive()
        record = bench.producer.ledger.get(bench.task.name, token)
        if record is not None and record.state in TERMINAL:
            time.sleep(1.0)  # a late copy, a late write, a pool process dying after the outcome
            record = bench.producer.ledger.get(bench.task.name, token)
            break
        time.sleep(0.25)
    died = died or not worker.alive()
    replaced = bench.pool == "prefork" and not died and bool(pool_before - set(worker.pool_pids()))
    return Seen(
        state=None if record is None else record.state.value,
        dead_reason="" if record is None else record.dead_reason or "",
        runs=bench.world.effects.count_documents({"kind": "body-run", "key": token}),
        worker_died=died,
        pool_replaced=replaced,
        log=worker.log_path.read_bytes()[offset:].decode(errors="replace")[-3000:],
    )


@pytest.mark.parametrize(("pool", "mode"), CASES, ids=[f"{p}-{m}" for p, m in CASES])
def test_a_body_ending_this_way_ends_recorded_and_the_worker_lives_on(
    bench_of: Any, pool: str, mode: str
) -> None:
    bench = bench_of(pool)
    bench.ensure_worker()
    state, most_runs = EXPECTED[mode]
    seen = run_one(bench, mode)
    try:
        assert not seen.worker_died, f"the worker ended:\n{seen.log}"
        assert seen.state == state, f"{seen}"
        assert state != "dead" or seen.dead_reason, "dead without a reason"
        assert 1 <= seen.runs <= most_runs, f"the body ran {seen.runs} times: {seen}"
        if mode not in OWN_PROCESS:
            assert not seen.pool_replaced, f"a pool process ended:\n{seen.log}"
    finally:
        bench.ensure_worker()  # (a failed case's dead worker never fails the next ones)
