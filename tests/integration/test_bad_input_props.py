"""Bad input, generated with hypothesis, against the real servers and a real worker.

Every case must end in a clear celery_ledger error at the caller, in success, or in a dead-letter
record with a reason; the worker stays up, and good messages interleaved run exactly once.

- Queue items published straight to the broker: arbitrary bytes, and kombu envelopes with
  arbitrary bodies, content types, headers (every header a worker reads, eta and expires
  included) and properties.
- Arbitrary task arguments, keys and tiers through the public API.
- Broken settings: ``create_app`` with arbitrary ``LEDGER_*`` variables.

Each library bug found here has a regression test of its own below, run on a stack of its own
(each once killed the worker); the generators leave those inputs out.

A worker that dies fails the test at once (tests/integration/watchdog.py). ``-m props
--hypothesis-profile=wide`` runs ten times as many examples (see tests/conftest.py).
"""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from celery.app.task import Context
from celery.utils.time import maybe_iso8601, maybe_make_aware
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu.transport.virtual.base import Base64
from kombu.utils.json import loads
from pymongo import MongoClient
from pymongo.collection import Collection

from celery_ledger import ConfigurationError, LedgerError, PayloadError, Settings, create_app
from celery_ledger import headers as ledger_headers
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess
from celery_ledger.envelope import (
    CELERY_HEADER_CHECKS,
    LEDGER_HEADER_CHECKS,
    PROPERTY_CHECKS,
    WORKER_SET_HEADERS,
    envelope_problem,
)
from celery_ledger.identity import derive_task_id
from celery_ledger.routing import TIERS
from tests.conftest import examples

from .conftest import ALL_TIERS, DEAD_WORKER_KEYS, NAMESPACE, TEST_ENV, make_isolated_stack
from .helpers import effect_count, wait_for
from .test_bad_messages import raw_message

DEFAULT_QUEUE = f"{NAMESPACE}.default"  # the test app's default tier queue
POISON_KEY = f"{NAMESPACE}:ledger:poison"
DELAYED_KEY = f"{NAMESPACE}:ledger:delayed"

BOUNDED = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    max_examples=examples(25),
)
APP = "tests.integration.ledger_app"
ADD, ECHO, RECORD, FLAKY = f"{APP}.add", f"{APP}.echo", f"{APP}.record", f"{APP}.flaky"

# -- generators ---------------------------------------------------------------------------------

# Keys with NUL and integers past 64 bits (BSON cannot store either as is), lone surrogates.
text = st.text(max_size=12) | st.sampled_from(["\ud800", "a\udfffb"])
keys = st.text(max_size=12) | st.sampled_from(["x\x00y", "$where", "a.b"])
integers = st.integers(-(2**63), 2**63 - 1) | st.sampled_from(
    [2**64, -(2**70), 10**30, 2**31, -1, 256]
)
floats = st.floats() | st.sampled_from([1e308, 1e12, -0.0])  # NaN and infinities too
# Dates as text (for eta and expires): any datetime in any timezone, ISO-like text, and odd ones.
dates = st.one_of(
    st.datetimes(timezones=st.none() | st.timezones()).map(datetime.isoformat),
    st.from_regex(
        r"\d{4}-\d{2}-\d{2}(T\d{2}(:\d{2}(:\d{2}(\.\d{1,9})?)?)?)?(Z|[+-]\d{2}:?\d{2})?",
        fullmatch=True,
    ),
    st.sampled_from(
        [
            "9999-12-31T24:00:00",
            "9999-12-31T23:59:59-23:59",
            "0001-01-01T00:00:00+00:01",
            "2026-11-23T10:00:00+24:00",
            "2026-W48-1",
            "now",
            "",
        ]
    ),
    st.integers(-5, 5).map(lambda s: (datetime.now(UTC) + timedelta(seconds=s)).isoformat()),
)
# kombu's JSON decodes {"__type__": ..., "__value__": ...} into dates, UUIDs and bytes.
# Left out: decimals, and values of the wrong type for bytes, base64 and a UUID's hex; and these
# objects in headers (transport bugs, see DECODER_KILLERS below).
kombu_objects = st.one_of(
    st.builds(
        lambda kind, value: {"__type__": kind, "__value__": value},
        st.sampled_from(["datetime", "date", "time", "bytes", "base64", "nope"]),
        dates | text,
    ),
    st.builds(
        lambda value: {"__type__": "uuid", "__value__": value},
        st.builds(lambda h: {"hex": h}, st.uuids().map(lambda u: u.hex) | text) | text,
    ),
)
header_values = st.recursive(
    st.none() | st.booleans() | integers | floats | text | dates,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=3),
    max_leaves=8,
)
json_values = st.recursive(
    st.none() | st.booleans() | integers | floats | text | dates | kombu_objects,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=3),
    max_leaves=8,
)
# Every header a worker reads: Celery's (eta and expires too), the names the worker sets
# itself, the fields of Celery's task context, the ledger's; and custom ones. Any value: a
# valid eta far ahead is a legitimate delay, which the test does not wait for (see
# scheduled_later).
HEADER_NAMES = sorted(
    set(CELERY_HEADER_CHECKS)
    | set(LEDGER_HEADER_CHECKS)
    | WORKER_SET_HEADERS
    | {name for name in dir(Context) if not name.startswith("__")}
    | {"countdown", "ledger_settled", "redelivered"}
)
headers = st.dictionaries(
    st.sampled_from(HEADER_NAMES) | keys.map(lambda name: f"x-{name}"), header_values, max_size=3
)
# Every property kombu and Celery read, with any value (or left out: MISSING).
MISSING = "<missing>"
PROPERTY_NAMES = sorted({*PROPERTY_CHECKS, "delivery_mode"})
properties = st.dictionaries(
    st.sampled_from(PROPERTY_NAMES), json_values | st.just(MISSING), max_size=2
) | st.builds(
    lambda name, value: {
        "delivery_info": {"exchange": "", "routing_key": DEFAULT_QUEUE, name: value}
    },
    st.sampled_from(["exchange", "routing_key", "redelivered"]),
    json_values,
)


def _not_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return True
    return False


# Bodies: [args, kwargs, embed] triples (embed empty: its signatures are Celery's canvas, out of
# scope here), any other JSON value, empty, or not JSON.
bodies = (
    st.tuples(
        st.lists(json_values, max_size=3), st.dictionaries(keys, json_values, max_size=2)
    ).map(lambda t: json.dumps([t[0], t[1], {}]).encode())
    | json_values.map(lambda value: json.dumps(value).encode())
    | st.binary(max_size=32).filter(_not_json)
)


def _message(
    body: bytes, task: str, content_type: str, extra: dict[str, Any], props: dict[str, Any]
) -> bytes:
    item = json.loads(raw_message(body, task=task, content_type=content_type, headers=extra))
    for name, value in props.items():
        if value == MISSING:
            item["properties"].pop(name, None)
        else:
            item["properties"][name] = value
    return json.dumps(item).encode()


envelopes = st.builds(
    _message,
    bodies,
    st.sampled_from([ADD, ECHO, "no.such.task", ""]),
    st.sampled_from(["application/json"] * 4 + ["application/x-python-serialize", "text/plain"]),
    headers,
    properties,
)
garbage = st.binary(max_size=48).filter(lambda b: not b.startswith(b"{"))
queue_items = st.one_of(envelopes, garbage)

# -- helpers ------------------------------------------------------------------------------------


def message_id(item: bytes) -> str | None:
    try:
        value = json.loads(item)["headers"]["id"]
    except (ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None


def verdict(
    ledger: Collection[dict[str, Any]], item: bytes, broker: redis.Redis | None = None
) -> str | None:
    """How the ledger settled a queue item: ``done``, ``dead: <reason>``, ``held`` (put off
    for a worker that can run it: an unknown task, arguments that do not bind), or None (not
    yet).

    A message with an id is found through it (the id is its job's record id, or an alias of
    it); one without is kept as received (its raw bytes)."""
    found: list[dict[str, Any]] = []
    ident = message_id(item)
    if ident and broker is not None:
        delayed = broker.zrange(DELAYED_KEY, 0, -1)
        unrunnable = ledger_headers.UNRUNNABLE_SINCE.encode()
        if any(ident.encode() in member and unrunnable in member for member in delayed):
            return "held"
    if ident is not None:
        for doc in ledger.find({"_id": ident}):
            target = doc.get("alias_of")
            found += list(ledger.find({"_id": target})) if target and "state" not in doc else [doc]
        found += ledger.find({"state": "dead", "message.headers.id": ident})
    found += ledger.find({"message.raw_base64": base64.b64encode(item).decode()})
    for doc in found:
        if doc.get("state") == "dead" and doc.get("dead_reason"):
            return f"dead: {doc['dead_reason']}"
    if any(doc.get("state") == "succeeded" for doc in found):
        return "done"
    return None


# A message whose valid eta is further ahead than this waits in the worker (Celery's timer):
# a legitimate delay, not an outcome the test waits for.
WAIT_FOR_ETA_SECONDS = 5.0


def scheduled_later(item: bytes) -> bool:
    """True if the transport accepts ``item`` and its eta (read as Celery reads it) is more than
    WAIT_FOR_ETA_SECONDS ahead: the worker holds it until then."""
    try:
        envelope = loads(item)
        if envelope_problem(envelope, {"base64": Base64()}) is not None:
            return False
        eta = maybe_make_aware(maybe_iso8601(envelope["headers"]["eta"]), "UTC")
    except Exception:
        return False
    return bool(eta > datetime.now(UTC) + timedelta(seconds=WAIT_FOR_ETA_SECONDS))


def _utf8(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def broker_of(stack: EmbeddedStack) -> redis.Redis:
    assert stack.broker is not None
    return redis.Redis.from_url(stack.broker.url)


# -- properties ---------------------------------------------------------------------------------


@BOUNDED
@given(items=st.lists(queue_items, min_size=1, max_size=4), split=st.integers(0, 4))
def test_arbitrary_queue_items_are_dead_lettered_or_run_and_the_worker_stays_up(
    stack: EmbeddedStack, app: Any, items: list[bytes], split: int
) -> None:
    from tests.integration.ledger_app import record

    # Given arbitrary items on a queue, with a good message published among them
    token = f"t-{uuid.uuid4().hex[:12]}"
    with broker_of(stack) as broker:
        for item in items[:split]:
            broker.lpush(DEFAULT_QUEUE, item)
        good = record.delay(token)
        for item in items[split:]:
            broker.lpush(DEFAULT_QUEUE, item)

    # Then the good message runs exactly once
    assert good.get(timeout=30)["token"] == token
    assert effect_count("record", token) == 1
    # and every item ends dead-lettered with a reason, or run, or waits (for its eta, or for a
    # worker that can run it: the test does not wait out LEDGER_UNRUNNABLE_WINDOW_SECONDS)
    broker = broker_of(stack)
    for item in items:
        if scheduled_later(item):
            continue
        wait_for(
            lambda item=item: verdict(app.ledger.collection, item, broker),
            timeout=20,
            what=f"an outcome for {item[:300]!r}",
        )
    # and the worker is still up
    assert stack.workers[0].alive()


FRESH = "<fresh>"  # replaced by a new uuid in the test: a key must never repeat across runs
keys_strategy = st.one_of(
    st.none(),
    st.text(max_size=12).map(lambda suffix: FRESH + suffix),
    st.sampled_from(["", "x" * 513, "\ud800", "a\udfffb"]),  # invalid strings
    st.integers(),
    st.lists(st.integers(), max_size=2),
)
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text()
    | st.sampled_from(["\ud800", "a\udfffb"])
    | st.binary(max_size=4)
    | st.datetimes(),
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.sets(st.integers(), max_size=2)
        | st.dictionaries(st.text(max_size=4) | st.integers(), children, max_size=3)
    ),
    max_leaves=8,
)


@settings(BOUNDED, max_examples=examples(40))
@given(
    args=st.lists(values, max_size=3),
    kwargs=st.dictionaries(st.text(max_size=6), values, max_size=2),
    key=keys_strategy,
    tier=st.none() | st.sampled_from(TIERS) | text,
)
def test_arbitrary_arguments_fail_at_the_caller_or_round_trip(
    app: Any, args: list[Any], kwargs: dict[str, Any], key: Any, tier: str | None
) -> None:
    from tests.integration.ledger_app import echo

    if isinstance(key, str) and key.startswith(FRESH):
        key = f"{uuid.uuid4()}-{key.removeprefix(FRESH)}"
    try:
        expected = json.loads(json.dumps([args, kwargs], allow_nan=False, sort_keys=True))
    except (TypeError, ValueError):
        expected = None  # not JSON: PayloadError
    key_ok = key is None or (isinstance(key, str) and 0 < len(key) <= 512 and _utf8(key))
    tier_ok = not tier or tier in TIERS
    options: dict[str, Any] = {}
    if key is not None:
        options["idempotency_key"] = key
    if tier is not None:
        options["tier"] = tier

    # When the arguments are published through the public API
    try:
        result = echo.apply_async(args, kwargs, **options)
    except LedgerError as exc:
        # Then a refusal is a celery_ledger error, and only for a reason
        if expected is None or not key_ok:
            assert isinstance(exc, PayloadError | ConfigurationError), exc
        else:
            assert not tier_ok and isinstance(exc, ConfigurationError), exc
        return
    # or the call was valid and its arguments come back as JSON
    assert expected is not None and key_ok and tier_ok, (expected, key, tier)
    assert result.get(timeout=30) == expected


# Settings whose bad values create_app accepts (test_create_app_refuses_an_invalid_setting)
# are left to that test: the broker URL (the breakers read it) and the Sentry DSN.
SETTING_NAMES = [
    f"LEDGER_{name.upper()}"
    for name in Settings.model_fields
    if name not in ("broker_url", "sentry_dsn")
]
EDGE_VALUES = [
    "",
    "0",
    "-1",
    "nan",
    "inf",
    "1e309",
    "true",
    "null",
    "{}",
    "[]",
    '{"bulk": {"max_retries": -1}}',
    '{"bulk": {"jitter": "sideways"}}',
    '{"payments": {"failure_threshold": 0}}',
    '{"payments": {"cooldown_seconds": "soon"}}',
    '{"reports.*": "nowhere"}',
    '["not-a-fernet-key"]',
]
env_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=16)
setting_values = st.one_of(
    st.sampled_from(EDGE_VALUES),
    env_text,
    json_values.map(json.dumps).filter(lambda s: "\x00" not in s),
)
environments = st.dictionaries(
    st.sampled_from(SETTING_NAMES)
    | env_text.map(lambda s: f"LEDGER_{s.upper()}").filter(lambda s: "=" not in s),
    setting_values,
    max_size=4,
)


@contextmanager
def ledger_environment(values: dict[str, str]) -> Iterator[None]:
    """Exactly ``values`` as this process's ``LEDGER_*`` variables, for the block."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("LEDGER_")}
    for name in saved:
        del os.environ[name]
    try:
        os.environ.update(values)
        yield
    finally:
        for name in [k for k in os.environ if k.startswith("LEDGER_")]:
            del os.environ[name]
        os.environ.update(saved)


@settings(BOUNDED, max_examples=examples(50))
@given(environment=environments)
def test_broken_settings_give_a_configuration_error_or_a_working_app(
    environment: dict[str, str],
) -> None:
    with ledger_environment(environment):
        try:
            app = create_app("settings_probe", set_as_current=False)
        except ConfigurationError:
            return
        # A built app must build its parts, or refuse them with a ConfigurationError
        try:
            app.breakers  # noqa: B018
            for tier in app.tiers.names:
                app.runtime.retry_policy_for(tier)
        except ConfigurationError:
            pass
        finally:
            app.close()


# -- library bugs the suite found (each was a strict xfail until fixed) ------------------------


@dataclass
class Isolated:
    """A stack of our own for inputs that break workers or the poison drain."""

    stack: EmbeddedStack
    ledger: Collection[dict[str, Any]]
    broker: redis.Redis

    @property
    def worker(self) -> WorkerProcess:
        return self.stack.workers[-1]

    def ensure_worker(self) -> None:
        """A live worker; after a crash the queues are purged, or the killer comes back."""
        if self.stack.workers and self.worker.alive():
            return
        self.broker.delete(*DEAD_WORKER_KEYS, POISON_KEY)
        name = f"isolated{len(self.stack.workers)}@127.0.0.1"
        self.stack.start_worker(ALL_TIERS, concurrency=2, name=name, env=TEST_ENV)

    def push_and_wait_taken(self, item: bytes, grace_seconds: float = 1.5) -> None:
        """Queue ``item``; return once a worker took it (and ``grace_seconds`` more)."""
        self.broker.lpush(DEFAULT_QUEUE, item)
        deadline = time.monotonic() + 10
        while self.broker.llen(DEFAULT_QUEUE) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(grace_seconds)

    def good_message_runs(self, timeout: float = 15.0) -> bool:
        """Publish a good message; True once it succeeded, False if the worker died first."""
        token = f"good-{uuid.uuid4().hex[:10]}"
        item = raw_message(
            json.dumps([[token], {}, {}]).encode(), task=RECORD, headers={"ledger_key": token}
        )
        self.broker.lpush(DEFAULT_QUEUE, item)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.worker.alive():
            if verdict(self.ledger, item, self.broker) == "done":
                return True
            time.sleep(0.1)
        return False

    def settle(self, item: bytes, timeout: float = 4.0) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.worker.alive():
            if (found := verdict(self.ledger, item, self.broker)) is not None:
                return found
            time.sleep(0.1)
        return verdict(self.ledger, item, self.broker)


@pytest.fixture(scope="module")
def isolated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Isolated]:
    running = make_isolated_stack(tmp_path_factory.mktemp("bad-input"))
    assert running.broker is not None and running.ledger is not None
    client: MongoClient[dict[str, Any]] = MongoClient(running.ledger.url)
    broker = redis.Redis.from_url(running.broker.url)
    try:
        yield Isolated(running, client[TEST_ENV["LEDGER_MONGO_DB"]]["ledger"], broker)
    finally:
        broker.close()
        client.close()
        running.stop()


def envelope_with(**changes: Callable[[dict[str, Any]], None]) -> Callable[[bytes], bytes]:
    def mutate(item: bytes) -> bytes:
        value = json.loads(item)
        for change in changes.values():
            change(value)
        return json.dumps(value).encode()

    return mutate


def _record_body() -> bytes:
    return json.dumps([[f"bad-{uuid.uuid4().hex[:8]}"], {}, {}]).encode()


WORKER_KILLERS = {
    # celery/worker/request.py unpacks the body as (args, kwargs, embed) outside any guard.
    "body not a triple": raw_message(b"[1]", task=RECORD),
    # celery/worker/strategy.py: an empty body fails before the consumer's error handlers.
    "empty body": raw_message(b"", task=RECORD),
    # billiard/asynpool turn timelimit into floats when the pool acks the job.
    "timelimit not numbers": raw_message(
        _record_body(), task=RECORD, headers={"timelimit": ["a", "b"]}
    ),
    "unhashable id": raw_message(_record_body(), task=RECORD, headers={"id": {"a": 1}}),
    "unhashable task name": raw_message(_record_body(), task=RECORD, headers={"task": ["a"]}),
    "stamps not a list": raw_message(
        _record_body(), task=RECORD, headers={"stamps": "x", "stamped_headers": 5}
    ),
    "headers not an object": envelope_with(h=lambda e: e.__setitem__("headers", "x"))(
        raw_message(_record_body(), task=RECORD)
    ),
    "unknown body encoding": envelope_with(
        p=lambda e: e["properties"].__setitem__("body_encoding", "rot13")
    )(raw_message(_record_body(), task=RECORD)),
}


@pytest.mark.parametrize("item", WORKER_KILLERS.values(), ids=WORKER_KILLERS.keys())
def test_worker_survives_a_malformed_envelope(isolated: Isolated, item: bytes) -> None:
    isolated.ensure_worker()
    isolated.push_and_wait_taken(item)
    assert isolated.good_message_runs(), "the worker died"
    assert isolated.worker.alive()
    assert (isolated.settle(item) or "").startswith("dead: ")


SILENTLY_DROPPED = {
    "kwargs not an object": raw_message(b'[["bad-kw"], [1], {}]', task=RECORD),
    "embed not an object": raw_message(b'[["bad-embed"], {}, "x"]', task=RECORD),
    "envelope without properties": envelope_with(p=lambda e: e.pop("properties"))(
        raw_message(_record_body(), task=RECORD)
    ),
}


@pytest.mark.parametrize("item", SILENTLY_DROPPED.values(), ids=SILENTLY_DROPPED.keys())
def test_malformed_task_message_is_dead_lettered(isolated: Isolated, item: bytes) -> None:
    isolated.ensure_worker()
    isolated.broker.lpush(DEFAULT_QUEUE, item)
    assert isolated.good_message_runs()
    assert (isolated.settle(item) or "").startswith("dead: ")


UNSTORABLE_HEADERS = {
    "NUL in a key": {"x\x00y": 1},
    "huge integer": {"x-big": 2**70},
}


@pytest.mark.parametrize("extra", UNSTORABLE_HEADERS.values(), ids=UNSTORABLE_HEADERS.keys())
def test_unstorable_poison_does_not_block_the_drain(
    isolated: Isolated, extra: dict[str, Any]
) -> None:
    isolated.ensure_worker()
    blocker = raw_message(b"[[1], {}, {}]", task="no.such.task", headers=extra)
    later = raw_message(b"[[1], {}, {}]", task="no.such.task.either")
    try:
        isolated.broker.lpush(DEFAULT_QUEUE, blocker)
        isolated.broker.lpush(DEFAULT_QUEUE, later)
        assert isolated.settle(later, timeout=8) is not None
    finally:
        isolated.broker.delete("celery_ledger:poison")


# Found widening the generators, outside the envelope checks (celery_ledger/transport.py):
# - the transport decodes a queue item with kombu's JSON decoder before any check runs, and
#   catches only ValueError, TypeError, UnicodeDecodeError and RecursionError. kombu's decoder
#   builds objects from {"__type__": ..., "__value__": ...}, and raises others: for a decimal,
#   InvalidOperation (text that is no number) or OverflowError (an exponent past C's ssize_t);
#   AttributeError for bytes or base64 from a number, or a UUID from a hex that is no string.
#   Out of Channel._brpop_read they end the worker ("Unrecoverable error"), and the popped item
#   is lost;
# - an item the checks refuse is kept with its headers, written with json.dumps: a header that
#   kombu's decoder turned into a datetime (or date, time, Decimal, UUID, bytes) raises
#   TypeError there, out of the same loop.
DECODER_KILLERS = {
    "decimal exponent past ssize_t": json.dumps(
        {"__type__": "decimal", "__value__": [0, [1], 10**30]}
    ).encode(),
    "decimal from text that is no number": json.dumps(
        {"__type__": "decimal", "__value__": "x"}
    ).encode(),
    "bytes from a number": json.dumps({"__type__": "bytes", "__value__": 5}).encode(),
    "uuid from a number": json.dumps({"__type__": "uuid", "__value__": {"hex": 5}}).encode(),
    "the same in a header": raw_message(
        _record_body(),
        task=RECORD,
        headers={"x-d": {"__type__": "decimal", "__value__": [0, [1], 10**30]}},
    ),
    "a refused message with a datetime header": raw_message(
        _record_body(),
        task=RECORD,
        headers={"id": "", "x-at": {"__type__": "datetime", "__value__": "2026-11-23T10:00"}},
    ),
}


@pytest.mark.parametrize("item", DECODER_KILLERS.values(), ids=DECODER_KILLERS.keys())
def test_an_item_the_json_decoder_cannot_build_is_dead_lettered(
    isolated: Isolated, item: bytes
) -> None:
    isolated.ensure_worker()
    isolated.push_and_wait_taken(item)
    assert isolated.good_message_runs(), "the worker died"
    assert (isolated.settle(item) or "").startswith("dead: ")


def _ledger_message(task: str, args: list[Any], **extra: Any) -> bytes:
    return raw_message(json.dumps([args, {}, {}]).encode(), task=task, headers=extra)


# Headers that once left a job stuck (never dead-lettered, never run), and how each settles now
# (None: run, or dead-lettered with a reason).
STUCK_JOBS = {
    # Celery revoked it unrecorded; LedgerRequest leaves expiry to the guard, which retires it.
    "expired message": (
        _ledger_message(RECORD, ["expired"], expires="2000-01-01T00:00:00+00:00"),
        "dead: expired",
    ),
    # The retry republished to the message's own tier; it now goes to the one the guard checked.
    "unknown ledger_tier on a retry": (
        _ledger_message(FLAKY, ["bad-tier", 1], ledger_tier="nowhere"),
        "done",
    ),
    # The failure record copied headers BSON cannot store (OverflowError, InvalidDocument).
    "huge integer header on a failure": (_ledger_message(ADD, ["a", 1], **{"x-big": 2**70}), None),
    "NUL in a header key on a failure": (_ledger_message(ADD, ["a", 1], **{"x-\x00": 1}), None),
    # error_entry(attempt=request.retries + 1) raised TypeError in the failure handler.
    "non-integer retries header on a failure": (
        _ledger_message(ADD, ["a", 1], retries="abc"),
        None,
    ),
}


@pytest.mark.parametrize(("item", "expected"), STUCK_JOBS.values(), ids=STUCK_JOBS.keys())
def test_a_bad_header_ends_dead_lettered_with_a_reason(
    isolated: Isolated, item: bytes, expected: str | None
) -> None:
    isolated.ensure_worker()
    isolated.broker.lpush(DEFAULT_QUEUE, item)
    assert isolated.good_message_runs()
    outcome = isolated.settle(item, timeout=5)
    assert outcome is not None and (outcome == "done" or outcome.startswith("dead: ")), outcome
    assert outcome.startswith(expected or ""), outcome


# Values create_app once accepted and that broke later (now refused by settings.py):
ACCEPTED_THEN_BROKEN = {
    "LEDGER_MONGO_URI": "http://ledger.example",  # pymongo InvalidURI at the first call
    "LEDGER_BROKER_URL": "not a url",  # ValueError from redis when app.breakers is built
    "LEDGER_MONGO_DB": "$ledger",  # pymongo InvalidName
    "LEDGER_LEDGER_COLLECTION": "",  # pymongo InvalidName
    "LEDGER_LEASE_SECONDS": "inf",  # OverflowError: timedelta(seconds=inf) at the first claim
    "LEDGER_BREAKERS": '{"payments": {"failure_threshold": 0}}',  # only when first used
    "LEDGER_RETRY_POLICIES": '{"bulk": {"max_retries": "many"}}',  # only when first used
    "LEDGER_SENTRY_DSN": "{}",  # create_app raises sentry_sdk's BadDsn
}


@pytest.mark.parametrize(
    ("name", "value"), ACCEPTED_THEN_BROKEN.items(), ids=ACCEPTED_THEN_BROKEN.keys()
)
def test_create_app_refuses_an_invalid_setting(name: str, value: str) -> None:
    with ledger_environment({name: value}), pytest.raises(ConfigurationError) as refused:
        create_app("settings_probe", set_as_current=False)
    # (the message names the variable the user set, as they wrote it)
    assert f"invalid setting {name}:" in str(refused.value)


def dedupe_probe(stack: EmbeddedStack, name: str, database: int) -> tuple[Any, Any, str]:
    """An app publishing ``probe.job`` with dedupe on, on a broker database no worker reads."""
    assert stack.broker is not None and stack.ledger is not None
    broker_url = stack.broker.url.rsplit("/", 1)[0] + f"/{database}"
    probe = create_app(
        name,
        settings=Settings(
            broker_url=broker_url,
            mongo_uri=stack.ledger.url,
            mongo_db=name,
            dedupe_on_publish=True,
        ),
        set_as_current=False,
    )

    @probe.task(shared=False, name="probe.job", idempotency_key="{token}")
    def job(token: str) -> str:
        return token

    return probe, job, broker_url


def test_reconciler_republishes_a_queued_job_whose_message_was_lost(stack: EmbeddedStack) -> None:

    probe, job, broker_url = dedupe_probe(stack, "reconcile_probe", 7)
    token = f"lost-{uuid.uuid4().hex[:8]}"
    with redis.Redis.from_url(broker_url) as broker:
        broker.flushdb()
        # Given a job published with dedupe_on_publish (a queued record), whose message is lost
        job.delay(token)
        broker.delete(probe.tiers.queue("default"))
        assert probe.ledger.get("probe.job", token).state == "queued"
        time.sleep(0.05)
        # When the reconciler runs past the stale delay
        report = probe.reconciler.sweep(stale_after_seconds=0.01, lease_grace_seconds=3600)
        # Then the job is published again, with its id
        assert report.republished == 1, report.as_dict()
        assert broker.llen(probe.tiers.queue("default")) == 1
        assert json.loads(broker.lindex(probe.tiers.queue("default"), 0))["headers"][
            "id"
        ] == derive_task_id("probe.job", token)
    probe.close()


def test_reconciler_leaves_a_stale_queued_job_whose_message_still_waits(
    stack: EmbeddedStack,
) -> None:

    probe, slow, broker_url = dedupe_probe(stack, "reconcile_backlog_probe", 8)
    token = f"waiting-{uuid.uuid4().hex[:8]}"
    with redis.Redis.from_url(broker_url) as broker:
        broker.flushdb()
        # Given a queued job whose message waits behind a backlog
        slow.delay(token)
        time.sleep(0.05)
        # When the reconciler finds it stale
        report = probe.reconciler.sweep(stale_after_seconds=0.01, lease_grace_seconds=3600)
        # Then it is left alone: no second copy to claim
        assert report.still_waiting == 1, report.as_dict()
        assert report.republished == 0
        assert broker.llen(probe.tiers.queue("default")) == 1
    probe.close()


def test_a_job_for_later_whose_delayed_message_was_lost_is_published_once_due(
    stack: EmbeddedStack,
) -> None:
    probe, job, broker_url = dedupe_probe(stack, "reconcile_later_probe", 9)
    token = f"later-{uuid.uuid4().hex[:8]}"
    queue = probe.tiers.queue("default")
    with redis.Redis.from_url(broker_url) as broker:
        broker.flushdb()
        # Given a job published with dedupe for 2 s later, and published again meanwhile
        job.apply_async((token,), countdown=2)
        job.apply_async((token,), countdown=2)
        record = probe.ledger.get("probe.job", token)
        assert record.state == "queued"
        delayed = probe.runtime.delayed.key
        assert broker.zcard(delayed) == 1  # the second publish found the record: skipped
        # When the broker loses the delayed set (its data gone, no AOF)
        broker.delete(delayed)
        # Then nothing is published before the job is due
        early = probe.reconciler.sweep(stale_after_seconds=0.01, lease_grace_seconds=3600)
        assert early.republished == 0 and broker.llen(queue) == 0, early.as_dict()
        # ...and once it is due, the reconciler publishes it, with its id
        time.sleep(2.1)
        due = probe.reconciler.sweep(stale_after_seconds=0.01, lease_grace_seconds=3600)
        assert due.republished == 1, due.as_dict()
        message = json.loads(broker.lindex(queue, 0))
        assert message["headers"]["id"] == derive_task_id("probe.job", token)
    probe.close()
