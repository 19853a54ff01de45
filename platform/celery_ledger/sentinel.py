"""Redis through Sentinel: how every Redis client of the platform reaches the broker's Redis,
for a plain URL (``redis://``, ``rediss://``, ``unix://``) or a list of sentinels.

A Sentinel deployment is configured as Celery users configure one. The broker URL lists the
sentinels, ``sentinel://[user:password@]host:port[/db][?ssl_*=...];sentinel://host:port;...``:
the first entry's user, password, database and ``ssl_*`` options are the data nodes' (the
primary's and the replicas': kombu reads them there, and so does this module). The transport
options name the primary (``master_name``) and give the sentinels' own connection options
(``sentinel_kwargs``: their ACL user and password, TLS). ``create_app`` fills both from
``LEDGER_SENTINEL_MASTER``, ``LEDGER_SENTINEL_USERNAME``, ``LEDGER_SENTINEL_PASSWORD`` and
``LEDGER_SENTINEL_TLS`` (:class:`SentinelSettings`); an app may set them in
``broker_transport_options`` itself, and the platform's clients read them from there
(:class:`RedisTarget`), as the broker's connection does.

A client made here asks the sentinels for the primary whenever it opens a connection, and drops
a connection to a server that is no longer the primary (gone, or demoted: it answers
``READONLY``), so after a failover the next command reaches the new primary (redis-py's
``SentinelConnectionPool``, the pool kombu's Sentinel channel uses for the broker's connection).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedSSLConnection

from .errors import ConfigurationError

SCHEME = "sentinel"
DEFAULT_PORT = 26379
PLACEHOLDER_PREFIX = "change-me"  # (.env.example's, as settings.py refuses them)


class SentinelSettings(BaseSettings):
    """The broker URL and the ``LEDGER_*`` settings of a Sentinel deployment (the first fields
    of :class:`celery_ledger.settings.Settings`, which checks the URL)."""

    model_config = SettingsConfigDict(env_prefix="LEDGER_", extra="ignore")

    broker_url: str | None = Field(
        None,
        repr=False,
        description="Celery broker URL: redis://, rediss:// or unix://, or the sentinels of a"
        " failover group, sentinel://[user:password@]host:port[/db];sentinel://host:port;..."
        " Required to publish or run a worker: unset, nothing is sent anywhere (never a Redis"
        " that happens to listen on localhost). The embedded stack sets it (`stack.env`).",
    )
    sentinel_master: str | None = Field(
        None,
        description="With sentinel:// broker URLs: the name the sentinels know the primary by"
        " (the transport option master_name).",
    )
    sentinel_username: str | None = Field(
        None, description="The sentinels' own ACL user (the data nodes' is in the URL)."
    )
    sentinel_password: SecretStr | None = Field(
        None, repr=False, description="The sentinels' own password (requirepass or ACL user)."
    )
    sentinel_tls: bool = Field(
        False,
        description="The sentinels speak TLS (verified with the URL's ssl_ca_certs, if any);"
        " the data nodes' TLS is the URL's ssl_* options.",
    )
    broker_timeout_seconds: float = Field(
        5.0,
        gt=0,
        le=300,
        description="How long a connection to the broker (or a sentinel), and each command on"
        " it, may wait for an answer before it fails: a broker that hangs without closing its"
        " connections (stopped, overloaded, cut off by the network) fails a publish within a"
        " few times this instead of holding it for ever. A worker's own connections wait six"
        " times this, then reconnect.",
    )

    broker_confirm_replicas: int | None = Field(
        None,
        ge=0,
        description="A job published while the ledger is away has no record yet: its record is"
        " kept in the broker until the ledger is back, and a failover that drops the old"
        " primary's last writes would drop the job with it. So such a publish waits (Redis WAIT,"
        " up to half of LEDGER_BROKER_TIMEOUT_SECONDS) until this many replicas hold the record,"
        " and is refused (NotReplicated: publish again, the key runs it once) if they do not."
        " Unset: 1 with sentinel:// URLs, 0 with one server (nothing to wait for). Set 0 for a"
        " Sentinel group without replicas, 1 for a managed Redis that fails over behind one URL;"
        " never more than the replicas a primary has (every such publish would be refused).",
    )

    def replicas_to_confirm(self) -> int:
        """How many replicas must hold a publish's record kept in the broker (see
        ``broker_confirm_replicas``)."""
        if self.broker_confirm_replicas is not None:
            return self.broker_confirm_replicas
        return 1 if is_sentinel_url(self.broker_url) else 0

    @field_validator("sentinel_password")
    @classmethod
    def _sentinel_password(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and value.get_secret_value().startswith(PLACEHOLDER_PREFIX):
            raise ValueError(
                f"it is a placeholder ({PLACEHOLDER_PREFIX}...) from .env.example: set a real"
                " secret"
            )
        return value


def is_sentinel_url(url: str | None) -> bool:
    """Whether ``url`` lists sentinels (``sentinel://...``) rather than one Redis server (None:
    no broker named)."""
    return url is not None and url.lower().startswith(SCHEME + "://")


@dataclass(frozen=True)
class SentinelURL:
    """A ``sentinel://`` URL list, parsed: the sentinels, and the data nodes' connection."""

    sentinels: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    db: int = 0
    tls: Mapping[str, Any] = field(default_factory=dict)  # the first entry's ssl_* options

    def node_kwargs(self) -> dict[str, Any]:
        """redis-py's keyword arguments for a connection to a data node."""
        kwargs: dict[str, Any] = {"db": self.db}
        if self.username:
            kwargs["username"] = self.username
        if self.password:
            kwargs["password"] = self.password
        if self.tls:
            kwargs.update(self.tls)
            kwargs["connection_class"] = SentinelManagedSSLConnection
        return kwargs


_EXPECTED = (
    "expected sentinel://[user:password@]host:port[/db][?ssl_*=...];sentinel://host:port;..."
    " with / @ : % ? # percent-encoded in the user name and password"
)
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def parse_sentinel_url(url: str) -> SentinelURL:
    """The sentinels and data-node options of ``url``.

    Raises:
        ValueError: not such a list (the message never quotes the URL: it may hold a password).
    """
    sentinels = []
    first = None
    for part in url.split(";"):
        try:
            parts = urlsplit(part.strip())
            host, port = parts.hostname, parts.port or DEFAULT_PORT
        except ValueError:
            raise ValueError(f"not a Sentinel URL list (scheme sentinel://): {_EXPECTED}") from None
        if parts.scheme.lower() != SCHEME or not host:
            raise ValueError(f"not a Sentinel URL list (scheme sentinel://): {_EXPECTED}")
        sentinels.append((host, port))
        first = first or parts
    assert first is not None  # (split gives one part at least)
    path = first.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(
            f"not a Sentinel URL list (scheme sentinel://): the database is a number; {_EXPECTED}"
        )
    tls: dict[str, Any] = {}
    for name, value in parse_qsl(first.query):
        if not name.startswith("ssl_"):
            continue
        if name == "ssl_cert_reqs":
            if value.lower().removeprefix("cert_") not in _CERT_REQS:
                raise ValueError("ssl_cert_reqs is none, optional or required")
            tls[name] = _CERT_REQS[value.lower().removeprefix("cert_")]
        elif name == "ssl_check_hostname":
            tls[name] = value.lower() != "false"
        else:
            tls[name] = value
    return SentinelURL(
        sentinels=tuple(sentinels),
        username=unquote(first.username) if first.username else None,
        password=unquote(first.password) if first.password else None,
        db=int(path or 0),
        tls=tls,
    )


def check_sentinel_url(url: str, check_password: Callable[[str | None], None]) -> str:
    """``url``, checked (for the settings): ``check_password`` refuses a placeholder."""
    check_password(parse_sentinel_url(url).password)
    return url


# A worker's own broker connections wait this many times LEDGER_BROKER_TIMEOUT_SECONDS: a stall
# of the broker longer than a producer waits (a fork for a snapshot, a slow disk) must not cut a
# take between its pop and its booking, which kombu makes two round trips.
WORKER_TIMEOUT_FACTOR = 6


def for_workers(options: Mapping[str, Any], settings: SentinelSettings) -> dict[str, Any]:
    """A worker's broker transport options: ``options`` with its longer socket timeout."""
    return {**options, "socket_timeout": settings.broker_timeout_seconds * WORKER_TIMEOUT_FACTOR}


def connection_options(settings: SentinelSettings) -> dict[str, Any]:
    """The broker transport options ``create_app`` sets from these settings: every URL's
    socket timeouts and keepalive, and through Sentinel, the primary's name and the sentinels'
    own options (``sentinel_kwargs``: their timeouts too)."""
    timeout = settings.broker_timeout_seconds
    sockets = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    options: dict[str, Any] = {**sockets, "socket_keepalive": True}
    if not is_sentinel_url(settings.broker_url):
        return options
    if settings.sentinel_master:
        options["master_name"] = settings.sentinel_master
    # (and no retries: redis-py's default tries a sentinel that hangs ten more times, each
    # waiting out the timeout, before it asks the next one)
    kwargs: dict[str, Any] = {**sockets, "retry": None}
    if settings.sentinel_username:
        kwargs["username"] = settings.sentinel_username
    if settings.sentinel_password is not None:
        kwargs["password"] = settings.sentinel_password.get_secret_value()
    if settings.sentinel_tls:
        kwargs["ssl"] = True
        kwargs.update(parse_sentinel_url(str(settings.broker_url)).tls)
    options["sentinel_kwargs"] = kwargs
    return options


@dataclass(frozen=True)
class RedisTarget:
    """Where the platform's Redis is: a URL and, for a ``sentinel://`` one, the broker's
    transport options (``master_name``, ``sentinel_kwargs``, ``min_other_sentinels``)."""

    url: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def sentinel(self) -> bool:
        return is_sentinel_url(self.url)

    def master_name(self) -> str:
        name = self.options.get("master_name")
        if not name:
            raise ConfigurationError(
                "a sentinel:// broker URL needs the primary's name: set LEDGER_SENTINEL_MASTER"
                " (or broker_transport_options={'master_name': ...})"
            )
        return str(name)

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new client (its own connection pool) of the primary; ``kwargs`` are redis-py's
        (``socket_timeout``, ``retry``...), for the data nodes' connections and the
        sentinels' alike."""
        if not self.sentinel:
            return redis.Redis.from_url(self.url, **kwargs)
        parsed = parse_sentinel_url(self.url)
        sentinel_kwargs = dict(self.options.get("sentinel_kwargs") or {})
        sentinel_kwargs.update(  # (a caller's own timeouts win over the settings')
            (name, value)
            for name, value in kwargs.items()
            if name in ("socket_timeout", "socket_connect_timeout", "retry")
        )
        manager = Sentinel(
            list(parsed.sentinels),
            min_other_sentinels=int(self.options.get("min_other_sentinels") or 0),
            sentinel_kwargs=sentinel_kwargs,
            **parsed.node_kwargs(),
            **kwargs,
        )
        client: redis.Redis = manager.master_for(self.master_name(), redis_class=redis.Redis)
        return client

    def primary(self, client: redis.Redis | None = None) -> str:
        """The primary's address as the sentinels name it now (``host:port``), or the URL's
        server for a plain URL."""
        if not self.sentinel:
            kwargs = (client or self.client()).connection_pool.connection_kwargs
            if "path" in kwargs:
                return str(kwargs["path"])
            return f"{kwargs.get('host')}:{kwargs.get('port')}"
        pool = (client or self.client()).connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        host, port = pool.get_master_address()
        return f"{host}:{port}"


def redis_client(target: str | RedisTarget, **kwargs: Any) -> redis.Redis:
    """A new client of ``target`` (a URL, or a :class:`RedisTarget`); ``kwargs`` as redis-py's.

    Raises:
        ConfigurationError: a ``sentinel://`` URL given without the primary's name.
    """
    if isinstance(target, str):
        target = RedisTarget(target)
    return target.client(**kwargs)


def fresh_client(client: redis.Redis) -> redis.Redis:
    """A client like ``client`` on a pool of its own (in a forked child: never the parent's)."""
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        manager = pool.sentinel_manager
        fresh = Sentinel(
            [_address(node) for node in manager.sentinels],
            min_other_sentinels=manager.min_other_sentinels,
            sentinel_kwargs=manager.sentinel_kwargs,
            **manager.connection_kwargs,
        )
        primary: redis.Redis = fresh.master_for(pool.service_name, redis_class=redis.Redis)
        return primary
    return redis.Redis(
        connection_pool=type(pool)(
            connection_class=pool.connection_class,
            max_connections=pool.max_connections,
            **pool.connection_kwargs,
        )
    )


def _address(node: redis.Redis) -> tuple[str, int]:
    kwargs = node.connection_pool.connection_kwargs
    return (kwargs["host"], kwargs["port"])


def primary_moved(client: redis.Redis) -> Callable[[], bool] | None:
    """For a client through Sentinel, whether the sentinels now name another primary than the
    one its connections were last made to (asks them; its idle connections to the old one are
    dropped then, so the next command reaches the new one); None for a plain URL (one server).
    Such a primary, stalled and running again until the sentinels demote it, may still have a
    replica they have not moved yet, whose confirmation of a write is lost with it."""
    pool = client.connection_pool
    if not isinstance(pool, SentinelConnectionPool):
        return None

    def moved() -> bool:
        before = pool.master_address
        return before is not None and tuple(pool.get_master_address()) != tuple(before)

    return moved


def primary_of(target: RedisTarget, client: redis.Redis) -> Callable[[], str] | None:
    """How to read the primary's address behind Sentinel (None for a plain URL: one server)."""
    return (lambda: target.primary(client)) if target.sentinel else None
