"""The reconciler: brings back jobs whose message is gone or stuck.

It finds (1) running records whose lease ended a grace period ago (their worker died, and Redis
would only redeliver the message after its visibility timeout, an hour by default), and
(2) queued or retrying records untouched for a long time (a publish that failed after the
record was written, a lost retry). For (1) it first looks for the message among the broker's
unacknowledged messages and puts it back on its queue, so it comes back exactly as sent; else,
and for (2), it republishes from the arguments kept on the record, with the same task id and
key. Fencing keeps this safe against a slow original holder: the new delivery claims with a
higher token, and the old holder's late writes are refused.

Runs as ``celery -A APP ledger reconcile`` and as the periodic task ``celery_ledger.reconcile``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from . import headers
from .ledger.record import State

if TYPE_CHECKING:
    from .app import LedgerCelery

logger = logging.getLogger("celery_ledger.reconciler")

# kombu's Redis transport keeps delivered, unacknowledged messages here (tag -> payload).
UNACKED_HASH = "unacked"
UNACKED_INDEX = "unacked_index"

# Move one unacked message back to the front of its queue, atomically.
_RESTORE = """
local payload = redis.call('HGET', KEYS[1], ARGV[1])
if not payload then return 0 end
redis.call('RPUSH', ARGV[2], ARGV[3])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""


@dataclass
class ReconcileReport:
    expired_leases: int = 0
    restored_from_broker: int = 0
    republished: int = 0
    stale_queued: int = 0
    stale_retrying: int = 0
    still_waiting: int = 0  # stale, but their message is still queued or delayed: left alone
    skipped: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def reconcile(
    app: LedgerCelery,
    *,
    lease_grace_seconds: float | None = None,
    stale_after_seconds: float | None = None,
    limit: int = 500,
    dry_run: bool = False,
) -> ReconcileReport:
    """One sweep; returns what it found and did."""
    settings = app.settings
    grace = (
        settings.reconcile_lease_grace_seconds
        if lease_grace_seconds is None
        else lease_grace_seconds
    )
    stale_after = (
        settings.reconcile_stale_after_seconds
        if stale_after_seconds is None
        else stale_after_seconds
    )
    ledger = app.ledger
    report = ReconcileReport()
    unacked = _unacked_by_task_id(app) if not dry_run else {}

    for doc in ledger.expired_leases(grace_seconds=grace, limit=limit):
        report.expired_leases += 1
        if dry_run:
            continue
        if doc["_id"] in unacked and _restore(app, *unacked[doc["_id"]]):
            report.restored_from_broker += 1
            ledger.touch(doc["_id"], doc.get("updated_at"))
        elif _republish(app, doc):
            report.republished += 1
            ledger.touch(doc["_id"], doc.get("updated_at"))
        else:
            report.skipped.append(doc["_id"])
    waiting: set[str] | None = None  # ids whose message is still in the broker, read once
    for state, attribute in ((State.QUEUED, "stale_queued"), (State.RETRYING, "stale_retrying")):
        for doc in ledger.stale(state, older_than_seconds=stale_after, limit=limit):
            setattr(report, attribute, getattr(report, attribute) + 1)
            if dry_run:
                continue
            if waiting is None:
                waiting = _waiting_task_ids(app) | set(unacked)
            if doc["_id"] in waiting:  # only slow (a backlog): a copy would cost a claim
                report.still_waiting += 1
                continue
            if ledger.touch(doc["_id"], doc.get("updated_at")) and _republish(app, doc):
                report.republished += 1
            else:
                report.skipped.append(doc["_id"])
    if report.expired_leases or report.stale_queued or report.stale_retrying:
        logger.warning("reconcile: %s", report.as_dict())
    return report


def _unacked_by_task_id(app: LedgerCelery) -> dict[str, tuple[str, str, bytes]]:
    """Unacknowledged messages by task id: (delivery tag, queue, message)."""
    found: dict[str, tuple[str, str, bytes]] = {}
    for tag, payload in app.redis.hscan_iter(UNACKED_HASH, count=500):
        try:
            message, _exchange, routing_key = json.loads(payload)
            task_id = message["headers"]["id"]
        except (ValueError, KeyError, TypeError):
            continue
        queue = routing_key  # kombu names each tier's list after its routing key
        found[task_id] = (
            tag.decode() if isinstance(tag, bytes) else tag,
            queue,
            json.dumps(message).encode(),
        )
    return found


def _waiting_task_ids(app: LedgerCelery) -> set[str]:
    """Task ids of the messages waiting in the tiers' queues and in the delayed set."""
    found: set[str] = set()
    for queue in app.tiers.names:
        for raw in app.redis.lrange(queue, 0, -1):
            try:
                found.add(str(json.loads(raw)["headers"]["id"]))
            except (ValueError, KeyError, TypeError):
                continue
    members = cast("list[bytes]", app.redis.zrange(app.delayed.key, 0, -1))
    for member in members:
        try:
            found.add(str(json.loads(member)["options"]["task_id"]))
        except (ValueError, KeyError, TypeError):
            continue
    return found


def _restore(app: LedgerCelery, tag: str, queue: str, message: bytes) -> bool:
    restore = app.redis.register_script(_RESTORE)
    return bool(restore(keys=[UNACKED_HASH, UNACKED_INDEX], args=[tag, queue, message]))


def _republish(app: LedgerCelery, doc: dict[str, Any]) -> bool:
    message = doc.get("message") or {}
    if "args_json" not in message or doc.get("task") not in app.tasks:
        return False
    app.send_task(
        doc["task"],
        json.loads(app.sealer.open(message["args_json"])),
        json.loads(app.sealer.open(message["kwargs_json"])),
        task_id=doc["_id"],
        queue=doc.get("tier") or None,
        headers={headers.KEY: doc.get("key"), headers.TIER: doc.get("tier")},
    )
    return True
