"""Hosts with clocks of their own, for tests over skew: libfaketime (Debian's ``faketime``)
preloaded into a process, its offset read from a file a test rewrites (a clock that jumps)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

LIBFAKETIME = next(
    iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))),
    Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
)
SITE = Path(__file__).with_name("faketime_site")

# A test (or a module: ``pytestmark``) over skewed hosts
needs_faketime = pytest.mark.skipif(
    not LIBFAKETIME.exists() and not os.environ.get("CI"),
    reason="libfaketime is not installed (apt-get install faketime; .ci/run installs it)",
)


class FakeClock:
    """A host's wall clock under libfaketime: an offset read from a file (a test makes it jump
    while the process runs), the monotonic clock left alone, as a kernel leaves it
    (``FAKETIME_DONT_FAKE_MONOTONIC``; ``faketime_site/sitecustomize.py`` says why sleeping then
    needs a shim, and why faking every clock is no host at all)."""

    def __init__(self, directory: Path, name: str, offset_seconds: float) -> None:
        self.path = directory / f"faketime-{name}"
        self.set(offset_seconds)

    def set(self, offset_seconds: float) -> None:
        self.path.write_text(f"{offset_seconds:+.0f}s\n")

    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": str(LIBFAKETIME),
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            "FAKETIME_CACHE_DURATION": "1",  # the file is read again every second
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(SITE), os.environ.get("PYTHONPATH", "")])
            ),
        }
