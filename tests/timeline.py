"""Where a run of the suite spent its time, from a timeline ``SUITE_TIMELINE`` wrote
(tests/conftest.py): the run's length, each process's busy time and last test, the longest
tests with when they started, and what was still running in the last minutes.

    SUITE_TIMELINE=/tmp/timeline.jsonl ./run test -q
    python -m tests.timeline /tmp/timeline.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(path: str, tail_seconds: float = 180.0) -> None:
    tests = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not tests:
        raise SystemExit(f"{path}: no test recorded")
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
    print(f"running in the last {tail_seconds:.0f} s:")
    for test in sorted(tests, key=lambda t: t["start"]):
        if test["end"] > last - tail_seconds and test["end"] - test["start"] > 10:
            print(
                f"  {test['process']}: {test['start'] - first:6.0f} -> {test['end'] - first:6.0f}"
                f" s  {test['test']}"
            )


if __name__ == "__main__":
    main(sys.argv[1], *(float(a) for a in sys.argv[2:3]))
