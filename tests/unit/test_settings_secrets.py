"""A refused URL or secret setting never shows any part of the secret it carries.

A parser's message quotes what it could not read, and in a URL whose password is not
percent-encoded that is a piece of the password: every URL and secret setting is refused here
with a password holding ``/``, ``@``, ``:`` and ``%``, written raw and percent-encoded, broken
in each way its parser notices, and no piece of it may appear in the error, its chain, or the
``ConfigurationError`` that ``create_app`` raises from the environment.
"""

from __future__ import annotations

import json
import traceback
from typing import Any
from urllib.parse import quote

import pytest
from pydantic import SecretStr, ValidationError

from celery_ledger import ConfigurationError, Settings, create_app

PIECES = ("pwAlpha", "pwBravo", "pwCharlie", "pwDelta", "pwEcho")
PASSWORD = "pwAlpha/pwBravo@pwCharlie:pwDelta%pwEcho"
PASSWORDS = {"raw": PASSWORD, "encoded": quote(PASSWORD, safe="")}
SIGNING_KEY = "k" * 40

# (setting, value with {pw}, the host the message names or None)
URLS = [
    ("broker_url", "redis://ledger:{pw}@redis:6379/0?socket_connect_timeout=soon", "redis"),
    ("broker_url", "rediss://ledger:{pw}@cache.example:6380/0?health_check_interval=x", None),
    ("broker_url", "redis://:{pw}@redis:notaport/0", None),
    ("broker_url", "redis://ledger:{pw}@redis:6379/0?socket_timeout=soon", "redis"),
    ("broker_url", "amqp://ledger:{pw}@rabbit//", "rabbit"),
    ("broker_url", "redis://ledger:{pw}", None),
    ("broker_url", "{pw}@redis:6379/0", None),
    ("broker_url", "sentinel://ledger:{pw}@s1:26379/x;sentinel://s2:26379", None),
    ("broker_url", "sentinel://ledger:{pw}@s1:26379/0;redis://s2:6379", None),
    ("broker_url", "sentinel://ledger:{pw}@s1:port/0", None),
    ("mongo_uri", "mongodb://ledger:{pw}@mongo:27017/?authSource=admin&tls=perhaps", "mongo"),
    ("mongo_uri", "mongodb://ledger:{pw}@mongo:99999/", None),
    ("mongo_uri", "mongodb://ledger:{pw}@mongo/?noSuchOption=1", "mongo"),
    ("mongo_uri", "mongodb://ledger:{pw}@mongo/?authMechanismProperties=AWS_SESSION_TOKE:x", None),
    ("mongo_uri", "mongodb://ledger:{pw}@a:1,b:x/", None),
    ("mongo_uri", "mongodb://ledger:{pw}", None),
    ("mongo_uri", "mongodb+srv://ledger:{pw}@cluster.example.net:27017/", "cluster.example.net"),
    ("mongo_uri", "http://ledger:{pw}@mongo/", "mongo"),
    ("sentry_dsn", "https://{pw}@/1", None),
    ("sentry_dsn", "https://public:{pw}@sentry.example:port/1", None),
    ("sentry_dsn", "ftp://{pw}@sentry.example/1", "sentry.example"),
]
# (setting, value with {pw}): secrets that are not URLs
SECRETS = [
    ("encryption_keys", ["change-me-{pw}"]),
    ("key_secret", "change-me-{pw}"),
    ("key_secret", "{short}"),
    ("signing_keys", [SIGNING_KEY, "change-me-{pw}"]),
    ("signing_keys", ["{short}"]),
    ("metrics_auth", ":{pw}"),
    ("sentinel_password", "change-me-{pw}"),
    ("console_secret", "change-me-{pw}"),
    ("console_secret", "{short}"),
]
COVERED = {field for field, *_ in URLS + SECRETS}


def with_password(value: Any, password: str) -> Any:
    """``value`` with ``{pw}`` the password, ``{short}`` its first 20 characters (too short)."""
    if isinstance(value, list):
        return [with_password(item, password) for item in value]
    return value.replace("{pw}", password).replace("{short}", password[:20])


def shown_pieces(exc: BaseException) -> list[str]:
    """The password's pieces in the exception's whole printed chain (any case: a parser may
    lower a host name)."""
    text = "".join(traceback.format_exception(exc)).lower()
    return [piece for piece in PIECES if piece.lower() in text]


def refusals(field: str, value: Any, monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """The refusal of ``value`` built in code, and from its ``LEDGER_*`` variable."""
    with pytest.raises(ValidationError) as direct:
        Settings(**{field: value})
    variable = f"LEDGER_{field.upper()}"
    monkeypatch.setenv(variable, value if isinstance(value, str) else json.dumps(value))
    with pytest.raises(ConfigurationError) as from_env:
        create_app("secrets", set_as_current=False)
    monkeypatch.delenv(variable)
    return [direct.value, from_env.value]


def test_every_url_and_secret_setting_is_covered() -> None:
    # A new setting that carries a secret is added to the cases above
    carrying = {
        name
        for name, field in Settings.model_fields.items()
        if name.endswith(("_url", "_uri", "_dsn")) or "SecretStr" in str(field.annotation)
    }
    assert carrying == COVERED


@pytest.mark.parametrize("form", PASSWORDS)
@pytest.mark.parametrize(("field", "template", "host"), URLS)
def test_a_refused_url_names_where_it_points_and_none_of_its_password(
    monkeypatch: pytest.MonkeyPatch, field: str, template: str, host: str | None, form: str
) -> None:
    # Given a URL with a password, written raw or percent-encoded, that its parser refuses
    value = with_password(template, PASSWORDS[form])

    for refused in refusals(field, value, monkeypatch):
        # Then the error names the setting and the URL's scheme (and host when it reads as one)
        message = str(refused)
        assert field in message.lower()  # the field, or its LEDGER_* variable
        assert "scheme" in message or "no scheme://" in message
        if host is not None and form == "raw":
            assert f"host {host}" in message
        # And no piece of the password is anywhere in what it prints
        assert shown_pieces(refused) == []


@pytest.mark.parametrize("form", PASSWORDS)
@pytest.mark.parametrize(("field", "template"), SECRETS)
def test_a_refused_secret_shows_none_of_it(
    monkeypatch: pytest.MonkeyPatch, field: str, template: Any, form: str
) -> None:
    value = with_password(template, PASSWORDS[form])

    for refused in refusals(field, value, monkeypatch):
        assert field in str(refused).lower()  # the field, or its LEDGER_* variable
        assert shown_pieces(refused) == []


def test_an_encryption_key_that_is_no_fernet_key_is_refused_without_echo() -> None:
    # Settings take any key that is not a placeholder; the app's sealer refuses what Fernet
    # cannot use
    settings = Settings(encryption_keys=[PASSWORD])

    with pytest.raises(ConfigurationError) as refused:
        create_app("secrets", settings=settings, set_as_current=False)

    assert "LEDGER_ENCRYPTION_KEYS" in str(refused.value)
    assert shown_pieces(refused.value) == []


def test_secret_types_keep_the_value_for_their_owner() -> None:
    # (the refusals above are not the settings losing secrets they accept)
    settings = Settings(key_secret=PASSWORD, metrics_auth=f"user:{PASSWORD}")
    assert isinstance(settings.key_secret, SecretStr)
    assert settings.key_secret.get_secret_value() == PASSWORD
    assert PASSWORD not in repr(settings)
