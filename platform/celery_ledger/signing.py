"""Message authentication: an HMAC over what makes a task message a job (pure functions).

With ``LEDGER_SIGNING_KEYS`` every task message an app publishes carries a ``ledger_signature``
header, an HMAC-SHA256 over the task name, the message id, the idempotency key, the workflow a
step wakes, ``eta``, ``expires``, ``retries`` and the whole body (arguments, keyword arguments,
and the embedded callbacks, errbacks, chain and chord). A worker verifies it before Celery
unpacks the message, so whoever can write to the broker cannot make a worker run a registered
task with arguments (or callbacks) of their choosing, nor give a captured message a new
identity. A captured message sent again unchanged is the same job, which the ledger already
runs once.

Keys are listed newest first: messages are signed with the first, and any listed key verifies
(each signature names its key by a short digest), so a rotation is "add the new key second on
every worker, then first everywhere, then drop the old key once its messages are consumed".

Why our own and not kombu's ``auth`` serializer: that one signs with X.509 certificates and a
private key per producer, signs only the body (a header such as the task name or the
idempotency key could be changed under a valid signature), and is itself the serializer, so
it cannot be combined with the sealed codec of sensitive tasks; an HMAC with shared keys is
what rotating secrets in a deployment's secret store can provide.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from typing import Any

from kombu.utils import json as kombu_json

from . import headers as ledger_headers
from .errors import ConfigurationError

HEADER = ledger_headers.SIGNATURE
VERSION = "v1"
# Headers bound by the signature besides the body (a republish under a new identity re-signs).
BOUND_HEADERS = (
    "task",
    "id",
    ledger_headers.KEY,
    ledger_headers.WORKFLOW,
    "eta",
    "expires",
    "retries",
)


def key_id(key: bytes) -> str:
    """A short public name of a key: which listed key a signature was made with."""
    return hashlib.sha256(b"celery-ledger-signing:" + key).hexdigest()[:12]


def signed_text(message_headers: Mapping[str, Any], body: Any) -> bytes:
    """The bytes a signature covers: the bound headers and the body, as canonical kombu JSON.

    The producer's values go through one kombu JSON round trip first, so a tuple, a datetime
    or an integer dictionary key gives the text the worker computes from the decoded message.
    """
    fields = [{name: message_headers.get(name) for name in BOUND_HEADERS}, body]
    decoded = kombu_json.loads(kombu_json.dumps(fields))
    text: str = kombu_json.dumps(decoded, sort_keys=True, separators=(",", ":"))
    return text.encode()


class Signer:
    """Signs and verifies task messages with ``LEDGER_SIGNING_KEYS`` (newest first)."""

    def __init__(self, keys: Sequence[str], *, required: bool = True) -> None:
        self._keys = {key_id(k.encode()): k.encode() for k in keys}
        self._signing = (key_id(keys[0].encode()), keys[0].encode()) if keys else None
        self.required = required and bool(keys)
        if len(self._keys) != len(keys):
            raise ConfigurationError("LEDGER_SIGNING_KEYS lists the same key twice")

    @property
    def enabled(self) -> bool:
        return self._signing is not None

    def sign(self, message_headers: Mapping[str, Any], body: Any) -> str:
        if self._signing is None:
            raise ConfigurationError("signing needs LEDGER_SIGNING_KEYS")
        kid, key = self._signing
        mac = hmac.new(key, signed_text(message_headers, body), hashlib.sha256).hexdigest()
        return f"{VERSION}:{kid}:{mac}"

    def problem(self, message_headers: Mapping[str, Any], body: Any) -> str | None:
        """Why a received message must not run (unsigned, or badly signed), or None.

        A message without a signature is refused only when signatures are required (turn that
        off while the producers' deploy that adds the keys rolls out); a signature that is
        there is always checked.
        """
        signature = message_headers.get(HEADER)
        if signature is None:
            return "unsigned message (LEDGER_SIGNING_KEYS requires one)" if self.required else None
        if not self._keys:
            return None  # signatures are not checked here (no keys)
        version, _, rest = str(signature).partition(":")
        kid, _, mac = rest.partition(":")
        if version != VERSION or not kid or not mac:
            return "malformed message signature"
        key = self._keys.get(kid)
        if key is None:
            return f"message signed with key {kid[:12]!r}, not listed in LEDGER_SIGNING_KEYS"
        try:
            text = signed_text(message_headers, body)
        except (TypeError, ValueError) as exc:
            return f"message signature cannot be checked: {type(exc).__name__}"
        expected = hmac.new(key, text, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, mac):
            return "bad message signature (the message was changed, or forged)"
        return None
