"""Bounds on waiting for a dependency: a deadline over a block of code, a call that waits no
longer than it, and a hedged call for idempotent reads.

    with app.deadline(2.0):                       # or the task option deadline_seconds=2.0
        profile = bounded(crm.fetch, user_id)     # waits 2 s at most
        price = hedged(lambda: primary.quote(sku), lambda: backup.quote(sku), after=0.2)
        requests.get(url, timeout=remaining())    # clients that take a timeout: pass what is left

Deadlines nest: an inner one never extends an outer one. Python cannot stop a call that does
not return, so :func:`bounded` runs the call in a helper thread and stops *waiting* at the
deadline with :class:`~celery_ledger.errors.DeadlineExceeded` (a ``TimeoutError``: a task's
retry policy retries it, an optional step is skipped on it); the call goes on in the background
and its answer is dropped. Give the dependency's own client ``timeout=remaining()`` as well, so
that it stops too. Written here rather than with ``concurrent.futures``' shared executors: a
call that never returns must not hold a pool slot another call needs.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..errors import ConfigurationError, DeadlineExceeded

T = TypeVar("T")

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "celery_ledger_deadline", default=None
)


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Within the block, calls through :func:`bounded` and :func:`hedged` wait at most until
    ``seconds`` from now (or an enclosing deadline, if sooner). ``None``: no new bound."""
    if seconds is None:
        yield
        return
    if not seconds > 0:
        raise ConfigurationError(f"a deadline must be a positive number of seconds, not {seconds}")
    at = time.monotonic() + seconds
    outer = _DEADLINE.get()
    token = _DEADLINE.set(at if outer is None else min(outer, at))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def remaining() -> float | None:
    """Seconds left before the current deadline (``None``: none is set; never negative)."""
    at = _DEADLINE.get()
    return None if at is None else max(0.0, at - time.monotonic())


@dataclass
class _Call(Generic[T]):
    """One call running in a helper thread of its own."""

    func: Callable[[], T]
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None

    def start(self, finished: threading.Condition | None = None) -> _Call[T]:
        context = contextvars.copy_context()  # the caller's deadline, trace and task context

        def run() -> None:
            try:
                self.value = context.run(self.func)
            except BaseException as exc:  # handed to the waiting caller, raised there
                self.error = exc
            finally:
                self.done.set()
                if finished is not None:
                    with finished:
                        finished.notify_all()

        threading.Thread(target=run, name="ledger-bounded-call", daemon=True).start()
        return self

    def outcome(self) -> T:
        if self.error is not None:
            raise self.error
        result: T = self.value
        return result


def bounded(func: Callable[..., T], *args: Any, seconds: float | None = None, **kwargs: Any) -> T:
    """``func(*args, **kwargs)``, waiting at most ``seconds`` or until the current deadline,
    whichever is sooner; without either, a plain call in this thread.

    Raises:
        DeadlineExceeded: no answer in time (the call goes on in the background).
    """
    limit = _limit(seconds)
    if limit is None:
        return func(*args, **kwargs)
    if limit <= 0:
        raise DeadlineExceeded(f"{_name(func)}: the deadline had passed before the call")
    call = _Call(lambda: func(*args, **kwargs)).start()
    if not call.done.wait(limit):
        raise DeadlineExceeded(f"{_name(func)}: no answer within {limit:.3g}s")
    return call.outcome()


def hedged(
    primary: Callable[[], T],
    alternate: Callable[[], T],
    *,
    after: float,
    seconds: float | None = None,
) -> T:
    """The first answer of ``primary`` and ``alternate``, the alternate started only if the
    primary has not answered within ``after`` seconds (or failed sooner). For idempotent reads
    only: both may run to the end. If both fail, the primary's error is raised.

    Raises:
        DeadlineExceeded: neither answered before ``seconds`` or the current deadline.
    """
    if after < 0:
        raise ConfigurationError("after must not be negative")
    limit = _limit(seconds)
    ends = None if limit is None else time.monotonic() + limit
    finished = threading.Condition()
    first = _Call(primary).start(finished)
    first.done.wait(after if ends is None else max(0.0, min(after, ends - time.monotonic())))
    if first.done.is_set() and first.error is None:
        return first.outcome()
    if ends is not None and time.monotonic() >= ends:
        raise DeadlineExceeded(f"{_name(primary)}: no answer within {limit:.3g}s")
    second = _Call(alternate).start(finished)
    with finished:
        while True:
            for call in (first, second):
                if call.done.is_set() and call.error is None:
                    return call.outcome()
            if first.done.is_set() and second.done.is_set():
                return first.outcome()  # both failed: the primary's error
            left = None if ends is None else ends - time.monotonic()
            if left is not None and left <= 0:
                raise DeadlineExceeded(
                    f"{_name(primary)} and its alternate: no answer within {limit:.3g}s"
                )
            finished.wait(left)


def _limit(seconds: float | None) -> float | None:
    if seconds is not None and not seconds > 0:
        raise ConfigurationError(f"seconds must be positive, not {seconds}")
    left = remaining()
    if seconds is None:
        return left
    return seconds if left is None else min(seconds, left)


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", None) or repr(func)
