"""The prefork pool's repair: a pool process killed while writing a message cannot end the
worker (celery_ledger.prefork)."""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
from collections.abc import Generator, Iterator
from typing import Any

import pytest
from celery.concurrency import asynpool, prefork

from celery_ledger import prefork as pool


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)  # as the worker's event loop reads it
    yield read_end, write_end
    for fd in (read_end, write_end):
        with contextlib.suppress(OSError):
            os.close(fd)


def reader(
    cls: type[Any], fd: int, readers: list[tuple[Any, ...]], received: list[Any]
) -> Generator[None, None, None]:
    handler = cls.__new__(cls)  # only its reader is exercised: no pool behind it
    handler.handle_event = "celery's reader"

    def add_reader(*args: Any) -> None:
        readers.append(args)

    gen: Generator[None, None, None] = handler._recv_message(add_reader, fd, received.append)
    return gen


def hub_step(gen: Generator[None, None, None]) -> None:
    """What kombu's hub does with a reader that is a generator: StopIteration and EBADF end it
    quietly, anything else ends the worker's loop ("Unrecoverable error")."""
    with contextlib.suppress(StopIteration):
        next(gen)


def message(obj: Any) -> bytes:
    body = pickle.dumps(obj)
    return struct.pack(">i", len(body)) + body


@pytest.mark.parametrize("cut_at", [2, 4, 10], ids=["in the header", "after it", "in the body"])
def test_a_message_cut_short_by_a_killed_process_never_ends_the_worker(
    pipe: tuple[int, int], cut_at: int
) -> None:
    read_end, write_end = pipe
    readers: list[tuple[Any, ...]] = []
    received: list[Any] = []
    data = message({"result": "x" * 50})
    # Given a process that wrote part of a message, then was killed
    os.write(write_end, data[:cut_at])
    gen = reader(pool.ResultHandler, read_end, readers, received)
    hub_step(gen)  # Celery's first, guarded step: it reads what is there and waits for more
    os.close(write_end)

    # When the hub reads on
    hub_step(gen)

    # Then nothing is raised into the hub, and the pipe goes back to Celery's reader
    assert readers == [(read_end, "celery's reader", read_end)]
    assert received == []


def test_celery_s_own_reader_ends_the_worker_there(pipe: tuple[int, int]) -> None:
    # (the failure the repair is for: fails if Celery guards it one day, then drop the repair)
    read_end, write_end = pipe
    os.write(write_end, message("x" * 50)[:10])
    gen = reader(asynpool.ResultHandler, read_end, [], [])
    hub_step(gen)
    os.close(write_end)

    with pytest.raises((OSError, EOFError)):
        hub_step(gen)


def test_a_message_in_pieces_is_still_read_whole(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    readers: list[tuple[Any, ...]] = []
    received: list[Any] = []
    data = message({"state": "done", "value": list(range(100))})
    os.write(write_end, data[:7])
    gen = reader(pool.ResultHandler, read_end, readers, received)
    hub_step(gen)
    os.write(write_end, data[7:])

    hub_step(gen)

    assert received == [{"state": "done", "value": list(range(100))}]
    assert readers == [(read_end, "celery's reader", read_end)]  # as Celery hands it back


class Worker:
    def __init__(self, pool_cls: Any) -> None:
        self.pool_cls = pool_cls


@pytest.mark.parametrize("chosen", ["prefork", "processes", prefork.TaskPool])
def test_a_worker_of_celery_s_prefork_pool_gets_the_repaired_one(chosen: Any) -> None:
    worker = Worker(chosen)

    pool.prefer_repaired_pool(worker)

    assert worker.pool_cls is pool.TaskPool


@pytest.mark.parametrize("chosen", ["threads", "solo", "no.such:Pool"])
def test_other_pools_are_left_as_chosen(chosen: str) -> None:
    worker = Worker(chosen)

    pool.prefer_repaired_pool(worker)

    assert worker.pool_cls == chosen


def test_the_repaired_pool_is_celery_s_prefork_pool_with_its_reader() -> None:
    assert issubclass(pool.TaskPool, prefork.TaskPool)
    assert pool.TaskPool.Pool.ResultHandler is pool.ResultHandler
