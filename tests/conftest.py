"""Hypothesis profiles for the whole suite, and the ``props`` marker on every property test.

- ``ci`` (the default): derandomized (each test draws the same examples on every run), and it
  first replays the examples stored in ``tests/hypothesis-examples/`` (read-only): every failure
  a wide search once found stays a regression example.
- ``wide`` (``--hypothesis-profile=wide``): random, ``WIDE_FACTOR`` times as many examples,
  and new failures are written into that directory, to be committed.

Select the property tests with ``-m props``; docs/contributing/testing.md has the commands.

The suite runs in parallel (pytest-xdist, ``-n auto --dist loadgroup`` in pyproject's addopts):
:func:`pytest_xdist_auto_num_workers` chooses how many processes, each with its own servers
and workers (the session fixtures are per process).
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, is_hypothesis_test, settings
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    ReadOnlyDatabase,
)

EXAMPLES_DIR = Path(__file__).parent / "hypothesis-examples"
CI_MAX_EXAMPLES = 100  # hypothesis' own default; tests ask for a share of it with examples()
WIDE_FACTOR = 10


class KeepFailures(ExampleDatabase):
    """A database that never forgets a failure: replaying a stored failure that now passes
    does not delete it (it stays a regression example). Shrinking still tidies up after itself:
    the larger failures it moves aside (hypothesis' ``.secondary`` keys) may be deleted."""

    def __init__(self, db: ExampleDatabase) -> None:
        super().__init__()
        self._wrapped = db

    def fetch(self, key: bytes) -> Iterable[bytes]:
        yield from self._wrapped.fetch(key)

    def save(self, key: bytes, value: bytes) -> None:
        self._wrapped.save(key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        if key.endswith(b".secondary"):
            self._wrapped.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.save(dest, value)
        self.delete(src, value)

    def _start_listening(self) -> None:
        pass

    def _stop_listening(self) -> None:
        pass


# derandomize=True and a database cannot be given together: settings() refuses it ("derandomize
# implies database=None"), and the built-in ci profile has no database. The database is given on
# a child of a derandomized parent instead, which hypothesis accepts and uses: the engine replays
# the stored examples, then draws the derandomized ones (tests/unit/test_profiles.py proves it).
_derandomized = settings(
    max_examples=CI_MAX_EXAMPLES,
    derandomize=True,
    deadline=None,  # a shared 2-core machine: timing is noise
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci", _derandomized, database=ReadOnlyDatabase(DirectoryBasedExampleDatabase(EXAMPLES_DIR))
)
settings.register_profile(
    "wide",
    _derandomized,
    derandomize=False,
    max_examples=CI_MAX_EXAMPLES * WIDE_FACTOR,
    database=KeepFailures(DirectoryBasedExampleDatabase(EXAMPLES_DIR)),
)
settings.load_profile("ci")  # --hypothesis-profile=NAME, read later by hypothesis, overrides


def examples(ci_count: int) -> int:
    """``ci_count`` examples under the ci profile, proportionally more under the wide one."""
    return max(1, ci_count * settings().max_examples // CI_MAX_EXAMPLES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wide = settings.get_current_profile_name() == "wide"
    for item in items:
        # A state machine run by run_state_machine_as_test carries the props mark itself.
        if is_hypothesis_test(getattr(item, "obj", None)) or item.get_closest_marker("props"):
            item.add_marker(pytest.mark.props)
            validate_now(item)
            if wide:  # the per-test timeout grows with the number of examples
                own = item.get_closest_marker("timeout")
                base = float(own.args[0]) if own and own.args else float(config.getini("timeout"))
                item.add_marker(pytest.mark.timeout(base * WIDE_FACTOR), append=False)
    if hasattr(config, "workerinput"):  # a process of a parallel run (xdist's workers collect)
        longest_files_first(config, items)


def validate_now(item: pytest.Item) -> None:
    """Validate a hypothesis test's strategies at collection, as the test would at its start.

    Validating describes the strategies' lambdas, which hypothesis finds by parsing the test
    file with ``ast.parse``. Done at a test's start, deep in the stack and with the earlier
    tests' threads about (a traceback formatted on one parses source lines too, on 3.11), it
    failed a run with CPython 3.11's ``SystemError: AST constructor recursion depth mismatch``
    (not reproduced on demand; the AST builder's depth count is the interpreter's). At
    collection the stack is shallow and no test has started a thread; the test's own
    validation is then a no-op."""
    handle = getattr(getattr(item, "obj", None), "hypothesis", None)
    for strategy in (getattr(handle, "_given_kwargs", None) or {}).values():
        try:
            strategy.validate()
        except Exception:  # (not a strategy, or an invalid one: the test itself says so)
            return


# Test files by their seconds in a recorded run (tests/durations.json, written by ``python -m
# tests.timeline PATH --durations``): a parallel run starts the longest files first, so that no
# process is left with a long test while the others have finished (xdist hands each process
# its next test in collection order). The integration tests still come before the unit tests,
# as in collection order (a unit test that leaves state behind cannot reach a server's test).
# A file not recorded yet counts as a typical one of its directory; within a file the order
# is the file's own.
DURATIONS = Path(__file__).with_name("durations.json")
UNRECORDED_SECONDS = {"integration": 20.0, "unit": 1.0}


def expected_seconds(path: str, recorded: dict[str, float]) -> float:
    if path in recorded:
        return float(recorded[path])
    return UNRECORDED_SECONDS["integration" if "/integration/" in f"/{path}" else "unit"]


def longest_files_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest test files first, integration before unit (each file's tests in order)."""
    try:
        recorded = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):  # (none recorded, or unreadable: collection order)
        return
    position = {item.nodeid: n for n, item in enumerate(items)}

    def longest_first(item: pytest.Item) -> tuple[bool, float, str, int]:
        path = item.nodeid.split("::", 1)[0]  # (the key timeline.py writes)
        unit = "/integration/" not in f"/{path}"
        return (unit, -expected_seconds(path, recorded), path, position[item.nodeid])

    items.sort(key=longest_first)


# The suite mostly waits on servers and workers (about one core of 2 busy with 4 processes): on 2
# cores 6 processes ran it faster than 4; more cores, up to 8, get one each (docs/, "Testing").
XDIST_WORKERS_MIN, XDIST_WORKERS_MAX = 6, 8


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: the processes for a run of the suite or of directories; none for tests of a
    single file (no worker to start: ``./run test tests/unit/test_x.py::test_y`` stays quick).
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still decides when set; ``-n N`` is taken as given."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    files = {config.invocation_params.dir / arg.split("::", 1)[0] for arg in config.args}
    if len(files) == 1 and next(iter(files)).is_file():
        return 0
    return max(XDIST_WORKERS_MIN, min(os.cpu_count() or 1, XDIST_WORKERS_MAX))


# ``SUITE_TIMELINE=PATH``: each test's start and end (wall clock) and the process that ran
# it, one JSON line per test appended to PATH, for ``python -m tests.timeline PATH`` (where a
# run's time went: which tests held the last minutes; docs/contributing/testing.md).
TIMELINE = os.environ.get("SUITE_TIMELINE")


def cpu_seconds() -> float:
    """This process's CPU and its reaped children's: a test's servers and workers stopped within
    it count (the session's own, reaped at its end, do not: a lower bound)."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    started, cpu = time.time(), cpu_seconds()
    yield
    if TIMELINE:
        line = {
            "test": item.nodeid,
            "process": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "start": started,
            "end": time.time(),
            "cpu": cpu_seconds() - cpu,
        }
        with open(TIMELINE, "a", encoding="utf-8") as out:  # (one short line: one write)
            out.write(json.dumps(line) + "\n")
