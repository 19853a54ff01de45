"""Real servers for the integration tests: valkey-server and SecantusDB on free loopback ports,
and real Celery prefork workers as subprocesses. Every process is stopped by PID.

A worker of these stacks that dies during a test fails that test at once with its last log
lines (:mod:`.watchdog`); the session's worker is then started again, on purged queues, for
the tests after it.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ledger.embedded import stack as stack_module
from celery_ledger.embedded.servers import ServerProcess, start_valkey
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess
from celery_ledger.settings import TIERS

from .provisioned import ProvisionedLedgers
from .watchdog import WATCH, WatchedStack

TEST_ENV = {
    "LEDGER_MONGO_DB": "ledger_tests",
    "LEDGER_LEASE_SECONDS": "4",
    "LEDGER_DEFER_POLL_SECONDS": "0.2",
    "LEDGER_UNAVAILABLE_BACKOFF_BASE_SECONDS": "0.5",
    "LEDGER_UNAVAILABLE_BACKOFF_CAP_SECONDS": "2",
    "LEDGER_MONGO_TIMEOUT_MS": "1500",
    "LEDGER_MAX_DELIVERIES": "3",
    # Tests sweep with the reconciler themselves (test_self_healing.py turns the workers' on)
    "LEDGER_RECONCILE_IN_WORKERS": "false",
    # ...and relay the outbox themselves (test_outbox.py turns the workers' on)
    "LEDGER_OUTBOX_RELAY_IN_WORKERS": "false",
    "LEDGER_BREAKERS": '{"payments": {"failure_threshold": 3, "cooldown_seconds": 3}}',
    "LEDGER_ESCALATION_CHECK_SECONDS": "0.5",
    # The console's logins (test_console.py): an operator and a viewer.
    "LEDGER_CONSOLE_USERS": (
        '{"olive": {"password": "operator-pass-123", "role": "operator"},'
        ' "vic": {"password": "viewer-pass-1234", "role": "viewer"}}'
    ),
    "LEDGER_RATE_LIMITS": '{"limited": {"rate_per_second": 4, "burst": 2}}',
    # Every message is signed and every signature checked, so each publish path (retries,
    # republishes, workflows, chords) is shown to sign what it sends; unsigned messages stay
    # accepted for the bad-input suites (test_signed_messages.py requires signatures).
    "LEDGER_SIGNING_KEYS": (
        '["test-signing-key-newest-0123456789abcdef", "test-signing-key-older-0123456789abcdef"]'
    ),
    "LEDGER_SIGNATURES_REQUIRED": "false",
    # Test-only Fernet keys (newest first): sensitive tasks are sealed at rest.
    "LEDGER_ENCRYPTION_KEYS": (
        '["0qFzQc5xoZQhPWiz7RlXDGRcus0k650e5VRXFgPRCH8=",'
        ' "AcKyJ2oLnrAAy_LZcIqJcLFxu0NMYeTJnp7JIrpzIs4="]'
    ),
}
APP_MODULE = "tests.integration.ledger_app"
NAMESPACE = "ledger_tests"  # the test app's name: its tier queues are "ledger_tests.<tier>"
ALL_TIERS = ",".join(f"{NAMESPACE}.{tier}" for tier in TIERS)
SESSION_WORKER = "main@127.0.0.1"
# What a dead worker leaves behind that would kill the next one: its queues (and their priority
# lists), the unacknowledged messages kombu restores, and the delayed deliveries.
DEAD_WORKER_KEYS = (
    *(f"{NAMESPACE}.{tier}" for tier in TIERS),
    f"{NAMESPACE}.unacked",
    f"{NAMESPACE}.unacked_index",
    f"{NAMESPACE}:ledger:delayed",
)
_session: list[EmbeddedStack] = []  # the session's stack, once started


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in str(item.path):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def provisioned_ledgers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every stack's authenticated SecantusDB starts from this process's provisioned copy
    (:mod:`.provisioned`: one start instead of two and a stop, for each stack)."""
    ledgers = ProvisionedLedgers(tmp_path_factory.mktemp("provisioned"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stack_module, "start_secantus", ledgers.start)
        yield


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    """Broker, ledger and one 4-process worker on every tier, shared by the session."""
    saved = dict(os.environ)
    os.environ.update(TEST_ENV)
    # Both servers require authentication (random passwords); the URLs carry them.
    running = WatchedStack(
        APP_MODULE, tmp_path_factory.mktemp("stack"), auth=True, queue_namespace=NAMESPACE
    )
    try:
        running.start_servers()
        os.environ.update(running.env)
        running.start_worker(ALL_TIERS, concurrency=4, name=SESSION_WORKER)
        WATCH.watch(running)
        _session.append(running)
        yield running
    finally:
        from tasks.effects import close_clients

        _session.clear()
        WATCH.unwatch(running)
        close_clients()
        running.stop()
        os.environ.clear()
        os.environ.update(saved)


def revive_session_worker() -> bool:
    """If the session's worker is dead, purge what it left behind and start another (first in
    ``stack.workers``, as before). True if it had to."""
    if not _session:
        return False
    running = _session[0]
    dead = [w for w in running.workers if w.name == SESSION_WORKER and not w.alive()]
    if not dead and any(w.name == SESSION_WORKER for w in running.workers):
        return False
    assert running.broker is not None
    with redis.Redis.from_url(running.broker.url) as broker:
        keys = [*DEAD_WORKER_KEYS]
        for tier in TIERS:
            keys += [key.decode() for key in broker.scan_iter(match=f"{tier}\x06\x16*")]
        broker.delete(*keys)
    for worker in dead:
        running.workers.remove(worker)
    worker = running.start_worker(ALL_TIERS, concurrency=4, name=SESSION_WORKER)
    running.workers.remove(worker)
    running.workers.insert(0, worker)
    return True


CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def fail_fast_on_dead_workers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Report a worker's death that no test was told about (between tests, or noticed by the
    test before the watchdog), and give the tests that follow a live session worker."""
    before = WATCH.take_pending()
    revive_session_worker()
    if before:
        pytest.fail(
            "a worker died before this test started:\n\n"
            + "\n\n".join(death.describe() for death in before),
            pytrace=False,
        )
    logs = _session_log_offsets()
    yield
    if request.node.stash.get(CALL_FAILED, False):
        # A failure seen only in a CI run is diagnosed from what the workers logged meanwhile,
        # and from where each of their processes is now (a job that never ran: a hang).
        stacks = _dump_session_stacks()
        request.node.add_report_section(
            "teardown", "worker logs", stacks + "\n" + _logged_since(logs, max_lines=1500)
        )
    after = WATCH.take_pending()
    revive_session_worker()
    if not after:
        return
    report = "\n\n".join(death.describe() for death in after)
    if request.node.stash.get(CALL_FAILED, False):  # the test failed already: add the why
        request.node.add_report_section("teardown", "worker died", report)
    else:
        pytest.fail(f"a worker died during this test:\n\n{report}", pytrace=False)


def _session_log_offsets() -> dict[Path, int]:
    """Where each log of the session stack's workers ends now."""
    offsets: dict[Path, int] = {}
    for worker in _session[0].workers if _session else ():
        try:
            offsets[worker.log_path] = worker.log_path.stat().st_size
        except OSError:
            offsets[worker.log_path] = 0
    return offsets


def _dump_session_stacks() -> str:
    """Have the session worker's processes write their threads' stacks to its log, one after
    another; says which processes, in the order their stacks appear."""
    if not _session:
        # (no session stack yet, as after a first test that needs none: importing the test app
        # now would bind it to no servers, and every later test of this process would fail)
        return "no stacks"
    from tests.integration.ledger_app import DUMP_STACKS

    asked = []
    for worker in _session[0].workers if _session else ():
        # Only the session worker runs the test app, whose processes handle the signal.
        if worker.name != SESSION_WORKER or not worker.alive():
            continue
        for role, pid in [("main", worker.pid), *(("pool", p) for p in worker.pool_pids())]:
            with contextlib.suppress(OSError):
                os.kill(pid, DUMP_STACKS)
                asked.append(f"{role} {pid}")
                time.sleep(0.3)  # written at once from the handler: keep the dumps apart
    return "stacks below, in this order: " + ", ".join(asked) if asked else "no stacks"


def _logged_since(offsets: dict[Path, int], *, max_lines: int = 200) -> str:
    """What those logs gained since ``offsets`` (the last ``max_lines`` lines of each)."""
    if not offsets and _session:  # the stack started with this test: all of it
        offsets = dict.fromkeys((worker.log_path for worker in _session[0].workers), 0)
    parts = []
    for path, offset in offsets.items():
        try:
            with path.open("rb") as log:
                log.seek(offset)
                lines = log.read().decode(errors="replace").splitlines()[-max_lines:]
        except OSError as exc:
            lines = [f"(unreadable: {exc})"]
        parts.append(f"--- {path.name}\n" + "\n".join(lines))
    return "\n".join(parts) or "(no session worker)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """While a test runs, a worker's death interrupts it with WorkerDied (see watchdog.py)."""
    with WATCH.armed():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed or hasattr(report, "wasxfail")
    return report


@pytest.fixture(scope="session")
def app(stack: EmbeddedStack) -> Any:
    """The test app, configured (from the environment) against the session's servers."""
    from tests.integration import ledger_app

    return ledger_app.app


@pytest.fixture
def token() -> str:
    """A fresh idempotency key, so tests never see each other's records or effects."""
    return f"t-{uuid.uuid4().hex[:12]}"


def make_isolated_stack(base: Path, app_module: str = APP_MODULE) -> WatchedStack:
    """A stack of its own, for tests that kill or stop servers (its workers are watched)."""
    running = WatchedStack(app_module, base, auth=True, queue_namespace=NAMESPACE)
    running.start_servers()
    WATCH.watch(running)
    return running


# Workers that heal by themselves, fast: a short lease, and their own reconciler sweeping every
# second (kombu itself would redeliver a message only after an hour).
HEALING_LEASE = 3.0
HEALING_SWEEP_EVERY = 1.0
HEALING_GRACE = 1.0
HEALING = {
    "LEDGER_LEASE_SECONDS": str(HEALING_LEASE),
    "LEDGER_RECONCILE_EVERY_SECONDS": str(HEALING_SWEEP_EVERY),
    "LEDGER_RECONCILE_LEASE_GRACE_SECONDS": str(HEALING_GRACE),
    "LEDGER_VISIBILITY_TIMEOUT_SECONDS": "3600",
    "LEDGER_RECONCILE_IN_WORKERS": "true",
}
DEFAULT_QUEUE = f"{NAMESPACE}.default"
UNACKED = f"{NAMESPACE}.unacked"


def start_healing_worker(stack: EmbeddedStack, name: str, **options: Any) -> WorkerProcess:
    """A worker of ``stack`` on the default tier with :data:`HEALING` (``env=`` adds to it)."""
    env = {**HEALING, **options.pop("env", {})}
    return stack.start_worker(DEFAULT_QUEUE, name=f"{name}@127.0.0.1", env=env, **options)


def broker_client(stack: EmbeddedStack) -> redis.Redis:
    assert stack.broker is not None
    return redis.Redis.from_url(stack.broker.url)


@contextlib.contextmanager
def own_stack(base: Path, app_module: str = APP_MODULE) -> Iterator[WatchedStack]:
    """A stack of its own whose servers the environment names while it runs (tasks.effects
    reads the ledger's URL from it), for tests that kill servers or fill them. Request the
    session's ``app`` first: the test app module binds to the servers the environment names
    when it is first imported."""
    from tasks.effects import close_clients

    saved = dict(os.environ)
    os.environ.update(TEST_ENV)
    try:
        running = make_isolated_stack(base, app_module)
        try:
            os.environ.update(running.env)
            close_clients()  # (clients made earlier name the session's servers)
            yield running
        finally:
            close_clients()
            running.stop()
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def own(tmp_path: Path, app: Any) -> Iterator[EmbeddedStack]:
    """A stack of its own, its workers the test's (the session's stack runs too: ``app``)."""
    with own_stack(tmp_path) as running:
        yield running


@pytest.fixture
def isolated(tmp_path: Path, stack: Any) -> Iterator[EmbeddedStack]:
    """A stack of its own with no worker (the test starts the workers it needs); modules whose
    tests all want the same worker define their own ``isolated``."""
    running = make_isolated_stack(tmp_path)
    try:
        yield running
    finally:
        running.stop()


def producer_app(stack: EmbeddedStack, name: str, **settings: Any) -> Any:
    """An app named ``name`` publishing to ``stack`` (a producer, or a probe of the records);
    its tier queues are the test app's unless ``queue_namespace`` says otherwise."""
    from celery_ledger import Settings, create_app

    assert stack.broker is not None and stack.ledger is not None
    settings.setdefault("queue_namespace", NAMESPACE)
    settings.setdefault("broker_url", stack.broker.url)
    settings.setdefault("mongo_uri", stack.ledger.url)
    settings.setdefault("mongo_db", "ledger_tests")
    return create_app(name, settings=Settings(**settings), set_as_current=False)


@pytest.fixture(scope="module")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A valkey server of the test module's own (for the tests of one Redis mechanism)."""
    server = start_valkey(tmp_path_factory.mktemp("valkey"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(valkey: ServerProcess) -> Iterator[redis.Redis]:
    """A client of the module's own valkey."""
    connection = redis.Redis.from_url(valkey.url)
    try:
        yield connection
    finally:
        connection.close()
