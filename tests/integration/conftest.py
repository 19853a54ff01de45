"""Real servers for the integration tests: valkey-server and SecantusDB on free loopback ports,
and real Celery prefork workers as subprocesses. Every process is stopped by PID."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_ledger.embedded.stack import EmbeddedStack

TEST_ENV = {
    "LEDGER_MONGO_DB": "ledger_tests",
    "LEDGER_LEASE_SECONDS": "4",
    "LEDGER_DEFER_POLL_SECONDS": "0.2",
    "LEDGER_UNAVAILABLE_BACKOFF_BASE_SECONDS": "0.5",
    "LEDGER_UNAVAILABLE_BACKOFF_CAP_SECONDS": "2",
    "LEDGER_MONGO_TIMEOUT_MS": "1500",
    "LEDGER_MAX_DELIVERIES": "3",
    "LEDGER_BREAKERS": '{"payments": {"failure_threshold": 3, "cooldown_seconds": 3}}',
    "LEDGER_RATE_LIMITS": '{"limited": {"rate_per_second": 4, "burst": 2}}',
    # Test-only Fernet keys (newest first): sensitive tasks are sealed at rest.
    "LEDGER_ENCRYPTION_KEYS": (
        '["0qFzQc5xoZQhPWiz7RlXDGRcus0k650e5VRXFgPRCH8=",'
        ' "AcKyJ2oLnrAAy_LZcIqJcLFxu0NMYeTJnp7JIrpzIs4="]'
    ),
}
APP_MODULE = "tests.integration.ledger_app"
ALL_TIERS = "critical,default,bulk"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in str(item.path):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    """Broker, ledger and one 4-process worker on every tier, shared by the session."""
    saved = dict(os.environ)
    os.environ.update(TEST_ENV)
    # Both servers require authentication (random passwords); the URLs carry them.
    running = EmbeddedStack(APP_MODULE, tmp_path_factory.mktemp("stack"), auth=True)
    try:
        running.start_servers()
        os.environ.update(running.env)
        running.start_worker(ALL_TIERS, concurrency=4, name="main@127.0.0.1")
        yield running
    finally:
        from tasks.effects import close_clients

        close_clients()
        running.stop()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def app(stack: EmbeddedStack) -> Any:
    """The test app, configured (from the environment) against the session's servers."""
    from tests.integration import ledger_app

    return ledger_app.app


@pytest.fixture
def token() -> str:
    """A fresh idempotency key, so tests never see each other's records or effects."""
    return f"t-{uuid.uuid4().hex[:12]}"


def make_isolated_stack(base: Path) -> EmbeddedStack:
    """A stack of its own, for tests that kill or stop servers."""
    running = EmbeddedStack(APP_MODULE, base, auth=True)
    running.start_servers()
    return running
