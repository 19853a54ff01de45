"""The kept message: what the ledger keeps of a job's message so that it can be published again.

Every path that can bring a job back uses it: the reconciler (a worker died, a message was lost),
a replay of a dead letter, a job shed by backpressure, a poison message of a known task. A kept
message holds the arguments (sealed when the task is sensitive) and the ledger headers the job
travels with (key, tier, first enqueue time, retry state), or, for a message that never reached a
task, the raw bytes as they were received.

Arguments are encoded with kombu's JSON, the encoding of the message itself: values its decoder
produced (datetimes, decimals, UUIDs) survive the round trip.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .. import headers, tracecontext, wire
from ..crypto import PREFIX, Sealer
from ..errors import StoreError
from ..untrusted import storable_value

RawKind = Literal["body", "envelope", "entry"]
_RAW_KINDS: dict[str, RawKind] = {"body": "body", "envelope": "envelope", "entry": "entry"}


class Publish(Protocol):
    """Sends one task message to a tier's queue (the app's ``send_task``, wired by
    ``create_app``); ``sealed`` seals the body and keeps the arguments out of its repr
    headers (a sensitive task's message)."""

    def __call__(
        self,
        task: str,
        args: list[Any],
        kwargs: dict[str, Any],
        *,
        task_id: str,
        tier: str,
        headers: dict[str, Any],
        retries: int = 0,
        expires: str | None = None,
        sealed: bool = False,
    ) -> None: ...


class UnreplayableMessage(StoreError):
    """The kept message cannot be turned back into a task's arguments."""


@dataclass(frozen=True)
class KeptMessage:
    """A job's message as the ledger keeps it (see the module docstring)."""

    args_json: str | None = None  # kombu JSON, or a sealed token for a sensitive task
    kwargs_json: str | None = None
    headers: Mapping[str, Any] = field(default_factory=dict)  # ledger headers, expires, retries
    raw_base64: str | None = None  # a message that never reached a task, as received
    # "body": the task message's body; "envelope": the queue item; "entry": unreadable as either
    raw_kind: RawKind | None = None
    queue: str | None = None  # where a raw message was found (informational, never trusted)
    # Whether ``headers`` were made storable when the message was built (``of_call``, ``of_raw``):
    # then ``document`` does not make them so a second time (a task's claim writes every one).
    _storable: bool = field(default=False, repr=False, compare=False)

    # -- building ----------------------------------------------------------------------------

    @classmethod
    def of_call(
        cls,
        args: Any,
        kwargs: Any,
        *,
        message_headers: Mapping[str, Any],
        sealer: Sealer | None = None,
    ) -> KeptMessage:
        """The arguments of a call and the ledger headers of its message; sealed with
        ``sealer`` (a sensitive task), kept in clear without one.

        Raises:
            TypeError: an argument kombu's JSON cannot encode.
        """
        args_json = wire.dumps(list(args or ()))
        kwargs_json = wire.dumps(dict(kwargs or {}))
        if sealer is not None:
            args_json, kwargs_json = sealer.seal(args_json), sealer.seal(kwargs_json)
        return cls(args_json, kwargs_json, carried_headers(message_headers), _storable=True)

    @classmethod
    def of_raw(
        cls, raw: bytes, *, kind: RawKind, queue: str | None, message_headers: Any = None
    ) -> KeptMessage:
        """A message that never reached a task body (poison), kept as received."""
        found = message_headers if isinstance(message_headers, Mapping) else {}
        return cls(
            raw_base64=base64.b64encode(raw).decode(),
            raw_kind=kind,
            queue=storable_value(queue) if queue is not None else None,
            headers=storable_value({str(k): v for k, v in found.items()}),
            _storable=True,
        )

    @classmethod
    def from_document(cls, doc: Any) -> KeptMessage | None:
        """The kept message of a stored record (schema 1 or 2), or None."""
        if not isinstance(doc, Mapping):
            return None
        kind = doc.get("raw_kind") or ("body" if doc.get("raw_base64") else None)
        raw_kind = _RAW_KINDS.get(kind) if isinstance(kind, str) else None
        return cls(
            args_json=_str_or_none(doc.get("args_json")),
            kwargs_json=_str_or_none(doc.get("kwargs_json")),
            headers=dict(doc.get("headers") or {}),
            raw_base64=_str_or_none(doc.get("raw_base64")),
            raw_kind=raw_kind,
            queue=_str_or_none(doc.get("queue")),
        )

    def document(self) -> dict[str, Any]:
        """The stored form (BSON-safe)."""
        kept = dict(self.headers)
        doc: dict[str, Any] = {"headers": kept if self._storable else storable_value(kept)}
        for name in ("args_json", "kwargs_json", "raw_base64", "raw_kind", "queue"):
            value = getattr(self, name)
            if value is not None:
                doc[name] = value
        return doc

    def with_headers(self, **changes: Any) -> KeptMessage:
        """A copy whose headers are updated (``None`` removes a header)."""
        updated = {**self.headers, **changes}
        return KeptMessage(
            self.args_json,
            self.kwargs_json,
            {k: v for k, v in updated.items() if v is not None},
            self.raw_base64,
            self.raw_kind,
            self.queue,
        )

    # -- reading -----------------------------------------------------------------------------

    @property
    def sealed(self) -> bool:
        """A sensitive task's message: its arguments, or its raw body, are sealed."""
        if any(
            isinstance(value, str) and Sealer.is_sealed(value)
            for value in (self.args_json, self.kwargs_json)
        ):
            return True
        try:
            body = self._raw_body()
        except (UnreplayableMessage, ValueError, TypeError, KeyError, binascii.Error):
            return False
        return body is not None and body.startswith(PREFIX.encode())

    @property
    def replayable(self) -> bool:
        """Whether the arguments can be rebuilt (a raw message may still fail to decode)."""
        return self.args_json is not None or (
            self.raw_base64 is not None and self.raw_kind != "entry"
        )

    def arguments(self, sealer: Sealer) -> tuple[list[Any], dict[str, Any]]:
        """The call's arguments (opened with ``sealer`` if sealed).

        Raises:
            UnreplayableMessage: nothing usable is kept.
            StoreError: sealed with a key no longer in ``LEDGER_ENCRYPTION_KEYS``.
        """
        if self.args_json is not None:
            args_text, kwargs_text = (
                sealer.open(self.args_json),
                sealer.open(self.kwargs_json or "{}"),
            )
            try:
                args, kwargs = wire.loads(args_text), wire.loads(kwargs_text)
            except (ValueError, TypeError) as exc:  # a damaged record: never a worker's crash
                raise UnreplayableMessage(f"the kept arguments are not JSON: {exc}") from exc
        elif self.raw_base64 is not None:
            args, kwargs = self._raw_arguments(sealer)
        else:
            raise UnreplayableMessage("no message was kept")
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise UnreplayableMessage("the kept arguments are not [args], {kwargs}")
        return args, kwargs

    def _raw_body(self) -> bytes | None:
        """The task body of a kept raw message (None: nothing raw is kept)."""
        if self.raw_base64 is None:
            return None
        if self.raw_kind == "entry":
            raise UnreplayableMessage("the message was kept as an unreadable entry")
        raw = base64.b64decode(self.raw_base64)
        if self.raw_kind == "envelope":
            envelope = json.loads(raw)
            body = envelope["body"]
            if (envelope.get("properties") or {}).get("body_encoding") == "base64":
                body = base64.b64decode(body)
            raw = body if isinstance(body, bytes) else str(body).encode()
        return raw

    def _raw_arguments(self, sealer: Sealer) -> tuple[Any, Any]:
        try:
            raw = self._raw_body()
            assert raw is not None
            if raw.startswith(PREFIX.encode()):  # a sensitive task's sealed body
                raw = sealer.open(raw.decode()).encode()
            triple = wire.loads(raw)
            return triple[0], triple[1]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, binascii.Error) as exc:
            raise UnreplayableMessage(f"the raw message has no usable arguments: {exc}") from exc

    # -- publishing again --------------------------------------------------------------------

    def republish(
        self,
        publish: Publish,
        sealer: Sealer,
        *,
        task: str,
        record_id: str,
        key: str,
        tier: str,
        arguments: tuple[list[Any], dict[str, Any]] | None = None,
    ) -> None:
        """Publish the job again under its own identity (``record_id`` as the task id), to
        ``tier``, with the ledger headers it was published with.

        ``arguments``: the call's arguments if the caller has already read them (with
        :meth:`arguments`), so that they are not opened twice.

        Raises:
            UnreplayableMessage: the arguments cannot be rebuilt.
        """
        args, kwargs = arguments if arguments is not None else self.arguments(sealer)
        carried = {name: self.headers[name] for name in headers.CARRIED if name in self.headers}
        carried.update({headers.KEY: key, headers.TIER: tier})
        retries = self.headers.get("retries")
        expires = self.headers.get("expires")
        publish(
            task,
            args,
            kwargs,
            task_id=record_id,
            tier=tier,
            headers=carried,
            retries=retries if isinstance(retries, int) and retries >= 0 else 0,
            expires=expires if isinstance(expires, str) else None,
            sealed=self.sealed,
        )

    def republish_record(
        self,
        publish: Publish,
        sealer: Sealer,
        record: Mapping[str, Any],
        *,
        tier: str,
        arguments: tuple[list[Any], dict[str, Any]] | None = None,
    ) -> None:
        """:meth:`republish` as the job whose ledger record is ``record`` (its id, task and
        key: a job the ledger knows, published from the message its record keeps)."""
        self.republish(
            publish,
            sealer,
            task=str(record.get("task")),
            record_id=str(record["_id"]),
            key=str(record.get("key")),
            tier=tier,
            arguments=arguments,
        )


def carried_headers(message_headers: Mapping[str, Any]) -> dict[str, Any]:
    """What a republish must carry of a message's headers (BSON-safe): the ledger's own,
    Celery's ``retries`` and ``expires``."""
    kept = {
        name: message_headers[name]
        for name in headers.CARRIED
        if name in message_headers and name not in tracecontext.HEADERS
    }
    kept.update(tracecontext.carried(message_headers))
    retries = message_headers.get("retries")
    if isinstance(retries, int) and not isinstance(retries, bool) and retries >= 0:
        kept["retries"] = retries
    expires = message_headers.get("expires")
    if isinstance(expires, str):
        kept["expires"] = expires
    result: dict[str, Any] = storable_value(kept)
    return result


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


__all__ = ["KeptMessage", "Publish", "UnreplayableMessage", "carried_headers"]
