"""Flower and the CLI load the reference app's tasks with no signing or encryption keys (they
are given none: least privilege); a worker of it refuses to start without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
from tasks import app
app.loader.import_default_modules()  # what Flower does at start
assert app.tasks["tasks.payments.store_card"].sensitive
print("problems:", len(app.missing_keys()))
"""


def test_the_reference_app_loads_without_keys_and_names_what_a_worker_would_need() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    env["LEDGER_BROKER_URL"] = "redis://127.0.0.1:1/0"  # nothing is contacted
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "platform")])
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "problems: 2" in result.stdout  # the encryption keys, and the key secret


TENANT_PROBE = """
from tasks import app
from celery_ledger.tenancy import tenant_of_call
app.loader.import_default_modules()
export = app.tasks["tasks.reports.customer_export"]
args = (42, "orders", "2026-11-29")
print(tenant_of_call(export.tenant_spec(), task_name=export.name, run=export.run, args=args,
                     kwargs={}))
"""


def test_the_reference_apps_export_names_its_customer_as_its_tenant() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    env["LEDGER_BROKER_URL"] = "redis://127.0.0.1:1/0"  # nothing is contacted
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "platform")])
    result = subprocess.run(
        [sys.executable, "-c", TENANT_PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "customer-42"  # each customer's exports are its own lane
