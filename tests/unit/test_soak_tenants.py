"""The chaos soak's tenant accounting (ops/chaos/tenants.py): each body's span (its end, or the
kill that ended it), the capped tenant's bodies at once, and what may go over its limit."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from ops.chaos.plan import CAPPED, PROFILES, TENANT_SHARES, plan_jobs, plan_workflows, tenant_of
from ops.chaos.report import Kill, TenantsReport
from ops.chaos.tenants import Span, account_tenants, over_limit, spans_of


def attempt(key: str, at: float, pid: int, *, redelivered: bool = False) -> dict[str, Any]:
    return {"key": key, "at": at, "pid": pid, "fence": 1, "redelivered": redelivered}


def end(key: str, at: float, pid: int) -> dict[str, Any]:
    return {"key": key, "at": at, "pid": pid, "fence": 1}


def span(started: float, ended: float, *, redelivered: bool = False) -> Span:
    return Span(f"k{started}", 1, started, ended, redelivered, 0)


def test_the_plan_gives_most_jobs_a_tenant_and_keeps_a_workflows_steps_in_its_own() -> None:
    jobs = plan_jobs(PROFILES["long"], random.Random(2811), "s1")
    found = Counter(job.tenant for job in jobs)
    # Given the shares, out of 100: each tenant gets about its share, 15% name none
    for tenant, share in TENANT_SHARES.items():
        assert abs(found[tenant] / len(jobs) - share / 100) < 0.03, found
    assert abs(found[None] / len(jobs) - 0.15) < 0.03, found
    flow = plan_workflows(PROFILES["ci"], random.Random(1), "s1")[0]
    assert tenant_of(flow.step_key(2)) == tenant_of(flow.undo_key(0)) == flow.tenant
    assert tenant_of("no number") is None


def test_a_body_ends_at_its_end_or_at_the_kill_of_its_process() -> None:
    attempts = [attempt("a", 1.0, 10), attempt("b", 2.0, 11), attempt("c", 3.0, 12)]
    kills = [Kill(0.5, "ledger", "pool", [11]), Kill(4.0, "ledger", "pool", [11])]
    spans = spans_of(attempts, [end("a", 1.5, 10)], kills, now=99.0)
    by_key = {s.key: s for s in spans}
    assert (by_key["a"].ended, by_key["a"].killed) == (1.5, False)
    assert (by_key["b"].ended, by_key["b"].killed) == (4.0, True)  # (not the kill before it)
    assert (by_key["c"].ended, by_key["c"].unended) == (99.0, True)


def test_bodies_at_once_and_the_stretches_over_the_limit() -> None:
    spans = [span(0, 10), span(1, 3), span(2, 4, redelivered=True), span(3, 5), span(10, 11)]
    most, stretches = over_limit(spans, 2)
    assert most == 3
    # Over 2 from 2 to 4 (an end and a start at 3: the end first), not at 10 (end before start)
    assert [(s.started, s.ended) for s in stretches] == [(2, 3), (3, 4)]
    assert [s.redelivered for s in stretches] == [1, 1]


def capped_over_limit(*, redelivered: bool, holding: list[tuple[float, float]]) -> TenantsReport:
    """Three of the capped tenant's bodies (limit 2) overlapping from 2.0 to 3.0."""
    keys = [k for k in (f"s1-quick-{n}" for n in range(500)) if tenant_of(k) == CAPPED][:3]
    attempts = [attempt(keys[0], 1.0, 10), attempt(keys[1], 1.5, 11)]
    attempts.append(attempt(keys[2], 2.0, 12, redelivered=redelivered))
    ends = [end(keys[0], 3.0, 10), end(keys[1], 3.5, 11), end(keys[2], 4.0, 12)]
    return account_tenants(
        [], {}, {}, {}, set(), {}, attempts, ends, [], tiers=dict.fromkeys(keys, "bulk"), now=9.0,
        holding=holding,
        lease_seconds=8.0, leftovers=[], most_entries=0,
    )  # fmt: skip


def test_over_the_limit_is_a_failure_unless_an_outage_explains_it() -> None:
    found = capped_over_limit(redelivered=False, holding=[])
    assert found.capped_most_at_once == 3 and len(found.capped_unexplained) == 1
    assert not found.ok
    # (a redelivered copy waits for a slot where its body starts, as any other)
    found = capped_over_limit(redelivered=True, holding=[])
    assert len(found.capped_unexplained) == 1 and not found.ok
    # (a copy held through an outage: begun within two leases after it ended)
    found = capped_over_limit(redelivered=False, holding=[(-20.0, -13.0)])
    assert len(found.capped_after_outage) == 1 and found.ok
    found = capped_over_limit(redelivered=False, holding=[(-30.0, -20.0)])
    assert len(found.capped_unexplained) == 1
