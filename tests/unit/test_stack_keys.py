"""The embedded stack's keys: made once, owner-only, the same after a restart, and valid."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from celery_ledger import Settings
from celery_ledger.embedded.stack import STACK_KEYS, stack_keys


def test_keys_are_made_once_owner_only_and_kept_for_the_next_start(tmp_path: Path) -> None:
    first = stack_keys(tmp_path)
    assert set(first) == set(STACK_KEYS)
    path = tmp_path / "stack-keys.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stack_keys(tmp_path) == first  # data sealed before a restart still opens
    # and they are keys the settings accept (a signing key, a Fernet key, a key secret)
    settings = Settings(
        signing_keys=json.loads(first["LEDGER_SIGNING_KEYS"]),
        encryption_keys=json.loads(first["LEDGER_ENCRYPTION_KEYS"]),
        key_secret=first["LEDGER_KEY_SECRET"],
    )
    assert settings.key_secret is not None and len(settings.signing_keys) == 1


def test_a_damaged_key_file_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "stack-keys.json").write_text("{not json")
    assert set(stack_keys(tmp_path)) == set(STACK_KEYS)
