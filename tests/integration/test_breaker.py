"""Circuit breakers against a real valkey-server, across threads and OS processes."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from dataclasses import asdict
from typing import Any

import pytest
import redis

from celery_ledger.embedded.servers import ServerProcess
from celery_ledger.errors import CircuitOpen, ConfigurationError
from celery_ledger.policies.breaker import (
    Admission,
    BreakerConfig,
    Breakers,
    BreakerState,
    CircuitBreaker,
)

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
COOLDOWN = 0.5


@pytest.fixture
def prefix() -> str:
    """A key prefix of the test's own, so tests never see each other's breakers."""
    return f"test:{uuid.uuid4().hex[:12]}"


class Recorder:
    """An ``on_transition`` that remembers what it was told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, BreakerState, BreakerState]] = []
        self._lock = threading.Lock()

    def __call__(self, name: str, old: BreakerState, new: BreakerState) -> None:
        with self._lock:
            self.calls.append((name, old, new))

    def moves(self) -> list[tuple[BreakerState, BreakerState]]:
        return [(old, new) for _, old, new in self.calls]


def make(
    client: redis.Redis, prefix: str, recorder: Recorder | None = None, **config: Any
) -> CircuitBreaker:
    config.setdefault("cooldown_seconds", COOLDOWN)
    return CircuitBreaker(
        "payments", client, BreakerConfig(**config), key_prefix=prefix, on_transition=recorder
    )


def trip(breaker: CircuitBreaker) -> None:
    for _ in range(breaker.config.failure_threshold):
        breaker.record_failure()
    assert breaker.status().state is OPEN


def wait_cooldown(breaker: CircuitBreaker) -> None:
    time.sleep(breaker.config.cooldown_seconds + 0.05)


# --- thresholds -----------------------------------------------------------------------------


def test_consecutive_failures_open_the_breaker(client: redis.Redis, prefix: str) -> None:
    recorder = Recorder()
    breaker = make(client, prefix, recorder, failure_threshold=3)
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.record_success() is CLOSED  # a success restarts the count
    assert breaker.record_failure() is CLOSED
    assert breaker.record_failure() is CLOSED
    assert breaker.status().consecutive_failures == 2
    assert breaker.record_failure() is OPEN
    status = breaker.status()
    assert (status.consecutive_failures, status.calls_in_window) == (3, 6)
    assert status.failures_in_window == 5
    assert recorder.calls == [("payments", CLOSED, OPEN)]


def test_failure_ratio_opens_only_with_min_calls(client: redis.Redis, prefix: str) -> None:
    breaker = make(
        client, prefix, failure_threshold=100, failure_ratio=0.5, min_calls=6, window_seconds=10
    )
    for _ in range(4):
        assert breaker.record_failure() is CLOSED  # 100% failures, but fewer than 6 calls
    assert breaker.record_success() is CLOSED
    assert breaker.record_failure() is OPEN  # 5 of 6


def test_failure_ratio_below_the_threshold_stays_closed(client: redis.Redis, prefix: str) -> None:
    breaker = make(client, prefix, failure_threshold=100, failure_ratio=0.6, min_calls=4)
    for _ in range(4):
        breaker.record_success()
    for _ in range(5):
        assert breaker.record_failure() is CLOSED  # at most 5 of 9
    assert breaker.record_failure() is OPEN  # 6 of 10


def test_calls_slide_out_of_the_window(client: redis.Redis, prefix: str) -> None:
    breaker = make(
        client, prefix, failure_threshold=100, failure_ratio=0.5, min_calls=4, window_seconds=0.6
    )
    for _ in range(3):
        breaker.record_failure()
    assert breaker.status().calls_in_window == 3
    time.sleep(0.7)
    assert breaker.status().calls_in_window == 0
    assert breaker.record_failure() is CLOSED  # only 1 call in the window now
    assert breaker.status().failures_in_window == 1


def test_config_is_validated() -> None:
    with pytest.raises(ConfigurationError):
        BreakerConfig(failure_threshold=0)
    with pytest.raises(ConfigurationError):
        BreakerConfig(failure_ratio=1.5)
    with pytest.raises(ConfigurationError):
        BreakerConfig(cooldown_seconds=0)


# --- open, half-open, probes ----------------------------------------------------------------


def test_open_refuses_until_cooldown(client: redis.Redis, prefix: str) -> None:
    breaker = make(client, prefix, failure_threshold=1)
    assert breaker.admit() == Admission(allowed=True)
    before = time.time()
    breaker.record_failure()
    status = breaker.status()
    assert status.opened_at is not None and status.retry_at is not None
    assert status.opened_at == pytest.approx(before, abs=0.5)
    assert status.retry_at == pytest.approx(status.opened_at + COOLDOWN)
    refused = breaker.admit()
    assert not refused.allowed and not refused.probe
    assert refused.retry_at == pytest.approx(status.retry_at)
    # Late outcomes of calls admitted before it opened change nothing.
    assert breaker.record_success() is OPEN
    assert breaker.record_failure() is OPEN
    assert breaker.status().opened_at == status.opened_at


def test_half_open_admits_exactly_the_probes(client: redis.Redis, prefix: str) -> None:
    recorder = Recorder()
    breaker = make(client, prefix, recorder, failure_threshold=1, half_open_probes=2)
    trip(breaker)
    wait_cooldown(breaker)
    first, second, third = breaker.admit(), breaker.admit(), breaker.admit()
    assert first == second == Admission(allowed=True, probe=True)
    assert not third.allowed and third.retry_at is not None
    assert third.retry_at == pytest.approx(time.time() + COOLDOWN, abs=0.3)  # first lease ends
    assert breaker.status().state is HALF_OPEN
    assert breaker.record_success() is HALF_OPEN  # not a probe: does not count
    assert breaker.record_success(probe=True) is HALF_OPEN
    assert breaker.admit().allowed is False  # one probe still out, one success still needed
    assert breaker.record_success(probe=True) is CLOSED
    status = breaker.status()
    assert (status.consecutive_failures, status.calls_in_window, status.opened_at) == (0, 0, None)
    assert breaker.admit() == Admission(allowed=True)
    assert recorder.moves() == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]


def test_a_probe_failure_opens_again(client: redis.Redis, prefix: str) -> None:
    recorder = Recorder()
    breaker = make(client, prefix, recorder, failure_threshold=1, half_open_probes=2)
    trip(breaker)
    first_opened = breaker.status().opened_at
    wait_cooldown(breaker)
    assert breaker.admit().probe
    assert breaker.admit().probe
    assert breaker.record_success(probe=True) is HALF_OPEN
    assert breaker.record_failure(probe=True) is OPEN
    status = breaker.status()
    assert status.opened_at is not None and first_opened is not None
    assert status.opened_at > first_opened
    assert not breaker.admit().allowed
    wait_cooldown(breaker)
    assert breaker.admit().probe  # a fresh half-open period: probe slots are free again
    assert recorder.moves() == [
        (CLOSED, OPEN),
        (OPEN, HALF_OPEN),
        (HALF_OPEN, OPEN),
        (OPEN, HALF_OPEN),
    ]


def test_a_lost_probe_frees_its_slot_after_the_lease(client: redis.Redis, prefix: str) -> None:
    breaker = make(client, prefix, failure_threshold=1)
    trip(breaker)
    wait_cooldown(breaker)
    assert breaker.admit().probe  # this probe never reports back
    assert not breaker.admit().allowed
    time.sleep(COOLDOWN + 0.05)
    assert breaker.admit().probe


def test_concurrent_admissions_get_exactly_n_probes(valkey: ServerProcess, prefix: str) -> None:
    recorder = Recorder()
    clients = [redis.Redis.from_url(valkey.url) for _ in range(12)]
    try:
        breakers = [
            make(c, prefix, recorder, failure_threshold=1, half_open_probes=3) for c in clients
        ]
        trip(breakers[0])
        wait_cooldown(breakers[0])
        barrier = threading.Barrier(len(breakers))
        results: list[Admission] = []

        def admit(breaker: CircuitBreaker) -> None:
            barrier.wait()
            results.append(breaker.admit())

        threads = [threading.Thread(target=admit, args=(b,)) for b in breakers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    finally:
        for c in clients:
            c.close()
    assert sum(a.probe for a in results) == sum(a.allowed for a in results) == 3
    assert recorder.moves() == [(CLOSED, OPEN), (OPEN, HALF_OPEN)]


# --- across OS processes --------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import redis
    from celery_ledger.policies.breaker import BreakerConfig, CircuitBreaker

    spec = json.loads(sys.argv[1])
    client = redis.Redis.from_url(spec["url"])
    moves = []
    breaker = CircuitBreaker(
        spec["name"], client, BreakerConfig(**spec["config"]), key_prefix=spec["prefix"],
        on_transition=lambda name, old, new: moves.append([old.value, new.value]),
    )
    results = []
    for op in spec["ops"]:
        if op.startswith("wait:"):  # announce readiness, then wait for the go signal
            client.incr(op[5:] + ":ready")
            while not client.exists(op[5:]):
                time.sleep(0.002)
        elif op == "admit":
            admission = breaker.admit()
            results.append([admission.allowed, admission.probe])
        else:
            results.append(getattr(breaker, op)().value)
    print(json.dumps({"results": results, "moves": moves}))
    client.close()
    """
)


def spawn(
    valkey: ServerProcess, prefix: str, config: dict[str, Any], ops: list[str]
) -> subprocess.Popen[str]:
    """A child process running ``ops`` on breaker "payments"; "wait:<key>" waits for ``go``."""
    spec = {"url": valkey.url, "prefix": prefix, "name": "payments", "config": config, "ops": ops}
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def outcome(child: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


def go(client: redis.Redis, key: str, children: int, *, after: float = 0.0) -> None:
    """Release the children at once, ``after`` seconds past all of them waiting on ``key``."""
    deadline = time.monotonic() + 60
    while int(client.get(f"{key}:ready") or 0) < children:
        assert time.monotonic() < deadline, "children did not get ready"
        time.sleep(0.01)
    time.sleep(after)
    client.set(key, 1)


def test_failures_in_one_process_open_the_breaker_for_another(
    valkey: ServerProcess, client: redis.Redis, prefix: str
) -> None:
    config: dict[str, Any] = {"failure_threshold": 3, "cooldown_seconds": 30.0}
    here = CircuitBreaker("payments", client, BreakerConfig(**config), key_prefix=prefix)
    assert here.admit().allowed
    before = time.time()
    child = outcome(spawn(valkey, prefix, config, ["record_failure"] * 3))
    assert child == {"results": ["closed", "closed", "open"], "moves": [["closed", "open"]]}
    refused = here.admit()
    assert not refused.allowed
    # Opened by the child, so no earlier than its spawn (a loaded machine took over 5 s from
    # there to here): the cooldown counts from the opening (1 s for the clocks' disagreement)
    assert refused.retry_at is not None
    assert before + 30 - 1 <= refused.retry_at <= time.time() + 30 + 1
    with pytest.raises(CircuitOpen):
        here.__enter__()
    # ...and the other way round: this process closes it, another process sees it closed.
    here.force(CLOSED)
    here.force(None)
    child = outcome(spawn(valkey, prefix, config, ["admit"]))
    assert child["results"] == [[True, False]]


def test_racing_processes_report_each_transition_once(
    valkey: ServerProcess, client: redis.Redis, prefix: str
) -> None:
    config = {"failure_threshold": 5, "cooldown_seconds": COOLDOWN, "half_open_probes": 2}
    first, second = f"{prefix}:go1", f"{prefix}:go2"
    ops = [f"wait:{first}", *["record_failure"] * 5, f"wait:{second}", "admit"]
    children = [spawn(valkey, prefix, config, ops) for _ in range(4)]
    go(client, first, len(children))  # all fail at once: one of them opens the breaker
    go(client, second, len(children), after=COOLDOWN + 0.05)  # all ask at once: 2 probes
    outcomes = [outcome(child) for child in children]
    moves = sorted(move for o in outcomes for move in o["moves"])
    assert moves == [["closed", "open"], ["open", "half_open"]]
    admissions = [o["results"][-1] for o in outcomes]
    assert sorted(admissions) == [[False, False], [False, False], [True, True], [True, True]]


# --- operator overrides ---------------------------------------------------------------------


def test_force_open_and_closed_until_cleared(client: redis.Redis, prefix: str) -> None:
    recorder = Recorder()
    breaker = make(client, prefix, recorder, failure_threshold=2)
    breaker.force(OPEN)
    status = breaker.status()
    assert (status.state, status.forced, status.retry_at) == (OPEN, True, None)
    assert breaker.admit() == Admission(allowed=False)
    time.sleep(COOLDOWN + 0.05)
    assert not breaker.admit().allowed  # a forced open breaker has no cooldown
    assert client.ttl(breaker.keys[0]) == -1  # a forced state never expires

    breaker.force(CLOSED)
    for _ in range(5):
        assert breaker.record_failure() is CLOSED
    assert breaker.admit().allowed
    status = breaker.status()
    assert (status.state, status.forced, status.consecutive_failures) == (CLOSED, True, 5)

    breaker.force(None)
    assert breaker.status().forced is False
    assert client.ttl(breaker.keys[0]) > 0
    assert breaker.record_failure() is OPEN  # thresholds apply again
    assert recorder.moves() == [(CLOSED, OPEN), (OPEN, CLOSED), (CLOSED, OPEN)]


def test_releasing_a_forced_open_breaker_admits_probes(client: redis.Redis, prefix: str) -> None:
    breaker = make(client, prefix, failure_threshold=1, cooldown_seconds=30.0)
    breaker.force(OPEN)
    breaker.force(None)
    assert breaker.status().state is HALF_OPEN
    assert breaker.admit().probe
    assert not breaker.admit().allowed
    with pytest.raises(ValueError):
        breaker.force(HALF_OPEN)


def test_reset_forgets_everything(client: redis.Redis, prefix: str) -> None:
    recorder = Recorder()
    breaker = make(client, prefix, recorder, failure_threshold=1)
    breaker.force(OPEN)
    breaker.reset()
    status = breaker.status()
    assert (status.state, status.forced, status.calls_in_window) == (CLOSED, False, 0)
    assert client.exists(*breaker.keys) == 0
    assert recorder.moves() == [(CLOSED, OPEN), (OPEN, CLOSED)]


def test_idle_keys_expire(client: redis.Redis, prefix: str) -> None:
    breaker = make(client, prefix, failure_ratio=0.5)
    breaker.record_failure()
    ttl = breaker.config.idle_ttl_seconds
    assert 0 < client.pttl(breaker.keys[0]) <= ttl * 1000
    assert 0 < client.pttl(breaker.keys[1]) <= ttl * 1000


# --- context manager and decorator ----------------------------------------------------------


def test_context_manager_records_outcomes(client: redis.Redis, prefix: str) -> None:
    breaker = make(client, prefix, failure_threshold=2)
    with breaker as entered:
        assert entered is breaker
    assert breaker.status().calls_in_window == 1
    with pytest.raises(KeyError), breaker:
        raise KeyError("boom")  # recorded, and not swallowed
    assert breaker.status().consecutive_failures == 1
    with pytest.raises(KeyError), breaker:
        raise KeyError("boom")
    ran = []
    with pytest.raises(CircuitOpen) as refused, breaker:
        ran.append(True)
    assert ran == []
    assert refused.value.name == "payments"
    assert refused.value.retry_at == breaker.status().retry_at
    assert str(refused.value).startswith("circuit 'payments' is open; retry after 20")


def test_context_manager_reports_probes(client: redis.Redis, prefix: str) -> None:
    breaker = make(client, prefix, failure_threshold=1)
    trip(breaker)
    wait_cooldown(breaker)
    with breaker, pytest.raises(CircuitOpen):  # the only probe slot is taken by the outer call
        breaker.__enter__()
    assert breaker.status().state is CLOSED


def test_decorator(client: redis.Redis, prefix: str) -> None:
    breaker = make(client, prefix, failure_threshold=1)

    @breaker
    def charge(amount: int) -> int:
        if amount < 0:
            raise ValueError(amount)
        return amount * 2

    assert charge.__name__ == "charge"
    assert charge(2) == 4
    with pytest.raises(ValueError):
        charge(-1)
    with pytest.raises(CircuitOpen):
        charge(3)


def test_transitions_are_logged_and_callback_errors_contained(
    client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(name: str, old: BreakerState, new: BreakerState) -> None:
        raise RuntimeError("callback bug")

    breaker = CircuitBreaker(
        "payments",
        client,
        BreakerConfig(failure_threshold=1, cooldown_seconds=COOLDOWN),
        key_prefix=prefix,
        on_transition=broken,
    )
    with caplog.at_level(logging.INFO, logger="celery_ledger.breaker"):
        assert breaker.record_failure() is OPEN
        wait_cooldown(breaker)
        breaker.admit()
    levels = [(r.levelno, r.getMessage()) for r in caplog.records if "->" in r.getMessage()]
    assert levels == [
        (logging.WARNING, "circuit 'payments': closed -> open"),
        (logging.INFO, "circuit 'payments': open -> half_open"),
    ]
    assert sum("on_transition failed" in r.getMessage() for r in caplog.records) == 2


# --- the registry ---------------------------------------------------------------------------


def test_breakers_registry(valkey: ServerProcess, prefix: str) -> None:
    configs = {"search": BreakerConfig(failure_threshold=1, cooldown_seconds=COOLDOWN)}
    default = BreakerConfig(failure_threshold=2)
    recorder = Recorder()
    mine = Breakers(
        valkey.url, configs=configs, default=default, key_prefix=prefix, on_transition=recorder
    )
    other = Breakers(valkey.url, key_prefix=prefix)
    try:
        assert mine["payments"] is mine["payments"]
        assert mine["payments"].config == default
        assert mine["search"].config == configs["search"]
        assert mine.names() == ["search"]  # configured, though never used

        other["mail:smtp*"].record_failure()  # used only by another registry (process)
        other["payments"].record_success()
        mine["search"].record_failure()
        assert mine.names() == ["mail:smtp*", "payments", "search"]
        statuses = {s.name: s for s in mine.statuses()}
        assert statuses["search"].state is OPEN
        assert statuses["payments"].calls_in_window == 1
        assert statuses["mail:smtp*"].consecutive_failures == 1
        assert recorder.calls == [("search", CLOSED, OPEN)]
        assert asdict(statuses["payments"])["state"] == "closed"
    finally:
        mine.close()
        other.close()
