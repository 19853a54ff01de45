"""Message authentication: an HMAC over what makes a task message a job (pure functions).

With ``LEDGER_SIGNING_KEYS`` every task message an app publishes carries a ``ledger_signature``
header, an HMAC-SHA256 over the whole body (arguments, keyword arguments, and the embedded
callbacks, errbacks, chain and chord) and over every header that decides what happens to the
job (:data:`BOUND_HEADERS`): its identity (task name, message id, idempotency key), its
schedule (``eta``, ``expires``), its tier, its age (``ledger_enqueued_at``, which its max age is
measured from), its retry and deferral state, its time limits, its group, the workflow a step
wakes, and the nested ``headers`` a republish copies. A worker verifies it before Celery unpacks
the message, so whoever can write to the broker cannot make a worker run a registered task with
arguments (or callbacks) of their choosing, give a captured message a new identity, nor make a
job expire, die of a time limit or run under another tier's policy by changing a header. A
captured message sent again unchanged is the same job, which the ledger already runs once.

The few headers left out (:data:`UNBOUND_HEADERS`) each say why: none of them can change what
happens to a job beyond a bound that does not depend on the message. Every republish of ours
that changes a bound header (a retry, a deferral, a replay) is a new publish, signed again.

Keys are listed newest first: messages are signed with the first, and any listed key verifies
(each signature names its key by a short digest), so a rotation is "add the new key second on
every worker, then first everywhere, then drop the old key once its messages are consumed".

Versions: ``v2`` binds the headers above; ``v1`` (older releases) bound only the identity, the
schedule, the workflow and the body, so a v1 message's age or tier could be changed under its
signature. A v1 signature is accepted only while unsigned messages are too
(``LEDGER_SIGNATURES_REQUIRED=false``, an upgrade in progress), never when signatures are
required.

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

from . import headers as ledger_headers
from . import wire
from .errors import ConfigurationError

HEADER = ledger_headers.SIGNATURE
VERSION = "v2"
LEGACY_VERSION = "v1"

# What a v1 signature (older releases) bound besides the body.
V1_BOUND_HEADERS = (
    "task",
    "id",
    ledger_headers.KEY,
    ledger_headers.WORKFLOW,
    "eta",
    "expires",
    "retries",
)
# Headers bound by a v2 signature besides the body: everything Celery and the ledger set when a
# message is published that a worker reads to decide what happens to the job. Each is set before
# the message is signed (Celery's as_task_v2, the ledger's apply_async), so none changes between
# the signature and the worker.
BOUND_HEADERS = (
    *V1_BOUND_HEADERS,
    # the ledger's: its tier's policy (lease, retries, time limit), its max age, the backoff
    # of its retries and deferrals, where its workflow's wake goes
    ledger_headers.TIER,
    ledger_headers.ENQUEUED_AT,
    ledger_headers.DEFERRALS,
    ledger_headers.PREVIOUS_DELAY,
    ledger_headers.WORKFLOW_TIER,
    # Celery's: time limits, chord and group bookkeeping, whether a result is stored, how
    # deep a replacement nests, revocation by stamp, result lineage
    "timelimit",
    "group",
    "group_index",
    "ignore_result",
    "replaced_task_nesting",
    "stamped_headers",
    "stamps",
    "root_id",
    "parent_id",
    "shadow",
    "lang",
    "origin",
    "argsrepr",
    "kwargsrepr",
    # Celery reads these from the headers when the body's embed leaves them out
    "callbacks",
    "errbacks",
    "chain",
    "chord",
    # The request's ``headers``: what a retry or deferral copies into its message, and where a
    # ledger header absent at the top level is looked up (Sentry's integration fills it before
    # the publish, so it is signed as it was sent).
    "headers",
)
# Headers a signature leaves out, and why that is safe. Any other header (tracing's
# ``sentry-trace``, ``baggage``, ``traceparent``) is not read by the platform or Celery to decide
# anything; kombu's ``redelivered`` only turns off the first claim's insert (a write's cost),
# as the unsigned ``ledger_new`` property turns it on (see headers.NEW). Message properties are
# never signed: none decides what happens to a job, except that ``ledger_handed_back`` delays the
# poison verdict by at most headers.MAX_HANDED_BACK deliveries (see headers.HANDED_BACK).
UNBOUND_HEADERS: dict[str, str] = {
    HEADER: "the signature itself",
    ledger_headers.SENT_AT: "stamped after the signature (before_task_publish); queue-wait"
    " metrics only",
    ledger_headers.UNRUNNABLE_SINCE: "changed in flight when a worker puts off a message it"
    " cannot run yet (an unknown task, arguments that do not bind), which goes back as it was"
    " sent, signature included; changing it only ends that put-off window early (the message"
    " is dead-lettered, replayable) or starts it again, for a message no worker here can run",
    ledger_headers.UNRUNNABLE_DEFERRALS: "changed in flight with ledger_unrunnable_since; only"
    " the put-off's backoff, capped at 10 s",
    "celery_beat_task": "Celery beat's mark of what it sends; read only for a message without"
    " a ledger_key header (a producer of ours always sets one), which it keys by the message's"
    " own id instead of its arguments",
    "compression": "added by kombu after the signature; it only says how the body is encoded,"
    " and the body the signature covers is the decoded one",
}


def key_id(key: bytes) -> str:
    """A short public name of a key: which listed key a signature was made with."""
    return hashlib.sha256(b"celery-ledger-signing:" + key).hexdigest()[:12]


def signed_text(message_headers: Mapping[str, Any], body: Any, *, version: str = VERSION) -> bytes:
    """The bytes a signature covers: the bound headers and the body, as canonical kombu JSON.

    The producer's values go through one kombu JSON round trip first, so a tuple, a datetime
    or an integer dictionary key gives the text the worker computes from the decoded message.
    A v2 text starts with its version, so it can never be read as a v1 text.
    """
    if version == LEGACY_VERSION:
        fields: list[Any] = [{name: message_headers.get(name) for name in V1_BOUND_HEADERS}, body]
    else:
        fields = [version, {name: message_headers.get(name) for name in BOUND_HEADERS}, body]
    decoded = wire.loads(wire.dumps(fields))
    text: str = wire.dumps(decoded, sort_keys=True, separators=(",", ":"))
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

    @property
    def newest_key_id(self) -> str | None:
        """The id of the key this process signs with (the first listed), or None."""
        return None if self._signing is None else self._signing[0]

    @staticmethod
    def key_id_of(signature: Any) -> str | None:
        """The id of the key a signature names, or None (unsigned, or not a signature)."""
        if not isinstance(signature, str):
            return None
        _version, _, rest = signature.partition(":")
        kid, _, _mac = rest.partition(":")
        return kid or None

    def sign(self, message_headers: Mapping[str, Any], body: Any) -> str:
        if self._signing is None:
            raise ConfigurationError("signing needs LEDGER_SIGNING_KEYS")
        kid, key = self._signing
        mac = hmac.new(key, signed_text(message_headers, body), hashlib.sha256).hexdigest()
        return f"{VERSION}:{kid}:{mac}"

    def lacks_key(self, message_headers: Mapping[str, Any]) -> bool:
        """Whether the message is signed with a well-formed signature of a key this process
        does not hold (another worker of the fleet may: a key added by a deploy under way)."""
        signature = message_headers.get(HEADER)
        if signature is None or not self._keys:
            return False
        version, _, rest = str(signature).partition(":")
        kid, _, mac = rest.partition(":")
        return version in (VERSION, LEGACY_VERSION) and bool(kid and mac) and kid not in self._keys

    def problem(
        self, message_headers: Mapping[str, Any], body: Any, *, strict: bool = False
    ) -> str | None:
        """Why a received message must not run (unsigned, or badly signed), or None.

        A message without a signature is refused only when signatures are required (turn that
        off while the producers' deploy that adds the keys rolls out); a signature that is
        there is always checked. ``strict``: as if they were required (a message another
        process already refused is vouched for by its signature only).
        """
        required = self.required or (strict and self.enabled)
        signature = message_headers.get(HEADER)
        if signature is None:
            return "unsigned message (LEDGER_SIGNING_KEYS requires one)" if required else None
        if not self._keys:
            return None  # signatures are not checked here (no keys)
        version, _, rest = str(signature).partition(":")
        kid, _, mac = rest.partition(":")
        if version not in (VERSION, LEGACY_VERSION) or not kid or not mac:
            return "malformed message signature"
        if version == LEGACY_VERSION and required:
            return (
                "message signed by an older release (v1 signature, which leaves its age and"
                " tier headers out): refused while LEDGER_SIGNATURES_REQUIRED is on"
            )
        key = self._keys.get(kid)
        if key is None:
            return f"message signed with key {kid[:12]!r}, not listed in LEDGER_SIGNING_KEYS"
        try:
            text = signed_text(message_headers, body, version=version)
        except (TypeError, ValueError) as exc:
            return f"message signature cannot be checked: {type(exc).__name__}"
        expected = hmac.new(key, text, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, mac):
            return "bad message signature (the message was changed, or forged)"
        return None
