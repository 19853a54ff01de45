"""The soak's tenants (celery-ledger only): what fair dispatch must keep under the faults.

Most of the soak's jobs and workflows name a tenant (plan.py: a big one that floods, one of
weight 3, one held to ``CAPPED_CONCURRENCY`` bodies at once on each tier across the fleet, a
small one; the rest none). Besides the soak's own invariants (each job's body ran once, nothing
lost, every workflow ended), these must hold:

- every tenant's jobs ended as designed, and each record keeps its planned tenant (through
  retries, deferrals, the outbox relay and the reconciler's copies);
- the tenants' lanes are empty at the end of the drain, and no tenant left in the ring or its
  set of tenants with work (a lane its tenant left would never be fed again);
- the capped tenant never had more bodies running at once on a tier than its limit, but after
  a fault that may lose its slots (see :func:`over_limit`).

What the design guarantees for a concurrency limit (fairness.py, docs/guide/tenants.md: a limit
holds on each tier): a tenant's message moves from its lane to the tier queue only while fewer
than ``concurrency`` unexpired entries of that tenant and tier exist; the move adds the message
copy's entry (its delivery tag, lapsing a lease later, on the broker's clock), the body's start
holds it again (``admit``), its heartbeat keeps it a lease ahead (every third of a lease), the
end of the delivery (``task_postrun``) removes it. A SIGKILLed body's entry stays until it
lapses, within a lease: after a kill the tenant runs *fewer* bodies for up to a lease, never
more. A copy whose entry lapsed before its body started (held in a busy queue or by a worker,
or put back into the tier queue by kombu itself past the lane: a pool process's delivery
rejected when the process died, a dead worker's unacknowledged messages restored after the
visibility timeout) starts only if its tenant has a free slot then, and is put off otherwise.

Entries are lost with the broker's data (a kill or a wipe without it, a failover to a replica
that missed the last writes), and a start admitted while the broker does not answer is not
counted: the tenant may then run past its limit until those bodies end. So at every instant the
capped tenant's bodies at once on a tier are at most its limit, and a stretch with more is
accepted only if it began during such a fault (``HOLDING_FAULTS``) or within two leases after
its end, and reported apart. Any other stretch over the limit fails the soak.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from redis import Redis

from celery_ledger.fairness import PRIORITY_STEPS, lane, prefix, ring_key
from celery_ledger.ledger.record import tenant_of_document

from .plan import CAPPED, CAPPED_CONCURRENCY, NO_TENANT, TENANT_POLICIES, tenant_of
from .report import Kill, TenantReport, TenantsReport

# The faults after which the capped tenant may run past its limit (see the module docstring):
# those that lose the broker's data or keep it from answering. After pool kills, worker kills
# and deploys, their copies come back redelivered and wait for a slot where their bodies start.
HOLDING_FAULTS = (
    "broker kill",
    "broker wipe",
    "broker failover",
    "broker stop",
    "ledger kill",
    "partition",
    "proxy reset",
    "proxy delay",
)


@dataclass(frozen=True)
class Span:
    """One run of a body: from its attempt's start to its end (or the SIGKILL that ended it)."""

    key: str
    pid: int
    started: float
    ended: float
    redelivered: bool
    retries: int
    killed: bool = False  # ended by a kill (no end recorded), at the kill
    unended: bool = False  # no end and no kill of its process found: open until the count


def spans_of(
    attempts: Iterable[Mapping[str, Any]],
    ends: Iterable[Mapping[str, Any]],
    kills: Sequence[Kill],
    *,
    now: float,
) -> list[Span]:
    """Each attempt paired with its end (same key, process and fence); one without an end was
    ended by the first kill of its process after it started, else it is left open (``now``)."""
    closing: dict[tuple[str, int, Any], list[float]] = defaultdict(list)
    for doc in ends:
        closing[(str(doc["key"]), int(doc["pid"]), doc.get("fence"))].append(float(doc["at"]))
    for found in closing.values():
        found.sort()
    spans = []
    for attempt in sorted(attempts, key=lambda a: float(a["at"])):
        key, pid, at = str(attempt["key"]), int(attempt["pid"]), float(attempt["at"])
        redelivered, retries = bool(attempt.get("redelivered")), int(attempt.get("retries") or 0)
        found = closing.get((key, pid, attempt.get("fence")), [])
        end = next((t for t in found if t >= at), None)
        if end is not None:
            found.remove(end)
            spans.append(Span(key, pid, at, end, redelivered, retries))
            continue
        kill = min((k.at for k in kills if pid in k.pids and k.at >= at), default=None)
        if kill is not None:
            spans.append(Span(key, pid, at, kill, redelivered, retries, killed=True))
        else:
            spans.append(Span(key, pid, at, now, redelivered, retries, unended=True))
    return spans


@dataclass(frozen=True)
class Excess:
    """A stretch of time when more bodies ran at once than the limit."""

    started: float
    ended: float
    running: tuple[Span, ...]

    @property
    def redelivered(self) -> int:
        return sum(s.redelivered for s in self.running)


def over_limit(spans: Sequence[Span], limit: int) -> tuple[int, list[Excess]]:
    """The most spans running at once, and every stretch with more than ``limit`` running
    (an end and a start at the same instant: the end first)."""
    events = sorted(
        [(s.started, 1, i) for i, s in enumerate(spans)]
        + [(s.ended, -1, i) for i, s in enumerate(spans)],
        key=lambda e: (e[0], e[1]),
    )
    running: set[int] = set()
    most, stretches = 0, []
    for index, (at, change, which) in enumerate(events):
        if change > 0:
            running.add(which)
        else:
            running.discard(which)
        most = max(most, len(running))
        following = events[index + 1][0] if index + 1 < len(events) else at
        if len(running) > limit and following > at:
            stretches.append(Excess(at, following, tuple(spans[i] for i in sorted(running))))
    return most, stretches


def lane_leftovers(redis: Redis, queues: Sequence[str]) -> list[str]:
    """What fair dispatch still holds for ``queues``: messages in any lane (found by name, so a
    lane whose tenant left the ring is seen too), tenants in the ring or the set with work."""
    found = []
    for queue in queues:
        pattern = f"{_glob(prefix(queue))}lane:*"
        for name in redis.scan_iter(match=pattern, count=500):
            n = int(redis.llen(name))
            if n:
                found.append(f"lane {_text(name)}: {n} messages")
        ring = [_text(t) for t in redis.lrange(ring_key(queue), 0, -1)]
        active = sorted(_text(t) for t in redis.smembers(f"{prefix(queue)}active"))
        if ring or active:
            found.append(f"{queue}: ring {ring}, tenants with work {active}")
    return found


def lane_depth(redis: Redis, queues: Sequence[str]) -> tuple[int, list[bytes]]:
    """Messages waiting in the lanes of the tenants with work, and the messages themselves."""
    pipe = redis.pipeline(transaction=False)
    for queue in queues:
        pipe.smembers(f"{prefix(queue)}active")
    names = [
        lane(queue, _text(tenant), step)
        for queue, tenants in zip(queues, pipe.execute(), strict=True)
        for tenant in tenants or ()
        for step in PRIORITY_STEPS
    ]
    items: list[bytes] = []
    for name in names:
        items += cast("list[bytes]", redis.lrange(name, 0, -1))
    return len(items), items


def account_tenants(
    jobs: Sequence[Any],
    states: Mapping[str, str],
    records: Mapping[str, Mapping[str, Any]],
    duplicates: Mapping[str, int],
    killed_to_dead: set[str],
    published: Mapping[str, float],
    attempts: Sequence[Mapping[str, Any]],
    ends: Sequence[Mapping[str, Any]],
    kills: Sequence[Kill],
    *,
    tiers: Mapping[str, str],
    now: float,
    holding: Sequence[tuple[float, float]],
    lease_seconds: float,
    leftovers: list[str],
    most_entries: int,
) -> TenantsReport:
    """The tenants' figures and invariants (see the module docstring)."""
    report = TenantsReport(
        policies={name: dict(policy) for name, policy in TENANT_POLICIES.items()},
        capped=CAPPED,
        capped_limit=CAPPED_CONCURRENCY,
        lanes_left=leftovers,
        most_capped_entries=most_entries,
    )
    first_start: dict[str, float] = {}
    for attempt in attempts:
        key = str(attempt["key"])
        first_start[key] = min(first_start.get(key, float("inf")), float(attempt["at"]))
    waits: dict[str, list[float]] = defaultdict(list)
    by_tenant: dict[str, TenantReport] = {}
    for job in jobs:
        name = job.tenant or NO_TENANT
        row = by_tenant.setdefault(name, TenantReport(name))
        state = states[job.key]
        row.jobs += 1
        row.succeeded += state == "succeeded"
        row.dead += state == "dead"
        row.designed_dead += job.designed == "dead"
        row.killed_to_dead += job.key in killed_to_dead
        if state == "pending":
            row.not_ended.append(job.key)
        row.duplicates += duplicates.get(job.key, 0)
        # (the product's reading: the record's field, else its kept message's, as a record
        # written by a claim has it: the job published while the ledger was away)
        kept = tenant_of_document(records.get(job.key, {}))
        if state != "pending" and kept != job.tenant:
            row.wrong_tenant.append(f"{job.key}: record {kept!r}, planned {job.tenant!r}")
        if job.key in first_start and job.key in published:
            waits[name].append(first_start[job.key] - published[job.key])
    for name, row in by_tenant.items():
        found = sorted(waits[name])
        if found:
            row.wait_median_seconds = statistics.median(found)
            row.wait_p90_seconds = found[int(0.9 * (len(found) - 1))]
    report.tenants = [by_tenant[name] for name in sorted(by_tenant, key=_order)]
    capped = [a for a in attempts if tenant_of(str(a["key"])) == CAPPED]
    capped_ends = [e for e in ends if tenant_of(str(e["key"])) == CAPPED]
    spans = spans_of(capped, capped_ends, kills, now=now)
    report.capped_bodies = len(spans)
    report.capped_redelivered = sum(s.redelivered for s in spans)
    report.capped_unended = [f"{s.key} pid {s.pid}" for s in spans if s.unended]
    # (the limit holds on each tier: fairness.py keeps a tenant's entries per tier queue)
    stretches: list[tuple[str, Excess]] = []
    for tier in sorted({tiers.get(s.key, "?") for s in spans}):
        most, excess = over_limit(
            [s for s in spans if tiers.get(s.key, "?") == tier], CAPPED_CONCURRENCY
        )
        report.capped_most_at_once = max(report.capped_most_at_once, most)
        stretches += [(tier, stretch) for stretch in excess]
    for tier, stretch in stretches:
        line = (
            f"{len(stretch.running)} capped bodies at once on {tier} for"
            f" {stretch.ended - stretch.started:.2f}s ({stretch.redelivered} redelivered):"
            + ", ".join(
                f" {s.key} pid {s.pid} retries {s.retries}"
                + (" redelivered" if s.redelivered else "")
                + (" killed" if s.killed else "")
                for s in stretch.running
            )
        )
        report.capped_over_limit_seconds += stretch.ended - stretch.started
        held = any(b <= stretch.started <= e + 2 * lease_seconds for b, e in holding)
        if held:
            report.capped_after_outage.append(line)
        else:
            report.capped_unexplained.append(line)
    return report


def _order(name: str) -> tuple[int, str]:
    return (name == NO_TENANT, name)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _glob(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


__all__ = [
    "Excess",
    "Span",
    "account_tenants",
    "lane_depth",
    "lane_leftovers",
    "over_limit",
    "spans_of",
]
