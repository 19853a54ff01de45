"""Post-mortem helpers: what the broker's append-only file says happened to a message."""

from __future__ import annotations

import base64
import json
from collections import defaultdict, deque
from collections.abc import Iterator

from celery_ledger.embedded.servers import ServerProcess
from celery_ledger.embedded.stack import WorkerProcess


def aof_commands(broker: ServerProcess) -> Iterator[list[bytes]]:
    """The commands in valkey's append-only files, in order (RESP arrays)."""
    for path in sorted((broker.data_dir / "appendonlydir").glob("*.incr.aof")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            if data[i : i + 1] != b"*":
                i += 1
                continue
            end = data.index(b"\r\n", i)
            count, i, args = int(data[i + 1 : end]), end + 2, []
            for _ in range(count):
                end = data.index(b"\r\n", i)
                length = int(data[i + 1 : end])
                args.append(data[end + 2 : end + 2 + length])
                i = end + 4 + length
            yield args


def broker_fate(broker: ServerProcess, key: str, system: str, *, unacked_key: str) -> str:
    """What the broker's AOF says happened to a job's message (replays the list ops).

    ``unacked_key``: the hash where kombu books a taken message (celery-ledger's is in its
    app's namespace: read against plain kombu's name, every message looked lost in flight).
    Only the AOF's increments are read: what happened before its last rewrite is not seen."""
    wanted_db = 0 if system == "ledger" else 1
    booked = unacked_key.encode()
    lists: dict[bytes, deque[bytes]] = defaultdict(deque)
    db, fate = 0, "never published"
    try:
        for args in aof_commands(broker):
            name = args[0].upper()
            if name == b"SELECT":
                db = int(args[1])
            elif db != wanted_db:
                continue
            elif name in (b"LPUSH", b"RPUSH"):
                for value in args[2:]:
                    (lists[args[1]].appendleft if name == b"LPUSH" else lists[args[1]].append)(
                        value
                    )
                    if message_key(value) == key and fate == "never published":
                        fate = f"pushed to {args[1].decode()}"
            elif name in (b"RPOP", b"LPOP") and lists[args[1]]:
                value = lists[args[1]].pop() if name == b"RPOP" else lists[args[1]].popleft()
                if message_key(value) == key:
                    fate = "popped by a consumer, never registered as unacked (lost in flight)"
            elif name == b"HSET" and args[1] == booked and message_key(args[3]) == key:
                fate = "popped and registered as unacked"
    except (OSError, ValueError, IndexError) as exc:
        return f"unreadable AOF ({exc})"
    return fate


def last_error(worker: WorkerProcess) -> str:
    """The last error line of a worker's log (why it exited)."""
    try:
        lines = worker.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "?"
    errors = [line for line in lines if "CRITICAL" in line or "Error" in line]
    tail = [line for line in lines[-40:] if line and not line.startswith(" ")]
    return (errors or tail or ["?"])[-1][:300]


def message_key(raw: bytes) -> str:
    """The job key of a queued task message (kombu's Redis envelope), for diagnostics."""
    try:
        envelope = json.loads(raw)
        if isinstance(envelope, list):  # an unacked entry: [message, exchange, routing key]
            envelope = envelope[0]
        return str(json.loads(base64.b64decode(envelope["body"]))[0][0])
    except (ValueError, KeyError, TypeError, IndexError):
        return "?"


def dead_letter_key(raw: bytes) -> str | None:
    try:
        key = json.loads(base64.b64decode(json.loads(raw)["body"])).get("key")
        return None if key is None else str(key)
    except (ValueError, KeyError, TypeError):
        return None
