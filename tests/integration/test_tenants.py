"""Tenants: fair dispatch inside a tier, weights, concurrency limits and a tenant's backpressure.

The dispatch script is driven on a real valkey as workers drive it (a take, then a refill in the
same round trip), and end to end with a real worker: a small tenant's jobs arriving behind a big
tenant's backlog start within a few jobs, not after the backlog; every job runs once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest
import redis

from celery_ledger import Backpressure, State
from celery_ledger.broker import RedisBroker
from celery_ledger.embedded.stack import EmbeddedStack
from celery_ledger.fairness import (
    TENANT_PROPERTY,
    FairDispatch,
    TenantPolicy,
    express_list,
    queue_list,
    running_key,
)
from tasks.effects import effects, record_effect

from .conftest import producer_app, start_healing_worker
from .helpers import effect_count, shared_task, wait_for

RECORD = "tests.integration.ledger_app.record"
FAIR = {"LEDGER_FAIR_QUEUE_DEPTH": "2"}  # (fair dispatch is off until set)


def envelope(job_id: str, tenant: str) -> str:
    return json.dumps(
        {"headers": {"id": job_id, "task": "t"}, "properties": {TENANT_PROPERTY: tenant}}
    )


def take(client: redis.Redis, fair: FairDispatch, queue: str) -> dict[str, Any] | None:
    """What a worker does: pop the queue (highest priority first), then refill it."""
    for step in (0, 3, 6, 9):
        item = client.rpop(queue_list(queue, step))
        if item is not None:
            fair.refill(queue)
            return json.loads(item)
    return None


def fed(client: redis.Redis, *, depth: int, lease_seconds: float = 60) -> tuple[FairDispatch, str]:
    """Lanes on a new queue that a worker of this release feeds (its mark set)."""
    fair = FairDispatch(client, depth=depth, lease_seconds=lease_seconds)
    queue = f"fair-{uuid.uuid4().hex[:8]}.default"
    fair.feed(queue)
    return fair, queue


def test_a_small_tenant_behind_a_big_backlog_waits_a_few_jobs(client: redis.Redis) -> None:
    fair, queue = fed(client, depth=2, lease_seconds=60)
    for n in range(500):
        fair.put(queue, "big", 0, envelope(f"big-{n}", "big"))
    for n in range(5):
        fair.put(queue, "small", 0, envelope(f"small-{n}", "small"))
    # The queue is kept shallow (2 staged, and small-0 ahead of them); the rest waits in lanes
    assert client.llen(queue) == 3
    order = [take(client, fair, queue)["headers"]["id"] for _ in range(505)]  # type: ignore[index]
    small_at = [i for i, job in enumerate(order) if job.startswith("small")]
    # Round robin: each small job within a turn of the queue's depth, not behind 500
    assert small_at == sorted(small_at) and small_at[-1] <= 2 + 2 * 5
    # ...and each tenant's own order is kept
    assert [j for j in order if j.startswith("big")] == [f"big-{n}" for n in range(500)]
    assert take(client, fair, queue) is None
    assert client.scard(f"{queue}:fair:active") == 0 and client.llen(f"{queue}:fair:ring") == 0


def ids(client: redis.Redis, fair: FairDispatch, queue: str, n: int) -> list[str]:
    return [take(client, fair, queue)["headers"]["id"] for _ in range(n)]  # type: ignore[index]


def test_a_tenant_arriving_with_nothing_waiting_goes_ahead_of_what_the_lanes_staged(
    client: redis.Redis,
) -> None:
    # Given a big tenant's backlog: one of its messages staged in the queue, the rest in its lane
    fair, queue = fed(client, depth=1)
    for n in range(20):
        fair.put(queue, "big", 0, envelope(f"big-{n}", "big"))
    # When a small tenant with nothing waiting arrives, its message skips its lane
    assert fair.put(queue, "small", 0, envelope("small-0", "small")) == 1
    assert fair.waiting(queue) == {"big": 19}
    # Then the next free process takes it, before the staged one: not after a turn of the ring
    assert ids(client, fair, queue, 3) == ["small-0", "big-0", "big-1"]
    # ...and so does the next small job, arriving after the ring moved again
    fair.put(queue, "small", 0, envelope("small-1", "small"))
    assert ids(client, fair, queue, 2) == ["small-1", "big-2"]


def test_a_tenant_whose_message_is_in_the_queue_keeps_its_order(client: redis.Redis) -> None:
    fair, queue = fed(client, depth=2)
    for n in range(10):
        fair.put(queue, "big", 0, envelope(f"big-{n}", "big"))
    assert fair.put(queue, "t", 0, envelope("t-0", "t")) == 1  # (goes ahead)
    fair.put(queue, "t", 0, envelope("t-1", "t"))  # (to its lane: t-0 is queued)
    assert ids(client, fair, queue, 4) == ["t-0", "big-0", "big-1", "big-2"]
    # t-1 was staged by its turn of the ring, and a turn of the big tenant's has passed since,
    # so t may go ahead again, as far as turns go; it has nothing in its lanes, but its t-1 is
    # in the queue: t-2 may not pass it
    queued = [json.loads(item)["headers"]["id"] for item in client.lrange(queue, 0, -1)]
    assert queued == ["big-3", "t-1"] and fair.waiting(queue).get("t") is None
    assert fair.put(queue, "t", 0, envelope("t-2", "t")) == 0
    order = ids(client, fair, queue, 9)
    assert order.index("t-1") < order.index("t-2")
    assert [j for j in order if j.startswith("big")] == [f"big-{n}" for n in range(3, 10)]


def test_new_tenants_arriving_without_end_never_hold_the_ring_back(client: redis.Redis) -> None:
    # Given a big tenant's backlog, and a new tenant arriving before every take
    fair, queue = fed(client, depth=1)
    for n in range(100):
        fair.put(queue, "big", 0, envelope(f"big-{n}", "big"))
    taken = []
    for n in range(60):
        fair.put(queue, f"new-{n}", 0, envelope(f"new-{n}", f"new-{n}"))
        taken += ids(client, fair, queue, 1)
    # Then at most every other take went ahead of the ring (one between two of its moves): the
    # big tenant still had its turns of the ring, which it shares with the new tenants that
    # could not go ahead (each newcomer going ahead, it would have had none), and every new
    # tenant's job is taken once
    assert sum(1 for j in taken if j.startswith("big")) >= 5
    assert [i for i, job in enumerate(taken) if job == f"new-{i}"] == list(range(0, 60, 2))
    taken += ids(client, fair, queue, 100)
    assert sorted(j for j in taken if j.startswith("new")) == sorted(f"new-{n}" for n in range(60))
    assert [j for j in taken if j.startswith("big")] == [f"big-{n}" for n in range(100)]
    assert take(client, fair, queue) is None


def test_a_tenant_at_its_concurrency_limit_does_not_go_ahead(client: redis.Redis) -> None:
    fair, queue = fed(client, depth=1)
    limited = {"capped": TenantPolicy(concurrency=1), "limited": TenantPolicy(concurrency=1)}
    fair.write_policies([queue], limited)
    for n in range(5):
        fair.put(queue, "big", 0, envelope(f"big-{n}", "big"))
    fair.renew(queue, "capped", "capped-running", 60)  # (its one slot, held by a running body)
    assert fair.put(queue, "capped", 0, envelope("capped-0", "capped")) == 0
    assert fair.waiting(queue) == {"big": 4, "capped": 1}
    # A limited tenant with its slot free goes ahead, and the slot is its message's
    assert fair.put(queue, "limited", 0, envelope("limited-0", "limited")) == 1
    assert fair.running(queue) == {"capped": 1, "limited": 1}
    assert ids(client, fair, queue, 1) == ["limited-0"]
    assert not fair.admit(queue, "limited", "limited-1", 60)  # (its slot is limited-0's)


def test_a_tenant_that_went_ahead_waits_for_every_other_tenants_turn_first(
    client: redis.Redis,
) -> None:
    # Given four tenants with backlogs, and a fifth that publishes a job whenever its last one
    # has started (never a backlog of its own: always arriving with nothing waiting)
    fair, queue = fed(client, depth=1)
    for n in range(60):
        for tenant in ("a", "b", "c", "d"):
            fair.put(queue, tenant, 0, envelope(f"{tenant}-{n}", tenant))

    def pending() -> bool:
        queued = [json.loads(item)["headers"]["id"] for item in client.lrange(queue, 0, -1)]
        return any(j.startswith("paced") for j in queued) or "paced" in fair.waiting(queue)

    taken: list[str] = []
    for n in range(100):
        if not pending():
            fair.put(queue, "paced", 0, envelope(f"paced-{n}", "paced"))
        taken += ids(client, fair, queue, 1)
    # Then it gets no more than a tenant's share (one start in five; a little less, as it
    # publishes only once its last job started), not every other start
    share = sum(1 for job in taken if job.startswith("paced")) / len(taken)
    assert 0.12 <= share <= 0.22, share  # (0.28 before a tenant waited for the others)
    assert {sum(1 for job in taken if job.startswith(t)) for t in "abcd"} <= set(range(18, 23))
    # ...while one that publishes after every other tenant had its turn goes ahead each time
    while pending():
        ids(client, fair, queue, 1)
    ids(client, fair, queue, 4)
    for n in range(10):
        fair.put(queue, "paced", 0, envelope(f"paced-again-{n}", "paced"))
        assert ids(client, fair, queue, 5)[0] == f"paced-again-{n}"
    # ...and what it leaves behind lapses: the mark of its last turn, nothing else
    while take(client, fair, queue) is not None:
        pass
    assert not client.exists(f"{queue}:fair:jumped", f"{queue}:fair:ring")
    assert 0 < client.ttl(f"{queue}:fair:turn:paced") <= 3600


def test_weights_are_honoured_while_both_have_work(client: redis.Redis) -> None:
    fair, queue = fed(client, depth=1, lease_seconds=60)
    fair.write_policies([queue], {"gold": TenantPolicy(weight=3)})
    for n in range(400):
        fair.put(queue, "gold", 0, envelope(f"gold-{n}", "gold"))
        fair.put(queue, "basic", 0, envelope(f"basic-{n}", "basic"))
    first = Counter(take(client, fair, queue)["headers"]["id"].split("-")[0] for _ in range(400))  # type: ignore[index]
    assert abs(first["gold"] / first["basic"] - 3.0) <= 0.3, first


def test_a_concurrency_limit_holds_a_tenant_back_and_a_release_lets_the_next_go(
    client: redis.Redis,
) -> None:
    fair, queue = fed(client, depth=10, lease_seconds=60)
    fair.write_policies([queue], {"capped": TenantPolicy(concurrency=2)})
    for n in range(6):
        fair.put(queue, "capped", 0, envelope(f"capped-{n}", "capped"))
    fair.put(queue, "other", 0, envelope("other-0", "other"))
    moved = [json.loads(item)["headers"]["id"] for item in client.lrange(queue, 0, -1)]
    assert sorted(moved) == ["capped-0", "capped-1", "other-0"]  # two of the capped, not six
    assert fair.running(queue) == {"capped": 2}
    fair.refill(queue)
    assert client.llen(queue) == 3  # still held: nothing ended
    fair.release(queue, "capped", "capped-0")
    assert client.llen(queue) == 4 and fair.running(queue) == {"capped": 2}
    assert fair.waiting(queue) == {"capped": 3}


def test_a_slot_lapses_when_its_worker_is_gone(client: redis.Redis) -> None:
    fair, queue = fed(client, depth=10, lease_seconds=0.3)
    fair.write_policies([queue], {"*": TenantPolicy(concurrency=1)})
    for n in range(2):
        fair.put(queue, "t", 0, envelope(f"t-{n}", "t"))
    assert client.llen(queue) == 1
    wait_for(lambda: fair.refill(queue) == 1, timeout=5, what="the lapsed slot freed")


def test_a_start_holds_the_limit_whatever_slot_lapsed(client: redis.Redis) -> None:
    """``admit`` (where a body starts): its own entry, even lapsed, is its slot until a refill
    gives it to another message; without one, only a free slot lets it start; and an entry
    brought back by a late renewal is counted, not trusted."""
    fair, queue = fed(client, depth=10, lease_seconds=60)
    fair.write_policies([queue], {"capped": TenantPolicy(concurrency=1)})
    running = running_key(queue, "capped")

    def lapse(job_id: str) -> None:  # (as a lease passing would, without waiting for it)
        client.zadd(running, {job_id: 1.0})

    for n in range(2):
        fair.put(queue, "capped", 0, envelope(f"capped-{n}", "capped"))
    assert client.llen(queue) == 1  # capped-0 moved, capped-1 held back
    assert fair.admit(queue, "capped", "capped-0", 60)
    lapse("capped-0")  # and no refill came since: still its slot
    assert fair.admit(queue, "capped", "capped-0", 60)
    lapse("capped-0")
    assert fair.refill(queue) == 1  # lapsed: capped-1 is moved in its place
    # Then capped-0, started late, waits; capped-1 starts; once it ended, capped-0 may
    assert not fair.admit(queue, "capped", "capped-0", 60)
    assert fair.admit(queue, "capped", "capped-1", 60)
    assert not fair.admit(queue, "capped", "capped-0", 60)
    fair.release(queue, "capped", "capped-1")
    assert fair.admit(queue, "capped", "capped-0", 60)
    assert fair.running(queue) == {"capped": 1}
    # And a running body's entry renewed after it lapsed and its slot went to another (a ledger
    # outage held its heartbeat back) is counted: the other, moved, does not start beside it
    fair.put(queue, "capped", 0, envelope("capped-2", "capped"))  # (held back: at the limit)
    lapse("capped-0")
    assert fair.refill(queue) == 1  # capped-2 moved in capped-0's place
    fair.renew(queue, "capped", "capped-0", 60)
    assert not fair.admit(queue, "capped", "capped-2", 60)
    fair.release(queue, "capped", "capped-0")
    assert fair.admit(queue, "capped", "capped-2", 60)
    # and a tenant without a limit (nor a "*" one) always starts
    assert fair.admit(queue, "free", "free-0", 60) and fair.admit(queue, "free", "free-1", 60)


def test_priorities_hold_inside_a_tenant(client: redis.Redis) -> None:
    fair, queue = fed(client, depth=1, lease_seconds=60)
    fair.put(queue, "t", 0, envelope("filler", "t"))  # (moved at once: the queue was empty)
    fair.put(queue, "t", 9, envelope("low", "t"))
    fair.put(queue, "t", 0, envelope("high", "t"))
    order = [take(client, fair, queue)["headers"]["id"] for _ in range(3)]  # type: ignore[index]
    assert order == ["filler", "high", "low"]


def test_the_reconciler_sees_a_message_in_a_lane(client: redis.Redis) -> None:
    fair, queue = fed(client, depth=1, lease_seconds=60)
    for n in range(3):
        fair.put(queue, "t", 0, envelope(f"id-{n}", "t"))
    broker = RedisBroker(client, queues=[queue], delayed_key=f"{queue}:delayed")
    assert broker.depth() == 3
    assert len(broker.waiting()) == 3  # in the queue and in the lane alike


def test_fair_dispatch_end_to_end_runs_each_job_once(own: EmbeddedStack) -> None:
    # Given one worker slot and a big tenant's backlog of 150 jobs (20 ms each)
    worker = start_healing_worker(own, "tenants", concurrency=1, env=FAIR)
    producer = producer_app(own, f"tenants_{uuid.uuid4().hex[:6]}", fair_queue_depth=2)
    task = shared_task(producer, RECORD)
    run = uuid.uuid4().hex[:8]
    big = [f"{run}-big-{n}" for n in range(150)]
    small = [f"{run}-small-{n}" for n in range(3)]
    for token in big:
        task.apply_async((token,), {"sleep_seconds": 0.02}, tenant="big")
    wait_for(lambda: effect_count("record", big[0]) == 1, timeout=60, what="the backlog running")
    # When a small tenant's jobs arrive behind it
    arrived = datetime.now(UTC)
    for token in small:
        task.apply_async((token,), {"sleep_seconds": 0.02}, tenant="small")

    # Then they run within a few of the big tenant's jobs, and every job runs once
    def ended() -> bool:
        return all(
            (r := producer.ledger.get(task.name, t)) is not None and r.state is State.SUCCEEDED
            for t in big + small
        )

    wait_for(ended, timeout=120, interval=0.5, what="every job succeeded")
    found = effects().find({"kind": "record", "key": {"$regex": f"^{run}"}}).sort("at", 1)
    done = [(effect["key"], effect["at"].replace(tzinfo=UTC)) for effect in found]
    last_small = max(at for key, at in done if key in small)
    between = [key for key, at in done if "-big-" in key and arrived < at < last_small]
    # (round robin: a big job, a small one; the queue 2 deep and a job in the worker's hands)
    assert len(between) <= 8, f"the small tenant waited behind {len(between)} of the big one's"
    assert [t for t in big + small if effect_count("record", t) != 1] == []
    record = producer.ledger.get(task.name, small[0])
    assert record is not None and record.tenant == "small"
    assert worker.alive()
    producer.close()


def test_a_tenant_over_its_max_waiting_is_refused_and_others_are_not(own: EmbeddedStack) -> None:
    producer = producer_app(
        own,
        f"tenants_{uuid.uuid4().hex[:6]}",
        tenants={"*": {"max_waiting": 5}},
        tier_limits={"default": {"policy": "reject", "high_water": 100000}},
        fair_queue_depth=1,
    )
    task = shared_task(producer, RECORD)
    run = uuid.uuid4().hex[:8]
    producer.runtime.fair.feed(producer.tiers.queue("default"))  # (as a worker of this release)
    for n in range(6):  # no worker takes them: 1 in the queue, 5 in the lane
        task.apply_async((f"{run}-flood-{n}",), tenant="flood")
    time.sleep(1.1)  # (a producer reads a tenant's count at most once a second)
    with pytest.raises(Backpressure):
        task.apply_async((f"{run}-flood-over",), tenant="flood")
    task.apply_async((f"{run}-calm-0",), tenant="calm")  # another tenant: published
    producer.close()


def test_without_a_worker_that_feeds_lanes_a_put_goes_straight_to_the_queue(
    client: redis.Redis,
) -> None:
    # A producer upgraded before the workers: no worker of this release marked the queue
    fair = FairDispatch(client, depth=1, lease_seconds=60)
    queue = f"fair-{uuid.uuid4().hex[:8]}.default"
    for n in range(3):
        fair.put(queue, "t", 0, envelope(f"id-{n}", "t"))
    assert client.llen(queue) == 3 and fair.waiting(queue) == {}
    # Marked, the lanes are used; the mark lapses with the last such worker
    fair.feed(queue, seconds=0.3)
    fair.put(queue, "t", 0, envelope("id-3", "t"))
    assert fair.waiting(queue) == {"t": 1}
    wait_for(lambda: not client.exists(f"{queue}:fair:feeder"), timeout=5, what="mark lapsed")
    # ...and a put then (the fleet rolled back) takes what the lanes hold to the queue first
    fair.put(queue, "t", 0, envelope("id-4", "t"))
    assert fair.waiting(queue) == {} and client.llen(queue) == 5
    order = [json.loads(i)["headers"]["id"] for i in reversed(client.lrange(queue, 0, -1))]
    assert order == [f"id-{n}" for n in range(5)]


def test_a_drain_moves_every_lane_to_the_queue_in_order(client: redis.Redis) -> None:
    fair, queue = fed(client, depth=1)
    for n in range(4):
        fair.put(queue, "a", 0, envelope(f"a-{n}", "a"))
        fair.put(queue, "b", 9, envelope(f"b-{n}", "b"))
    assert fair.drain(queue) == 7  # (the first moved at its put: the queue was empty)
    assert fair.waiting(queue) == {} and client.llen(f"{queue}:fair:ring") == 0
    a = [json.loads(i)["headers"]["id"] for i in reversed(client.lrange(queue, 0, -1))]
    assert a == [f"a-{n}" for n in range(4)]


def test_a_fleet_turning_fair_dispatch_off_runs_every_tenants_job_once(
    own: EmbeddedStack,
) -> None:
    # Given a worker with fair dispatch on (it feeds the lanes) beside one with it off (it
    # neither marks nor feeds them; it drains what they hold), and a producer with it on
    new = start_healing_worker(own, "tenants-new", concurrency=1, env=FAIR)
    old = start_healing_worker(
        own, "tenants-old", concurrency=1, env={"LEDGER_FAIR_QUEUE_DEPTH": "0"}
    )
    producer = producer_app(own, f"tenants_{uuid.uuid4().hex[:6]}", fair_queue_depth=2)
    task = shared_task(producer, RECORD)
    run = uuid.uuid4().hex[:8]
    first = [f"{run}-first-{n}" for n in range(60)]
    for n, token in enumerate(first):
        task.apply_async((token,), {"sleep_seconds": 0.05}, tenant=f"t{n % 3}")
    wait_for(
        lambda: sum(effect_count("record", t) for t in first) >= 10, timeout=60, what="running"
    )
    # When the worker with it on goes, with jobs still in the lanes
    new.stop()
    time.sleep(11)  # (its mark on the queue lapses: the producer's puts go to the queue)
    # ...and the producer publishes more
    later = [f"{run}-later-{n}" for n in range(10)]
    for n, token in enumerate(later):
        task.apply_async((token,), tenant=f"t{n % 3}")

    # Then every job runs once, on the other worker
    def ended() -> bool:
        return all(
            (r := producer.ledger.get(task.name, t)) is not None and r.state is State.SUCCEEDED
            for t in first + later
        )

    wait_for(ended, timeout=120, interval=0.5, what="every job succeeded")
    assert [t for t in first + later if effect_count("record", t) != 1] == []
    assert old.alive()
    producer.close()


def test_a_dead_jobs_kept_message_keeps_the_tenant_its_call_gave(own: EmbeddedStack) -> None:
    # Given a job whose tenant only its call names, which fails for good on a worker
    worker = start_healing_worker(own, "tenants-dead", concurrency=1)
    producer = producer_app(own, f"tenants_{uuid.uuid4().hex[:6]}", dedupe_on_publish=False)
    task = shared_task(producer, "tests.integration.ledger_app.fails_until_fixed")
    token = f"dead-{uuid.uuid4().hex[:8]}"
    task.apply_async((token,), tenant="acme")
    wait_for(
        lambda: (r := producer.ledger.get(task.name, token)) is not None and r.state is State.DEAD,
        timeout=60,
        what="the job dead",
    )
    # Then the message the ledger keeps to replay it names the tenant (no record at publish:
    # the claim kept it), so a replay or a republish dispatches it as the tenant's again
    document = producer.ledger.collection.find_one({"task": task.name, "key": token})
    assert document is not None
    assert document["message"]["headers"]["ledger_tenant"] == "acme"
    assert producer.ledger.get(task.name, token).tenant == "acme"  # type: ignore[union-attr]
    assert worker.alive()
    producer.close()


def test_a_refill_passes_over_at_most_a_batch_of_tenants_at_their_limit(
    client: redis.Redis,
) -> None:
    # Given 300 tenants each at its limit of one (a job running), each with one more waiting
    fair, queue = fed(client, depth=1000)
    fair.write_policies([queue], {"*": TenantPolicy(concurrency=1)})
    for n in range(300):
        fair.renew(queue, f"t{n}", f"t{n}-a", 60)  # (its slot, as a running body keeps it)
        fair.put(queue, f"t{n}", 0, envelope(f"t{n}-b", f"t{n}"))
    assert client.llen(queue) == 0 and client.llen(f"{queue}:fair:ring") == 300
    # When the last one's job ends, the refill passes over at most a batch (100) of the
    # others before it stops (a script that read 300 at every take would hold the broker)
    assert fair.release(queue, "t299", "t299-a") == 0
    # ...and the refills after it go on where it stopped, reaching that tenant's next job
    moved = [fair.refill(queue) for _ in range(3)]
    assert sum(moved) == 1
    assert json.loads(client.lindex(queue, 0))["headers"]["id"] == "t299-b"  # type: ignore[arg-type]


def test_a_take_through_the_transport_refills_its_queue_in_the_same_round_trip(
    own: EmbeddedStack,
) -> None:
    # Given a tenant's 10 jobs with fair dispatch on, the queue kept 1 deep (9 in its lane)
    from kombu import Consumer, Queue

    producer = producer_app(own, f"tenants_{uuid.uuid4().hex[:6]}", fair_queue_depth=1)
    queue = producer.tiers.queue("default")
    producer.runtime.fair.feed(queue)  # (as a worker of this release marks it)
    task = shared_task(producer, RECORD)
    run = uuid.uuid4().hex[:8]
    for n in range(10):
        task.apply_async((f"{run}-{n}",), priority=n % 2 * 9, tenant="acme")
    client = redis.Redis.from_url(producer.settings.broker_url)
    lists = [queue_list(queue, step) for step in (0, 3, 6, 9)]
    assert sum(client.llen(name) for name in lists) == 1
    assert producer.runtime.fair.waiting(queue) == {"acme": 9}
    # When a consumer takes one through the transport (kombu's BRPOP, then the booking)
    taken: list[Any] = []
    with producer.connection_for_read() as connection:
        consumer = Consumer(
            connection.default_channel,
            queues=[Queue(queue)],
            callbacks=[lambda body, message: taken.append(message)],
        )
        with consumer:
            connection.drain_events(timeout=10)
        # Then the booking's pipeline moved the next one from the lane: the queue is 1 deep
        assert len(taken) == 1
        assert sum(client.llen(name) for name in lists) == 1
        assert producer.runtime.fair.waiting(queue) == {"acme": 8}
        # ...of the higher priority first (kombu's priority 0 is served first)
        assert client.llen(queue_list(queue, 0)) == 1
        taken[0].requeue()
    producer.close()


def test_a_ring_that_lost_its_tenants_is_made_again_and_a_bad_policy_is_the_default(
    client: redis.Redis,
) -> None:
    fair, queue = fed(client, depth=1)
    for tenant in ("a", "b", "c"):
        for n in range(3):
            fair.put(queue, tenant, 0, envelope(f"{tenant}-{n}", tenant))
    # An eviction (or a hand) takes the ring, and a policy is in a form this release does not
    # write (another release's): every tenant is still fed, none is stranded, no script fails
    client.delete(f"{queue}:fair:ring")
    client.hset(f"{queue}:fair:policy", mapping={"b": "3", "*": "x,y"})
    seen = [take(client, fair, queue)["headers"]["id"] for _ in range(9)]  # type: ignore[index]
    assert sorted(seen) == sorted(f"{t}-{n}" for t in "abc" for n in range(3))
    assert fair.waiting(queue) == {} and client.get(f"{queue}:fair:waiting") is None


def test_a_job_enqueued_in_a_transaction_keeps_its_tenant(own: EmbeddedStack) -> None:
    # Found by the chaos soak: an outbox job's kept message had no tenant, so the relay (or the
    # publish after the commit) sent it straight to the tier queue, past its tenant's lane and
    # concurrency limit, and its record named no tenant.
    # Given no worker and a tier queue one message deep, fed from lanes, already holding a
    # tenant's job
    producer = producer_app(own, f"tenants_{uuid.uuid4().hex[:6]}", fair_queue_depth=1)
    task = shared_task(producer, RECORD)
    queue = producer.tiers.queue("default")
    producer.runtime.fair.feed(queue)  # (as a worker of this release)
    run = uuid.uuid4().hex[:8]
    task.apply_async((f"{run}-first",), tenant="acme")
    client = redis.Redis.from_url(own.broker.url)  # type: ignore[union-attr]

    # When another job of that tenant is enqueued in the app's transaction and committed
    def checkout(session: Any) -> None:
        task.apply_async((f"{run}-in-transaction",), tenant="acme", session=session)

    producer.outbox.transaction(checkout)

    # Then it waits in the tenant's lane (not in the queue, past the dispatch) and its record
    # names the tenant
    lane = f"{queue}:fair:lane:0:acme"
    wait_for(lambda: client.llen(lane) == 1, timeout=10, what="the job in its tenant's lane")
    waiting = [json.loads(m)["properties"].get("ledger_tenant") for m in client.lrange(lane, 0, -1)]
    assert waiting == ["acme"]
    assert client.llen(queue) == 1
    record = producer.ledger.get(task.name, f"{run}-in-transaction")
    assert record is not None and record.tenant == "acme"
    client.close()
    producer.close()


def test_a_tenants_rate_holds_across_the_fleet_and_others_run_unhindered(
    own: EmbeddedStack,
) -> None:
    # Given a tenant limited to 2 jobs a second (a burst of 1), on a fleet of two workers, and
    # fair dispatch off (a rate holds with or without lanes)
    tenants = json.dumps({"slow": {"rate_per_second": 2, "burst": 1}})
    workers = [
        start_healing_worker(own, "tenants", concurrency=2, env={"LEDGER_TENANTS": tenants})
        for _ in range(2)
    ]
    producer = producer_app(own, f"tenants_{uuid.uuid4().hex[:6]}")
    task = shared_task(producer, RECORD)
    run = uuid.uuid4().hex[:8]
    slow = [f"{run}-slow-{n}" for n in range(8)]
    fast = [f"{run}-fast-{n}" for n in range(8)]
    # When both tenants publish at once
    for s, f in zip(slow, fast, strict=True):
        task.apply_async((s,), tenant="slow")
        task.apply_async((f,), tenant="fast")

    def ran(tokens: list[str]) -> bool:
        return all(effect_count("record", t) == 1 for t in tokens)

    wait_for(lambda: ran(slow + fast), timeout=90, interval=0.5, what="every job ran")
    found = effects().find({"kind": "record", "key": {"$regex": f"^{run}"}})
    at = {effect["key"]: effect["at"].replace(tzinfo=UTC) for effect in found}
    # Then the limited tenant's jobs ran no faster than its rate (8 jobs, a burst of 1, 2 a
    # second: at least 3.5 s from the first to the last), the other's were not held back
    # (all done before the limited tenant's last), and every job ran once
    starts = sorted(at[t] for t in slow)
    assert (starts[-1] - starts[0]).total_seconds() >= 3.5 * 0.95, starts
    assert max(at[t] for t in fast) < starts[-1]
    assert [t for t in slow + fast if effect_count("record", t) != 1] == []
    assert all(worker.alive() for worker in workers)
    producer.close()


def test_a_limit_holds_where_bodies_start_when_slots_lapse_in_a_busy_queue(
    own: EmbeddedStack,
) -> None:
    # Given a tenant limited to one body at once, its slots lapsing after 4 s (the lease), and
    # its jobs published behind 8 s of untenanted work of a higher priority for a worker of
    # two processes: its moved job waits past its lease, so its slot lapses and the next of
    # its jobs is moved in its place once the queue is short again; both reach the worker
    limits = {"capped": {"concurrency": 1}}
    producer = producer_app(
        own,
        f"tenants_{uuid.uuid4().hex[:6]}",
        fair_queue_depth=2,
        lease_seconds=4,
        tenants=limits,
    )
    fair, queue = producer.runtime.fair, producer.runtime.tiers.queue("default")
    fair.write_policies([queue], producer.settings.tenants)  # (what a worker does at its start)
    fair.feed(queue)
    spanned = shared_task(producer, "tests.integration.ledger_app.spanned")
    busy = shared_task(producer, RECORD)
    run = uuid.uuid4().hex[:8]
    capped = [f"{run}-capped-{n}" for n in range(4)]
    others = [f"{run}-other-{n}" for n in range(16)]
    for token in capped:
        spanned.apply_async((token, 1.0), tenant="capped", priority=9)
    for token in others:
        busy.apply_async((token,), {"sleep_seconds": 1.0}, priority=0)
    assert fair.waiting(queue) == {"capped": 3}  # one moved, three in the lane
    env = {
        **FAIR,
        "LEDGER_LEASE_SECONDS": "4",
        "LEDGER_BUSY_RECHECK_SECONDS": "1",
        "LEDGER_TENANTS": json.dumps(limits),
    }
    worker = start_healing_worker(own, "tenants", concurrency=2, env=env)
    # When they all run
    wait_for(
        lambda: (
            all(effect_count("span", t) >= 1 for t in capped)
            and all(effect_count("record", t) >= 1 for t in others)
        ),
        timeout=120,
        interval=0.5,
        what="every job ran",
    )
    # Then the tenant never had two bodies at once (the second to start waited its turn)
    spans = sorted(
        (e["started"], e["ended"], e["key"])
        for e in effects().find({"kind": "span", "key": {"$in": capped}})
    )
    overlaps = [(a[2], b[2]) for a in spans for b in spans if a[0] < b[0] < a[1] - 0.05]
    assert overlaps == [], f"capped bodies at once: {overlaps}"
    # and the case arose (a start found its tenant at its limit), and each job ran once
    assert "at its concurrency limit (capped)" in worker.log_path.read_text(errors="replace")
    assert [t for t in capped if effect_count("span", t) != 1] == []
    assert [t for t in others if effect_count("record", t) != 1] == []
    assert worker.alive()
    producer.close()


def express_ids(client: redis.Redis, queue: str) -> list[str]:
    """The express list's messages, oldest (first taken) first."""
    items = client.lrange(express_list(queue, 0), 0, -1)
    return [json.loads(item)["headers"]["id"] for item in reversed(items)]


def test_with_an_express_process_a_newcomer_goes_to_the_express_lists_in_order(
    client: redis.Redis,
) -> None:
    # Given a big tenant's backlog on a queue whose worker keeps an express process
    fair, queue = fed(client, depth=1)
    fair.feed(queue, express=True)
    for n in range(20):
        fair.put(queue, "big", 0, envelope(f"big-{n}", "big"))
    # When two newcomers go ahead (the ring moving in between)
    assert fair.put(queue, "a", 0, envelope("a-0", "a")) == 1
    assert ids(client, fair, queue, 1) == ["big-0"]  # (a take from the queue alone)
    assert fair.put(queue, "b", 0, envelope("b-0", "b")) == 1
    # Then they wait in the express list, first in first out, and the queue keeps its staging
    assert express_ids(client, queue) == ["a-0", "b-0"]
    assert [json.loads(i)["headers"]["id"] for i in client.lrange(queue, 0, -1)] == ["big-1"]
    # ...where the reconciler sees them (not missing: never published again), as the depth does
    broker = RedisBroker(client, queues=[queue], delayed_key=f"{queue}:delayed")
    assert len(broker.waiting()) == 21 and broker.depth() == 21  # (19 of big's, a-0, b-0)
    # When no worker marks the queue for its express process any more (the mark lapsed: a
    # rollback, every such worker gone), the next refill moves them to the queue's front, in order
    client.delete(f"{queue}:fair:express")
    fair.refill(queue)
    assert client.llen(express_list(queue, 0)) == 0
    assert ids(client, fair, queue, 3) == ["a-0", "b-0", "big-1"]
    # A drain (before a rollback) moves them too, the mark there or not
    fair.feed(queue, express=True)
    assert fair.put(queue, "c", 0, envelope("c-0", "c")) == 1
    assert express_ids(client, queue) == ["c-0"]
    while fair.drain(queue):
        pass
    assert client.llen(express_list(queue, 0)) == 0
    assert ids(client, fair, queue, 2) == ["c-0", "big-2"]


def test_a_newcomer_runs_in_the_express_process_while_the_flood_holds_every_slot(
    own: EmbeddedStack,
) -> None:
    # Given a worker of one process (and its express process) running a big tenant's job that
    # holds it until the test releases it, the rest of the backlog waiting
    worker = start_healing_worker(own, "express", concurrency=1, env=FAIR)
    producer = producer_app(own, f"tenants_{uuid.uuid4().hex[:6]}", fair_queue_depth=2)
    task = shared_task(producer, RECORD)
    run = uuid.uuid4().hex[:8]
    big = [f"{run}-big-{n}" for n in range(5)]
    for token in big:
        task.apply_async((token,), {"sleep_seconds": 90, "held": True}, tenant="big")

    def state(token: str) -> State | None:
        record = producer.ledger.get(task.name, token)
        return None if record is None else record.state

    wait_for(lambda: state(big[0]) is State.RUNNING, timeout=60, what="the flood's job running")
    # When a small tenant's job arrives
    small = f"{run}-small"
    task.apply_async((small,), tenant="small")
    # Then it runs beside the flood's job, not after it: nothing ended to free a process
    wait_for(lambda: effect_count("record", small) == 1, timeout=30, what="the newcomer ran")
    assert effect_count("record", big[0]) == 0 and state(big[0]) is State.RUNNING
    assert [t for t in big[1:] if state(t) is not State.QUEUED] == []  # (the flood waits)
    # ...and when the flood is released every job runs once
    for token in big:
        record_effect("release", token)
    wait_for(
        lambda: all(state(t) is State.SUCCEEDED for t in big),
        timeout=120,
        interval=0.5,
        what="the flood succeeded",
    )
    assert [t for t in [*big, small] if effect_count("record", t) != 1] == []
    assert worker.alive()
    producer.close()
