"""Messages no worker here can run yet: how long to put them off before they are dead.

During a rolling deploy a new task (or a new signature of a task) reaches workers that do not
have it yet; with two apps on one broker by mistake, one app's workers see the other's tasks.
Celery discards such a message with an error. Here it is put off with a growing, jittered delay
(1 s doubling to 10 s) and comes back as it was sent, until a worker that can run it takes it;
only when ``window_seconds`` have passed since a worker first put it off is it dead-lettered
(and replayable).
"""

from __future__ import annotations

import random
from typing import Any

from .. import headers
from ..untrusted import float_or_none
from .backoff import backoff_seconds


def unrunnable_delay(
    message_headers: dict[str, Any], *, window_seconds: float, now: float
) -> tuple[float, dict[str, Any]] | None:
    """(delay, the headers the message comes back with), or None once its window is over."""
    since = float_or_none(message_headers.get(headers.UNRUNNABLE_SINCE))
    since = now if since is None or since > now else since
    if now - since >= window_seconds:
        return None
    count = float_or_none(message_headers.get(headers.UNRUNNABLE_DEFERRALS)) or 0
    count = int(min(max(count, 0), 1000))
    delay = backoff_seconds(count, base_seconds=1.0, cap_seconds=10.0, jitter="none")
    held = {
        **message_headers,
        headers.UNRUNNABLE_SINCE: since,
        headers.UNRUNNABLE_DEFERRALS: count + 1,
    }
    return delay * random.uniform(0.8, 1.2), held
