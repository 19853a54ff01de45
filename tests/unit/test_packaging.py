"""What ``pip install celery-ledger`` ships: every module of the library, importable, its license
and its version; and what its CLI says about itself."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import celery_ledger
from celery_ledger.cli import ledger

LIBRARY = Path(__file__).resolve().parents[2] / "platform" / "celery_ledger"
_CACHES = shutil.ignore_patterns("__pycache__", "*.pyc")
PROJECT = tomllib.loads((LIBRARY.parents[1] / "pyproject.toml").read_text())["project"]


def test_every_directory_of_the_library_is_a_package() -> None:
    # setuptools' find (pyproject.toml) ships only directories with an __init__.py: a module
    # in any other would be missing from the wheel while the editable install still finds it.
    missing = [
        str(directory.relative_to(LIBRARY.parent))
        for directory in [LIBRARY, *LIBRARY.rglob("*")]
        if directory.is_dir()
        and directory.name != "__pycache__"
        and any(directory.glob("*.py"))
        and not (directory / "__init__.py").exists()
    ]
    assert missing == []


@pytest.mark.skipif(
    subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode,
    reason="pip is not available",
)
def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes its build/ directory beside the sources.
    source = tmp_path / "source"
    root = LIBRARY.parents[1]
    shutil.copytree(LIBRARY, source / "platform" / "celery_ledger", ignore=_CACHES)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(root / name, source / name)
    built = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"),
            *("-w", str(tmp_path), str(source)),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("celery_ledger-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(path.relative_to(LIBRARY.parent)) for path in LIBRARY.rglob("*.py")}
    assert modules - shipped == set()
    # The license travels with the wheel, in its metadata (PEP 639: .dist-info/licenses/)
    licenses = [name for name in shipped if name.endswith(".dist-info/licenses/LICENSE")]
    assert len(licenses) == 1, sorted(shipped)
    text = zipfile.ZipFile(wheel).read(licenses[0]).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    metadata = next(name for name in shipped if name.endswith(".dist-info/METADATA"))
    assert "License-Expression: Apache-2.0" in zipfile.ZipFile(wheel).read(metadata).decode()
    assert wheel.name.startswith(f"celery_ledger-{PROJECT['version']}-")


def test_the_version_is_the_projects() -> None:
    # Given the package installed from this tree (editable, as ./run sets it up)
    # Then its __version__ is pyproject's, and so is what `celery ledger --version` prints
    assert celery_ledger.__version__ == PROJECT["version"]
    result = CliRunner().invoke(ledger, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"celery-ledger {PROJECT['version']}\n"


def _commands(group: click.Group, path: str) -> list[tuple[str, click.Command]]:
    found = []
    for name, command in group.commands.items():
        found.append((f"{path} {name}", command))
        if isinstance(command, click.Group):
            found += _commands(command, f"{path} {name}")
    return found


def test_no_command_summary_is_cut() -> None:
    # click lists a group's commands with a summary of at most 45 characters (less on a narrow
    # terminal) and cuts a longer one with "...": each command's short help fits
    cut = [
        path
        for path, command in [("ledger", ledger), *_commands(ledger, "ledger")]
        if command.get_short_help_str(limit=45).endswith("...")
        or len(command.get_short_help_str(limit=1000)) > 45
    ]
    assert cut == []
