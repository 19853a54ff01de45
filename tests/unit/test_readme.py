"""The README is the front door: the two set-up commands, a working app, links that resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

# Imports the README's app as myapp.celery and runs its tasks eagerly (bodies without the
# ledger, as its unit tests would): the app module must import, declare ledger tasks with the
# options it shows, and return what it says.
PROBE = """
from celery_ledger import LedgerTask
from myapp.celery import CardDeclined, app, charge, rebuild_report

assert isinstance(charge, LedgerTask) and charge.tier == "critical", charge
assert rebuild_report.tier == "bulk", rebuild_report
assert charge.key_of((7, 100), {}) == "order-7"
app.conf.task_always_eager = True
assert charge.delay(7, 100).get(timeout=10) == {"order": 7, "charged": 100}
assert rebuild_report.delay("sales", "2026-11-29").get(timeout=10)["report"] == "sales"
try:
    charge.apply(args=(8, 0), throw=True)
except CardDeclined:
    print("declined as documented")
print("ok")
"""


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def test_the_readme_gives_the_two_setup_commands() -> None:
    assert "./run demo" in README and "./run test" in README


def test_the_readme_is_a_front_door() -> None:
    # At most 200 lines: the rest of what there is to say is in the site (docs/).
    assert len(README.splitlines()) <= 200


def test_the_readmes_app_is_a_working_app(tmp_path: Path) -> None:
    # Given the README's first Python block, saved where its first line says
    app_code = _python_blocks(README)[0]
    assert app_code.startswith("# myapp/celery.py\n")
    package = tmp_path / "myapp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "celery.py").write_text(app_code)
    # When it is imported and its tasks are called (nothing is contacted)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    env["LEDGER_BROKER_URL"] = "redis://127.0.0.1:1/0"
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT / "platform")])
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # Then its tasks are ledger tasks with the documented keys, tiers and results
    assert result.returncode == 0, result.stderr[-3000:]
    assert "declined as documented" in result.stdout and "ok" in result.stdout


def test_the_readmes_usage_names_what_the_app_defines() -> None:
    usage = _python_blocks(README)[1]
    assert "charge.delay(7, 100)" in usage and '"order-7"' in usage


def test_every_relative_link_of_the_readme_resolves() -> None:
    # The README is read on GitHub, outside the site: mkdocs --strict does not check it.
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    relative = [link for link in links if "://" not in link]
    assert relative, "the README links into docs/"
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert missing == []
