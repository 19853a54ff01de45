"""The first hour of a new user, on real servers: the quickstart followed as the README and
``docs/getting-started/your-app.md`` write it, from the wheel installed in a fresh virtualenv.

The app is the README's (saved where its first line says), the commands are the ones the two
pages print (parsed out of them, so the pages cannot drift from what works): the embedded
stack started with ``celery -A myapp.celery ledger stack``, the ``source`` line it prints typed
into another shell, the pages' Python run there as written, the production worker command, a
job shown by its id and by its task and key, ``ledger health``, Flower's API with the login the
stack exported, and Ctrl-C. No output of any of them holds a traceback (issue 38).

One test, so one process builds the virtualenv and runs the stack (about 40 s on 2 cores).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.newcomer import PIP_MISSING, ROOT, Newcomer, imported_from, make_newcomer

README = (ROOT / "README.md").read_text()
YOUR_APP = (ROOT / "docs" / "getting-started" / "your-app.md").read_text()
DEMO = (ROOT / "docs" / "getting-started" / "demo.md").read_text()
# A terminal of the new user's: wide enough that rich does not wrap a worker's name.
TERMINAL = {"COLUMNS": "200"}

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(PIP_MISSING, reason="pip is not available"),
]

# Runs Python blocks of the pages in the user's shell, statement by statement, as typed into
# an interpreter: each expression's value is printed as a JSON line (a record as its fields,
# a result handle as its id).
PROBE = """
import ast, importlib, json, sys

namespace = dict(vars(importlib.import_module("myapp.celery")))
for block in json.loads(sys.argv[1]):
    for statement in ast.parse(block).body:
        source = ast.get_source_segment(block, statement)
        if not isinstance(statement, ast.Expr):
            exec(compile(ast.Module([statement], []), "<doc>", "exec"), namespace)
            continue
        value = eval(compile(ast.Expression(statement.value), "<doc>", "eval"), namespace)
        line = block.splitlines()[statement.end_lineno - 1]  # with its comment
        shown = {"source": source, "line": line, "repr": repr(value)}
        if hasattr(value, "model_dump"):
            shown["fields"] = value.model_dump(mode="json")
        if hasattr(value, "id") and hasattr(value, "get"):
            shown["id"] = value.id
        print("doc:", json.dumps(shown))
"""


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def _bash_lines(text: str) -> list[str]:
    """Each command of the page's bash blocks, without its comment."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]


def _commands(*pages: str) -> list[str]:
    """The ``celery -A myapp...`` commands the pages print, in code spans or bash blocks, each
    once, in the order they first appear."""
    found = []
    for page in pages:
        found += re.findall(r"`(celery -A myapp[^`]*)`", page)
        found += [line for line in _bash_lines(page) if line.startswith("celery -A myapp")]
    return list(dict.fromkeys(" ".join(command.split()) for command in found))


def _variants(command: str, values: dict[str, str]) -> list[str]:
    """``command`` with its placeholders (``JOB_ID``) filled in from ``values``, and once with
    and once without each optional ``[--flag]``."""
    for name in re.findall(r"\b[A-Z][A-Z_]{2,}\b", command):
        assert name in values, f"the page's command {command!r} has a placeholder {name} to fill"
        command = command.replace(name, values[name])
    optional = re.search(r" \[(--[a-z-]+)\]", command)
    if optional is None:
        return [command]
    without, with_flag = (
        command.replace(optional.group(0), ""),
        command.replace(optional.group(0), f" {optional.group(1)}"),
    )
    return [*_variants(without, values), *_variants(with_flag, values)]


def _pids(output: str) -> list[int]:
    """The processes the stack listed (``valkey     pid 1234 ...``)."""
    return [int(pid) for pid in re.findall(r"^\S+\s+pid (\d+)", output, re.M)]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(output: Path, text: str, process: subprocess.Popen[bytes], timeout: float) -> str:
    """The output once it holds ``text``; fails if the process ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        said = output.read_text(errors="replace")
        if text in said:
            return said
        assert process.poll() is None, f"exited with {process.returncode}:\n{said}"
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} in {timeout} s:\n{output.read_text(errors='replace')}")


def _ctrl_c(
    process: subprocess.Popen[bytes], output: Path, *, exit_code: int = 0, timeout: float = 60
) -> str:
    """Ctrl-C in the process's terminal; its whole output once it has exited by itself, with
    ``exit_code``."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        said = output.read_text(errors="replace")
        masks = "".join(  # (ignored or blocked signals: inherited from whoever started it)
            line
            for line in Path(f"/proc/{process.pid}/status").read_text().splitlines(True)
            if line.startswith(("SigBlk", "SigIgn", "SigCgt"))
        )
        raise AssertionError(f"still running {timeout} s after Ctrl-C:\n{said}\n{masks}") from None
    said = output.read_text(errors="replace")
    assert process.returncode == exit_code, said
    assert "Traceback" not in said, said
    return said


@contextlib.contextmanager
def _left_running(process: subprocess.Popen[bytes], output: Path) -> Iterator[None]:
    """Whatever happens in the block, ``process`` and every process it listed end with it
    (each by its pid: the stack's children run in sessions of their own)."""
    try:
        yield
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(60)
        for pid in [process.pid, *_pids(output.read_text(errors="replace"))]:
            if _running(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        process.poll()


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory) -> Newcomer:
    found = make_newcomer(tmp_path_factory.mktemp("first-hour-servers"), app="myapp.celery")
    assert imported_from(found).startswith(str(found.python.parents[1]))  # the wheel's
    # The README's app, saved where its first line says
    app = _python_blocks(README)[0]
    path = app.splitlines()[0].removeprefix("# ")
    assert path == "myapp/celery.py", app
    (found.home / path).parent.mkdir()
    (found.home / path).write_text(app)
    return found


def test_the_quickstart_runs_from_the_installed_wheel(newcomer: Newcomer, tmp_path: Path) -> None:
    commands = _commands(README, YOUR_APP)
    stacks = [c for c in commands if " ledger stack" in c]
    workers = [c for c in commands if " ledger worker " in c]
    others = [c for c in commands if c not in (*stacks, *workers)]
    assert stacks == ["celery -A myapp.celery ledger stack"], commands  # the pages agree
    assert "pip install 'celery-ledger[embedded]'" in _bash_lines(YOUR_APP)
    assert workers and any(" ledger show " in c for c in others), commands
    assert any(c.endswith(" ledger health") for c in others), commands

    # Given the stack started as the pages say (in a terminal of its own)
    stack_output = tmp_path / "stack.out"
    stack = newcomer.start(stacks[0], stack_output, env=TERMINAL)
    with _left_running(stack, stack_output):
        said = _wait_for(stack_output, "Ctrl-C stops every process", stack, timeout=150)
        assert "Traceback" not in said, said
        assert "billing.critical, billing.default, billing.bulk" in said, said  # the app's own
        # ...and the line it says to type in another shell
        (source,) = re.findall(r"In another shell: (source \S+)", said)
        assert source == "source .ledger-dev/stack.env", said

        # When the production worker command runs beside it (a terminal of its own)
        with contextlib.ExitStack() as started:
            production = []
            for index, command in enumerate(workers):
                output = tmp_path / f"worker-{index}.out"
                process = newcomer.start(command, output, setup=source, env=TERMINAL)
                started.enter_context(_left_running(process, output))
                production.append((process, output))
            # ...and the pages' Python runs in the other shell, as written
            blocks = [_python_blocks(README)[1], _python_blocks(YOUR_APP)[1]]
            probe = f"python -c {shlex.quote(PROBE)} {shlex.quote(json.dumps(blocks))}"
            ran = newcomer.shell(f"{source}\n{probe}", env=TERMINAL).worked().stdout
            shown = [json.loads(line[5:]) for line in ran.splitlines() if line.startswith("doc: ")]
            # Then each result is the one its comment promises, read from the ledger
            promised = [s for s in shown if "# {" in s["line"]]
            assert promised, ran
            for each in promised:
                comment = each["line"].split("# ", 1)[1]
                literal = comment[: comment.rindex("}") + 1]
                assert ast.literal_eval(each["repr"]) == ast.literal_eval(literal), each
            # ...every publish of charge(7, 100) is the one job, which ran once
            ids = {s["id"] for s in shown if "id" in s}
            assert len(ids) == 1, shown
            records = [s["fields"] for s in shown if "fields" in s]
            assert records and all(r["state"] == "succeeded" for r in records), records
            assert all(r["attempts"] == 1 and r["key"] == "order-7" for r in records), records

            # ...and every other command the pages print works, in that shell
            (job_id,) = ids
            for command in others:
                for variant in _variants(command, {"JOB_ID": job_id}):
                    if variant.endswith(" ledger health"):  # (the production worker in it)
                        mine = f"critical@{socket.gethostname()}"
                        out = _until(newcomer, f"{source}\n{variant}", saying=mine)
                        assert "healthy" in out and "UNHEALTHY" not in out, out
                        continue
                    out = newcomer.shell(f"{source}\n{variant}", env=TERMINAL).worked().stdout
                    if " ledger show " in variant and variant.endswith("--json"):
                        record = json.loads(out)
                        assert record["id"] == job_id and record["state"] == "succeeded", out
                    elif " ledger show " in variant:
                        assert "succeeded" in out and '{"order": 7, "charged": 100}' in out, out

            # ...Flower answers with the login the stack exported (the demo page's command)
            (curl,) = re.findall(r"`(curl [^`]*)`", DEMO)
            _until(newcomer, f"{source}\n{curl}", saying='"critical@127.0.0.1"')

            # Ctrl-C in the production worker's terminal: a warm shutdown
            for process, output in production:  # (Celery's status after SIGINT is 1)
                assert "Warm shutdown" in _ctrl_c(process, output, exit_code=1)

        # Ctrl-C in the stack's terminal stops every process it listed, and every log is clean
        said = _ctrl_c(stack, stack_output)
        assert _pids(said) and not [pid for pid in _pids(said) if _running(pid)], said
        logs = sorted((newcomer.home / ".ledger-dev").glob("*.log"))
        assert logs, said
        for log in logs:
            assert "Traceback" not in log.read_text(errors="replace"), log


def _until(newcomer: Newcomer, script: str, *, saying: str, tries: int = 5) -> str:
    """The output of ``script`` once it succeeds saying ``saying``. Workers answer a broadcast
    within a timeout (``ledger health``: 2 s, Flower: 1 s): on a busy machine, or while the
    production worker still starts, one may be missing from the first answer."""
    for _ in range(tries):
        ran = newcomer.shell(script, env=TERMINAL)
        assert "Traceback" not in ran.output, ran.output
        if ran.code == 0 and saying in ran.stdout:
            return ran.stdout
        time.sleep(1)
    raise AssertionError(f"not done after {tries} tries:\n{ran.output}")
