"""What a ``BaseException`` from an app's code means, and its text read safely.

A task's body and a workflow's code may raise anything. Most of it is the code's own end (a
failure to record), but the worker's own stop raises into running code too, and that must never
be recorded as the code's failure: the work goes back with its message, as a killed process's.
And an exception's text is written wherever a failure is recorded, so a ``__str__`` that raises
must not take the recording with it.
"""

from __future__ import annotations

import sys
import threading


def worker_stopping(exc: BaseException) -> bool:
    """Whether ``exc`` is the worker (or its pool) ending the code rather than the code's own.
    Each says so its own way: billiard's terminate handler raised it in a prefork pool process
    (a cold stop terminates them); a green pool ended the greenlet (``GreenletExit``) or its
    hard time limit did (gevent's and eventlet's ``Timeout``, which the worker then reports as
    the time limit); or Celery's cold stop raised it in the main thread, where a solo pool runs
    the code (its handler sets ``should_terminate`` first; a warm stop raises nothing)."""
    for module, name in (
        ("greenlet", "GreenletExit"),
        ("gevent", "Timeout"),
        ("eventlet", "Timeout"),
    ):
        kind = getattr(sys.modules.get(module), name, None)
        if isinstance(kind, type) and isinstance(exc, kind):
            return True
    billiard = sys.modules.get("billiard.common")
    fired = getattr(billiard, "terminate_handler_fired", None)
    if callable(fired) and fired():
        return True
    state = sys.modules.get("celery.worker.state")
    terminating = getattr(state, "should_terminate", None)
    return (
        terminating is not None
        and terminating is not False
        and threading.current_thread() is threading.main_thread()
    )


def text_of(exc: object) -> str | None:
    """``str(exc)``, or None when its ``__str__`` or ``__repr__`` raises."""
    try:
        repr(exc)
        return str(exc)
    except Exception:
        return None


def readable(value: object) -> str:
    """``str(value)``, or ``Type (its text could not be read)``: a task's own reason object
    (a ``Reject``'s, say) must not turn the ending it asked for into a crash of the guard."""
    text = text_of(value)
    return text if text is not None else f"{type(value).__name__} (its text could not be read)"


def described(exc: BaseException) -> str:
    """``Type: text``, or ``Type (its text could not be read)``."""
    text = text_of(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text is not None else f"{name} (its text could not be read)"
