"""Loaded (as ``sitecustomize``) only into the processes the clock-skew tests run under
libfaketime, to make a host whose wall clock is off and whose monotonic clock is right, as a
kernel's is: ``FAKETIME_DONT_FAKE_MONOTONIC=1``.

In that mode libfaketime still rewrites the absolute monotonic deadline Python's ``time.sleep``
passes to ``clock_nanosleep``, and the call fails (EINVAL); in the other mode (every clock
faked) a thread's timed wait (``threading.Event.wait``, a lock with a timeout) never returns, so
heartbeats and housekeeping stop. Sleeping as a timed wait on an event that is never set goes
through neither: it waits the time asked, on the real monotonic clock.
"""

import threading
import time


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    threading.Event().wait(seconds)


time.sleep = _sleep
