"""Idempotency keys and the task ids derived from them (pure functions).

A job's identity is ``(task name, idempotency key)``; its ledger record's ``_id`` is the task id
derived from that pair (:func:`derive_task_id`), whatever path the job takes: publishing, a
retry, a deferral, the reconciler's republish, a replay, a poison message. A message whose own
id is not that id (a canvas member frozen with a random id, a message from another producer) is
an *alias* of the job: the ledger records which job it names, so its result can be read by its id.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import inspect
import json
import re
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

from .errors import ConfigurationError, PayloadError

# Namespace of the task ids celery-ledger derives; never change it (ids would change).
TASK_ID_NAMESPACE = uuid.UUID("6f1c3a52-5d0e-4c4e-9b59-3f0a6c1d2e77")

KeySpec = str | Callable[..., Any] | None


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal values give equal text.

    Raises:
        PayloadError: ``value`` holds something JSON cannot represent.
    """
    try:
        return _CANONICAL.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:  # (nested past the stack)
        raise PayloadError(f"not JSON-serialisable: {exc}") from exc


# ``json.dumps`` with these options, its encoder made once (every publish encodes its arguments
# with it for the size check, and a default key hashes them): the same text, the same errors.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)


def default_key(
    task_name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    secret: bytes | None = None,
) -> str:
    """A stable key for a call: a hash of the task name and the canonical JSON arguments.

    With ``secret`` (a sensitive task's) it is a keyed HMAC instead, ``m:...``: a plain hash of
    low-entropy arguments (a card number, an amount) is reversed by trying them all, and the
    key is in message headers, logs and the ledger in clear.
    """
    body = canonical_json([task_name, list(args), dict(kwargs)]).encode()
    if secret is not None:
        return "m:" + hmac.new(secret, body, hashlib.sha256).hexdigest()[:32]
    return "h:" + hashlib.sha256(body).hexdigest()[:32]


def derive_task_id(task_name: str, key: str) -> str:
    """The Celery task id (and ledger ``_id``) of the job ``(task_name, key)``.

    Derived from the JSON pair, so no choice of name and key can collide with another.
    """
    # ``str(uuid.uuid5(TASK_ID_NAMESPACE, name))`` without its UUID object (every publish and
    # every delivery derives one): the name's SHA-1 after the namespace, version 5, RFC 4122.
    name = _NAMESPACE_BYTES + json.dumps([task_name, key]).encode()
    digest = bytearray(hashlib.sha1(name, usedforsecurity=False).digest())
    digest[6] = (digest[6] & 0x0F) | 0x50
    digest[8] = (digest[8] & 0x3F) | 0x80
    text = digest[:16].hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


_NAMESPACE_BYTES = TASK_ID_NAMESPACE.bytes


def option_as_given(cls: type, name: str) -> Any:
    """A task class's option as its class body gave it (``idempotency_key``, ``tenant``): a
    function unbound, a staticmethod's function. What ``inspect.getattr_static`` finds on a
    class whose metaclass keeps ``__dict__`` (a task's is ``type``), at a tenth of its cost:
    every publish reads two."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            spec = klass.__dict__[name]
            return spec.__func__ if isinstance(spec, staticmethod) else spec
    raise AttributeError(name)


def _signature(func: Callable[..., Any]) -> inspect.Signature:
    """A task's signature, read once: building it is most of what binding a call costs (every
    publish with a key template binds one). A callable that cannot be hashed is read each time."""
    try:
        return _cached_signature(func)
    except TypeError:  # unhashable
        return inspect.signature(func)


_cached_signature = functools.lru_cache(maxsize=1024)(inspect.signature)


class _Plain(NamedTuple):
    """A signature whose every parameter is positional-or-keyword (most task bodies)."""

    names: tuple[str, ...]
    defaults: dict[str, Any]  # of the parameters that have one


@functools.lru_cache(maxsize=1024)
def _plain_cached(func: Callable[..., Any]) -> _Plain | None:
    parameters = inspect.signature(func).parameters.values()
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters):
        return None
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    return _Plain(tuple(p.name for p in parameters), defaults)


def _plain_arguments(
    func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any] | None:
    """What ``bind_arguments`` returns, for a plain signature that the call binds; else None
    (then ``Signature.bind`` says why not). Every publish with a key template and every
    delivery binds its call: ``bind`` builds objects this does not."""
    try:
        plain = _plain_cached(func)
    except (TypeError, ValueError):  # unhashable, or no signature
        return None
    if plain is None or len(args) > len(plain.names):
        return None
    arguments = dict(zip(plain.names, args, strict=False))
    used = 0
    for name in plain.names[len(args) :]:
        if name in kwargs:
            arguments[name] = kwargs[name]
            used += 1
        elif name in plain.defaults:
            arguments[name] = plain.defaults[name]
        else:
            return None  # a required argument missing
    # (each keyword names a parameter not given by position)
    return arguments if used == len(kwargs) else None


def why_unbound(
    func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> str | None:
    """Why a call's arguments do not bind ``func``'s signature, or None (None too when it has
    no signature to check against)."""
    if _plain_arguments(func, args, kwargs) is not None:
        return None
    try:
        signature = _signature(func)
    except (TypeError, ValueError):  # no signature to check against
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        return str(exc)
    return None


def bind_arguments(
    func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults applied (for key templates)."""
    plain = _plain_arguments(func, args, kwargs)
    if plain is not None:
        return plain
    try:
        bound = _signature(func).bind(*args, **kwargs)
    except TypeError as exc:
        raise PayloadError(
            f"arguments do not match {func.__name__}{_signature(func)}: {exc}"
        ) from exc
    bound.apply_defaults()
    return dict(bound.arguments)


def compute_key(
    spec: KeySpec,
    *,
    task_name: str,
    run: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    secret: bytes | None = None,
) -> str:
    """The idempotency key of a call, from the task's ``idempotency_key`` option.

    ``spec`` is a callable over the task's arguments, a ``str.format`` template over the
    arguments by name (``"order-{order_id}"``), or ``None`` for :func:`default_key` (keyed
    with ``secret`` if given).
    """
    if spec is None:
        return default_key(task_name, args, kwargs, secret=secret)
    key = apply_spec(
        spec, "idempotency_key", task_name=task_name, run=run, args=args, kwargs=kwargs
    )
    return validate_key(key, task_name=task_name)


def apply_spec(
    spec: str | Callable[..., Any],
    option: str,
    *,
    task_name: str,
    run: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> Any:
    """What a task option over its call's arguments names (``idempotency_key``, ``tenant``): a
    callable called with them, or a ``str.format`` template filled with them by name.

    Raises:
        PayloadError: the callable does not take these arguments.
        ConfigurationError: the template names an argument the task does not have, or the
            option is neither.
    """
    if callable(spec):
        try:
            return spec(*args, **kwargs)
        except TypeError as exc:
            raise PayloadError(
                f"{option} of {task_name} cannot take these arguments: {exc}"
            ) from exc
    if isinstance(spec, str):
        bound = bind_arguments(run, args, kwargs)
        try:
            return spec.format(**bound)
        except (KeyError, IndexError) as exc:
            raise ConfigurationError(
                f"{option} template {spec!r} of {task_name} names unknown argument {exc}"
            ) from exc
        except (ValueError, AttributeError, TypeError) as exc:  # ("{x.id}" of a dict, say)
            raise PayloadError(
                f"{option} template {spec!r} of {task_name} does not format these arguments: {exc}"
            ) from exc
    raise ConfigurationError(
        f"{option} of {task_name} must be a callable or a str.format template,"
        f" not {type(spec).__name__}"
    )


def template_problem(spec: str, run: Callable[..., Any]) -> str | None:
    """What is wrong with a ``str.format`` template over ``run``'s arguments by name (None:
    nothing found before a call: a field's attribute or index is read only then)."""
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(spec) if field is not None]
    except ValueError as exc:
        return f"template {spec!r} does not parse: {exc}"
    try:
        parameters = _signature(run).parameters
    except (TypeError, ValueError):  # (no signature to read: checked at each call)
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    for field in fields:
        name = field.split(".", 1)[0].split("[", 1)[0]
        if name not in parameters:
            known = ", ".join(parameters) or "none"
            return f"template {spec!r} names {name or '{}'!r}, not an argument ({known})"
    return None


def validate_key(key: Any, *, task_name: str) -> str:
    """Check that a key is a non-empty string of sensible length."""
    if not isinstance(key, str) or not key:
        raise PayloadError(f"idempotency key of {task_name} must be a non-empty str, got {key!r}")
    if len(key) > 512:
        raise PayloadError(f"idempotency key of {task_name} is longer than 512 characters")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PayloadError(
            f"idempotency key of {task_name} is not valid UTF-8 text: {exc}"
        ) from exc
    return key


# The key of a message that names none and whose arguments cannot be keyed: its own id.
MESSAGE_ID_KEY_PREFIX = "id:"

# A periodic run's key: its schedule entry and its slot (celery_ledger.schedules), which the
# body reads back as ``self.scheduled_for``. The key carries the slot (no header of its own: a
# worker of an earlier release refuses an unknown ledger_ header, and takes this key).
SCHEDULE_KEY_PREFIX = "schedule:"
_SLOT_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
_SLOT_KEY = re.compile(r"schedule:(?P<entry>.+)@(?P<slot>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")


def slot_key(entry_name: str, slot: float) -> str:
    """The idempotency key of a schedule entry's run for ``slot`` (unix seconds)."""
    moment = datetime.fromtimestamp(slot, UTC).strftime(_SLOT_FORMAT)
    return f"{SCHEDULE_KEY_PREFIX}{entry_name}@{moment}"


def slot_of_key(key: Any) -> datetime | None:
    """The slot a periodic run's key names (UTC), or None for any other key."""
    found = _SLOT_KEY.fullmatch(key) if isinstance(key, str) else None
    if found is None:
        return None
    return datetime.strptime(found["slot"], _SLOT_FORMAT).replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Identity:
    """Which job a message is: ``(task, key)``, its record id, and the message's own id."""

    task: str
    key: str
    record_id: str
    message_id: str

    @property
    def alias(self) -> str | None:
        """The message's id when it is not the record's (the ledger keeps it as an alias)."""
        return None if self.message_id == self.record_id else self.message_id


def identity_of(
    task_name: str,
    message_id: str,
    *,
    key_header: Any,
    key_of_arguments: Callable[[], str] | None = None,
) -> Identity:
    """The identity of a message: its key header if valid, else the key its arguments give
    (the task's ``idempotency_key`` over them, as a publish through the task would compute),
    else its own id (``id:<message id>``).
    """
    key: str | None = None
    if key_header:
        try:
            key = validate_key(key_header, task_name=task_name)
        except PayloadError:
            key = None
    if key is None and key_of_arguments is not None:
        try:
            key = key_of_arguments()
        except Exception:  # the app's key function, on a message it did not expect: any error
            key = None
    if key is None:
        key = MESSAGE_ID_KEY_PREFIX + message_id
    return Identity(task_name, key, derive_task_id(task_name, key), message_id)
