"""tests/conftest.py: the ci profile is derandomized and still replays the stored failures; the
wide profile keeps every failure it finds."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    InMemoryExampleDatabase,
    ReadOnlyDatabase,
)

from tests.conftest import EXAMPLES_DIR, KeepFailures


def test_the_ci_profile_is_derandomized_and_reads_the_committed_examples() -> None:
    ci = settings.get_profile("ci")
    assert ci.derandomize
    assert ci.database == ReadOnlyDatabase(DirectoryBasedExampleDatabase(EXAMPLES_DIR))
    wide = settings.get_profile("wide")
    assert not wide.derandomize and wide.max_examples >= 10 * ci.max_examples


def _fails_on_big_numbers(n: int) -> None:
    assert n < 1000


def test_a_stored_failure_replays_under_a_derandomized_profile(tmp_path: Path) -> None:
    # Given a failure that a (random, writable) search stored in a directory database
    store = DirectoryBasedExampleDatabase(tmp_path)
    search = settings(settings.get_profile("wide"), database=KeepFailures(store))
    with pytest.raises(AssertionError):
        settings(search)(given(st.integers())(_fails_on_big_numbers))()
    assert any(store.fetch(key) for key in _keys(tmp_path))

    # When the same test runs derandomized with that database read-only, only replaying
    replay = settings(
        settings.get_profile("ci"), database=ReadOnlyDatabase(store), phases=[Phase.reuse]
    )
    assert replay.derandomize
    # Then the stored failure is found again (no generation: only the database could have it)
    with pytest.raises(AssertionError):
        settings(replay)(given(st.integers())(_fails_on_big_numbers))()


def _keys(root: Path) -> list[bytes]:
    return list(DirectoryBasedExampleDatabase(root).fetch(b".hypothesis-keys"))


def test_keep_failures_never_forgets_a_failure_but_tidies_shrinking() -> None:
    inner = InMemoryExampleDatabase()
    db = KeepFailures(inner)
    db.save(b"k", b"failure")
    db.delete(b"k", b"failure")  # replayed and passed: still kept
    db.move(b"k", b"k.secondary", b"failure")  # shrinking moved it aside: kept too
    db.save(b"k.secondary", b"larger")
    db.delete(b"k.secondary", b"larger")
    assert set(inner.fetch(b"k")) == {b"failure"}
    assert set(inner.fetch(b"k.secondary")) == {b"failure"}
