"""Encryption-key rotation: seal what is stored again with the newest key, and say when an old
key can be dropped from ``LEDGER_ENCRYPTION_KEYS``.

A rotation, end to end (the README's "Rotating encryption keys"):

1. prepend a new key and roll it out to every process: new values are sealed with it, the old
   key still opens the rest;
2. ``celery -A APP ledger keys reseal``: every value sealed with an older key is sealed again
   with the new one: ledger records (their messages, raw poison, results, checkpoints, step
   results), groups, workflows (arguments, events, signals), delayed deliveries, the messages
   waiting in the tier queues and the dead letters' queue, kombu's delivered, unacknowledged
   messages, and poison the transport kept that is not drained into the ledger yet;
3. ``celery -A APP ledger keys check``: nothing left means the old key can go (a value written
   under the pass by an older process, or a message a worker took meanwhile, is counted; run the
   reseal again);
4. drop the old key.

Broker items are rewritten in place by a compare-and-set script: only if the item is still the
one read at that position (a consumer that popped it, or a push that moved it, makes the set fail
and the item is counted for the next pass), so no message is lost or doubled. Values no listed
key opens are counted, never rewritten: they were sealed with a key dropped too early.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from .broker import queue_lists
from .crypto import Sealer
from .delayed import DelayedDeliveries
from .ledger.store import Ledger
from .reseal import Reseal, Tally, reseal_tree, resealed_queue_item


@dataclass
class RotationReport:
    """What one pass found, by place (``ledger <collection>``, ``delayed <key>``,
    ``queue <list>``, ``unacked <hash>``)."""

    places: dict[str, Tally] = field(default_factory=dict)

    @property
    def total(self) -> Tally:
        total = Tally()
        for tally in self.places.values():
            total.add(tally)
        return total

    @property
    def old_keys_unused(self) -> bool:
        """Whether every sealed value found opens with the newest key alone."""
        total = self.total
        return total.stale == 0 and total.unopenable == 0 and total.changed_meanwhile == 0


def rotate_keys(
    *,
    sealer: Sealer,
    ledger: Ledger,
    delayed: Sequence[DelayedDeliveries],
    broker: redis.Redis,
    queues: Sequence[str],
    unacked_key: str,
    poison_key: str,
    apply: bool,
) -> RotationReport:
    """Seal every stored value again with ``sealer``'s newest key (``apply``), or survey what
    needs it (module docstring)."""
    report = RotationReport()
    for name, tally in ledger.reseal(sealer.reseal, apply=apply).items():
        report.places[f"ledger {name}"] = tally
    for deliveries in delayed:
        report.places[f"delayed {deliveries.key}"] = deliveries.reseal(sealer.reseal, apply=apply)
    lists = _BrokerLists(broker)
    for queue in queues:
        for name in queue_lists(queue):
            tally = lists.reseal_list(name, sealer, apply=apply)
            if tally != Tally() or name == queue:
                report.places[f"queue {name}"] = tally
    report.places[f"unacked {unacked_key}"] = lists.reseal_unacked(unacked_key, sealer, apply=apply)
    # Poison kept by the transport, not drained into the ledger yet (its raw message may be a
    # sensitive task's sealed body).
    report.places[f"poison {poison_key}"] = lists.reseal_list(
        poison_key, sealer, apply=apply, entry=_resealed_poison
    )
    return report


# KEYS[1] = a list; ARGV = index, the item as read there, its replacement.
_SET_LIST_ITEM = """
if redis.call('LINDEX', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('LSET', KEYS[1], ARGV[1], ARGV[3])
  return 1
end
return 0
"""
# KEYS[1] = a hash; ARGV = field, the value as read, its replacement.
_SET_HASH_VALUE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
  return 1
end
return 0
"""


class _BrokerLists:
    """Queue items and kombu's unacknowledged entries, resealed by compare-and-set."""

    def __init__(self, broker: redis.Redis) -> None:
        self._broker = broker
        self._set_item = broker.register_script(_SET_LIST_ITEM)
        self._set_value = broker.register_script(_SET_HASH_VALUE)

    def reseal_list(
        self,
        key: str,
        sealer: Sealer,
        *,
        apply: bool,
        chunk: int = 500,
        entry: Callable[[Any, Reseal, Tally], Any] = resealed_queue_item,
    ) -> Tally:
        """Items are addressed from the tail (negative indices), where consumers pop: a
        push at the head, the common change, moves no item read so far. Each item is JSON,
        resealed by ``entry`` (a queue item by default)."""
        tally = Tally()
        end = -1
        while True:
            items = self._broker.lrange(key, end - chunk + 1, end)
            for offset, item in enumerate(reversed(items)):
                new = _resealed_item(item, sealer, tally, entry)
                if new is not None and apply:
                    index = end - offset
                    done = self._set_item(keys=[key], args=[index, item, new])
                    tally.changed_meanwhile += 1 - int(done)
            if len(items) < chunk:
                return tally
            end -= chunk

    def reseal_unacked(self, key: str, sealer: Sealer, *, apply: bool) -> Tally:
        """kombu's delivered, unacknowledged messages: ``[item, exchange, routing key]`` each
        (a worker's crash puts the item back in its queue as it is here)."""
        tally = Tally()
        for tag, value in self._broker.hscan_iter(key, count=500):
            try:
                entry = json.loads(value)
            except ValueError:
                continue
            if not isinstance(entry, list) or not entry:
                continue
            item = resealed_queue_item(entry[0], sealer.reseal, tally)
            if item is not entry[0] and apply:
                new = json.dumps([item, *entry[1:]])
                done = self._set_value(keys=[key], args=[tag, value, new])
                tally.changed_meanwhile += 1 - int(done)
        return tally


def _resealed_item(
    item: bytes | str,
    sealer: Sealer,
    tally: Tally,
    entry: Callable[[Any, Reseal, Tally], Any],
) -> str | None:
    """The list item sealed again, or None if nothing in it changed."""
    try:
        decoded = json.loads(item)
    except ValueError:
        return None  # the transport keeps an unreadable item as poison when it pops it
    new = entry(decoded, sealer.reseal, tally)
    return None if new is decoded else json.dumps(new)


def _resealed_poison(entry: Any, reseal: Reseal, tally: Tally) -> Any:
    """A poison entry (its raw message base64 in ``raw_base64``, as a dead record keeps it)."""
    return reseal_tree(entry, reseal, tally) if isinstance(entry, dict) else entry


__all__ = ["RotationReport", "rotate_keys"]
