"""The bulk throttle: whether background work should hold back while the foreground suffers.

Two signals: the foreground p95 latency the apps report (:mod:`celery_ledger.pressure`) and the
critical tier's backlog. Engage above either threshold; release once both are back under
``resume_ratio`` of their marks (hysteresis, so the throttle does not flap). The worker applies
the decision to its own consumption (:class:`ThrottleSwitch`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError
from ..locks import ForkSafeLock
from ..pressure import Pressure
from .backpressure import QueueDepths

logger = logging.getLogger("celery_ledger.worker")


@dataclass(frozen=True)
class ThrottleRule:
    """Engage above either threshold; release once both are at or below ``resume_ratio`` of it.

    ``None`` disables a signal.
    """

    latency_threshold_ms: float | None = 500.0
    critical_backlog: int | None = 100
    resume_ratio: float = 0.7

    def __post_init__(self) -> None:
        if not 0 < self.resume_ratio <= 1:
            raise ConfigurationError("resume_ratio must be in (0, 1]")
        if (self.latency_threshold_ms or 0) < 0 or (self.critical_backlog or 0) < 0:
            raise ConfigurationError("thresholds must not be negative")


class Throttle:
    """Whether background work should hold back; re-evaluated at most every ``interval_seconds``."""

    def __init__(
        self,
        pressure: Pressure,
        depths: QueueDepths,
        rule: ThrottleRule,
        *,
        critical_queue: str = "critical",
        interval_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rule.critical_backlog is not None and critical_queue not in depths.queues:
            raise ConfigurationError(f"queue {critical_queue!r} is not sampled by the depths")
        self.pressure = pressure
        self.depths = depths
        self.rule = rule
        self.critical_queue = critical_queue
        self._interval = interval_seconds
        self._clock = clock
        self._lock = ForkSafeLock()
        self._checked_at: float | None = None
        self._engaged = False
        self._reason: str | None = None

    def should_throttle(self) -> bool:
        """True while the foreground is under pressure (see :class:`ThrottleRule`)."""
        with self._lock:
            if self._checked_at is None or self._clock() - self._checked_at >= self._interval:
                self._engaged, self._reason = self._evaluate()
                self._checked_at = self._clock()
            return self._engaged

    def reason(self) -> str | None:
        """Why the last :meth:`should_throttle` said to throttle (None if it did not)."""
        return self._reason

    def _evaluate(self) -> tuple[bool, str | None]:
        rule = self.rule
        p95 = self.pressure.p95_ms() if rule.latency_threshold_ms is not None else None
        backlog = None
        if rule.critical_backlog is not None:
            backlog = self.depths.depth(self.critical_queue)
        over: list[str] = []  # above the threshold: engages
        held: list[str] = []  # above the resume level only: keeps an engaged throttle engaged
        ratio, limit = rule.resume_ratio, rule.latency_threshold_ms
        if limit is not None and p95 is not None:
            if p95 > limit:
                over.append(f"foreground p95 {_num(p95)}ms > {_num(limit)}ms")
            elif p95 > limit * ratio:
                held.append(f"foreground p95 {_num(p95)}ms > resume {_num(limit * ratio)}ms")
        cap = rule.critical_backlog
        if cap is not None and backlog is not None:
            if backlog > cap:
                over.append(f"critical backlog {backlog} > {cap}")
            elif backlog > cap * ratio:
                held.append(f"critical backlog {backlog} > resume {_num(cap * ratio)}")
        engaged = bool(over) or (self._engaged and bool(held))
        return engaged, "; ".join(over + held) if engaged else None


def _num(value: float) -> str:
    return f"{round(value, 1):g}"


class ThrottleSwitch:
    """Pauses this worker's bulk consumption while the throttle says the foreground suffers.

    It asks the worker itself, through Celery's remote control (``cancel_consumer`` /
    ``add_consumer``), so the change runs in the worker's event loop: messages not yet taken
    stay in the queue, messages already reserved still run; nothing is lost or run twice.
    """

    def __init__(self, app: Any, hostname: str, queue: str) -> None:
        self._app = app
        self._hostname = hostname
        self._queue = queue
        self.engaged = False

    def tick(self) -> None:
        throttle = self._app.runtime.throttle
        should = throttle.should_throttle()
        if should == self.engaged:
            return
        control, reason = self._app.control, throttle.reason()
        to_this = {"destination": [self._hostname], "reply": True, "timeout": 2.0}
        if should:
            control.cancel_consumer(self._queue, **to_this)
            logger.warning("throttling %s on %s: %s", self._queue, self._hostname, reason)
        else:
            control.add_consumer(self._queue, **to_this)
            logger.warning("resuming %s on %s", self._queue, self._hostname)
        self.engaged = should
        self._app.runtime.observers.throttle(self._queue, should, reason)
