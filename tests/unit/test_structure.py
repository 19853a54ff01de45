"""The library's shape, held in CI: its layers (import contracts), the size of its modules and
its public API. A change that breaks one of these says so here, not in a later review."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import celery_ledger

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "platform" / "celery_ledger"
MAX_LINES = 600
# Modules over the limit, each to be split by concern (issue 37); none may grow past its cap,
# and a module that shrinks under the limit leaves this list.
OVERSIZED = {
    "guard.py": 1418,
    "task.py": 1140,
    "schedules.py": 954,
    "app.py": 959,
    "workflow/engine.py": 935,
    "triggers.py": 818,
    "console/app.py": 670,
    "settings.py": 644,
    "deadletter.py": 685,
}
# The public API (``celery_ledger.__all__``): a name added or removed is a change of the
# release's API, said in CHANGELOG.md; this list changes with it.
PUBLIC_API = {
    "Alternate", "Backpressure", "CatchUp", "CircuitOpen", "CommitLost", "ConfigurationError",
    "ControlFlow", "DeadlineExceeded", "ErrorEntry", "Fallback", "IdentityError", "Interrupted",
    "Job", "LastGood", "LeaseLost", "LedgerCelery", "LedgerError", "LedgerRecord", "LedgerTask",
    "LedgerUnavailable", "NonDeterminism", "NotReplicated", "Observer", "Overlap", "PayloadError",
    "PermanentError", "Placeholder", "PublishError", "RetryNotPublished", "SchedulePolicy",
    "Settings", "State", "StepFailed", "StoreError", "TaskError", "Workflow",
    "WorkflowCancelled", "WorkflowContext", "WorkflowError", "WorkflowEvent", "WorkflowFailed",
    "WorkflowHandle", "WorkflowStatus", "bounded", "create_app", "deadline", "hedged",
    "remaining",
}  # fmt: skip


def test_the_layers_and_the_adapters_seam_hold() -> None:
    """import-linter's contracts (pyproject.toml): each layer imports only the ones below it,
    and no Celery or kombu below the adapters but the listed imports still to move."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    linter = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(linter), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_no_module_is_over_its_size() -> None:
    sizes = {
        path.relative_to(LIBRARY).as_posix(): len(path.read_text().splitlines())
        for path in LIBRARY.rglob("*.py")
    }
    over = {name: lines for name, lines in sizes.items() if lines > OVERSIZED.get(name, MAX_LINES)}
    assert over == {}, f"modules over {MAX_LINES} lines (or past their cap): {over}"
    shrunk = sorted(name for name in OVERSIZED if sizes.get(name, 0) <= MAX_LINES)
    assert shrunk == [], f"under the limit now: take them off OVERSIZED: {shrunk}"


def test_the_public_api_is_the_locked_one() -> None:
    assert set(celery_ledger.__all__) == PUBLIC_API
    assert len(celery_ledger.__all__) == len(PUBLIC_API)  # no name twice
    for name in PUBLIC_API:
        assert getattr(celery_ledger, name) is not None


def test_the_store_and_its_fakes_provide_what_each_caller_needs() -> None:
    """Each caller's Protocol (``celery_ledger.ledger.ports``) is provided by the real store
    (mypy checks its types) and by the in-memory fake the unit tests use (checked here: every
    method, with every parameter a caller may pass by name, the fake's keyword-only where the
    store's are), so the fakes never drift from what the engines call."""
    import inspect

    from celery_ledger.ledger.ports import PORTS
    from celery_ledger.ledger.store import Ledger
    from tests.fakes import MemoryLedger

    fake = MemoryLedger()
    missing: list[str] = []
    for port in PORTS:
        members = [
            name
            for name, value in vars(port).items()
            if callable(value) and not name.startswith("_")
        ]
        for name in members:
            wanted = inspect.signature(getattr(port, name))
            for provider in (Ledger, MemoryLedger):
                method = getattr(provider, name, None)
                if method is None:
                    missing.append(f"{provider.__name__}.{name} ({port.__name__})")
                    continue
                given = inspect.signature(method).parameters
                for param in wanted.parameters.values():
                    if param.name == "self" or any(p.kind is p.VAR_KEYWORD for p in given.values()):
                        continue
                    if param.name not in given:
                        missing.append(f"{provider.__name__}.{name}({param.name}=)")
                    elif (param.default is inspect.Parameter.empty) != (
                        given[param.name].default is inspect.Parameter.empty
                    ) and param.default is not inspect.Parameter.empty:
                        missing.append(f"{provider.__name__}.{name}: {param.name} has no default")
        assert callable(fake.now)
    assert missing == [], missing
