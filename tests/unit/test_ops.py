"""ops/: alert rules, the Grafana dashboard and the runbooks agree with the code.

Alert rules are checked with ``promtool`` (Debian's ``prometheus`` package) when it is on PATH,
including the rule unit tests in ``alerts_test.yml``; else with a schema check in PyYAML. Under
``CI=true`` one of them must be there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest
from prometheus_client import CollectorRegistry

from celery_ledger.cli import ledger
from celery_ledger.observability.metrics import METRIC_NAMES, LedgerMetrics

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "ops" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "ops" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "ops" / "grafana" / "dashboards" / "celery-ledger.json"
RUNBOOKS = ROOT / "ops" / "runbooks"
SERIES = re.compile(r"\bcelery_ledger_[a-z_]+")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def test_alert_rules_with_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (apt-get install prometheus); schema check below")
    for args in (["check", "rules", str(ALERTS)], ["test", "rules", str(ALERT_TESTS)]):
        result = subprocess.run(
            [promtool, *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_schema() -> None:
    try:
        import yaml
    except ImportError:
        if _in_ci() and shutil.which("promtool") is None:
            pytest.fail("CI=true needs promtool or PyYAML to validate ops/prometheus/alerts.yml")
        pytest.skip("PyYAML is not installed (the dev extra has it)")
    document: dict[str, Any] = yaml.safe_load(ALERTS.read_text())
    names = []
    for group in document["groups"]:
        assert group["name"] and group["rules"], group
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert rule["alert"] and rule["expr"], rule
            assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule
            assert rule["annotations"]["summary"], rule
            if "for" in rule:
                assert re.fullmatch(r"\d+[smh]", rule["for"]), rule
            runbook = rule["annotations"].get("runbook_url")
            if runbook:
                assert (ROOT / runbook).is_file(), runbook
            names.append(rule["alert"])
    assert len(names) == len(set(names))


def test_ops_use_only_metrics_we_export() -> None:
    for path in (ALERTS, ALERT_TESTS, DASHBOARD):
        used = set(SERIES.findall(path.read_text()))
        assert used, path
        assert used <= METRIC_NAMES, f"{path.name}: unknown {sorted(used - METRIC_NAMES)}"


def test_every_defined_metric_is_catalogued() -> None:
    registry = CollectorRegistry()
    LedgerMetrics(registry)
    exported = {
        sample_name
        for family in registry.collect()
        for sample_name in _sample_names(family.name, family.type)
    }
    assert exported <= METRIC_NAMES, sorted(exported - METRIC_NAMES)


def _sample_names(name: str, kind: str) -> list[str]:
    if kind == "counter":
        return [f"{name}_total"]
    if kind == "histogram":
        return [f"{name}_{suffix}" for suffix in ("bucket", "sum", "count")]
    return [name]


def test_dashboard_is_provisionable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "celery-ledger"
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "prometheus"  # provisioning/datasources
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])


def _resolves(words: list[str]) -> bool:
    """``ledger WORDS...`` names a command (the words after it are its arguments)."""
    command: click.Command = ledger
    for word in words:
        if not isinstance(command, click.Group):
            return True
        if word not in command.commands:
            return False
        command = command.commands[word]
    return True


def test_runbooks_name_real_commands_and_are_indexed() -> None:
    pages = sorted(RUNBOOKS.glob("*.md"))
    index = (RUNBOOKS / "README.md").read_text()
    assert len(pages) >= 7
    docs = sorted((ROOT / "docs").rglob("*.md"))  # the site's pages, where the README's text went
    for page in [*pages, ROOT / "README.md", *docs]:
        text = page.read_text()
        if page.parent == RUNBOOKS and page.name != "README.md":
            assert f"({page.name})" in index, f"{page.name} is not in the runbook index"
        for words in re.findall(r"celery -A \S+ ledger ((?:[a-z][a-z-]*(?: |$))+)", text, re.M):
            assert _resolves(words.split()), f"{page.name}: unknown command ledger {words}"
