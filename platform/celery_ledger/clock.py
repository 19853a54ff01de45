"""Server time: the clock every decision shared between processes is made on.

A lease written by one worker and judged by another, a due time set by a producer and handed
out by a worker, an age stamped at publish and checked at run: each compares times written by
different processes. A host's wall clock drifts, is stepped by NTP, or stops while a VM is
suspended, so none of these may be judged on the clock of whichever process looks. Each is
judged on the clock of the server that stores the times: the ledger's (MongoDB's ``hello``
``localTime``) for everything kept on records, the broker's (Redis's ``TIME``) for everything
kept in Redis or stamped on messages.

Reading the server for every decision would add a round trip to every task. A
:class:`ServerClock` reads its server once, anchors the answer on this host's boot-time clock
(monotonic, and counting the time the host was suspended, unlike ``time.monotonic``), and
follows it from there: the time it gives is the server's, within the reading's error (half the
round trip, plus the server's resolution), plus that clock's drift since (parts per million).
It reads the server again every ``resync_seconds``, and at once if that clock ran backwards (a
kernel's never does; a process whose every clock is faked, as libfaketime can, does), so a
clock that jumps misleads it for at most ``resync_seconds``; the wall clock of this host is
never used for a decision, only to report how far it is from the server's
(:attr:`Reading.offset_seconds`: ``celery_ledger_clock_offset_seconds``, the ``clock`` check of
``ledger health``).

When the server cannot be read the clock keeps following its last reading (the boot-time clock
does not need the server) and tries again after a pause at least as long as the failed read
took, so an outage costs a caller a timed-out read once per pause, not once per call; before
any reading it answers with the wall clock, and says so in a warning: the decision it serves
needs that server anyway, so it fails on its own.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from pymongo.errors import PyMongoError

from .errors import brief
from .locks import ForkSafeLock

logger = logging.getLogger(__name__)

# Between readings: short enough that a clock that jumps (in a test harness: a real monotonic
# clock never does) misleads a process for seconds, long enough to cost nothing (one command
# per process every few seconds, outside every task's round trips).
RESYNC_SECONDS = 5.0
# After a failed reading, the next attempt waits this long (not once per call while the
# server is away).
RETRY_SECONDS = 1.0
# Past this offset between the host's clock and a server's, the process logs a warning (at
# most once per WARN_EVERY_SECONDS per clock): the host needs NTP, though no decision uses it.
WARN_OFFSET_SECONDS = 1.0
WARN_EVERY_SECONDS = 600.0
# What a failed reading raises (a server away, an answer without a time). Nothing wider: a
# soft time limit raised into a read must reach the task it limits.
READ_ERRORS: tuple[type[BaseException], ...] = (
    PyMongoError,
    redis.RedisError,
    OSError,
    LookupError,
    TypeError,
    ValueError,
)


def _host_clock() -> float:
    """Monotonic seconds that also count a suspended host's sleep (Linux's CLOCK_BOOTTIME)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


BOOT_CLOCK: Callable[[], float] = _host_clock if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic


@dataclass(frozen=True)
class Reading:
    """One reading of a server's clock.

    ``offset_seconds`` is the server's clock minus this host's wall clock (positive: the host
    is behind); ``error_seconds`` bounds how far the server time this reading gives can be
    from the server's own (half the round trip, plus the server's resolution).
    """

    server: str
    server_time: float  # unix seconds, at the middle of the round trip
    at_monotonic: float  # this host's monotonic clock at that moment
    offset_seconds: float
    error_seconds: float


class ServerClock:
    """The time on one server, as this process knows it (see the module docstring).

    ``read`` returns the server's time in unix seconds (one round trip); it is called in the
    thread that needs the time, at most once per ``resync_seconds`` (a caller that finds
    another thread reading uses the reading it has). Safe to share across threads and across a
    fork (the monotonic clock is the host's, so a child keeps its parent's reading).
    """

    def __init__(
        self,
        server: str,
        read: Callable[[], float],
        *,
        resolution_seconds: float = 0.0,
        resync_seconds: float = RESYNC_SECONDS,
        retry_seconds: float = RETRY_SECONDS,
        warn_offset_seconds: float = WARN_OFFSET_SECONDS,
        on_reading: Callable[[Reading], None] | None = None,
        monotonic: Callable[[], float] = BOOT_CLOCK,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.server = server
        self._read = read
        self._resolution = resolution_seconds
        self._resync = resync_seconds
        self._retry = retry_seconds
        self.warn_offset_seconds = warn_offset_seconds
        # Told of every reading (the app's observers: the offset metric); set by the runtime
        self.on_reading = on_reading
        self._monotonic = monotonic
        self._wall = wall
        self._reading: Reading | None = None
        self._failed_at: float | None = None  # monotonic time of the last failed read
        self._pause = retry_seconds  # after a failed read: at least as long as it took
        self._reading_lock = ForkSafeLock()  # one reader at a time
        self._warned_unread = False
        self._warned_at: float | None = None

    @property
    def reading(self) -> Reading | None:
        """The last reading (None before the first succeeds)."""
        return self._reading

    def now(self) -> float:
        """The server's time now, in unix seconds."""
        reading = self._current()
        if reading is None:
            return self._wall()
        return reading.server_time + (self._monotonic() - reading.at_monotonic)

    def now_datetime(self) -> datetime:
        """:meth:`now` as an aware UTC datetime (microseconds, as BSON keeps milliseconds)."""
        return datetime.fromtimestamp(self.now(), UTC)

    def sync(self) -> Reading:
        """Read the server's clock now (raises what ``read`` raises)."""
        before = self._monotonic()
        server_time = self._read()
        after = self._monotonic()
        middle = (before + after) / 2
        # The wall clock at the same moment, for the offset only (never for a decision)
        wall = self._wall() - (after - middle)
        reading = Reading(
            server=self.server,
            server_time=server_time,
            at_monotonic=middle,
            offset_seconds=server_time - wall,
            error_seconds=(after - before) / 2 + self._resolution,
        )
        self._reading, self._failed_at = reading, None
        if self._monotonic is BOOT_CLOCK:  # (a test's own clock is not the process's)
            _LAST[self.server] = reading
        if abs(reading.offset_seconds) > self.warn_offset_seconds and (
            self._warned_at is None or not 0 <= middle - self._warned_at < WARN_EVERY_SECONDS
        ):
            self._warned_at = middle
            logger.warning(
                "this host's clock is %+.3fs from the %s server's (±%.3fs): decisions use the"
                " server's clock, but the host needs time sync (NTP)",
                -reading.offset_seconds,
                self.server,
                reading.error_seconds,
            )
        if self.on_reading is not None:
            try:
                self.on_reading(reading)
            except Exception:  # reporting a reading never fails the decision that asked
                logger.exception("reporting the %s clock's reading failed", self.server)
        return reading

    def _paused(self, now: float) -> bool:
        failed = self._failed_at
        return failed is not None and 0 <= now - failed < self._pause

    def _current(self) -> Reading | None:
        reading = self._reading
        now = self._monotonic()
        if reading is not None:
            since = now - reading.at_monotonic
            if 0 <= since < self._resync:
                return reading
        if self._paused(now):
            return reading  # the server was away a moment ago: not again on every call
        # Another thread reading: use what there is (before the first reading, wait for it)
        if not self._reading_lock.acquire(blocking=reading is None):
            return reading
        try:
            if self._reading is not reading and self._reading is not None:
                return self._reading  # read by another thread while this one waited
            if self._paused(self._monotonic()):
                return reading  # another thread's read failed while this one waited
            started = self._monotonic()
            try:
                return self.sync()
            except READ_ERRORS as exc:
                self._failed_at = self._monotonic()
                self._pause = max(self._retry, self._failed_at - started)
                if reading is None and not self._warned_unread:
                    self._warned_unread = True
                    logger.warning(
                        "cannot read the %s server's clock (%s): using this host's until it can",
                        self.server,
                        brief(exc),
                    )
                return reading
        finally:
            self._reading_lock.release()


# The last reading of each kind of server in this process (for what is stamped where no app is
# at hand: Celery's publish signal); read without any I/O.
_LAST: dict[str, Reading] = {}


def last_known_time(server: str) -> float:
    """The time on ``server`` (``"broker"``, ``"ledger"``) as this process's last reading of
    such a server has it, followed on the boot-time clock; this host's wall clock if it has
    read none. Never reads the server (see :meth:`ServerClock.now` for that)."""
    reading = _LAST.get(server)
    if reading is None:
        return time.time()
    return reading.server_time + (BOOT_CLOCK() - reading.at_monotonic)


def mongo_time(client: object) -> float:
    """The MongoDB server's time (``hello``'s ``localTime``), in unix seconds."""
    reply = client.admin.command("hello")  # type: ignore[attr-defined]
    local = reply["localTime"]
    if not isinstance(local, datetime):
        raise TypeError(f"hello.localTime is not a date: {local!r}")
    if local.tzinfo is None:  # pymongo decodes BSON dates naive (UTC) unless tz_aware
        local = local.replace(tzinfo=UTC)
    return local.timestamp()


def redis_time(client: object) -> float:
    """The Redis server's time (``TIME``), in unix seconds."""
    seconds, micros = client.time()  # type: ignore[attr-defined]
    return float(seconds) + float(micros) / 1e6


# How often a worker writes its offsets to the fleet's book, and how long a host that stopped
# writing stays in it (a stopped worker's last reading is not the fleet's any more).
REPORT_EVERY_SECONDS = 30.0
REPORT_KEPT_SECONDS = 300.0


@dataclass(frozen=True)
class HostClocks:
    """A host's last offsets (server -> (offset, error) in seconds), as it reported them."""

    host: str
    at: float  # the broker's time of the report
    offsets: dict[str, tuple[float, float]]

    def worst(self) -> float:
        """The largest offset this host is known to have, beyond the readings' error."""
        return max(
            (max(abs(offset) - error, 0.0) for offset, error in self.offsets.values()),
            default=0.0,
        )


class ClockBook:
    """Each host's offsets from the servers' clocks, where every process of the app can read
    them (one Redis hash, host -> JSON): workers write theirs every ``REPORT_EVERY_SECONDS``;
    ``ledger health`` and the console read the fleet's."""

    def __init__(self, client: object, *, namespace: str) -> None:
        self._client = client
        self.key = f"{namespace}:ledger:clocks" if namespace else "ledger:clocks"

    def report(self, host: str, clocks: tuple[ServerClock, ...], *, now: float) -> None:
        offsets = {
            clock.server: (clock.reading.offset_seconds, clock.reading.error_seconds)
            for clock in clocks
            if clock.reading is not None
        }
        entry = json.dumps({"at": now, "offsets": offsets})
        self._client.hset(self.key, host, entry)  # type: ignore[attr-defined]

    def hosts(self, *, now: float) -> list[HostClocks]:
        """The hosts that reported within ``REPORT_KEPT_SECONDS`` (older reports are removed)."""
        found: list[HostClocks] = []
        gone: list[Any] = []
        for host, raw in self._client.hgetall(self.key).items():  # type: ignore[attr-defined]
            name = host.decode() if isinstance(host, bytes) else str(host)
            try:
                entry = json.loads(raw)
                at = float(entry["at"])
                offsets = {
                    str(server): (float(pair[0]), float(pair[1]))
                    for server, pair in dict(entry["offsets"]).items()
                }
            except (ValueError, KeyError, TypeError, IndexError):
                gone.append(host)  # not an entry this platform wrote
                continue
            if now - at > REPORT_KEPT_SECONDS:
                gone.append(host)
                continue
            found.append(HostClocks(name, at, offsets))
        if gone:
            self._client.hdel(self.key, *gone)  # type: ignore[attr-defined]
        return sorted(found, key=lambda h: h.worst(), reverse=True)


class ClockReports:
    """Reports a process's offsets to the fleet's book when it has no worker housekeeping to do
    it (a producer, the console): on its clocks' own readings, at most once per
    ``REPORT_EVERY_SECONDS``, so it costs no thread and no read of a server beyond those its
    decisions make; a process whose clocks are never read has nothing to report.

    A worker turns it off (``enabled``): its housekeeping reports for its host, pool processes
    included. A failed write is dropped (the next reading tries again): reporting never fails
    the publish whose reading it rides on."""

    def __init__(
        self,
        book: Callable[[], ClockBook],
        clocks: Callable[[], tuple[ServerClock, ...]],
        *,
        role: str = "client",
        monotonic: Callable[[], float] = BOOT_CLOCK,
    ) -> None:
        self._book = book
        self._clocks = clocks
        self.role = role
        self.enabled = True
        self._monotonic = monotonic
        self._last: float | None = None

    @property
    def host(self) -> str:
        """This process's entry in the book (a pid, as a host may run several)."""
        return f"{self.role} {socket.gethostname()} pid {os.getpid()}"

    def reading_taken(self, reading: Reading) -> None:
        if not self.enabled:
            return
        now = self._monotonic()
        if self._last is not None and 0 <= now - self._last < REPORT_EVERY_SECONDS:
            return
        self._last = now
        try:
            self._book().report(self.host, self._clocks(), now=last_known_time("broker"))
        except READ_ERRORS as exc:
            logger.debug("could not report this process's clock offsets: %s", exc)
