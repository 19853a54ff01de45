"""(b) Plain Celery, Celery's MongoDB result backend (``BENCH_MONGO_RESULTS``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from celery import Celery

from ._plain import build_plain


def build(env: Mapping[str, str]) -> Celery:
    return build_plain(env, backend=env["BENCH_MONGO_RESULTS"], track_started=False)


def __getattr__(name: str) -> Any:  # ``celery -A`` reads ``app``; built on first access
    if name == "app":
        globals()["app"] = build(os.environ)
        return globals()["app"]
    raise AttributeError(name)
