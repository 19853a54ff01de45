"""What ``pip install celery-ledger`` ships: every module of the library, importable."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[2] / "platform" / "celery_ledger"
_CACHES = shutil.ignore_patterns("__pycache__", "*.pyc")


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
    for name in ("pyproject.toml", "README.md"):
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
