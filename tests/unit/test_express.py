"""The express process of fair dispatch: what a take reads and in which order, how the pool
is sized for it, and which queues a worker marks for it (celery_ledger.express)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kombu.asynchronous.semaphore import LaxBoundedSemaphore
from kombu.transport import redis as kombu_redis

from celery_ledger.express import express_queues
from celery_ledger.fairness import express_list, take_keys
from celery_ledger.prefork import TaskPool, express_slots
from celery_ledger.tenancy import refill_all

SEP = kombu_redis.Channel.sep


def kombu_list(queue: str, step: int) -> str:
    return queue if step == 0 else f"{queue}{SEP}{step}"


def test_an_express_list_reads_as_a_take_from_its_queue() -> None:
    # kombu names the queue of a take by the key's text before its last separator
    for step in (0, 3, 6, 9):
        assert express_list("acme.default", step).rsplit(SEP, 1)[0] == "acme.default"
        assert express_list("acme.default", step) != kombu_list("acme.default", step)


def test_a_take_reads_each_steps_express_lists_before_the_queues() -> None:
    keys = take_keys(["a", "b"], (0, 3), kombu_list, express_only=False)
    assert keys == [
        express_list("a", 0), express_list("b", 0), "a", "b",
        express_list("a", 3), express_list("b", 3), f"a{SEP}3", f"b{SEP}3",
    ]  # fmt: skip
    # the express process reads the express lists alone, in the same order
    only = take_keys(["a", "b"], (0, 3), kombu_list, express_only=True)
    assert only == [k for k in keys if k in {express_list(q, s) for q in "ab" for s in (0, 3)}]


def app_with(depth: int, slots: int) -> Any:
    settings = SimpleNamespace(fair_queue_depth=depth, fair_express_slots=slots)
    return SimpleNamespace(runtime=SimpleNamespace(settings=settings))


def test_the_pool_keeps_express_processes_only_with_fair_dispatch_on() -> None:
    assert express_slots(app_with(1, 1)) == 1
    assert express_slots(app_with(1, 0)) == 0
    assert express_slots(app_with(0, 1)) == 0  # (fair dispatch off: nothing goes ahead)
    assert express_slots(object()) == 0  # (another app)


def test_the_pool_and_its_free_process_count_grow_by_the_express_slots_but_prefetch_does_not() -> (
    None
):
    semaphore = LaxBoundedSemaphore(2)
    pool = TaskPool(2, app=app_with(1, 1), semaphore=semaphore)
    assert pool.limit == 3 and pool.express_slots == 1
    # the worker's count of free processes, which the pool releases at each job's end
    assert semaphore.initial_value == 3 and semaphore.value == 3
    # Celery's prefetch (and its restoration after a reconnection) counts the others only
    pool._pool = SimpleNamespace(_processes=3)
    assert pool.num_processes == 2
    plain = TaskPool(2, app=app_with(0, 1), semaphore=LaxBoundedSemaphore(2))
    assert plain.limit == 2 and plain.express_slots == 0


class Lanes:
    def __init__(self) -> None:
        self.fed: list[tuple[str, bool]] = []

    def feed(self, queue: str, *, express: bool = False) -> int:
        self.fed.append((queue, express))
        return 0


def test_a_worker_marks_for_express_only_the_queues_its_express_process_takes_from() -> None:
    lanes = Lanes()
    consumer = SimpleNamespace(ledger_express_queues=frozenset({"t.default"}))
    refill_all(lanes, lambda: ["t.default", "t.bulk"], lambda: express_queues(consumer))  # type: ignore[arg-type]
    assert lanes.fed == [("t.default", True), ("t.bulk", False)]
    # a consumer without an express process (not started, stopped, another pool) marks none
    assert express_queues(None) == frozenset() and express_queues(SimpleNamespace()) == frozenset()
