"""(b'') Plain Celery, MongoDB result backend, ``task_track_started``, and the ledger's write
concern (``w=majority``, journaled): the same durability as celery-ledger's writes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from celery import Celery

from ._plain import build_plain


def build(env: Mapping[str, str]) -> Celery:
    url = env["BENCH_MONGO_RESULTS"]
    durable = f"{url}{'&' if '?' in url else '?'}w=majority&journal=true"
    return build_plain(env, backend=durable, track_started=True)


def __getattr__(name: str) -> Any:  # ``celery -A`` reads ``app``; built on first access
    if name == "app":
        globals()["app"] = build(os.environ)
        return globals()["app"]
    raise AttributeError(name)
