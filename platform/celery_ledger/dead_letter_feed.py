"""The dead letters' queue (the feed) as the platform reads it back: which deaths it holds a
copy of, and, after the broker lost data, which copies it lost.

The ledger's dead records are the dead letters; the queue is a feed of copies for consumers
(``deadletter.py`` publishes them). A copy is confirmed once (``copied_at`` on its record), so a
broker that loses data loses copies nothing would send again. What was lost is judged against
what the queue still holds, since the broker keeps no other trace of a copy.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from .ledger.core import FOREVER

# After a failover, copies made since the last look may be lost: their deaths may be a little
# older (a copy made by the housekeeping, its first publish failed, is made up to its grace and
# a tick later). Longer ago, every death in between would be read to find them, in the sweep.
COPY_LOOKBACK = timedelta(minutes=1)
# Queue items, and dead records, read per round trip.
PAGE = 100


def copy_of(item: bytes | str) -> tuple[str, float] | None:
    """(record id, when it was copied) of a dead-letter queue item this platform wrote (kombu's
    Redis transport: a JSON envelope whose body is the copy's JSON, maybe base64), or None."""
    try:
        envelope = json.loads(item)
        body = envelope["body"]
        properties = envelope.get("properties") or {}
        if properties.get("body_encoding") == "base64":
            body = base64.b64decode(body)
        copy = json.loads(body)
        at = datetime.fromisoformat(copy["at"]).timestamp()
        return str(copy["record_id"]), at
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def held(redis: Any, queue: str, cap: int) -> set[str]:
    """The record ids the queue holds a copy of (it holds at most ``cap``), read in pages."""
    present: set[str] = set()
    for start in range(0, cap, PAGE):
        items = redis.lrange(queue, start, start + PAGE - 1)
        present |= {copy[0] for item in items if (copy := copy_of(item))}
        if len(items) < PAGE:
            break
    return present


def copied(doc: Mapping[str, Any], since: datetime | None) -> bool:
    """Whether a dead record's queue copy was made (since ``since``, if given), and no copy is
    due or being made now (``claimable_at`` is ``FOREVER`` once one is confirmed: a pass that
    marked one due again, or took one to publish, must not be followed by another marking it:
    two workers would publish it). A record of an earlier release has no ``copied_at``: copied
    if it is not a workflow's own record (those have no copy)."""
    if doc.get("claimable_at") != FOREVER:
        return False
    copied_at = doc.get("copied_at")
    if isinstance(copied_at, datetime):
        return since is None or copied_at >= since
    return since is None and not doc.get("workflow_status")


def lost(
    newest_first: Iterable[Mapping[str, Any]],
    *,
    present: set[str],
    since: datetime | None,
    cap: int,
    ours: Callable[[Mapping[str, Any]], bool],
) -> list[str]:
    """The dead records among the ``cap`` newest whose copy was made (since ``since``) and
    that the queue no longer holds, of this app (``ours``)."""
    found: list[str] = []
    for seen, doc in enumerate(newest_first):
        if seen >= cap:
            break
        if doc["_id"] not in present and copied(doc, since) and ours(doc):
            found.append(str(doc["_id"]))
    return found


def drop(redis: Any, queue: str, record_ids: Iterable[str]) -> int:
    """Remove the queue's copies of these records; returns how many."""
    wanted = set(record_ids)
    if not wanted:
        return 0
    dropped = 0
    for item in redis.lrange(queue, 0, -1):
        copy = copy_of(item)
        if copy is not None and copy[0] in wanted:  # (gone already if consumed meanwhile)
            dropped += int(redis.lrem(queue, 1, item))
    return dropped


def trim(redis: Any, queue: str, cutoff: float, limit: int) -> int:
    """Remove copies made before ``cutoff`` (unix seconds), oldest first, looking at the
    ``limit`` oldest (at the tail, where the queue is consumed); returns how many."""
    dropped = 0
    for item in reversed(redis.lrange(queue, -limit, -1)):  # oldest first
        copy = copy_of(item)
        if copy is None:
            continue  # not a copy this platform wrote: its consumer's to take
        if copy[1] > cutoff:
            break
        dropped += int(redis.lrem(queue, -1, item))
    return dropped
