"""What ``pip install celery-ledger`` ships: every module and data file of the library,
importable, its license and its version, in the wheel and in the sdist (and in a wheel built
from that sdist, as pip builds one where no wheel fits); and what its CLI says about itself."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import celery_ledger
from celery_ledger.cli import ledger
from tests.newcomer import PIP_MISSING, build_wheel, wheel_of

LIBRARY = Path(__file__).resolve().parents[2] / "platform" / "celery_ledger"
ROOT = LIBRARY.parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
# Every file the library is made of, as a path inside a wheel: its modules, py.typed, the
# console's templates and static files (pyproject's package-data).
SHIPPED = {
    str(path.relative_to(LIBRARY.parent))
    for path in LIBRARY.rglob("*")
    if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
}
needs_pip = pytest.mark.skipif(PIP_MISSING, reason="pip is not available")


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


@needs_pip
def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    _holds_the_library_and_its_license(wheel)
    assert wheel.name.startswith(f"celery_ledger-{PROJECT['version']}-")


def _holds_the_library_and_its_license(wheel: Path) -> None:
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert SHIPPED - shipped == set()
    assert "celery_ledger/py.typed" in shipped
    # The license travels with the wheel, in its metadata (PEP 639: .dist-info/licenses/)
    licenses = [name for name in shipped if name.endswith(".dist-info/licenses/LICENSE")]
    assert len(licenses) == 1, sorted(shipped)
    text = zipfile.ZipFile(wheel).read(licenses[0]).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    metadata = next(name for name in shipped if name.endswith(".dist-info/METADATA"))
    assert "License-Expression: Apache-2.0" in zipfile.ZipFile(wheel).read(metadata).decode()


@needs_pip
def test_the_sdist_holds_the_project_and_builds_a_whole_wheel(tmp_path: Path) -> None:
    # Given what a clone of the repository holds (git's files, new ones too; nothing ignored)
    checkout = tmp_path / "checkout"
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():  # (a file deleted but not yet committed is listed)
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    # When pyproject's build backend builds the sdist (what `python -m build --sdist
    # --no-isolation` calls: the backend's hook, with this interpreter's setuptools)
    backend = PYPROJECT["build-system"]["build-backend"]
    built = subprocess.run(
        [
            *(sys.executable, "-c"),
            f"import sys, {backend} as backend; print(backend.build_sdist(sys.argv[1]))",
            str(tmp_path / "sdist"),
        ],
        cwd=checkout,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    sdist = tmp_path / "sdist" / built.stdout.split()[-1]
    assert sdist.name == f"celery_ledger-{PROJECT['version']}.tar.gz"
    # Then it holds the license, the README, pyproject.toml and the whole library
    top = f"celery_ledger-{PROJECT['version']}/"
    with tarfile.open(sdist) as archive:
        names = {name.removeprefix(top) for name in archive.getnames()}
    assert {"LICENSE", "README.md", "pyproject.toml", "PKG-INFO"} <= names
    assert {f"platform/{name}" for name in SHIPPED} - names == set()
    # ...and the wheel pip builds from it (where no wheel fits) holds all of it too
    _holds_the_library_and_its_license(wheel_of(sdist, tmp_path / "from-sdist"))


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
