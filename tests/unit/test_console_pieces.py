"""The console's pure pieces: no console without a login, where a login may send you on to,
the sparklines it draws, and the password rules of its logins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from celery_ledger import ConfigurationError, Settings
from celery_ledger.console.app import _ago, _local, _spark, create_console


def test_no_console_without_a_login() -> None:
    with pytest.raises(ConfigurationError, match="LEDGER_CONSOLE_USERS"):
        create_console(SimpleNamespace(settings=SimpleNamespace(console_users={})))


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("/jobs/abc", "/jobs/abc"),
        ("/", "/"),
        (None, "/"),
        ("", "/"),
        ("https://evil.example/", "/"),
        ("//evil.example/", "/"),
        ("/\\\\evil.example/", "/"),
        ("javascript:alert(1)", "/"),
    ],
)
def test_a_login_sends_you_on_only_within_the_console(target: str | None, expected: str) -> None:
    assert _local(target) == expected


def test_a_sparkline_is_an_svg_of_its_values() -> None:
    svg = str(_spark([0, 1, 4, 2]))
    assert svg.startswith("<svg") and "polyline" in svg and 'aria-label="7 in 4 minutes"' in svg
    assert str(_spark([])) == ""
    assert _ago(None) == "-" and _ago(30) == "30s" and _ago(600) == "10m" and _ago(7200) == "2.0h"


@pytest.mark.parametrize(
    "users",
    [
        '{"alice": {"password": "short", "role": "operator"}}',
        '{"alice": {"password": "change-me-console-password", "role": "operator"}}',
        '{"alice": {"password": "long-enough-password", "role": "admin"}}',
        '{"alice": {"password": "long-enough-password", "shell": "yes"}}',
    ],
)
def test_a_weak_or_wrong_login_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, users: str
) -> None:
    monkeypatch.setenv("LEDGER_CONSOLE_USERS", users)
    with pytest.raises(ValidationError) as raised:
        Settings()
    assert "long-enough-password" not in str(raised.value)
