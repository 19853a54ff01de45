"""A prefork pool process is forked from a main process whose threads use the same services:
the child must never inherit a connection pool (or a lock) that one of those threads held at the
fork. Found by a CI run: a pool process forked to replace a killed one hung on its first Redis
call (redis-py resets an inherited pool under the pool's own lock), and its job with it."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from celery_ledger import Settings, create_app
from celery_ledger.runtime import PER_PROCESS, Runtime


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens: every call fails at once with a connection error


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    settings = Settings(broker_url=f"redis://127.0.0.1:{closed_port()}/0")
    app = create_app("fork_safety", settings=settings, set_as_current=False)
    yield app.runtime


def held_during_fork(pools: list[Any]) -> tuple[threading.Event, threading.Thread]:
    """A parent thread inside each pool (holding its lock), as housekeeping is at times."""
    release, holding = threading.Event(), threading.Barrier(2)

    def hold() -> None:
        for pool in pools:
            pool._lock.acquire()
        holding.wait()
        release.wait(30)
        for pool in pools:
            pool._lock.release()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    holding.wait()
    return release, thread


def in_child(check: Any, seconds: int = 10) -> int:
    """Run ``check`` in a forked child; its exit status (0: passed; SIGALRM: it hung)."""
    pid = os.fork()
    if pid == 0:  # the child: report by exit code only
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not the test runner's timeout handler
        signal.alarm(seconds)
        try:
            os._exit(0 if check() else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return status


def test_every_connection_holding_service_is_rebuilt_in_a_forked_child(
    runtime: Runtime,
) -> None:
    built = {name: getattr(runtime, name) for name in PER_PROCESS}  # the parent uses them all

    def rebuilt() -> bool:
        return all(
            getattr(runtime, name) is not parents
            for name, parents in built.items()
            if parents is not None
        )

    assert in_child(rebuilt) == 0


def test_the_reconciler_a_pool_process_sweeps_with_is_its_own() -> None:
    # The worker's main process sweeps from a thread; a pool process running the beat task
    # must not use that sweep's Redis client, nor count as its lock's owner.
    settings = Settings(broker_url=f"redis://127.0.0.1:{closed_port()}/0")
    app = create_app("fork_safety_sweep", settings=settings, set_as_current=False)
    parents = app.reconciler

    assert in_child(lambda: app.reconciler is not parents) == 0


def test_a_child_forked_while_a_parent_thread_holds_a_redis_pool_does_not_hang(
    runtime: Runtime,
) -> None:
    import redis

    from celery_ledger.errors import LedgerError

    # Given the parent's threads inside the broker client's pool and the delayed set's
    pools = [runtime.redis.connection_pool, runtime.delayed._redis.connection_pool]
    release, thread = held_during_fork(pools)

    # When a pool process is forked then, and makes its first Redis calls (no server: each
    # must fail at once with a connection error, not wait for a lock nobody will release)
    def first_calls_fail_fast() -> bool:
        for call in (runtime.redis.ping, runtime.delayed.pending):
            try:
                call()
            except (redis.ConnectionError, LedgerError):
                continue
            return False
        return True

    try:
        status = in_child(first_calls_fail_fast)
    finally:
        release.set()
        thread.join()

    # Then it does not hang (SIGALRM) and its calls fail as they would in any process
    assert not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM), "hung"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_forked_child_reports_latency_through_a_client_of_its_own() -> None:
    import redis

    from celery_ledger.pressure import Pressure

    # Given a web process's latency reporter, its flusher inside the client's pool at the fork
    pressure = Pressure(redis.Redis.from_url(f"redis://127.0.0.1:{closed_port()}/0"))
    release, thread = held_during_fork([pressure.client.connection_pool])

    def fails_fast() -> bool:
        try:
            pressure.flush() if pressure.report_latency(5.0) is None else None
        except redis.ConnectionError:
            return pressure.client.connection_pool.pid == os.getpid()
        return False

    try:
        status = in_child(fails_fast)
    finally:
        release.set()
        thread.join()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_fork_safe_lock_held_by_a_parent_thread_at_the_fork_is_free_in_the_child() -> None:
    """Every per-process object of the library guards itself with a ForkSafeLock: a child
    forked while one of its parent's threads holds it must take it at once."""
    from celery_ledger.locks import ForkSafeLock

    lock = ForkSafeLock()
    with lock:  # the parent's first use: its lock object exists before the fork
        pass
    release, holding = threading.Event(), threading.Barrier(2)

    def hold() -> None:
        with lock:
            holding.wait()
            release.wait(30)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    holding.wait()
    try:

        def takes_it() -> bool:
            with lock:  # hangs (SIGALRM) if the child kept the parent's held lock
                return True

        assert in_child(takes_it, seconds=5) == 0
        assert not lock.acquire(blocking=False)  # the parent's lock is still held: the same
    finally:
        release.set()
        thread.join()
    with lock:  # and free again in the parent once its thread let go
        pass


def test_a_group_commit_queue_held_by_a_parent_writer_at_the_fork_is_fresh_in_the_child() -> None:
    """A threads pool's writers share one queue: a child forked while a parent writer holds
    it (or leads a flush) sends its own writes at once."""
    from types import SimpleNamespace

    from celery_ledger.ledger.group_commit import GroupCommit, Statement

    class Collection:
        def bulk_write(self, requests: list[Any], ordered: bool) -> Any:
            return SimpleNamespace(matched_count=len(requests), upserted_ids={})

    writes = GroupCommit(lambda: Collection())  # type: ignore[arg-type, return-value]
    writes.write([Statement({"_id": "a"}, {"$set": {"x": 1}})])  # the parent's queue exists
    queue = writes._here()
    release, holding = threading.Event(), threading.Barrier(2)

    def hold() -> None:
        with queue.cond:
            queue.flushing = True  # a parent writer leading a flush
            holding.wait()
            release.wait(30)
            queue.flushing = False

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    holding.wait()
    try:

        def writes_at_once() -> bool:
            (outcome,) = writes.write([Statement({"_id": "b"}, {"$set": {"x": 1}})])
            return outcome.matched is True

        assert in_child(writes_at_once, seconds=5) == 0
    finally:
        release.set()
        thread.join()
