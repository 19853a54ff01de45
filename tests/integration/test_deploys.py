"""Several apps on one broker, and rolling deploys: each app's workers take only its own jobs,
and a job no worker can run yet waits for one that can instead of dying."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ledger import LedgerCelery, State
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess
from celery_ledger.identity import derive_task_id
from celery_ledger.ledger.message import KeptMessage

from .conftest import producer_app
from .helpers import effect_count, wait_for

StartWorker = Callable[..., WorkerProcess]


@pytest.fixture
def start_worker(stack: EmbeddedStack, tmp_path: Path) -> Iterator[StartWorker]:
    """Workers of other app modules on the session's servers (stopped after the test)."""
    started: list[WorkerProcess] = []

    def start(
        module: str,
        namespace: str,
        name: str,
        *,
        tiers: tuple[str, ...] = (),
        pool: str = "prefork",
        **env: str,
    ) -> WorkerProcess:
        other = EmbeddedStack(
            module,
            tmp_path,
            broker=stack.broker,
            ledger=stack.ledger,
            queue_namespace=namespace,
        )
        worker = other.start_worker(
            other.queues_of(*tiers), concurrency=1, name=f"{name}@127.0.0.1", pool=pool, env=env
        )
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def producer(stack: EmbeddedStack, name: str, **settings: Any) -> LedgerCelery:
    """An app of its own name, on its own queues (the namespace defaults to the app's name)."""
    app: LedgerCelery = producer_app(stack, name, queue_namespace=None, **settings)
    return app


def dead_records(app: LedgerCelery, ids: list[str]) -> list[str]:
    return [i for i in ids if (app.ledger.resolve(i) or {}).get("state") == State.DEAD.value]


def test_two_apps_on_one_broker_never_take_each_others_jobs(
    stack: EmbeddedStack, start_worker: StartWorker
) -> None:
    # Given two apps on one broker, each with a task "deploys.whoami" of the default tier
    start_worker("tests.integration.apps.deploy_v1", "deploys", "deploys-1")
    start_worker("tests.integration.apps.other", "other_tests", "other-1")
    deploys = producer(stack, "deploys")
    other = producer(stack, "other_tests", ledger_collection="other_ledger")
    tokens = [uuid.uuid4().hex[:10] for _ in range(10)]
    # When each publishes jobs to its default tier
    results_ours = [
        deploys.send_task(
            "deploys.whoami",
            (t,),
            queue=deploys.tiers.queue("default"),
            headers={"ledger_key": t},
        ).get(timeout=30)
        for t in tokens
    ]
    theirs_results = [
        other.send_task(
            "deploys.whoami",
            (t,),
            queue=other.tiers.queue("default"),
            headers={"ledger_key": t},
        ).get(timeout=30)
        for t in tokens
    ]
    # Then every job ran on its own app's workers, once
    assert results_ours == ["deploys"] * len(tokens)
    assert theirs_results == ["other_tests"] * len(tokens)
    assert all(effect_count("whoami-deploys", t) == 1 for t in tokens)
    assert all(effect_count("whoami-other", t) == 1 for t in tokens)
    deploys.close()
    other.close()


def test_a_rolling_deploy_runs_a_new_task_once_and_dead_letters_nothing(
    stack: EmbeddedStack, start_worker: StartWorker
) -> None:
    assert stack.broker is not None
    # Given only workers of version 1 (no new_feature task, greet without its new argument)
    start_worker("tests.integration.apps.deploy_v1", "deploys", "old-1")
    app = producer(stack, "deploys")
    token = uuid.uuid4().hex[:10]
    # When version 2's producers publish a new task and a call with the new argument
    new = app.send_task(
        "deploys.new_feature",
        (token,),
        queue=app.tiers.queue("default"),
        headers={"ledger_key": token},
    )
    greet = app.send_task(
        "deploys.greet",
        (token, "hi"),
        queue=app.tiers.queue("critical"),
        headers={"ledger_key": token},
    )
    # Then the old workers put both off, as sent, instead of killing them
    delayed = redis.Redis.from_url(stack.broker.url)

    def held() -> set[str]:
        members = [m.decode() for m in delayed.zrange(app.runtime.delayed.key, 0, -1)]
        return {i for i in (new.id, greet.id) if any(i in m for m in members)}

    wait_for(lambda: held() == {new.id, greet.id}, what="both held for a worker that can")
    time.sleep(20)  # the deploy takes its time
    # and once a version 2 worker is up, each runs exactly once
    start_worker("tests.integration.apps.deploy_v2", "deploys", "new-1")
    # (an old worker may take a message again and put it off once more: both still run)
    assert new.get(timeout=90) == "new"
    assert greet.get(timeout=90) == "hi"
    assert effect_count("new_feature", token) == 1
    assert effect_count("greet", token) == 1
    # and nothing was dead-lettered on the way
    assert dead_records(app, [new.id, greet.id]) == []
    assert delayed.llen(app.dead_letters.poison_key) == 0
    assert delayed.llen(app.tiers.dead_letter_queue) == 0
    app.close()


@pytest.mark.parametrize("publish", ["plain message", "record at publish"])
def test_a_task_no_worker_ever_knows_is_dead_after_the_window(
    stack: EmbeddedStack, start_worker: StartWorker, publish: str
) -> None:
    start_worker(
        "tests.integration.apps.deploy_v1",
        "deploys",
        f"window-{publish.replace(' ', '-')}",
        LEDGER_UNRUNNABLE_WINDOW_SECONDS="4",
    )
    app = producer(stack, "deploys")
    token = uuid.uuid4().hex[:10]
    if publish == "plain message":  # no record until a worker claims it
        result = app.send_task(
            "deploys.never_deployed",
            (token,),
            queue=app.tiers.queue("default"),
            headers={"ledger_key": token},
        )
    else:
        # A producer of a release no worker runs: its publish writes the job's queued record
        # (dedupe on publish, the default), which must die with the message, not wait for ever

        @app.task(name="deploys.never_deployed", idempotency_key="{token}", shared=False)
        def never_deployed(token: str) -> str:
            return token

        result = never_deployed.delay(token)
    record_id = derive_task_id("deploys.never_deployed", token)
    record = wait_for(
        lambda: (
            (doc := app.ledger.find_raw(record_id)) is not None
            and doc.get("state") == State.DEAD.value
            and doc
        ),
        timeout=40,
        what="the unknown task dead-lettered after its window",
    )
    assert record["dead_reason"].startswith("unknown task 'deploys.never_deployed'")
    assert record["death"] == "unknown-task"
    assert app.ledger.resolve(result.id)["_id"] == record_id  # its message id finds it
    app.close()


# An able worker up, the parked message is in its inbox within a look (1 s) and runs when the
# worker has room: this bound leaves a loaded CI machine its margin.
HANDOFF_BOUND_SECONDS = 15.0


@pytest.mark.parametrize(
    ("unable", "able", "order"),
    [
        (1, 1, "able-later"),  # the deploy's first new worker comes up after the publish
        (3, 1, "able-later"),  # most of the fleet still old
        (1, 3, "able-first"),  # most of the fleet new
        (1, 1, "able-idle"),  # the new worker idle long before the job comes
    ],
    ids=["1:1-able-later", "3:1-able-later", "1:3-able-first", "1:1-able-idle"],
)
def test_a_job_only_some_workers_can_run_reaches_one_of_them_within_seconds(
    stack: EmbeddedStack, start_worker: StartWorker, unable: int, able: int, order: str
) -> None:
    """The handoff: whatever the mix, a message the old workers cannot run (a new task, a new
    argument) is parked by them and taken by a new worker, not left to the race for the
    queue; it runs once, and nothing is dead-lettered."""
    assert stack.broker is not None
    run = uuid.uuid4().hex[:6]
    app = producer(stack, "deploys")
    broker = redis.Redis.from_url(stack.broker.url)

    def start(module: str, name: str, count: int) -> None:
        for i in range(count):
            start_worker(f"tests.integration.apps.{module}", "deploys", f"{name}{i}-{run}")

    if order != "able-later":
        start("deploy_v2", "new", able)
        if order == "able-idle":
            time.sleep(15.0)  # idle: its consumer and its look at the parked long settled
    start("deploy_v1", "old", unable)
    tokens = [f"{run}-{i}" for i in range(3)]
    jobs = []
    for token in tokens:
        jobs.append(
            app.send_task(
                "deploys.new_feature",
                (token,),
                queue=app.tiers.queue("default"),
                headers={"ledger_key": token},
            )
        )
        jobs.append(
            app.send_task(
                "deploys.greet",
                (token, "hi"),
                queue=app.tiers.queue("critical"),
                headers={"ledger_key": token},
            )
        )
    if order == "able-later":
        parking = app.runtime.parking
        wait_for(lambda: parking.count() >= 1, what="the old workers parking what they can't run")
        time.sleep(2.0)
        start("deploy_v2", "new", able)
    up = time.monotonic()
    assert [job.get(timeout=60) for job in jobs] == ["new", "hi"] * len(tokens)
    waited = time.monotonic() - up
    assert waited < HANDOFF_BOUND_SECONDS, f"the last job ran {waited:.1f}s after a new worker"
    for token in tokens:
        assert effect_count("new_feature", token) == 1
        assert effect_count("greet", token) == 1
    assert dead_records(app, [job.id for job in jobs]) == []
    assert broker.llen(app.dead_letters.poison_key) == 0
    # Every parked entry was received (the index empties: nothing waits for a later bounce)
    ids = {job.id for job in jobs}
    wait_for(
        lambda: not [p for p in app.runtime.parking.all() if p.raw["headers"]["id"] in ids],
        timeout=10,
        what="the parked entries done",
    )
    app.close()


@pytest.mark.parametrize(
    ("new", "old", "order"),
    [(3, 1, "old-idle"), (1, 1, "old-later")],
    ids=["3:1-old-idle", "1:1-old-later"],
)
def test_a_task_the_new_release_removed_runs_on_the_old_workers_while_they_last(
    stack: EmbeddedStack, start_worker: StartWorker, new: int, old: int, order: str
) -> None:
    """The other way round: the new release removed a task that producers of the old one
    still send. The new workers park it; an old worker (idle for a while, or up only after
    the publish) takes it and runs it once; nothing is dead-lettered while one is up."""
    run = uuid.uuid4().hex[:6]
    app = producer(stack, "deploys")

    def start(module: str, name: str, count: int) -> None:
        for i in range(count):
            start_worker(f"tests.integration.apps.{module}", "deploys", f"{name}{i}-{run}")

    start("deploy_v3", "new", new)
    if order == "old-idle":
        start("deploy_v1", "old", old)
        time.sleep(15.0)  # idle: its consumer and its look at the parked long settled
    tokens = [f"{run}-{i}" for i in range(3)]
    jobs = [
        app.send_task(
            "deploys.whoami",
            (token,),
            queue=app.tiers.queue("default"),
            headers={"ledger_key": token},
        )
        for token in tokens
    ]
    if order == "old-later":
        parking = app.runtime.parking
        wait_for(lambda: parking.count() >= 1, what="the new workers parking the removed task")
        start("deploy_v1", "old", old)
    up = time.monotonic()
    assert [job.get(timeout=60) for job in jobs] == ["deploys"] * len(tokens)
    assert time.monotonic() - up < HANDOFF_BOUND_SECONDS
    assert all(effect_count("whoami-deploys", token) == 1 for token in tokens)
    assert dead_records(app, [job.id for job in jobs]) == []
    app.close()


def test_a_worker_takes_only_what_its_tiers_serve_whatever_its_pool(
    stack: EmbeddedStack, start_worker: StartWorker
) -> None:
    """A new worker that serves the critical tier only (on the threads pool) takes the parked
    critical job and leaves the default one parked, for a worker of its tier."""
    run = uuid.uuid4().hex[:6]
    app = producer(stack, "deploys")
    start_worker("tests.integration.apps.deploy_v1", "deploys", f"old-{run}")
    token = f"tiers-{run}"
    new = app.send_task(
        "deploys.new_feature",
        (token,),
        queue=app.tiers.queue("default"),
        headers={"ledger_key": token},
    )
    greet = app.send_task(
        "deploys.greet",
        (token, "hi"),
        queue=app.tiers.queue("critical"),
        headers={"ledger_key": token},
    )
    wait_for(lambda: app.runtime.parking.count() >= 2, what="both parked by the old worker")
    start_worker(
        "tests.integration.apps.deploy_v2",
        "deploys",
        f"crit-{run}",
        tiers=("critical",),
        pool="threads",
    )
    assert greet.get(timeout=30) == "hi"
    time.sleep(3.0)  # several looks of the critical worker at the parked default job
    assert effect_count("new_feature", token) == 0
    wait_for(  # (between the bounces of its backoff it is parked, not run)
        lambda: new.id in {p.raw["headers"]["id"] for p in app.runtime.parking.all()},
        timeout=15,
        what="the default job still parked",
    )
    start_worker("tests.integration.apps.deploy_v2", "deploys", f"dflt-{run}", tiers=("default",))
    assert new.get(timeout=30) == "new"
    assert effect_count("new_feature", token) == 1 and effect_count("greet", token) == 1
    app.close()


@pytest.mark.parametrize("lost", ["committed-unpublished", "lost-in-flight"])
def test_a_new_tasks_job_an_old_sweeper_holds_reaches_a_new_worker(
    stack: EmbeddedStack, start_worker: StartWorker, lost: str
) -> None:
    """Mid-deploy, the fleet's outbox relay and reconciler run on an old worker (the first up
    holds their leases). A job of a task only the new release has, committed by a producer
    that died before its publish, or published and its message lost, is brought back by the
    old worker all the same (its record names this fleet), and the handoff runs it once on
    a new worker, long before the deploy is done."""
    assert stack.broker is not None
    run = uuid.uuid4().hex[:6]
    quick = {  # (the session's workers leave the sweeps to the tests that drive them)
        "LEDGER_RECONCILE_IN_WORKERS": "true",
        "LEDGER_OUTBOX_RELAY_IN_WORKERS": "true",
        "LEDGER_RECONCILE_EVERY_SECONDS": "1",
        "LEDGER_RECONCILE_STALE_AFTER_SECONDS": "3",
    }
    old = start_worker("tests.integration.apps.deploy_v1", "deploys", f"old-{run}", **quick)
    app = producer(stack, "deploys")
    broker = redis.Redis.from_url(stack.broker.url)
    lock = (
        "deploys:ledger:outbox" if lost == "committed-unpublished" else "deploys:ledger:reconciler"
    )

    def holder() -> str:
        return (broker.get(lock) or b"").decode()

    wait_for(lambda: f":{old.pid}|" in holder(), what="the old worker holding the sweep's lease")
    start_worker("tests.integration.apps.deploy_v2", "deploys", f"new-{run}", **quick)
    # Given a job of the new task the ledger knows, whose message never reached the broker
    token = f"{run}-job"
    record_id = derive_task_id("deploys.new_feature", token)
    kept = KeptMessage.of_call([token], {}, message_headers={"ledger_key": token})
    app.ledger.enqueue(
        record_id, task="deploys.new_feature", key=token, tier="default", message=kept
    )
    if lost == "committed-unpublished":
        app.ledger.mark_unpublished(record_id)  # what a committed outbox write holds
    # Then it runs once, on the new worker, while the old one still holds the lease
    assert app.AsyncResult(record_id).get(timeout=60) == "new"
    assert effect_count("new_feature", token) == 1
    assert f":{old.pid}|" in holder()
    assert dead_records(app, [record_id]) == []
    app.close()
