"""Where a run of the suite spent its time, from a timeline ``SUITE_TIMELINE`` wrote
(tests/conftest.py): the run's length, each process's busy time and last test, the longest
tests with when they started, the files using the most CPU, and what was still running in the
last minutes.

    SUITE_TIMELINE=/tmp/timeline.jsonl ./run test -q
    python -m tests.timeline /tmp/timeline.jsonl
    python -m tests.timeline /tmp/timeline.jsonl --durations   # rewrite tests/durations.json

``--durations`` writes each test file's total time in that run to :data:`DURATIONS`, which
tests/conftest.py reads to start the longest files first.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

DURATIONS = Path(__file__).with_name("durations.json")


def read(path: str) -> list[dict[str, Any]]:
    tests = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not tests:
        raise SystemExit(f"{path}: no test recorded")
    return tests


def write_durations(path: str) -> None:
    """Each test file's total seconds in the run at ``path``, into :data:`DURATIONS`."""
    totals: dict[str, float] = defaultdict(float)
    for test in read(path):
        totals[str(test["test"]).split("::", 1)[0]] += float(test["end"]) - float(test["start"])
    ordered = dict(sorted((file, round(seconds, 1)) for file, seconds in totals.items()))
    DURATIONS.write_text(json.dumps(ordered, indent=1) + "\n")
    print(f"{DURATIONS}: {len(ordered)} files, {sum(ordered.values()):.0f} s in all")


def main(path: str, tail_seconds: float = 180.0) -> None:
    tests = read(path)
    first = min(t["start"] for t in tests)
    last = max(t["end"] for t in tests)
    print(f"{len(tests)} tests, {last - first:.0f} s from the first start to the last end")
    by_process: dict[str, list[dict[str, float | str]]] = defaultdict(list)
    for test in tests:
        by_process[str(test["process"])].append(test)
    for process, ran in sorted(by_process.items()):
        busy = sum(float(t["end"]) - float(t["start"]) for t in ran)
        end = max(ran, key=lambda t: float(t["end"]))
        print(
            f"  {process}: {len(ran)} tests, busy {busy:.0f} s, done at"
            f" {float(end['end']) - first:.0f} s (last: {end['test']})"
        )
    print("longest tests (start, length):")
    for test in sorted(tests, key=lambda t: t["start"] - t["end"])[:12]:
        print(
            f"  {test['start'] - first:6.0f} s  {test['end'] - test['start']:6.1f} s"
            f"  {test['test']}"
        )
    # CPU: the test's process and the servers and workers it started and stopped (a lower
    # bound). On 2 cores the suite is bound by CPU as much as by waits: these are the tests
    # whose shortening shortens the run.
    cpu: dict[str, float] = defaultdict(float)
    for test in tests:
        cpu[str(test["test"]).split("::", 1)[0]] += float(test.get("cpu", 0.0))
    if any(cpu.values()):
        print(f"CPU, {sum(cpu.values()):.0f} s in all; the files using most:")
        for file, seconds in sorted(cpu.items(), key=lambda f: -f[1])[:15]:
            print(f"  {seconds:6.0f} s  {file}")
    print(f"running in the last {tail_seconds:.0f} s:")
    for test in sorted(tests, key=lambda t: t["start"]):
        if test["end"] > last - tail_seconds and test["end"] - test["start"] > 10:
            print(
                f"  {test['process']}: {test['start'] - first:6.0f} -> {test['end'] - first:6.0f}"
                f" s  {test['test']}"
            )


if __name__ == "__main__":
    if "--durations" in sys.argv[2:]:
        write_durations(sys.argv[1])
    else:
        main(sys.argv[1], *(float(a) for a in sys.argv[2:3]))
