"""The checks and messages behind :mod:`celery_ledger.settings`: what a URL, a secret, a tier or
an options mapping must be, where a bad URL is wrong (without echoing it), and the text of a
refused ``LEDGER_*`` variable."""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from dataclasses import asdict, fields
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from pydantic_settings import SettingsError

from .fairness import DEFAULT_TENANT, TenantPolicy, check_tenant
from .policies.backpressure import TierLimit
from .policies.breaker import BreakerConfig
from .policies.rate_limit import RateLimit
from .policies.retry import RetryPolicy
from .routing import TIERS

#: What a publish, a worker or a broker check says when no broker was named.
BROKER_URL_UNSET = (
    "LEDGER_BROKER_URL is not set: celery-ledger never guesses a broker, so nothing is sent"
    " or consumed.\nSet it to your Redis (export LEDGER_BROKER_URL=redis://HOST:6379/0), or"
    " run `celery -A APP ledger stack` and `source` the stack.env it writes."
)
#: What Celery is given when no broker was named: a host that never resolves (``.invalid``,
#: RFC 2606), which celery-ledger's transport refuses with :data:`BROKER_URL_UNSET` first.
UNSET_BROKER_HOST = "ledger-broker-url-not-set.invalid"
UNSET_BROKER_URL = f"redis://{UNSET_BROKER_HOST}:6379/0"

_SRV = "mongodb+srv://"
_QUEUE_NAME = re.compile(r"[A-Za-z0-9._:-]{1,100}")
_BAD_DATABASE_CHARS = frozenset(' ./\\"$\x00')
Options = TypeVar("Options", BreakerConfig, RetryPolicy, TierLimit, RateLimit)


_ENCODED = "with / @ : % ? # percent-encoded in the user name and password"
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_ADDRESS = re.compile(r"(?P<host>[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\])(?::[0-9]{1,5})?")


def located(url: str) -> str:
    """Where a refused URL points (its scheme and hosts), and nothing of its credentials.

    The user name and password end at the URL's *last* ``@`` (a password that is not
    percent-encoded may hold ``@``, ``/`` or ``:`` itself). Hosts are shown only if what follows
    reads as ``host[:digits][,host[:digits]...]``: when an ``@`` could be in the query or the
    fragment, or an address does not read as one, no host is shown, as it could be a piece of
    the password.
    """
    scheme = _URL_SCHEME.match(url)
    if scheme is None:
        return "no scheme://"
    where = f"scheme {scheme.group(1).lower()}://"
    userinfo, at, rest = url[scheme.end() :].rpartition("@")
    if at and not {"?", "#"}.isdisjoint(userinfo):
        return f"{where}, host not shown"
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if not authority:
        return f"{where}, no host"
    addresses = [_ADDRESS.fullmatch(address) for address in authority.split(",")]
    if not all(addresses):
        return f"{where}, host not shown"
    return f"{where}, host {','.join(a['host'] for a in addresses if a)}"


# The prefix of every secret in .env.example: a deployment that kept one has no secret at all.
PLACEHOLDER_PREFIX = "change-me"


def _not_a_placeholder(password: str | None) -> None:
    if password and password.startswith(PLACEHOLDER_PREFIX):
        raise ValueError(
            f"its password is a placeholder ({PLACEHOLDER_PREFIX}...) from .env.example:"
            " set a real secret"
        )


def _random_secret(value: SecretStr, what: str) -> None:
    """An HMAC key: not a placeholder, and long enough to be random (never echoed)."""
    text = value.get_secret_value()
    _not_a_placeholder(text)
    if len(text) < 32:
        raise ValueError(f"{what} needs 32 or more characters (random)")


def _check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; known tiers: {', '.join(TIERS)}")


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if isinstance(value, RetryPolicy | BreakerConfig | TierLimit | RateLimit):
        return dict(asdict(value))
    if not isinstance(value, dict):
        raise ValueError(f"{what}: expected a JSON object, not {type(value).__name__}")
    return value


def _built(kind: type[Options], base: Options, options: Any, *, what: str) -> Options:
    """``options`` over ``base``, built as ``kind`` (types, ranges and finite numbers checked).

    An object of ``kind`` passes as it is.
    """
    if isinstance(options, kind):
        return options
    options = _mapping(options, what)
    known = [field.name for field in fields(kind)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{what}: unknown option {', '.join(unknown)}; known: {', '.join(known)}")
    try:
        built = TypeAdapter(kind).validate_python({**asdict(base), **options})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc']))}: {error['msg']}".lstrip(": ").replace(
                "Value error, ", ""
            )
            for error in exc.errors()
        )
        raise ValueError(f"{what}: {problems}") from None
    infinite = [
        name
        for name in options
        if isinstance(getattr(built, name), float) and not math.isfinite(getattr(built, name))
    ]
    if infinite:
        raise ValueError(f"{what}: {', '.join(infinite)} must be finite")
    return built


def describe_invalid(exc: ValidationError | SettingsError) -> str:
    """What is wrong with the ``LEDGER_*`` variables (``Settings()`` refused them): each
    variable by its name, what it needs, and what to do; never a value (it may be a secret).
    """
    if isinstance(exc, SettingsError):  # a JSON setting that does not parse
        field = re.search(r'field "(\w+)"', str(exc))
        name = f"LEDGER_{field.group(1).upper()}" if field else "a LEDGER_* variable"
        problems = [f"{name}: not valid JSON ({exc.__cause__ or exc})"]
    else:
        by_variable: dict[str, list[str]] = {}
        for error in exc.errors(include_url=False, include_input=False):
            location = [str(part) for part in error["loc"]]
            name = f"LEDGER_{location[0].upper()}" if location else "a LEDGER_* variable"
            message = _ERROR_TEXT.get(error["type"], error["msg"]).removeprefix("Value error, ")
            where = ".".join(location[1:])
            by_variable.setdefault(name, []).append(f"{where}: {message}" if where else message)
        problems = [f"{name}: {'; '.join(found)}" for name, found in by_variable.items()]
    names = ", ".join(sorted({problem.partition(":")[0] for problem in problems}))
    return (
        f"invalid setting {'; '.join(problems)}\n"
        f"Fix {names} in the environment (or unset it for its default)."
    )


_ERROR_TEXT = {"missing": "required", "extra_forbidden": "unknown field"}


def check_sentry_dsn(value: str | None) -> str | None:
    """``value`` if it reads as a Sentry DSN (or is unset), else :class:`ValueError`."""
    if not value:
        return value
    try:
        from sentry_sdk.utils import Dsn
    except ImportError:  # create_app says that the sentry extra is missing
        return value
    try:
        Dsn(value)
    except Exception:  # BadDsn, or urllib's ValueError about its port (which quotes it)
        pass
    else:
        return value
    raise ValueError(
        f"not a Sentry DSN ({located(value)}): expected https://PUBLIC_KEY@HOST/PROJECT_ID,"
        " as the Sentry project's settings give it"
    )


def tenant_policies(value: Any) -> dict[str, TenantPolicy]:
    """``LEDGER_TENANTS``: each tenant's policy (``*``: every other tenant's)."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else {}
    checked: dict[str, TenantPolicy] = {}
    for name, options in _mapping(value, "tenants").items():
        if name != DEFAULT_TENANT:
            check_tenant(name)
        if isinstance(options, TenantPolicy):
            checked[name] = options
            continue
        options = _mapping(options, f"tenant {name!r}")
        known = [field.name for field in fields(TenantPolicy)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(
                f"tenant {name!r}: unknown option {', '.join(unknown)}; known: {', '.join(known)}"
            )
        try:
            checked[name] = TenantPolicy(**options)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"tenant {name!r}: {exc}") from None
    return checked


def unknown_settings(known: set[str]) -> str | None:
    """What is wrong with the environment's ``LEDGER_*`` names not in ``known``, if any."""
    unknown = sorted(
        name for name in os.environ if name.startswith("LEDGER_") and name not in known
    )
    if not unknown:
        return None
    # (by the part after LEDGER_: the shared prefix made any name look close to some setting)
    by_suffix = {name.removeprefix("LEDGER_"): name for name in known}
    hints = [
        [
            by_suffix[m]
            for m in difflib.get_close_matches(name.removeprefix("LEDGER_"), by_suffix, n=1)
        ]
        for name in unknown
    ]
    return (
        "unknown setting "
        + "; ".join(
            f"{name} (did you mean {hint[0]}?)" if hint else name
            for name, hint in zip(unknown, hints, strict=True)
        )
        + "\nRename or unset it: every LEDGER_* variable must name a setting."
    )


class ConsoleUser(BaseModel):
    """A login of the web console: its password and role."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    password: SecretStr
    role: Literal["viewer", "operator"] = "viewer"

    @field_validator("password")
    @classmethod
    def _password(cls, value: SecretStr) -> SecretStr:
        text = value.get_secret_value()
        _not_a_placeholder(text)
        if not text.strip(". …"):
            raise ValueError(
                'its password is a placeholder ("..."): set a real one, 12+ characters'
            )
        if len(text) < 12:
            raise ValueError("a console password needs 12 or more characters")
        return value
