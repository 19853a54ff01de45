"""celery_ledger.settings.Settings: every value is checked when the settings are built."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from celery_ledger import ConfigurationError, Settings, create_app
from celery_ledger.policies.backpressure import DEFAULT_TIER_LIMITS, TierLimit
from celery_ledger.policies.breaker import BreakerConfig
from celery_ledger.policies.rate_limit import RateLimit
from celery_ledger.policies.retry import RetryPolicy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("broker_url", "not a url"),
        ("broker_url", "amqp://guest@localhost//"),
        ("broker_url", "redis://host:port/0"),
        ("mongo_uri", "http://ledger.example"),
        ("mongo_uri", "mongodb://"),
        ("mongo_uri", "mongodb://host/?noSuchOption=1"),
        ("mongo_uri", "mongodb+srv://"),
        ("mongo_uri", "mongodb+srv://cluster.example.net:27017/"),
        ("mongo_db", ""),
        ("mongo_db", "$ledger"),
        ("mongo_db", "a.b"),
        ("mongo_db", "with space"),
        ("mongo_db", "x" * 64),
        ("ledger_collection", ""),
        ("ledger_collection", "a$b"),
        ("ledger_collection", "a\x00b"),
        ("ledger_collection", "system.ledger"),
        ("ledger_collection", ".ledger"),
        ("ledger_collection", "ledger."),
        ("ledger_collection", "a..b"),
        ("lease_seconds", float("inf")),
        ("lease_seconds", "nan"),
        ("throttle_latency_ms", "inf"),
        ("busy_recheck_seconds", "1e309"),
        ("rate_limits", {"a": {"rate_per_second": float("inf"), "burst": 1}}),
        ("breakers", {"payments": {"failure_threshold": 0}}),
        ("breakers", {"payments": {"failure_threshold": 2.5}}),
        ("breakers", {"payments": {"cooldown_seconds": "soon"}}),
        ("breakers", {"payments": {"cooldown_seconds": "inf"}}),
        ("breakers", {"payments": {"failure_ratio": 2}}),
        ("breakers", {"payments": {"threshold": 3}}),
        ("retry_policies", {"bulk": {"max_retries": "many"}}),
        ("retry_policies", {"bulk": {"max_retries": -1}}),
        ("retry_policies", {"bulk": {"jitter": "sideways"}}),
        ("retry_policies", {"bulk": {"base_seconds": "inf"}}),
        ("retry_policies", {"critical": {"base_seconds": 60}}),  # over the tier's 30s cap
        ("retry_policies", {"bulk": {"retries": 3}}),
        ("retry_policies", {"nowhere": {"max_retries": 3}}),
        ("sentry_dsn", "{}"),
        ("sentry_dsn", "https://sentry.example/1"),  # no public key
    ],
)
def test_an_invalid_value_is_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(**{field: value})
    assert field in str(refused.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("broker_url", "redis://:secret@127.0.0.1:6379/0"),
        ("broker_url", "rediss://cache.example:6380/1"),
        ("broker_url", "unix:///run/redis.sock"),
        ("mongo_uri", "mongodb://u:p@mongo:27017/?replicaSet=rs0&authSource=admin"),
        ("mongo_uri", "mongodb://a:1,b:2/?directConnection=false"),
        ("mongo_uri", "mongodb+srv://u:p@cluster0.example.net/db?retryWrites=true"),
        ("mongo_db", "billing_2024-prod"),
        ("ledger_collection", "ledger.v2"),
        ("sentry_dsn", "https://public@sentry.example/1"),
        ("sentry_dsn", ""),
    ],
)
def test_a_valid_value_is_kept_as_given(field: str, value: Any) -> None:
    assert getattr(Settings(**{field: value}), field) == value


def test_json_settings_become_the_policy_objects_the_platform_uses() -> None:
    # Given JSON options over the defaults (as LEDGER_* variables carry them)
    settings = Settings(
        breakers={"payments": {"failure_threshold": 3, "failure_ratio": 0.5}},
        rate_limits={"reports": {"rate_per_second": 5, "burst": "10"}},
        tier_limits={"bulk": {"high_water": 20000, "policy": "shed"}},
    )
    # Then each is the typed object, built once, with the defaults for what is not given
    assert settings.breakers == {"payments": BreakerConfig(failure_threshold=3, failure_ratio=0.5)}
    assert settings.rate_limits == {"reports": RateLimit(rate_per_second=5.0, burst=10)}
    assert settings.tier_limits["bulk"] == TierLimit(
        high_water=20000, policy="shed", block_timeout_seconds=5.0
    )
    assert settings.tier_limits["critical"] == DEFAULT_TIER_LIMITS["critical"]


def test_retry_policy_options_are_converted_to_their_types() -> None:
    settings = Settings(retry_policies={"bulk": {"max_retries": "10", "base_seconds": 2}})

    # Options over the tier's own default (bulk: decorrelated jitter, an hour's cap)
    assert settings.retry_policies == {
        "bulk": RetryPolicy(
            max_retries=10, base_seconds=2.0, cap_seconds=3600.0, jitter="decorrelated"
        )
    }


def test_breaker_options_are_converted_to_their_types() -> None:
    settings = Settings(breakers={"payments": {"failure_threshold": "3", "cooldown_seconds": 3}})

    assert settings.breakers == {
        "payments": BreakerConfig(failure_threshold=3, cooldown_seconds=3.0)
    }


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("LEDGER_MONGO_URI", "http://ledger.example"),
        ("LEDGER_BROKER_URL", "not a url"),
        ("LEDGER_LEASE_SECONDS", "inf"),
        ("LEDGER_BREAKERS", '{"payments": {"failure_threshold": 0}}'),
        ("LEDGER_RETRY_POLICIES", '{"bulk": {"max_retries": "many"}}'),
        ("LEDGER_RETRY_POLICIES", '{"bulk": {"cap_seconds": Infinity}}'),
        ("LEDGER_SENTRY_DSN", "{}"),
    ],
)
def test_create_app_refuses_an_invalid_variable_naming_it(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)

    with pytest.raises(ConfigurationError) as refused:
        create_app("unit", set_as_current=False)
    assert variable in str(refused.value)


SECRET = "s3cr3t-never-shown"
SECRET_BEARING = [
    ("LEDGER_BROKER_URL", f"redis://:{SECRET}@host:notaport/0"),
    ("LEDGER_BROKER_URL", f"amqp://user:{SECRET}@host//"),
    ("LEDGER_BROKER_URL", f"redis://:{SECRET}@host/0?socket_timeout=soon"),
    ("LEDGER_MONGO_URI", f"mongodb://user:{SECRET}@host:99999/"),
    ("LEDGER_MONGO_URI", f"http://user:{SECRET}@ledger.example"),
    ("LEDGER_MONGO_URI", f"mongodb://user:{SECRET}@host/?w=sometimes&journal=perhaps"),
    ("LEDGER_MONGO_URI", f"mongodb+srv://user:{SECRET}@cluster.example.net:27017/"),
    ("LEDGER_MONGO_URI", f"mongodb://user:{SECRET}@a:1,b:x/"),
    ("LEDGER_SENTRY_DSN", f"ftp://{SECRET}@sentry.example/1"),
    ("LEDGER_SENTRY_DSN", f"https://{SECRET}@/1"),
    ("LEDGER_ENCRYPTION_KEYS", SECRET),
    ("LEDGER_ENCRYPTION_KEYS", f'["{SECRET}", 7]'),
    ("LEDGER_ENCRYPTION_KEYS", f'{{"key": "{SECRET}"}}'),
]


@pytest.mark.parametrize(("var", "value"), SECRET_BEARING, ids=lambda v: v[:24])
def test_a_refused_setting_never_echoes_the_secret_it_carries(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    import traceback

    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigurationError) as info:
        create_app("secrets", set_as_current=False)
    # The message names the setting, and no part of the error chain shows the secret
    shown = "".join(traceback.format_exception(info.value))
    assert var in str(info.value)
    assert SECRET not in shown

    # The same for settings built in code
    monkeypatch.delenv(var)
    with pytest.raises(ValidationError) as direct:
        Settings(**{var.removeprefix("LEDGER_").lower(): _parsed(value)})
    assert SECRET not in "".join(traceback.format_exception(direct.value))


def _parsed(value: str) -> Any:
    import json

    try:
        return json.loads(value)
    except ValueError:
        return value


def test_keys_and_passwords_stay_out_of_the_settings_repr() -> None:
    key = "AcKyJ2oLnrAAy_LZcIqJcLFxu0NMYeTJnp7JIrpzIs4="
    settings = Settings(
        broker_url=f"redis://:{SECRET}@host:6379/0",
        mongo_uri=f"mongodb://u:{SECRET}@host/",
        sentry_dsn=f"https://{SECRET}@sentry.example/1",
        encryption_keys=[key],
    )
    for text in (repr(settings), str(settings)):
        assert SECRET not in text and key not in text
    assert key not in str(settings.model_dump())  # a key stays secret even in a dump
    assert settings.encryption_keys[0].get_secret_value() == key


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("broker_url", "redis://:change-me-redis-password@redis:6379/0"),
        ("broker_url", "rediss://user:change-me@redis:6380/0"),
        ("mongo_uri", "mongodb://ledger:change-me-mongo-password@mongo:27017/?authSource=admin"),
        ("mongo_uri", "mongodb+srv://ledger:change-me-x@cluster.example.net/"),
    ],
)
def test_a_placeholder_password_from_the_env_example_is_refused(field: str, value: str) -> None:
    with pytest.raises(ValidationError, match="placeholder") as info:
        Settings(**{field: value})
    assert field in str(info.value)


def test_a_real_password_that_merely_contains_the_words_is_accepted() -> None:
    settings = Settings(broker_url="redis://:not-change-me@redis:6379/0")
    assert settings.broker_url.endswith("@redis:6379/0")
