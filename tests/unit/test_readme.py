"""The README documents what users configure and run."""

from __future__ import annotations

from pathlib import Path

from celery_ledger.settings import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_in_the_readme_table() -> None:
    missing = [
        f"LEDGER_{name.upper()}"
        for name in Settings.model_fields
        if f"| `LEDGER_{name.upper()}` |" not in README
    ]
    assert not missing, f"settings missing from README.md: {missing}"


def test_the_readme_gives_the_two_setup_commands() -> None:
    assert "./run demo" in README and "./run test" in README
