"""Time: no guarantee depends on the hosts' clocks agreeing.

Real workers (and producers) run under libfaketime (Debian's ``faketime``): each with its own
clock, offset by seconds to an hour, fast or slow, or jumping while it works. The ledger and
the broker keep their own clocks. Every case counts what a user counts: the body ran once,
nothing waited past its bound, no worker died (the watchdog fails a test whose worker dies).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from celery_ledger import State
from celery_ledger.clock import ClockBook
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess

from .conftest import (
    DEFAULT_QUEUE,
    HEALING,
    NAMESPACE,
    TEST_ENV,
    UNACKED,
    broker_client,
    producer_app,
    start_healing_worker,
)
from .helpers import shared_task, wait_for
from .skew import LIBFAKETIME, FakeClock, needs_faketime

RECORD = "tests.integration.ledger_app.record"
pytestmark = needs_faketime


@pytest.fixture
def clocks(tmp_path: Path) -> Iterator[Any]:
    assert LIBFAKETIME.exists(), "libfaketime is missing (apt-get install faketime)"
    yield lambda name, offset: FakeClock(tmp_path, name, offset)


def skewed_worker(
    stack: EmbeddedStack, name: str, clock: FakeClock | None, **env: str
) -> WorkerProcess:
    return start_healing_worker(
        stack, name, concurrency=1, env={**(clock.env() if clock else {}), **env}
    )


def effects_of(stack: EmbeddedStack, kind: str, token: str) -> list[dict[str, Any]]:
    assert stack.ledger is not None
    world = MongoClient(stack.ledger.url, tz_aware=True).get_database("reference_world")
    return list(world.effects.find({"kind": kind, "key": token}))


def release(stack: EmbeddedStack, token: str) -> None:
    """Let a held ``record`` body of ``token`` end (see ``ledger_app.record``)."""
    assert stack.ledger is not None
    with MongoClient(stack.ledger.url) as client:
        client.get_database("reference_world").effects.insert_one({"kind": "release", "key": token})


def holder_of(producer: Any, task: Any, token: str) -> str | None:
    record = producer.ledger.get(task.name, token)
    if record is None or record.state is not State.RUNNING:
        return None
    return str(record.lease_owner).split("@", 1)[0]


def held_then_redelivered(
    stack: EmbeddedStack,
    holder: FakeClock | None,
    taker: FakeClock | None,
    *,
    meanwhile: Any = None,
) -> None:
    """A job held by one worker (a lease of 3 s, renewed by heartbeats while its 9 s body
    runs), then delivered a second time to another worker (which also sweeps as the fleet's
    reconciler: expired leases, stranded messages); ``meanwhile`` runs after that. Then the
    body ran once, by the holder: the second delivery was its duplicate."""
    producer = producer_app(stack, f"held_{uuid.uuid4().hex[:6]}")
    record = shared_task(producer, RECORD)
    token = f"held-{uuid.uuid4().hex[:8]}"
    skewed_worker(stack, "holder", holder)
    record.apply_async((token,), {"sleep_seconds": 9.0})
    wait_for(lambda: holder_of(producer, record, token) == "holder", what="the holder running")
    skewed_worker(stack, "taker", taker)
    record.apply_async((token,), {"sleep_seconds": 9.0})
    if meanwhile is not None:
        meanwhile()
    wait_for(
        lambda: (r := producer.ledger.get(record.name, token)) and r.state is State.SUCCEEDED,
        timeout=40,
        what="the job succeeding",
    )
    time.sleep(6.0)  # the second delivery's recheck, and another reconciler sweep or two
    ran = effects_of(stack, "record", token)
    final = producer.ledger.get(record.name, token)
    assert len(ran) == 1, f"the body ran {len(ran)} times"
    assert final.attempts == 1 and final.fence > 0
    producer.close()


@pytest.mark.parametrize(
    ("holder_offset", "taker_offset"),
    [
        (0, 300),  # a taker 5 minutes fast: the lease looked expired to it
        (-300, 0),  # a holder 5 minutes slow: it wrote a lease that had ended for everyone
        (0, -3600),  # a taker an hour slow
        (3600, 0),  # a holder an hour fast
    ],
    ids=["taker+5m", "holder-5m", "taker-1h", "holder+1h"],
)
def test_a_live_lease_is_never_taken_over_whatever_the_clocks(
    isolated: EmbeddedStack, clocks: Any, holder_offset: int, taker_offset: int
) -> None:
    held_then_redelivered(
        isolated,
        clocks("holder", holder_offset) if holder_offset else None,
        clocks("taker", taker_offset) if taker_offset else None,
    )


@pytest.mark.parametrize(
    ("whose", "jump_seconds"),
    [("holder", -600), ("taker", 600)],
    ids=["holder-jumps-back-10m", "taker-jumps-ahead-10m"],
)
def test_a_clock_that_jumps_while_the_job_runs_never_runs_it_twice(
    isolated: EmbeddedStack, clocks: Any, whose: str, jump_seconds: int
) -> None:
    clock = clocks(whose, 0)

    def jump() -> None:
        # that worker's clock jumps (NTP stepping it, a VM resumed) in the middle of the run
        time.sleep(1.0)
        clock.set(jump_seconds)

    held_then_redelivered(
        isolated,
        clock if whose == "holder" else None,
        clock if whose == "taker" else None,
        meanwhile=jump,
    )


@pytest.mark.parametrize("offset", [-300, 300, -3600], ids=["-5m", "+5m", "-1h"])
def test_a_countdown_runs_when_due_on_workers_whose_clocks_are_off(
    isolated: EmbeddedStack, clocks: Any, offset: int
) -> None:
    producer = producer_app(isolated, f"due_{uuid.uuid4().hex[:6]}")
    record = shared_task(producer, RECORD)
    token = f"due-{uuid.uuid4().hex[:8]}"
    # Given only workers whose clocks are off (they hand out the due deliveries)
    skewed_worker(isolated, "late", clocks("late", offset))
    # When a job is published for 4 s from now
    published = time.monotonic()
    record.apply_async((token,), countdown=4)
    # Then it runs then: not at once (a fast worker), not minutes later (a slow one)
    wait_for(lambda: effects_of(isolated, "record", token), timeout=30, what="the job running")
    waited = time.monotonic() - published
    assert 3.5 <= waited <= 12.0, f"ran {waited:.1f}s after its publish, due after 4s"
    producer.close()


PRODUCE = """
import sys, time
from tests.integration import ledger_app  # the test app, on the servers its environment names
task, token, how = getattr(ledger_app, sys.argv[1]), sys.argv[2], sys.argv[3]
extra = [float(value) for value in sys.argv[4:]]
print(time.monotonic(), flush=True)  # (not faked: the host's, which the test reads too)
task.apply_async((token, *extra), countdown=4 if how == "countdown" else None)
ledger_app.app.close()
"""


def produce_on(
    stack: EmbeddedStack, clock: FakeClock, task: str, token: str, how: str, *extra: float
) -> float:
    """Publish from a process of its own, on ``clock`` (the test app, as its workers run it);
    returns the monotonic time of its publish."""
    env = {
        **os.environ,
        **TEST_ENV,
        **stack.env,
        **clock.env(),
    }
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], *sys.path])
    done = subprocess.run(
        [sys.executable, "-c", PRODUCE, task, token, how, *map(str, extra)],
        env=env,
        check=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
    )
    return float(done.stdout.split()[0])


@pytest.mark.parametrize("offset", [-3600, 3600], ids=["producer-1h", "producer+1h"])
def test_a_producers_clock_moves_neither_a_due_time_nor_an_age(
    isolated: EmbeddedStack, clocks: Any, offset: int
) -> None:
    producer = producer_app(isolated, f"prod_{uuid.uuid4().hex[:6]}")
    skewed_worker(isolated, "fair", None)
    clock = clocks("producer", offset)
    # A job with a 60 s max age, published by a host an hour off: it is not "an hour old"
    token = f"age-{uuid.uuid4().hex[:8]}"
    produce_on(isolated, clock, "expiring", token, "now")
    wait_for(lambda: effects_of(isolated, "expiring", token), timeout=30, what="it running")
    # A countdown from that host runs 4 s after its publish, not an hour early or late
    token = f"cd-{uuid.uuid4().hex[:8]}"
    published = produce_on(isolated, clock, "record", token, "countdown")
    wait_for(lambda: effects_of(isolated, "record", token), timeout=30, what="it running")
    # (not early; late by no more than a loaded machine's worker takes: 12.4 s was seen under
    # a load of 36 on 2 cores; an hour's offset would show as 3,600 s)
    assert 3.5 <= time.monotonic() - published <= 30.0
    # And the fleet's clock book (``ledger health``'s clock check) shows that producer's host
    book = ClockBook(producer.runtime.redis, namespace=producer.runtime.tiers.namespace)
    offsets = [
        h.offsets["broker"][0]
        for h in book.hosts(now=producer.runtime.message_time())
        if h.host.startswith("client ") and "broker" in h.offsets
    ]
    assert any(abs(found + offset) < 5 for found in offsets), offsets
    producer.close()


@pytest.mark.parametrize("jump_seconds", [-600, 600], ids=["back-10m", "ahead-10m"])
def test_a_clock_that_jumps_while_a_job_waits_moves_not_its_due_time(
    isolated: EmbeddedStack, clocks: Any, jump_seconds: int
) -> None:
    producer = producer_app(isolated, f"wait_{uuid.uuid4().hex[:6]}")
    record = shared_task(producer, RECORD)
    token = f"wait-{uuid.uuid4().hex[:8]}"
    # Given the only worker (it hands out due deliveries), and a job due in 6 s
    clock = clocks("waiter", 0)
    skewed_worker(isolated, "waiter", clock)
    published = time.monotonic()
    record.apply_async((token,), countdown=6)
    # When the worker's clock jumps while the job waits
    time.sleep(2.0)
    clock.set(jump_seconds)
    # Then it runs when due: not at once, not ten minutes later
    wait_for(lambda: effects_of(isolated, "record", token), timeout=30, what="the job running")
    waited = time.monotonic() - published
    assert 5.5 <= waited <= 14.0, f"ran {waited:.1f}s after its publish, due after 6s"
    producer.close()


@pytest.mark.parametrize("offset", [-3600, 3600], ids=["-1h", "+1h"])
def test_workflow_timers_and_signal_timeouts_end_when_due_on_a_worker_whose_clock_is_off(
    isolated: EmbeddedStack, clocks: Any, offset: int
) -> None:
    from tests.integration.ledger_app import declare_workflows

    producer = producer_app(isolated, f"timer_{uuid.uuid4().hex[:6]}", workflow_check_seconds=3)
    flows = declare_workflows(producer)
    token = f"timer-{uuid.uuid4().hex[:8]}"
    # Given the only worker on a clock an hour off, and a workflow that sleeps 4 s
    isolated.start_worker(
        isolated.queues_of(),
        concurrency=2,
        name="timers@127.0.0.1",
        env={**HEALING, **clocks("timers", offset).env()},
    )
    started = time.monotonic()
    handle = flows["order"].start(token, steps=1, sleep=4)
    # Then the timer fires when due (on the ledger's clock), not an hour early or late
    result = handle.result(timeout=60)
    assert result["done"] == ["s0-done"]
    assert time.monotonic() - started >= 4.0
    fired = [e for e in handle.history() if e.kind == "fired"]
    scheduled = [
        e for e in handle.history() if e.kind == "scheduled" and e.data.get("kind") == "timer"
    ]
    assert len(fired) == 1 and len(scheduled) == 1
    assert 3.9 <= scheduled[0].data["until"] - scheduled[0].at.timestamp() <= 4.1
    assert fired[0].at.timestamp() >= scheduled[0].data["until"] - 0.01
    assert (fired[0].at - scheduled[0].at).total_seconds() <= 15.0
    # And a signal's timeout (4 s, no signal sent) ends the wait when due, the same way
    waiting = flows["order"].start(f"{token}-signal", steps=1, signal="approve", signal_timeout=4)
    started = time.monotonic()
    assert waiting.result(timeout=60)["signal"] is None
    assert time.monotonic() - started >= 3.5
    timed_out = [e for e in waiting.history() if e.kind == "timed_out"]
    waits = [
        e for e in waiting.history() if e.kind == "scheduled" and e.data.get("kind") == "signal"
    ]
    assert len(timed_out) == 1 and len(waits) == 1
    assert timed_out[0].at.timestamp() >= waits[0].data["until"] - 0.01
    assert (timed_out[0].at - waits[0].at).total_seconds() <= 15.0
    producer.close()


@pytest.mark.parametrize(
    ("producer_offset", "worker_offset"),
    [(-3600, 0), (0, 3600), (3600, -3600)],
    ids=["producer-1h", "worker+1h", "producer+1h-worker-1h"],
)
def test_a_latency_objective_counts_from_the_publish_whatever_the_clocks(
    isolated: EmbeddedStack, clocks: Any, producer_offset: int, worker_offset: int
) -> None:
    producer = producer_app(isolated, f"slo_{uuid.uuid4().hex[:6]}")
    report = shared_task(producer, "tests.integration.ledger_app.patient_report")
    skewed_worker(isolated, "judge", clocks("judge", worker_offset) if worker_offset else None)
    # A first job warms the worker's pool process (its connections) first: the objective below
    # is 5 s from the publish (seconds, against clocks an hour off)
    warm = f"slo-warm-{uuid.uuid4().hex[:6]}"
    report.apply_async((warm, 0.0))
    wait_for(lambda: effects_of(isolated, "patient_report", warm), timeout=30, what=warm)
    clock = clocks("producer", producer_offset) if producer_offset else None
    # A job well within its 5 s objective, and one past it (7 s), from a host whose clock is off
    quick, slow = (f"slo-{what}-{uuid.uuid4().hex[:6]}" for what in ("quick", "slow"))
    for token, seconds in ((quick, 0.1), (slow, 7.0)):
        if clock is None:
            report.apply_async((token, seconds))
        else:
            produce_on(isolated, clock, "patient_report", token, "now", seconds)
    for token in (quick, slow):
        wait_for(lambda t=token: effects_of(isolated, "patient_report", t), timeout=30, what=token)
    time.sleep(3.0)  # the workers' escalation checks (every 0.5 s here)
    # The quick one is not late (an hour-old publish, to a clock an hour off); the slow one is
    # late once
    assert effects_of(isolated, "late", quick) == []
    assert len(effects_of(isolated, "late", slow)) == 1
    producer.close()


def test_breaker_cooldowns_and_rate_limits_hold_on_workers_whose_clocks_are_off(
    isolated: EmbeddedStack, clocks: Any
) -> None:
    """A breaker's cooldown and a rate bucket's refill are judged on the broker's clock: two
    workers an hour apart neither call a dependency early nor wait an hour for it."""
    from celery_ledger.policies.breaker import BreakerState

    assert isolated.ledger is not None
    world = MongoClient(isolated.ledger.url, tz_aware=True).get_database("reference_world")
    producer = producer_app(isolated, f"policies_{uuid.uuid4().hex[:6]}")
    limited = shared_task(producer, "tests.integration.ledger_app.rate_limited")
    payments = shared_task(producer, "tests.integration.ledger_app.call_payments")
    skewed_worker(isolated, "fast", clocks("fast", 3600))
    skewed_worker(isolated, "slow", clocks("slow", -3600))
    # A bucket of 4/s (burst 2) shared by both: 10 jobs take 2 s at least, and not an hour
    tokens = [f"rate-{i}-{uuid.uuid4().hex[:6]}" for i in range(10)]
    seen: list[float] = []
    published = time.monotonic()
    for token in tokens:
        limited.apply_async((token,))
    deadline = time.monotonic() + 40
    while len(seen) < len(tokens) and time.monotonic() < deadline:
        done = world.effects.count_documents({"kind": "limited", "key": {"$in": tokens}})
        seen += [time.monotonic()] * (done - len(seen))
        time.sleep(0.05)
    assert len(seen) == len(tokens), f"{len(seen)} of {len(tokens)} rate-limited jobs ran"
    # (from the publish: the bucket limits starts, and a slow first job under load would
    # shorten the span between completions)
    assert seen[-1] - published >= (len(tokens) - 2) / 4 - 0.4, "the bucket was overdrawn"
    # A breaker opened by failures (3, cooldown 3 s): no call while it cools, a probe after
    breaker = producer.breakers["payments"]
    breaker.reset()
    world.effects.insert_one({"kind": "outage", "key": "payments"})
    token = f"pay-{uuid.uuid4().hex[:6]}"
    try:
        payments.apply_async((token,))
        wait_for(lambda: breaker.status().state is BreakerState.OPEN, timeout=30, what="open")
        opened, calls = time.monotonic(), effects_of(isolated, "payment_call", token)
        time.sleep(2.0)
        assert len(effects_of(isolated, "payment_call", token)) == len(calls), "called early"
    finally:
        world.effects.delete_many({"kind": "outage", "key": "payments"})
    wait_for(
        lambda: (r := producer.ledger.get(payments.name, token)) and r.state is State.SUCCEEDED,
        timeout=30,
        what="the job succeeding after the cooldown",
    )
    assert time.monotonic() - opened >= 2.5
    assert breaker.status().state is BreakerState.CLOSED
    producer.close()


RELAYING = {
    # the outbox relay alone brings a dead committer's work back (no reconciler runs)
    "LEDGER_RECONCILE_IN_WORKERS": "false",
    "LEDGER_OUTBOX_RELAY_IN_WORKERS": "true",
    "LEDGER_OUTBOX_RELAY_SECONDS": "0.5",
    "LEDGER_OUTBOX_GRACE_SECONDS": "1",
}


@pytest.mark.parametrize(
    ("committer_offset", "relay_offset"),
    [(3600, -3600), (-3600, 3600)],
    ids=["committer+1h-relay-1h", "committer-1h-relay+1h"],
)
def test_a_dead_committers_work_is_relayed_after_its_grace_whatever_the_clocks(
    isolated: EmbeddedStack, clocks: Any, committer_offset: int, relay_offset: int
) -> None:
    """The outbox's grace counts on the ledger's clock from the commit: a committer an hour
    off marks its records neither long overdue nor an hour in the future for the relay."""
    from celery_ledger.embedded.servers import app_env

    assert isolated.ledger is not None
    token = f"outbox-{uuid.uuid4().hex[:8]}"
    relay = clocks("relay", relay_offset)
    isolated.start_worker(
        isolated.queues_of(),
        concurrency=2,
        name="relay@127.0.0.1",
        env={**RELAYING, **relay.env()},
    )
    # Given a committer on a clock an hour off, SIGKILLed between its commit and its publish
    committer = clocks("committer", committer_offset)
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.apps.outbox_committer", token],
        env=app_env(TEST_ENV, isolated.env, RELAYING, committer.env()),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == -9 and "committed" in done.stdout, done.stderr[-2000:]
    died = time.monotonic()
    # Then the relay on its own clock runs the job once, within seconds
    wait_for(lambda: effects_of(isolated, "record", token), timeout=30, what="the relayed job")
    assert time.monotonic() - died < 20
    time.sleep(2.0)
    assert len(effects_of(isolated, "record", token)) == 1


SWEEP = """
import sys
from tests.integration import ledger_app  # the test app, on the servers its environment names
with ledger_app.app.connection_for_write() as connection:
    channel = connection.default_channel
    channel.visibility_timeout = float(sys.argv[1])  # (below the settings' floor, for speed)
    channel.qos.restore_visible(num=100, interval=1)
ledger_app.app.close()
"""


def sweep_unacked_on(stack: EmbeddedStack, clock: FakeClock, visibility_timeout: int) -> None:
    """kombu's sweep of messages unacknowledged past the visibility timeout, run once by a
    process of its own on ``clock`` (a worker runs it every few minutes)."""
    env = {
        **os.environ,
        **TEST_ENV,
        **stack.env,
        **clock.env(),
    }
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], *sys.path])
    done = subprocess.run(
        [sys.executable, "-c", SWEEP, str(visibility_timeout)],
        env=env,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def taken_messages(stack: EmbeddedStack) -> int:
    return int(broker_client(stack).hlen(UNACKED))


@pytest.mark.parametrize(
    ("holder_offset", "sweeper_offset"),
    [(0, 3600), (-3600, 0), (0, 300), (-300, 300)],
    ids=["sweeper+1h", "holder-1h", "sweeper+5m", "holder-5m-sweeper+5m"],
)
def test_a_running_jobs_message_is_not_put_back_early_whatever_the_clocks(
    isolated: EmbeddedStack, clocks: Any, holder_offset: int, sweeper_offset: int
) -> None:
    """kombu puts a message back on its queue once it has been taken longer ago than the
    visibility timeout. The take is booked, and its age judged, on the broker's clock: a
    sweeper whose clock runs fast, or a holder whose clock runs slow, does not hand a
    running job's message to a second worker."""
    producer = producer_app(isolated, f"vis_{uuid.uuid4().hex[:6]}")
    record = shared_task(producer, RECORD)
    token = f"vis-{uuid.uuid4().hex[:8]}"
    skewed_worker(isolated, "holder", clocks("holder", holder_offset))
    # (a body held until the test releases it, at most 60 s: the sweep below runs while it
    # does, even on a loaded machine, where the sweeper's own start once took longer than a
    # body of a fixed shorter time)
    record.apply_async((token,), {"sleep_seconds": 60.0, "held": True})
    wait_for(lambda: holder_of(producer, record, token) == "holder", what="the holder running")
    # When a sweeper with a visibility timeout of 60 s sweeps soon after the take (seconds;
    # a loaded machine's parallel suite once took over 5 s to get there: the timeout is far
    # above that and the body, and far below the clocks' offsets of 5 minutes and an hour)
    sweep_unacked_on(isolated, clocks("sweeper", sweeper_offset), visibility_timeout=60)
    # Then the message stays taken (not back on the queue for another worker) while the job runs
    assert holder_of(producer, record, token) == "holder", "the body ended before the sweep"
    assert taken_messages(isolated) == 1
    assert broker_client(isolated).llen(DEFAULT_QUEUE) == 0
    release(isolated, token)
    wait_for(lambda: effects_of(isolated, "record", token), timeout=60, what="the job ending")
    assert len(effects_of(isolated, "record", token)) == 1
    producer.close()


@pytest.mark.parametrize(
    ("holder_offset", "sweeper_offset"),
    [(0, -3600), (3600, 0), (300, -300)],
    ids=["sweeper-1h", "holder+1h", "holder+5m-sweeper-5m"],
)
def test_a_dead_workers_message_is_put_back_when_due_whatever_the_clocks(
    isolated: EmbeddedStack, clocks: Any, holder_offset: int, sweeper_offset: int
) -> None:
    """A worker SIGKILLed mid-body leaves its message taken: the sweep puts it back once its
    visibility timeout has passed on the broker's clock, not an hour later because the
    sweeper's clock runs slow or the holder's ran fast; then it runs once."""
    producer = producer_app(isolated, f"vis_{uuid.uuid4().hex[:6]}")
    record = shared_task(producer, RECORD)
    token = f"dead-{uuid.uuid4().hex[:8]}"
    holder = skewed_worker(isolated, "holder", clocks("holder", holder_offset))
    record.apply_async((token,), {"sleep_seconds": 60.0, "held": True})
    wait_for(lambda: holder_of(producer, record, token) == "holder", what="the holder running")
    holder.kill()
    release(isolated, token)  # (the heir's body ends at once)
    assert taken_messages(isolated) == 1
    # When a sweeper with a visibility timeout of 2 s sweeps 3 s after the take or later
    time.sleep(3.0)
    sweep_unacked_on(isolated, clocks("sweeper", sweeper_offset), visibility_timeout=2)
    # Then the message is back on its queue, and a worker runs it once
    assert taken_messages(isolated) == 0
    assert broker_client(isolated).llen(DEFAULT_QUEUE) == 1
    skewed_worker(isolated, "heir", None, LEDGER_RECONCILE_IN_WORKERS="false")
    wait_for(lambda: effects_of(isolated, "record", token), timeout=60, what="the job running")
    time.sleep(1.0)
    assert len(effects_of(isolated, "record", token)) == 1
    producer.close()


# The fleet's leases (one holder across the fleet each): what turns each on, its key, and how
# long a dead holder keeps it (the lock's time to live).
FLEET_LEASES = {
    "reconciler": ({"LEDGER_RECONCILE_EVERY_SECONDS": "1"}, "reconciler", 2.5),
    "outbox-relay": (
        {
            "LEDGER_RECONCILE_IN_WORKERS": "false",
            "LEDGER_OUTBOX_RELAY_IN_WORKERS": "true",
            "LEDGER_OUTBOX_RELAY_SECONDS": "1",
        },
        "outbox",
        2.5,
    ),
}


@pytest.mark.parametrize(
    ("lease", "holder_offset", "contender_offset"),
    [
        ("reconciler", -3600, 3600),
        ("reconciler", 3600, -3600),
        ("outbox-relay", -3600, 3600),
    ],
    ids=[
        "reconciler-holder-1h-contender+1h",
        "reconciler-holder+1h-contender-1h",
        "relay-holder-1h-contender+1h",
    ],
)
def test_the_fleets_leases_stay_with_a_live_holder_and_pass_on_in_time_whatever_the_clocks(
    isolated: EmbeddedStack, clocks: Any, lease: str, holder_offset: int, contender_offset: int
) -> None:
    """The reconciler's and the outbox relay's leases (a trigger's and the scheduler's are the
    same lock; test_schedules.py hands the scheduler's over between skewed hosts) end on the
    broker's clock: a contender two hours ahead of the holder does not
    take a lease its holder renews, and a dead holder's lease passes on within its time to
    live however far behind the contender's clock runs."""
    env, kind, ttl = FLEET_LEASES[lease]
    key = f"{NAMESPACE}:ledger:{kind}"
    broker = broker_client(isolated)

    def holder_now() -> str | None:
        value = broker.get(key)
        return value.decode() if value is not None else None

    holder = skewed_worker(isolated, "holder", clocks("holder", holder_offset), **env)
    wait_for(lambda: holder_now() is not None, timeout=30, what="the holder taking the lease")
    held = holder_now()
    assert held is not None and held.split("|")[0].endswith(f":{holder.pid}"), held
    skewed_worker(isolated, "contender", clocks("contender", contender_offset), **env)
    watched_until = time.monotonic() + max(ttl * 1.5, 5.0)
    while time.monotonic() < watched_until:
        assert holder_now() == held, "the lease was taken from a live holder"
        time.sleep(0.2)
    holder.kill()
    died = time.monotonic()
    wait_for(
        lambda: holder_now() not in (None, held), timeout=ttl + 30, what="the lease passing on"
    )
    taken = holder_now()
    assert taken is not None and int(taken.split("|")[1]) > int(held.split("|")[1])
    assert time.monotonic() - died <= ttl + 3.0, "the dead holder's lease lasted too long"
