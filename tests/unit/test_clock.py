"""Server time (celery_ledger.clock): decisions follow the server's clock, never the host's."""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import pytest

from celery_ledger.clock import REPORT_EVERY_SECONDS, ClockReports, HostClocks, ServerClock
from celery_ledger.health import clock_status


class Host:
    """A host's clocks: ``wall`` may be set anywhere (skewed, stepped); ``mono`` only moves on
    unless a test fakes every clock (as libfaketime does)."""

    def __init__(self, wall: float = 1_000.0, mono: float = 50.0) -> None:
        self.wall = wall
        self.mono = mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


class Server:
    """A server whose clock reads ``time``; each read takes ``round_trip`` seconds of the host's."""

    def __init__(self, host: Host, time: float, round_trip: float = 0.002) -> None:
        self.host = host
        self.time = time
        self.round_trip = round_trip
        self.reads = 0
        self.down = False

    def read(self) -> float:
        if self.down:
            raise ConnectionError("server away")
        self.reads += 1
        self.host.advance(self.round_trip / 2)
        self.time += self.round_trip / 2
        answer = self.time
        self.host.advance(self.round_trip / 2)
        self.time += self.round_trip / 2
        return answer

    def advance(self, seconds: float) -> None:
        self.time += seconds


def clock_of(host: Host, server: Server, **options: float) -> ServerClock:
    return ServerClock(
        "ledger", server.read, monotonic=lambda: host.mono, wall=lambda: host.wall, **options
    )


def test_the_time_is_the_servers_whatever_the_hosts_wall_clock_says() -> None:
    host = Host(wall=1_000.0)
    server = Server(host, time=1_300.0)  # the host is 5 minutes behind
    clock = clock_of(host, server)
    assert clock.now() == pytest.approx(1_300.002, abs=0.002)
    # The host's wall clock is stepped by an hour (NTP, a resumed VM): nothing changes
    host.wall += 3_600
    host.advance(1.0)
    server.advance(1.0)
    assert clock.now() == pytest.approx(server.time, abs=0.002)
    assert server.reads == 1  # followed on the monotonic clock, not read again


def test_the_reading_reports_the_hosts_offset_within_half_the_round_trip() -> None:
    host = Host(wall=1_000.0)
    server = Server(host, time=1_300.0, round_trip=0.2)
    reading = clock_of(host, server).sync()
    assert reading.offset_seconds == pytest.approx(300.0, abs=1e-9)
    assert reading.error_seconds == pytest.approx(0.1)


def test_it_reads_the_server_again_every_resync_period() -> None:
    host = Host()
    server = Server(host, time=5_000.0)
    clock = clock_of(host, server, resync_seconds=5.0)
    clock.now()
    host.advance(4.0)
    server.advance(4.0)
    clock.now()
    assert server.reads == 1
    host.advance(1.5)
    server.advance(1.5)
    clock.now()
    assert server.reads == 2


@pytest.mark.parametrize("jump", [-600.0, -1.0, 30.0, 3_600.0])
def test_a_jump_of_every_local_clock_misleads_it_for_no_longer_than_a_resync(jump: float) -> None:
    # Given a reading, and then a process whose every clock jumps (libfaketime fakes the
    # monotonic clock too; a kernel never steps it)
    host = Host()
    server = Server(host, time=9_000.0)
    clock = clock_of(host, server, resync_seconds=5.0)
    clock.now()
    host.wall += jump
    host.mono += jump
    # Then a jump back, or forward by more than the resync period, is read again at once;
    # a smaller forward jump is believed for less than the period
    seen = clock.now()
    if jump < 0 or jump >= 5.0:
        assert seen == pytest.approx(server.time, abs=0.01)
    else:
        assert abs(seen - server.time) <= 5.0


def test_before_its_first_reading_it_answers_with_the_hosts_clock_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = Host(wall=1_000.0)
    server = Server(host, time=1_300.0)
    server.down = True
    clock = clock_of(host, server, retry_seconds=1.0)
    with caplog.at_level(logging.WARNING, "celery_ledger.clock"):
        assert clock.now() == 1_000.0
        assert clock.now() == 1_000.0  # not read again at once
    assert "cannot read the ledger server's clock" in caplog.text
    server.down = False
    host.advance(1.0)
    assert clock.now() == pytest.approx(server.time, abs=0.01)


def test_a_server_that_goes_away_leaves_it_following_its_last_reading() -> None:
    host = Host()
    server = Server(host, time=2_000.0)
    clock = clock_of(host, server, resync_seconds=5.0)
    clock.now()
    server.down = True
    host.advance(60.0)
    server.advance(60.0)
    assert clock.now() == pytest.approx(server.time, abs=0.01)


def test_a_host_far_from_the_server_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    host = Host(wall=1_000.0)
    with caplog.at_level(logging.WARNING, "celery_ledger.clock"):
        clock_of(host, Server(host, time=1_000.5), warn_offset_seconds=1.0).sync()
        assert not caplog.records
        clock_of(host, Server(host, time=1_300.0), warn_offset_seconds=1.0).sync()
    assert re.search(r"this host's clock is -(299\.99\d|300\.00\d)s", caplog.text)
    assert "NTP" in caplog.text


def test_every_reading_is_told_to_the_observer() -> None:
    host = Host()
    seen = []
    clock = clock_of(host, Server(host, time=1_010.0))
    clock.on_reading = seen.append
    clock.sync()
    assert [r.server for r in seen] == ["ledger"]
    assert seen[0].offset_seconds == pytest.approx(10.0)


def hosts(**offsets: float) -> list[HostClocks]:
    return [HostClocks(name, 0.0, {"ledger": (offset, 0.01)}) for name, offset in offsets.items()]


@pytest.mark.parametrize(
    ("offsets", "status"),
    [
        ({}, "ok"),
        ({"a": 0.2, "b": -0.5}, "ok"),
        ({"a": 0.2, "b": -3.0}, "warn"),
        ({"a": 90.0, "b": 0.0}, "down"),
        ({"a": -90.0}, "down"),
    ],
)
def test_the_health_check_is_decided_by_the_host_furthest_from_a_server(
    offsets: dict[str, float], status: str
) -> None:
    found, detail, data = clock_status(hosts(**offsets), warn_seconds=1.0, down_seconds=60.0)
    assert found == status
    if offsets:
        furthest = max(offsets, key=lambda name: abs(offsets[name]))
        assert furthest in detail
        assert set(data["hosts"]) == set(offsets)
    if status != "ok":
        assert "NTP" in detail


def test_a_readings_error_is_not_counted_against_the_host() -> None:
    within_error = [HostClocks("a", 0.0, {"broker": (1.05, 0.1)})]
    assert clock_status(within_error, warn_seconds=1.0, down_seconds=60.0)[0] == "ok"


def test_many_threads_asking_at_once_cost_one_read_per_resync() -> None:
    # The happy path's round trips: a clock read is never per task, however many ask
    host = Host()
    server = Server(host, time=1_000.0)
    clock = clock_of(host, server, resync_seconds=5.0)
    threads = [threading.Thread(target=lambda: [clock.now() for _ in range(200)]) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert server.reads == 1


def test_a_server_away_costs_one_timed_out_read_per_pause_not_one_per_call() -> None:
    host = Host()
    server = Server(host, time=1_000.0)
    clock = clock_of(host, server, resync_seconds=5.0, retry_seconds=1.0)
    clock.now()
    attempts = []

    def slow_failure() -> float:
        attempts.append(host.mono)
        host.advance(5.0)  # a read that waits out its 5 s timeout
        raise ConnectionError("server away")

    clock._read = slow_failure  # (the server goes away)
    host.advance(6.0)
    for _ in range(20):
        clock.now()
        host.advance(0.5)
    # one read failed after 5 s: the next is tried no sooner than 5 s after it
    assert len(attempts) == 2
    assert attempts[1] - attempts[0] >= 10.0


def test_a_soft_time_limit_raised_into_a_read_is_not_swallowed() -> None:
    from celery.exceptions import SoftTimeLimitExceeded

    host = Host()

    def limited() -> float:
        raise SoftTimeLimitExceeded()

    clock = ServerClock("ledger", limited, monotonic=lambda: host.mono, wall=lambda: host.wall)
    with pytest.raises(SoftTimeLimitExceeded):
        clock.now()


class Book:
    """The fleet's book, in memory: what each process reported last."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, tuple[float, float]]] = {}
        self.down = False

    def report(self, host: str, clocks: tuple[ServerClock, ...], *, now: float) -> None:
        if self.down:
            raise ConnectionError("broker away")
        self.entries[host] = {
            c.server: (c.reading.offset_seconds, c.reading.error_seconds)
            for c in clocks
            if c.reading is not None
        }


def reporting_process(role: str = "client") -> tuple[Host, Server, ServerClock, Book, Any]:
    host, book = Host(wall=1_000.0), Book()
    server = Server(host, time=1_300.0)  # the host is 5 minutes slow
    clock = clock_of(host, server)
    reports = ClockReports(lambda: book, lambda: (clock,), role=role, monotonic=lambda: host.mono)
    clock.on_reading = reports.reading_taken
    return host, server, clock, book, reports


def test_a_producer_reports_its_offset_to_the_fleet_on_its_own_readings() -> None:
    _host, _server, clock, book, reports = reporting_process()
    clock.now()
    assert list(book.entries) == [reports.host]
    assert reports.host.startswith("client ")
    offset, error = book.entries[reports.host]["ledger"]
    assert offset == pytest.approx(300.0, abs=error)


def test_it_reports_at_most_once_per_period_whatever_the_readings() -> None:
    host, server, clock, book, reports = reporting_process()
    clock.now()
    server.advance(100.0)  # the host's clock falls further behind: not written at once
    for _ in range(5):
        host.advance(REPORT_EVERY_SECONDS / 6)
        server.advance(REPORT_EVERY_SECONDS / 6)
        clock.now()
    assert book.entries[reports.host]["ledger"][0] == pytest.approx(300.0, abs=0.01)
    host.advance(REPORT_EVERY_SECONDS)
    server.advance(REPORT_EVERY_SECONDS)
    clock.now()
    assert book.entries[reports.host]["ledger"][0] == pytest.approx(400.0, abs=0.01)


def test_a_worker_turns_it_off_and_a_broker_away_fails_nothing() -> None:
    _host, _server, clock, book, reports = reporting_process()
    reports.enabled = False
    clock.sync()
    assert book.entries == {}
    reports.enabled, book.down = True, True
    assert clock.sync().offset_seconds == pytest.approx(300.0, abs=0.01)  # the reading stands
    assert book.entries == {}
