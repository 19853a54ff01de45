"""The documentation site builds with warnings as errors, and its reference matches the code.

The build is what ``./run docs`` runs (``mkdocs build --strict``): a broken relative link or
anchor, a page left out of the navigation or a docstring mkdocstrings cannot read fails it. It
takes half a minute to a minute and a half on 2 busy cores, so it runs once (a module fixture,
one xdist group) in ``./run test``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import click
import pytest

from celery_ledger.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# One process builds the site for the whole module (xdist hands out tests one by one otherwise).
pytestmark = pytest.mark.xdist_group("docs-site")


def _hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"docs_hook_{name}", DOCS / "_hooks" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra (in dev) installs mkdocs")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # (Material's banner on stderr)
        check=False,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    return out


def test_the_site_builds_strictly_with_every_section(site: Path) -> None:
    for page in (
        "getting-started/install",
        "guide/guarantees",
        "operations/security",
        "ops/runbooks/backlog",  # the runbooks are pages of the site
        "reference/api",
        "reference/cli",
        "evidence/benchmarks",
        "internals/ledger-protocol",
        "contributing",
        "changelog",
    ):
        assert (site / page / "index.html").is_file(), page
    assert (site / "ops" / "bench" / "figures" / "throughput.png").is_file()


def test_every_setting_is_documented_with_its_description(site: Path) -> None:
    # Given the settings page generated from the model (docs/_hooks/generated.py)
    page = (site / "reference" / "settings" / "index.html").read_text()
    # Then every field is there, and every field says what it is for
    missing = [
        f"LEDGER_{name.upper()}"
        for name in Settings.model_fields
        if f"<code>LEDGER_{name.upper()}</code>" not in page
    ]
    assert missing == []
    undescribed = [name for name, field in Settings.model_fields.items() if not field.description]
    assert undescribed == []


def test_the_generated_settings_table_has_a_row_per_field() -> None:
    table = _hook("generated").settings_table().splitlines()
    assert len(table) == 2 + len(Settings.model_fields)
    assert "| `LEDGER_LEASE_SECONDS` | float | `60.0` |" in "\n".join(table)


def test_the_cli_reference_lists_every_command(site: Path) -> None:
    from celery_ledger.cli import ledger

    page = (site / "reference" / "cli" / "index.html").read_text()
    names = ledger.list_commands(click.Context(ledger))  # (the group loads its commands then)
    assert len(names) > 10, names
    for name in names:
        assert f"celery -A APP ledger {name}" in page, name


def test_every_metric_the_workers_export_is_in_the_metrics_reference() -> None:
    code = "".join(
        path.read_text() for path in (ROOT / "platform/celery_ledger/observability").glob("*.py")
    )
    defined = set(re.findall(r'"(celery_ledger_[a-z_]+)"', code))
    page = (DOCS / "reference" / "metrics.md").read_text()
    assert defined and {name for name in defined if f"`{name}`" not in page} == set()
