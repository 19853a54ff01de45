"""Is the platform up? The checks behind ``celery -A APP ledger health`` and the console.

Each with a short timeout: the broker (PING, and which server answered it: through Sentinel,
the primary the sentinels name), the ledger (ping and a read), workers per tier
(``inspect active_queues``: which tiers have a worker consuming), open breakers (reported, never
failing), the broker's replicas a publish waits for while the ledger is away (warned when
fewer answer). A required tier without a worker is down.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .clock import (
    READ_ERRORS,
    ClockBook,
    HostClocks,
    Reading,
    ServerClock,
    mongo_time,
    redis_time,
)
from .handoff import Parking, tally
from .ledger.store import Ledger
from .ledger.trigger_store import TriggerState, TriggerStore
from .sentinel import redis_client
from .unrecorded import Unrecorded

Status = Literal["ok", "warn", "down", "skipped"]


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


def tier_checks(
    active_queues: Mapping[str, Iterable[Mapping[str, Any]]] | None,
    tiers: Iterable[str],
    required: Iterable[str],
    queue_of: Callable[[str], str] = lambda tier: tier,
) -> list[Check]:
    """One check per tier from ``inspect().active_queues()``; a required tier needs a worker.

    ``queue_of`` names a tier's queue (the app's ``tiers.queue``)."""
    needed = set(required)
    by_tier: dict[str, list[str]] = {tier: [] for tier in tiers}
    tier_of_queue = {queue_of(tier): tier for tier in by_tier}
    for worker, queues in sorted((active_queues or {}).items()):
        for queue in queues or ():
            tier = tier_of_queue.get(str(queue.get("name")))
            if tier is not None:
                by_tier[tier].append(worker)
    checks = []
    for tier, workers in by_tier.items():
        if workers:
            status: Status = "ok"
            detail = f"{len(workers)} worker(s): {', '.join(workers)}"
        else:
            status = "down" if tier in needed else "warn"
            detail = "no worker consuming" + ("" if tier in needed else " (not required)")
        checks.append(Check(f"tier {tier}", status, detail, {"workers": workers}))
    return checks


def run_checks(app: Any, *, required: Iterable[str], timeout: float) -> list[Check]:
    checks = [_timed("broker", lambda: _broker(app, timeout))]
    broker_up = checks[0].status == "ok"
    checks.append(_timed("ledger", lambda: _ledger(app, timeout)))
    tiers = list(app.tiers.names)
    if broker_up:
        try:
            active = app.control.inspect(timeout=timeout).active_queues()
        except Exception as exc:
            checks.append(Check("workers", "down", f"inspect failed: {exc}"))
        else:
            checks.extend(tier_checks(active, tiers, required, app.tiers.queue))
            checks.append(_timed("primary", lambda: _workers_primary(app, timeout)))
        checks.append(_timed("breakers", lambda: _breakers(app)))
        checks.append(_timed("parked", lambda: _parked(app, timeout)))
        checks.append(_timed("unrecorded", lambda: _unrecorded(app, timeout)))
        checks.append(_timed("replicas", lambda: _replicas(app, timeout)))
    else:
        required_tiers = set(required)
        for tier in tiers:
            status: Status = "down" if tier in required_tiers else "skipped"
            checks.append(Check(f"tier {tier}", status, "unknown: the broker is down"))
    checks.append(_timed("outbox", lambda: _outbox(app, timeout)))
    checks.append(_timed("clock", lambda: _clock(app, timeout)))
    with contextlib.suppress(Exception):  # the modules that declare triggers (as a worker)
        app.loader.import_default_modules()
    if getattr(app, "triggers", None):
        checks.append(_timed("triggers", lambda: _triggers(app, timeout)))
    return checks


def _timed(name: str, check: Callable[[], tuple[Status, str, dict[str, Any]]]) -> Check:
    started = time.monotonic()
    try:
        status, detail, data = check()
    except Exception as exc:
        status, detail, data = "down", f"{type(exc).__name__}: {exc}", {}
    data["ms"] = round((time.monotonic() - started) * 1000, 1)
    return Check(name, status, detail, data)


def _short_redis(app: Any, timeout: float) -> redis.Redis:
    """A broker client of the check's own, whose calls give up after ``timeout``."""
    return redis_client(
        app.runtime.broker_target,  # (through Sentinel: the primary it names)
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),  # one attempt: the timeout is the budget
    )


def _broker(app: Any, timeout: float) -> tuple[Status, str, dict[str, Any]]:
    client = _short_redis(app, timeout)
    try:
        client.ping()
        primary = app.runtime.broker_target.primary(client)
    finally:
        client.close()
    return "ok", f"PING answered by {primary}", {"primary": primary}


def _workers_primary(app: Any, timeout: float) -> tuple[Status, str, dict[str, Any]]:
    """Which broker server each worker's consumer uses (``ledger_broker``, worker.py), against
    the primary (through Sentinel, the one the sentinels name now): a worker on another is
    reported (it reconnects at its next connection error), never failing the check."""
    client = _short_redis(app, timeout)
    try:
        primary = app.runtime.broker_target.primary(client)
    finally:
        client.close()
    workers: dict[str, Any] = {}
    try:
        replies = app.control.broadcast("ledger_broker", reply=True, timeout=timeout) or []
    except Exception as exc:  # (reported; the workers check says whether any consume)
        return "warn", f"primary {primary}; workers not asked: {exc}", {"primary": primary}
    for reply in replies:
        for worker, answer in reply.items():
            workers[worker] = (answer or {}).get("broker") if isinstance(answer, dict) else None
    elsewhere = {worker: address for worker, address in workers.items() if address != primary}
    data = {"primary": primary, "workers": workers}
    if not workers:
        return "skipped", f"no worker answered (primary {primary})", data
    if elsewhere:
        on = ", ".join(f"{worker} on {address}" for worker, address in sorted(elsewhere.items()))
        return "warn", f"primary {primary}; not on it: {on}", data
    return "ok", f"{len(workers)} worker(s) on the primary {primary}", data


@contextlib.contextmanager
def _short_ledger(app: Any, timeout: float) -> Iterator[Ledger]:
    """A ledger client of the check's own, whose calls give up after ``timeout``."""
    settings = app.settings
    ledger = Ledger(
        uri=settings.mongo_uri,
        database=settings.mongo_db,
        collection=settings.ledger_collection,
        timeout_ms=max(int(timeout * 1000), 100),
    )
    try:
        yield ledger
    finally:
        ledger.close()


def _ledger(app: Any, timeout: float) -> tuple[Status, str, dict[str, Any]]:
    with _short_ledger(app, timeout) as ledger:
        ledger.ping()
        dead = ledger.count_dead()  # a read: credentials and database work
    detail = f"ping and read ok; {dead} dead letter(s)"
    return ("warn" if dead else "ok"), detail, {"dead_letters": dead}


def _clock(app: Any, timeout: float) -> tuple[Status, str, dict[str, Any]]:
    """This host's and the fleet's offsets from the ledger's and the broker's clocks (read
    with the check's own short-timeout clients)."""
    runtime = app.runtime
    settings = runtime.settings
    here: dict[str, Reading] = {}
    hosts: list[HostClocks] = []
    client = _short_redis(app, timeout)
    try:
        # a server that is away is its own check's finding, not this one's
        with contextlib.suppress(*READ_ERRORS):
            here["broker"] = ServerClock("broker", lambda: redis_time(client)).sync()
            book = ClockBook(client, namespace=runtime.tiers.namespace)
            hosts = book.hosts(now=here["broker"].server_time)
    finally:
        client.close()
    with _short_ledger(app, timeout) as ledger, contextlib.suppress(*READ_ERRORS):
        reading = ServerClock("ledger", lambda: mongo_time(ledger.client), resolution_seconds=0.001)
        here["ledger"] = reading.sync()
    own = HostClocks(
        f"{socket.gethostname()} (this check)",
        0.0,
        {server: (r.offset_seconds, r.error_seconds) for server, r in here.items()},
    )
    return clock_status(
        [own, *hosts],
        warn_seconds=settings.clock_warn_seconds,
        down_seconds=settings.clock_down_seconds,
    )


def clock_status(
    hosts: Iterable[HostClocks], *, warn_seconds: float, down_seconds: float
) -> tuple[Status, str, dict[str, Any]]:
    """The ``clock`` check: the host furthest from a server's clock decides (beyond its
    reading's error). No guarantee depends on a host's clock (leases, due times and ages are
    the servers'); past ``warn_seconds`` it needs time sync; past ``down_seconds`` (a default
    lease) Celery's own absolute times from that host (``expires=`` in seconds, etas its app
    computes) are off by more than a lease."""
    known = sorted(hosts, key=lambda h: h.worst(), reverse=True)
    data: dict[str, Any] = {
        "hosts": {
            h.host: {server: round(offset, 3) for server, (offset, _e) in h.offsets.items()}
            for h in known
        }
    }
    if not known:
        return "ok", "no host has reported its clock yet", data
    worst = known[0]
    status: Status = "ok"
    if worst.worst() > down_seconds:
        status = "down"
    elif worst.worst() > warn_seconds:
        status = "warn"
    detail = (
        f"{len(known)} host(s); furthest from a server's clock: {worst.host},"
        f" {worst.worst():.3f}s (warn past {warn_seconds:g}s, down past {down_seconds:g}s)"
    )
    if status != "ok":
        detail += "; decisions use the servers' clocks: sync this host (NTP)"
    return status, detail, data


def _parked(app: Any, timeout: float) -> tuple[Status, str, dict[str, Any]]:
    """Messages a worker could not run, parked for one that can (celery_ledger.handoff)."""
    client = _short_redis(app, timeout)
    try:
        runtime = app.runtime
        parking = Parking(client, delayed_key=runtime.parking.delayed_key, key=runtime.parking.key)
        now = redis_time(client)
        return parked_status(
            tally(parking.all(), now=now),
            window_seconds=runtime.settings.unrunnable_window_seconds,
        )
    finally:
        client.close()


def _unrecorded(app: Any, timeout: float) -> tuple[Status, str, dict[str, Any]]:
    """Jobs published while the ledger was away, waiting for the reconciler to write their
    records (celery_ledger.unrecorded): warn while any wait (the ledger still away, or no
    worker reconciling), as a message of theirs lost meanwhile would not come back."""
    client = _short_redis(app, timeout)
    try:
        waiting = Unrecorded(client, namespace=app.runtime.tiers.namespace).count()
    finally:
        client.close()
    if not waiting:
        return "ok", "no published job waits for its record", {"waiting": 0}
    detail = (
        f"{waiting} job(s) published while the ledger was away wait for their records (the"
        " workers' reconciler writes them once the ledger answers)"
    )
    return "warn", detail, {"waiting": waiting}


def _replicas(app: Any, timeout: float) -> tuple[Status, str, dict[str, Any]]:
    """Whether the broker's primary has the replicas that a publish made while the ledger is
    away waits for (``LEDGER_BROKER_CONFIRM_REPLICAS``), asked as such a publish asks: a write,
    then ``WAIT`` on the same connection for as long as it waits (within the check's own
    timeout). A ``WAIT`` alone counts a replica stopped since its last acknowledgement; the
    platform's least-privileged broker user may run both, not ``INFO``. Never ``down``: a
    broker away is the broker check's finding."""
    settings = app.runtime.settings
    wanted = int(settings.replicas_to_confirm())
    if not wanted:
        return "skipped", "no replica confirms a publish (LEDGER_BROKER_CONFIRM_REPLICAS)", {}
    wait_ms = max(1, int(min(settings.broker_timeout_seconds, timeout) * 500))
    client = _short_redis(app, timeout)
    try:
        probe = client.pipeline(transaction=False)
        probe.set(f"{app.runtime.tiers.namespace}:ledger:health:replicas", "1", px=60_000)
        probe.execute_command("WAIT", wanted, wait_ms)
        acked = int(probe.execute()[-1])
    except redis.RedisError as exc:
        detail = f"the primary did not answer the probe ({exc}): a publish while the ledger is"
        return "warn", detail + " away would be refused too", {"wanted": wanted}
    finally:
        client.close()
    return replicas_status(wanted, acked)


def replicas_status(wanted: int, acked: int) -> tuple[Status, str, dict[str, Any]]:
    data = {"wanted": wanted, "replicas": acked}
    if acked >= wanted:
        return (
            "ok",
            f"{acked} replica(s) of the primary answer (a publish waits for {wanted})",
            data,
        )
    detail = (
        f"{acked} replica(s) of the primary answer and LEDGER_BROKER_CONFIRM_REPLICAS asks"
        f" {wanted}: while the ledger is away every publish is refused (NotReplicated) until"
        " they are back"
    )
    return "warn", detail, data


def parked_status(
    found: tuple[dict[tuple[str, str], int], float], *, window_seconds: float
) -> tuple[Status, str, dict[str, Any]]:
    """The ``parked`` check: ok when nothing waits for a worker that can run it; warn while
    something does (a deploy under way, or a worker short of a key); down once the oldest has
    waited half its window (the rest of the window, then it is a dead letter)."""
    counts, oldest = found
    data: dict[str, Any] = {
        "parked": {f"{task} ({why})": n for (why, task), n in sorted(counts.items())},
        "oldest_seconds": round(oldest, 1),
    }
    total = sum(counts.values())
    if not total:
        return "ok", "no message waits for a worker that can run it", data
    tasks = ", ".join(f"{task} ({why}) {n}" for (why, task), n in sorted(counts.items()))
    detail = (
        f"{total} message(s) wait for a worker that can run them: {tasks}; the oldest for"
        f" {oldest:.0f}s (dead-lettered after {window_seconds:g}s)"
    )
    return ("down" if oldest > window_seconds / 2 else "warn"), detail, data


def _breakers(app: Any) -> tuple[Status, str, dict[str, Any]]:
    statuses = app.breakers.statuses()
    not_closed = {s.name: s.state.value for s in statuses if s.state.value != "closed"}
    if not not_closed:
        return "ok", f"{len(statuses)} breaker(s), none open", {"open": {}}
    detail = ", ".join(f"{name} {state}" for name, state in sorted(not_closed.items()))
    return "warn", detail, {"open": not_closed}


def _triggers(app: Any, timeout: float) -> tuple[Status, str, dict[str, Any]]:
    """Change-stream triggers: down while one is stopped (its stream invalidated, its place
    lost from the oplog): its changes no longer become jobs until it is reset and backfilled."""
    with _short_ledger(app, timeout) as ledger:
        return trigger_report(TriggerStore(ledger).all(), app.triggers)


def trigger_report(
    states: Iterable[TriggerState], declared: Iterable[str]
) -> tuple[Status, str, dict[str, Any]]:
    """The triggers check from the stored states of the ``declared`` triggers."""
    stored = {state.name: state for state in states}
    data: dict[str, Any] = {}
    stopped, unwatched = [], []
    for name in sorted(declared):
        state = stored.get(name)
        if state is None or (state.token is None and not state.problem):
            unwatched.append(name)
            data[name] = {"status": "not watched yet"}
        elif state.problem:
            stopped.append(f"{name} {state.problem}")
            data[name] = {"status": state.problem, "detail": state.detail}
        else:
            updated = state.updated_at.isoformat() if state.updated_at else None
            data[name] = {"status": "watching", "changes": state.changes, "saved_at": updated}
    if stopped:
        detail = (
            "stopped: " + ", ".join(stopped) + " (reset with `ledger triggers reset NAME`, then"
            " backfill the collection)"
        )
        return "down", detail, data
    if unwatched:
        return "warn", "no watcher has started yet: " + ", ".join(unwatched), data
    return "ok", f"{len(data)} trigger(s) watching", data


def _outbox(app: Any, timeout: float) -> tuple[Status, str, dict[str, Any]]:
    """Jobs committed in an app's transaction and still unpublished well past the relay's
    time (see outbox.py): no worker runs the relay, their tier is held by backpressure, or
    they are sealed with a key the relay's worker lacks."""
    settings = app.settings
    overdue = settings.outbox_grace_seconds + 3 * settings.outbox_relay_seconds
    with _short_ledger(app, timeout) as ledger:
        waiting = ledger.unpublished(older_than_seconds=overdue, limit=OUTBOX_SAMPLE)
    return outbox_report(waiting, overdue_seconds=overdue)


OUTBOX_SAMPLE = 1000  # unpublished records read at most (a count beyond says "1000 or more")


def outbox_report(
    waiting: Iterable[Mapping[str, Any]], *, overdue_seconds: float
) -> tuple[Status, str, dict[str, Any]]:
    """The outbox check from the records unpublished past ``overdue_seconds``."""
    by_tier: dict[str, int] = {}
    for doc in waiting:
        tier = str(doc.get("tier"))
        by_tier[tier] = by_tier.get(tier, 0) + 1
    total = sum(by_tier.values())
    if not total:
        return "ok", "no committed job waits to be published", {"waiting": {}}
    count = f"{total}" if total < OUTBOX_SAMPLE else f"{OUTBOX_SAMPLE} or more"
    tiers = ", ".join(f"{tier} {n}" for tier, n in sorted(by_tier.items()))
    detail = (
        f"{count} committed job(s) unpublished for over {overdue_seconds:g}s ({tiers}):"
        " their tier is above its mark, no worker runs the outbox relay"
        " (LEDGER_OUTBOX_RELAY_IN_WORKERS), or they are sealed with a key the relay's worker"
        " lacks (its log says so)"
    )
    return "warn", detail, {"waiting": by_tier}
