"""Unit tests see none of the process's ``LEDGER_*`` or ``OTEL_*`` environment.

``Settings()`` reads its defaults from ``LEDGER_*`` variables. One pytest run takes the
integration suites first, and their session stack keeps its test environment (a 4 s lease,
among others) until the session ends, so a unit test that builds ``Settings()`` with a default
saw that environment in a full run and the defaults alone when run by itself: it passed or
failed by the order of the run. Each unit test now starts from the defaults a user gets.
"""

from __future__ import annotations

import os

import pytest

ISOLATED_PREFIXES = ("LEDGER_", "OTEL_")


@pytest.fixture(autouse=True)
def _no_ledger_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # (pydantic-settings reads its variables whatever their case)
    for name in [n for n in os.environ if n.upper().startswith(ISOLATED_PREFIXES)]:
        monkeypatch.delenv(name)
