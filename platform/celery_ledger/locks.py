"""A lock that survives ``fork``: the prefork pool forks worker processes from a main process
whose own threads (housekeeping, the reconciler, metrics) use the same objects.

A ``threading.Lock`` held by one of those threads at the moment of the fork stays held for
ever in the child, whose first use of it then hangs (a pool process that never runs another
task). :class:`ForkSafeLock` notices that it is in a new process and starts with a fresh lock
there. A child begins with one thread, so the first use after the fork is not contended.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType

# Which process this is, counted up in every forked child: cheaper to compare on every use of
# a lock than ``os.getpid()``, which is a system call each time (a few per task, measured in the
# pool's profile). Python runs the hook after every ``os.fork`` (billiard's pool forks with it);
# where there is no such hook, every use compares the process id as before.
_generation = 0
_AT_FORK = hasattr(os, "register_at_fork")


def _forked() -> None:
    global _generation
    _generation += 1


if _AT_FORK:
    os.register_at_fork(after_in_child=_forked)


def process_generation() -> int:
    """A number that differs in a forked child from its parent's (the fork-detection of every
    per-process object here: locks, the heartbeat thread)."""
    return _generation if _AT_FORK else os.getpid()


class ForkSafeLock:
    """A non-reentrant lock, fresh in every forked child (a context manager)."""

    def __init__(self) -> None:
        self._generation = process_generation()
        self._lock = threading.Lock()

    def _current(self) -> threading.Lock:
        generation = process_generation()
        if self._generation != generation:
            self._lock = threading.Lock()
            self._generation = generation
        return self._lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._current().acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


# What a forked child inherited and replaced (a client whose pool a parent's thread may hold):
# kept, never collected, because such a client's finalizer closes its pool under that very
# lock, and the child would hang there.
_INHERITED: list[object] = []


def keep_inherited(obj: object) -> None:
    """Keep ``obj`` (inherited from the parent, replaced in this child) from being finalized."""
    _INHERITED.append(obj)
