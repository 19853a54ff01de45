"""Tenants seen (issue 40): each tier's tenants in the metrics and the console (the most
waiting by name, the rest as ``other``), a tenant's refusals counted, and the ledger's records
found by tenant (``ledger show --tenant``, ``ledger dlq list --tenant``), on real servers: the
session's valkey and SecantusDB, and its worker for the jobs that die.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from argparse import Namespace
from typing import Any

import httpx
import pytest
import redis
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from celery_ledger import Observer, State
from celery_ledger.cli.commands import show
from celery_ledger.cli.dlq import dlq
from celery_ledger.cli.tenants import tenants
from celery_ledger.embedded.stack import EmbeddedStack
from celery_ledger.observability.exporter import StateCollector

from .conftest import producer_app
from .helpers import shared_task, wait_for
from .test_console import OPERATOR, served

RECORD = "tests.integration.ledger_app.record"


class Refusals(Observer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def tenant_refused(self, tier: str, tenant: str, policy: str) -> None:
        self.seen.append((tier, tenant, policy))


@pytest.fixture
def unconsumed(stack: EmbeddedStack) -> Any:
    """A producer of its own tier queues (no worker takes them: its jobs stay where fair
    dispatch put them), two tenants named per tier, a tenant limited to one slot, and a
    tenant's max_waiting of 5 on a tier that sheds."""
    run = uuid.uuid4().hex[:8]
    producer = producer_app(
        stack,
        f"seen_{run}",
        queue_namespace=f"seen-{run}",
        fair_queue_depth=1,
        tenants_top=2,
        tenants={"capped": {"concurrency": 1}, "*": {"max_waiting": 5}},
        tier_limits={"default": {"policy": "shed", "high_water": 100000}},
        console_users={OPERATOR[0]: {"password": OPERATOR[1], "role": "operator"}},
    )
    queues = [producer.tiers.queue(tier) for tier in producer.tiers.names]
    fair = producer.runtime.fair
    fair.write_policies(queues, producer.settings.tenants)  # (as a worker does at start)
    for queue in queues:  # and as it marks the queues it feeds from the lanes (none here)
        fair.feed(queue, seconds=300)
    yield producer, run
    producer.close()


def test_each_tiers_tenants_are_gauged_shown_and_listed(unconsumed: Any) -> None:
    producer, run = unconsumed
    task = shared_task(producer, RECORD)
    assert task.app is producer
    tier = producer.tier_of(task.name)
    refusals = producer.runtime.observers.add(Refusals())
    # Given the capped tenant's two jobs (one moved to the queue, holding its only slot; one
    # waiting), then 6 of a flood (its first goes ahead of the queued one: the flood had
    # nothing waiting), 2 of a calm tenant and 1 of a tiny one, all waiting
    for n in range(2):
        task.apply_async((f"{run}-capped-{n}",), tenant="capped")
    for name, count in (("flood", 6), ("calm", 2), ("tiny", 1)):
        for n in range(count):
            task.apply_async((f"{run}-{name}-{n}",), tenant=name)

    # When the worker's exporter is scraped
    registry = CollectorRegistry()
    registry.register(StateCollector(producer.runtime, [], tenants_top=2))

    def gauge(name: str, tenant: str) -> float | None:
        return registry.get_sample_value(name, {"tier": tier, "tenant": tenant})

    # Then the two most waiting are named, and the capped and tiny tenants summed as other
    assert gauge("celery_ledger_tenant_waiting", "flood") == 5
    assert gauge("celery_ledger_tenant_waiting", "calm") == 2
    assert gauge("celery_ledger_tenant_waiting", "other") == 2
    assert gauge("celery_ledger_tenant_running", "other") == 1  # the capped one's slot
    assert gauge("celery_ledger_tenant_waiting", "tiny") is None
    assert gauge("celery_ledger_tenant_waiting", "capped") is None

    # And the console's overview shows the same rows for the tier
    with served(producer) as url, httpx.Client(base_url=url, timeout=20) as client:
        login = client.get("/login").text
        csrf = re.search(r'name="csrf" value="([^"]+)"', login)
        assert csrf is not None
        client.post("/login", data={"user": OPERATOR[0], "password": OPERATOR[1], "csrf": csrf[1]})
        page = client.get("/").text
    rows = re.findall(
        rf'<tr data-tier="{tier}" data-tenant="([^"]+)">.*?'
        r'class="num waiting">(\d+)</td><td class="num running">(\d+)</td>',
        page,
        re.S,
    )
    assert rows == [("flood", "5", "0"), ("calm", "2", "0"), ("other", "2", "1")]
    assert "(2 tenants)" in page

    # And the flood's next job, past its max_waiting of 5, is shed (the tier's policy) and
    # reported; another tenant's publish goes on
    time.sleep(1.1)  # (a producer reads a tenant's count at most once a second)
    task.apply_async((f"{run}-flood-shed",), tenant="flood")
    task.apply_async((f"{run}-calm-late",), tenant="calm")
    assert refusals.seen == [(tier, "flood", "shed")]
    shed = producer.ledger.get(task.name, f"{run}-flood-shed")
    assert shed is not None and shed.state is State.DEAD and shed.tenant == "flood"

    # And `ledger dlq list --tenant flood` finds the shed job, and no other tenant's
    listed = CliRunner().invoke(
        dlq, ["list", "--tenant", "flood", "--records", "--json"], obj=Namespace(app=producer)
    )
    assert listed.exit_code == 0, listed.output
    found = [row for row in json.loads(listed.output) if row["key"].startswith(run)]
    assert [(row["key"], row["tenant"]) for row in found] == [(f"{run}-flood-shed", "flood")]


def test_ledger_tenants_lists_each_tiers_tenants_and_drains_their_lanes(unconsumed: Any) -> None:
    producer, run = unconsumed
    task = shared_task(producer, RECORD)
    tier = producer.tier_of(task.name)
    queue = producer.tiers.queue(tier)
    for name, count in (("flood", 4), ("calm", 2)):
        for n in range(count):
            task.apply_async((f"{run}-{name}-{n}",), tenant=name)
    obj = Namespace(app=producer)
    # `ledger tenants list` shows who waits (the flood's first was moved to the queue at its
    # put, and the calm tenant's first went ahead of it: the calm one had nothing waiting)
    listed = CliRunner().invoke(tenants, ["list", "--tier", tier, "--json"], obj=obj)
    assert listed.exit_code == 0, listed.output
    rows = {(r["tenant"], r["waiting"], r["max_waiting"]) for r in json.loads(listed.output)}
    assert rows == {("flood", 3, 5), ("calm", 1, 5)}
    table = CliRunner().invoke(tenants, ["list"], obj=obj)
    assert table.exit_code == 0 and "flood" in table.output, table.output
    # `ledger tenants drain` moves them all to the queue, in each tenant's order, audited
    drained = CliRunner().invoke(
        tenants, ["drain", "--tier", tier, "--yes", "--actor", "ops"], obj=obj
    )
    assert drained.exit_code == 0, drained.output
    assert f"{tier}: 4 moved to {queue}" in drained.output
    assert producer.runtime.fair.waiting(queue) == {}
    assert redis.Redis.from_url(producer.settings.broker_url).llen(queue) == 6
    # A tier that does not exist is a one-line mistake, no traceback
    wrong = CliRunner().invoke(tenants, ["list", "--tier", "nope"], obj=obj)
    assert wrong.exit_code != 0 and "Traceback" not in wrong.output


def test_ledger_show_and_dlq_list_find_a_tenants_records(app: Any, token: str) -> None:
    from tests.integration.ledger_app import boom, record

    tenant, other = f"acme-{token}", f"globex-{token}"
    # Given two of a tenant's jobs that die, one of another tenant's, and one that succeeds
    doomed = [boom.apply_async((f"{token}-boom-{n}",), tenant=tenant) for n in range(2)]
    theirs = boom.apply_async((f"{token}-boom-theirs",), tenant=other)
    record.apply_async((f"{token}-ok",), tenant=tenant).get(timeout=60)
    for result in [*doomed, theirs]:
        wait_for(
            lambda r=result: (
                (d := app.ledger.get_by_id(r.id)) is not None and d.state is State.DEAD
            ),
            timeout=60,
            what="the job dead",
        )
    # and one of the tenant's dead records without the field, its tenant only in the headers
    # of the message it keeps (as a record written by a publish before the field was kept)
    first = doomed[0].id
    assert app.ledger.find_raw(first)["tenant"] == tenant
    app.ledger.collection.update_one(
        {"_id": first},
        {"$unset": {"tenant": ""}, "$set": {"message.headers.ledger_tenant": tenant}},
    )
    assert "tenant" not in app.ledger.find_raw(first)

    # When the operator lists the tenant's dead jobs
    listed = CliRunner().invoke(
        dlq, ["list", "--tenant", tenant, "--records", "--json"], obj=Namespace(app=app)
    )
    # Then both are there, the record without the field too, and not the other tenant's
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    assert sorted(row["id"] for row in rows) == sorted(r.id for r in doomed)
    assert {row["tenant"] for row in rows} == {tenant}
    grouped = CliRunner().invoke(
        dlq, ["list", "--tenant", tenant, "--json"], obj=Namespace(app=app)
    )
    assert grouped.exit_code == 0 and sum(g["count"] for g in json.loads(grouped.output)) == 2

    # And `ledger show --tenant` lists all three of its records, or only those of a state
    every = CliRunner().invoke(show, ["--tenant", tenant, "--json"], obj=Namespace(app=app))
    assert every.exit_code == 0, every.output
    assert len(json.loads(every.output)) == 3
    dead = CliRunner().invoke(
        show, ["--tenant", tenant, "--state", "dead", "--json"], obj=Namespace(app=app)
    )
    assert sorted(row["_id"] for row in json.loads(dead.output)) == sorted(r.id for r in doomed)
    one = CliRunner().invoke(
        show, ["--tenant", tenant, "--limit", "1", "--json"], obj=Namespace(app=app)
    )
    assert len(json.loads(one.stdout)) == 1 and "more exist" in one.stderr

    # And a job shown by id under another tenant's name is refused, naming its own
    mismatch = CliRunner().invoke(show, [theirs.id, "--tenant", tenant], obj=Namespace(app=app))
    assert mismatch.exit_code == 1 and other in mismatch.output
