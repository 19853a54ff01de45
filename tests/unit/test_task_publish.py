"""LedgerTask.apply_async: keys, task ids, headers, queues and limits, with no broker.

Celery's own ``Task.apply_async`` (the parent) is replaced by a recorder, so what LedgerTask
hands to Celery is observed without publishing anything. Eager mode is not used: it bypasses
the ledger.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import celery.app.task
import pytest
from kombu.exceptions import OperationalError

from celery_ledger import (
    Backpressure,
    ConfigurationError,
    IdentityError,
    LedgerCelery,
    LedgerTask,
    LedgerUnavailable,
    NotReplicated,
    PayloadError,
    PublishError,
    Settings,
    create_app,
)
from celery_ledger.admission import ADMITTED
from celery_ledger.identity import default_key, derive_task_id
from celery_ledger.ledger.store import EnqueueOutcome

SENTINEL = object()


@dataclass
class Published:
    args: Any
    kwargs: Any
    task_id: str
    options: dict[str, Any]

    @property
    def headers(self) -> dict[str, Any]:
        """The message headers, less the publish-time stamp (checked on its own)."""
        headers = dict(self.options["headers"])
        headers.pop("ledger_enqueued_at", None)
        return headers


@dataclass
class FakeDelayed:
    scheduled: list[tuple[str, Any, Any, dict[str, Any], float]] = field(default_factory=list)

    sealed: list[bool] = field(default_factory=list)  # whether each was held sealed

    def schedule(
        self,
        task_name: str,
        args: Any,
        kwargs: Any,
        options: dict[str, Any],
        due_at: float,
        *,
        sealer: Any = None,
    ) -> None:
        self.scheduled.append((task_name, args, kwargs, options, due_at))
        self.sealed.append(sealer is not None)


@dataclass
class FakeUnrecorded:
    """The runtime's store of jobs published without their record (unrecorded.py)."""

    kept: list[Any] = field(default_factory=list)

    def keep(self, jobs: Any) -> bool:
        self.kept.extend(jobs)
        return True


@dataclass
class FakeLedger:
    outcome: EnqueueOutcome = EnqueueOutcome.NEW
    down: bool = False
    enqueued: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    unpublished: list[str] = field(default_factory=list)
    tries: int = 0

    def now(self) -> datetime:
        return datetime.now(UTC)

    def enqueue(self, record_id: str, **fields: Any) -> EnqueueOutcome:
        self.tries += 1
        if self.down:
            raise LedgerUnavailable("ledger unreachable during enqueue: timed out")
        self.enqueued.append((record_id, fields))
        return self.outcome

    def mark_unpublished(self, record_id: str, *, later: bool = False) -> None:
        self.unpublished.append(f"{record_id} (later)" if later else record_id)


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[Published]:
    calls: list[Published] = []

    def record(
        self: Any,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> object:
        assert task_id is not None
        calls.append(Published(args, kwargs, task_id, options))
        return SENTINEL

    monkeypatch.setattr(celery.app.task.Task, "apply_async", record)
    return calls


@pytest.fixture
def app() -> LedgerCelery:
    settings = Settings(
        broker_url="redis://127.0.0.1:1/0",
        mongo_uri="mongodb://127.0.0.1:1/",
        max_payload_bytes=2048,
        routing_rules={"reports.*": "bulk"},
        dedupe_on_publish=False,  # (the publish's own mechanics; dedupe's tests turn it on)
    )
    return create_app("unit", settings=settings, set_as_current=False)


@pytest.fixture
def delayed(app: LedgerCelery) -> FakeDelayed:
    fake = FakeDelayed()
    # ``delayed`` is a cached_property of the runtime: shadow it per instance
    app.runtime.__dict__["delayed"] = fake
    return fake


@pytest.fixture
def add(app: LedgerCelery) -> LedgerTask:
    @app.task(name="math.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    return add


@pytest.fixture
def charge(app: LedgerCelery) -> LedgerTask:
    @app.task(name="shop.charge", shared=False, idempotency_key="order-{order_id}-{region}")
    def charge(order_id: int, region: str = "eu") -> None:
        pass

    return charge


def only(calls: list[Published]) -> Published:
    assert len(calls) == 1, calls
    return calls[0]


# -- keys and task ids ------------------------------------------------------------------------


def test_default_key_and_derived_task_id(add: LedgerTask, published: list[Published]) -> None:
    result = add.apply_async((1, 2))

    call = only(published)
    key = default_key("math.add", (1, 2), {})
    assert result is SENTINEL
    assert call.task_id == derive_task_id("math.add", key)
    enqueued_at = call.options["headers"]["ledger_enqueued_at"]
    assert abs(enqueued_at - time.time()) < 5  # the job's first publish, for max age
    assert call.headers == {"ledger_key": key, "ledger_tier": "default"}
    assert (tuple(call.args), call.kwargs) == ((1, 2), {})


def test_same_call_gives_the_same_task_id(add: LedgerTask, published: list[Published]) -> None:
    add.apply_async((1, 2))
    add.delay(1, 2)
    add.apply_async((1, 3))

    assert published[0].task_id == published[1].task_id
    assert published[2].task_id != published[0].task_id


def test_kwargs_order_does_not_change_the_task_id(
    add: LedgerTask, published: list[Published]
) -> None:
    add.apply_async(kwargs={"x": 1, "y": 2})
    add.apply_async(kwargs={"y": 2, "x": 1})

    assert published[0].task_id == published[1].task_id


def test_template_key(charge: LedgerTask, published: list[Published]) -> None:
    charge.delay(7)
    charge.apply_async((8,), {"region": "us"})

    assert [c.headers["ledger_key"] for c in published] == ["order-7-eu", "order-8-us"]
    assert published[0].task_id == derive_task_id("shop.charge", "order-7-eu")


def test_callable_key(app: LedgerCelery, published: list[Published]) -> None:
    @app.task(name="mail.send", shared=False, idempotency_key=lambda to, body: f"mail:{to}")
    def send(to: str, body: str) -> None:
        pass

    send.delay("a@example.org", "hello")
    send.delay("a@example.org", "hello again")

    assert {c.headers["ledger_key"] for c in published} == {"mail:a@example.org"}
    assert {c.task_id for c in published} == {derive_task_id("mail.send", "mail:a@example.org")}


def test_explicit_key_call_option_wins(charge: LedgerTask, published: list[Published]) -> None:
    charge.apply_async((7,), idempotency_key="manual-1")

    call = only(published)
    assert call.headers["ledger_key"] == "manual-1"
    assert call.task_id == derive_task_id("shop.charge", "manual-1")
    assert "idempotency_key" not in call.options


@pytest.mark.parametrize(
    ("option", "meant"),
    [
        ("countdwn", "countdown"),  # Celery sent it as a message property: the job ran at once
        ("expire", "expires"),
        ("priorty", "priority"),
        ("idempotency_kye", "idempotency_key"),
        ("tenat", "tenant"),
        ("link_errors", "link_error"),
    ],
)
def test_a_misspelt_option_is_refused_naming_the_one_meant(
    charge: LedgerTask, published: list[Published], option: str, meant: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        charge.apply_async((7,), **{option: 5})
    assert f"{option!r}; did you mean {meant!r}?" in str(refused.value)
    assert published == []  # nothing was sent


@pytest.mark.parametrize("option", ["x_trace_tag", "my_property", "redelivered"])
def test_an_option_near_no_known_one_is_passed_on_as_before(
    charge: LedgerTask, published: list[Published], option: str
) -> None:
    # (a message property of the app's own: Celery sends it on, as before)
    charge.apply_async((7,), **{option: "v"})
    assert only(published).options[option] == "v"


def test_the_platforms_own_marks_are_never_taken_for_misspellings(
    charge: LedgerTask, published: list[Published]
) -> None:
    # (a guard deferral passes its hand-back count: near the ledger_handed_back property, it
    # was refused, and no deferral could publish)
    import celery_ledger.task as task_module

    marks = {
        task_module._HANDED_BACK: 0,
        task_module._REPUBLISH: True,
    }
    charge.apply_async((7,), **marks)
    assert len(published) == 1


def test_a_stamp_near_a_known_option_is_passed_on(
    charge: LedgerTask, published: list[Published]
) -> None:
    # (the stamping visitor names its stamps: they are options, listed in stamped_headers)
    charge.apply_async((7,), prioritee="high", stamped_headers=["prioritee"])
    assert only(published).options["prioritee"] == "high"


@pytest.mark.parametrize("key", ["", 42, "k" * 513])
def test_invalid_explicit_key_is_refused(
    charge: LedgerTask, published: list[Published], key: Any
) -> None:
    with pytest.raises(PayloadError):
        charge.apply_async((7,), idempotency_key=key)
    assert published == []


def test_key_header_of_a_republished_message_is_kept(
    charge: LedgerTask, published: list[Published]
) -> None:
    charge.apply_async((7,), headers={"ledger_key": "original", "trace": "t1"})

    call = only(published)
    assert call.headers == {"ledger_key": "original", "ledger_tier": "default", "trace": "t1"}
    assert call.task_id == derive_task_id("shop.charge", "original")


def test_a_task_id_that_is_not_the_keys_is_refused(
    add: LedgerTask, published: list[Published]
) -> None:
    # Two jobs with one explicit id would share a record (and dedupe each other)
    with pytest.raises(IdentityError, match="is not the id of job"):
        add.apply_async((1, 2), task_id="my-id")
    assert published == []


def test_the_keys_own_task_id_may_be_given(add: LedgerTask, published: list[Published]) -> None:
    task_id = derive_task_id("math.add", "k-1")
    add.apply_async((1, 2), task_id=task_id, idempotency_key="k-1")
    assert only(published).task_id == task_id


@pytest.mark.parametrize(
    "canvas", [{"root_id": "r"}, {"parent_id": "p"}, {"group_id": "g"}, {"retries": 1}]
)
def test_a_task_id_frozen_by_celery_is_an_alias_of_the_job(
    add: LedgerTask, published: list[Published], canvas: dict[str, Any]
) -> None:
    # A chain, group, callback or retry publishes with the id Celery froze for it; the key
    # header says which job it is (the worker records the id as an alias of the job)
    add.apply_async((1, 2), task_id="frozen-by-celery", **canvas)
    call = only(published)
    assert call.task_id == "frozen-by-celery"
    assert call.headers["ledger_key"] == default_key("math.add", (1, 2), {})


def test_template_with_arguments_not_matching_the_signature(
    charge: LedgerTask, published: list[Published]
) -> None:
    with pytest.raises(PayloadError, match="arguments do not match"):
        charge.apply_async((7, "eu", "extra"))
    assert published == []


# -- tiers and queues -------------------------------------------------------------------------


def test_queue_defaults_to_the_tier(app: LedgerCelery, published: list[Published]) -> None:
    @app.task(name="shop.pay", shared=False, tier="critical")
    def pay() -> None:
        pass

    pay.delay()

    call = only(published)
    assert call.options["queue"] == "unit.critical"
    assert call.headers["ledger_tier"] == "critical"


def test_settings_rule_routes_the_task(app: LedgerCelery, published: list[Published]) -> None:
    @app.task(name="reports.daily", shared=False, tier="critical")
    def daily() -> None:
        pass

    daily.delay()

    assert only(published).options["queue"] == "unit.bulk"


def test_call_tier_overrides_the_task_tier(add: LedgerTask, published: list[Published]) -> None:
    add.apply_async((1, 2), tier="bulk")

    call = only(published)
    assert call.options["queue"] == "unit.bulk"
    assert call.headers["ledger_tier"] == "bulk"
    assert "tier" not in call.options


def test_explicit_queue_wins_over_the_tier(add: LedgerTask, published: list[Published]) -> None:
    add.apply_async((1, 2), queue="special", tier="critical")

    call = only(published)
    assert call.options["queue"] == "special"
    assert call.headers["ledger_tier"] == "critical"


def test_unknown_call_tier_publishes_nothing(add: LedgerTask, published: list[Published]) -> None:
    with pytest.raises(ConfigurationError, match="known tiers: critical, default, bulk"):
        add.apply_async((1, 2), tier="urgent")
    assert published == []


def test_unknown_tier_on_a_base_class_is_refused(
    app: LedgerCelery, published: list[Published]
) -> None:
    class Urgent(LedgerTask):
        tier = "urgent"

    with pytest.raises(ConfigurationError):

        @app.task(name="shop.urgent", shared=False, base=Urgent)
        def urgent() -> None:
            pass

        urgent.delay()
    assert published == []


# -- payload checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((object(), 2), {}),
        ((1, 2), {"when": datetime(2024, 1, 1)}),
        (({1, 2}, 3), {}),
        ((float("nan"), 1), {}),
    ],
    ids=["object", "datetime", "set", "nan"],
)
def test_non_json_arguments_are_refused_before_publishing(
    add: LedgerTask, published: list[Published], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    with pytest.raises(PayloadError, match="not JSON-serialisable"):
        add.apply_async(args, kwargs)
    assert published == []


def test_a_deliverys_decoded_arguments_are_published_again_as_kombu_encodes_them(
    add: LedgerTask, published: list[Published]
) -> None:
    # A message carried kombu's type markers: the worker decoded bytes, a datetime, a Decimal.
    # Its retry or deferral publishes them again (a new publish would refuse them).
    decoded = (b"ab\x00", datetime(2026, 1, 1, tzinfo=UTC), Decimal("1.5"))
    request = SimpleNamespace(
        id="m-1",
        args=decoded,
        kwargs={},
        delivery_info={},
        as_execution_options=lambda: {},
        ignore_result=False,
    )
    add.signature_from_request(
        request, decoded, {}, headers={"ledger_key": "k-1"}, countdown=0
    ).apply_async()
    assert only(published).args == decoded


def test_payload_at_the_limit_is_published(app: LedgerCelery, published: list[Published]) -> None:
    @app.task(name="blob.store", shared=False, idempotency_key="blob")
    def store(blob: str) -> None:
        pass

    overhead = len('[[""],{}]')
    store.delay("x" * (2048 - overhead))

    assert len(published) == 1


def test_payload_over_the_limit_is_refused(app: LedgerCelery, published: list[Published]) -> None:
    @app.task(name="blob.store", shared=False, idempotency_key="blob")
    def store(blob: str) -> None:
        pass

    overhead = len('[[""],{}]')
    with pytest.raises(PayloadError, match="LEDGER_MAX_PAYLOAD_BYTES") as info:
        store.delay("x" * (2048 - overhead + 1))
    assert "2049 bytes" in str(info.value)
    assert published == []


def test_ignore_result_is_stripped(add: LedgerTask, published: list[Published]) -> None:
    add.apply_async((1, 2), ignore_result=True, priority=3)

    call = only(published)
    assert "ignore_result" not in call.options
    assert call.options["priority"] == 3


# -- delayed publishing -----------------------------------------------------------------------


def test_countdown_schedules_a_delayed_delivery(
    add: LedgerTask, published: list[Published], delayed: FakeDelayed
) -> None:
    before = time.time()
    result = add.apply_async((1, 2), countdown=30, priority=5)
    after = time.time()

    assert published == []
    [(name, args, kwargs, options, due_at)] = delayed.scheduled
    task_id = derive_task_id("math.add", default_key("math.add", (1, 2), {}))
    assert (name, args, kwargs) == ("math.add", [1, 2], {})
    assert before + 30 <= due_at <= after + 30
    assert options["task_id"] == task_id
    options["headers"].pop("ledger_enqueued_at")
    assert options["headers"] == {
        "ledger_key": default_key("math.add", (1, 2), {}),
        "ledger_tier": "default",
    }
    assert options["queue"] == "unit.default"
    assert options["priority"] == 5
    assert "countdown" not in options
    assert None not in options.values()
    assert result.id == task_id


def test_a_job_for_later_is_enqueued_when_it_is_due(add: LedgerTask, delayed: FakeDelayed) -> None:
    # its age (max_age_seconds) and latency objective count from its due time: a reminder due
    # in two days is not two days old when it runs
    add.apply_async((1, 2), countdown=2 * 86400)

    [(_name, _args, _kwargs, options, due_at)] = delayed.scheduled
    assert options["headers"]["ledger_enqueued_at"] == due_at


def test_future_eta_schedules_at_the_eta(
    add: LedgerTask, published: list[Published], delayed: FakeDelayed
) -> None:
    eta = datetime.now(UTC) + timedelta(hours=1)

    add.apply_async((1, 2), eta=eta)
    add.apply_async((1, 3), eta=eta.isoformat())

    assert published == []
    assert [entry[4] for entry in delayed.scheduled] == [eta.timestamp()] * 2


def _secure_app(name: str) -> LedgerCelery:
    """An app with encryption keys and a key secret (it publishes sensitive tasks)."""
    from cryptography.fernet import Fernet

    settings = Settings(
        broker_url="redis://127.0.0.1:1/0",
        mongo_uri="mongodb://127.0.0.1:1/",
        encryption_keys=[Fernet.generate_key().decode()],
        key_secret=SECRET,
        dedupe_on_publish=False,
    )
    return create_app(name, settings=settings, set_as_current=False)


def test_a_sensitive_task_publishes_a_sealed_body_and_holds_its_delayed_entry_sealed(
    published: list[Published], delayed: FakeDelayed
) -> None:
    from celery_ledger.crypto import REDACTED, SEALED_SERIALIZER

    secure = _secure_app("unit_sensitive")
    secure.runtime.__dict__["delayed"] = delayed

    @secure.task(name="vault.store", shared=False, sensitive=True)
    def store(card: str) -> None: ...

    @secure.task(name="vault.plain", shared=False)
    def plain(card: str) -> None: ...

    store.delay("4111")
    plain.delay("4111")
    store.apply_async(("4111",), countdown=60)
    sealed, clear = published
    assert sealed.options["serializer"] == SEALED_SERIALIZER
    assert sealed.options["argsrepr"] == sealed.options["kwargsrepr"] == REDACTED
    assert "serializer" not in clear.options and "argsrepr" not in clear.options
    assert delayed.sealed == [True]
    assert delayed.scheduled[0][3]["serializer"] == SEALED_SERIALIZER  # re-sealed when due

    # A body that carries a sensitive task's signature (its arguments) is sealed too
    published.clear()
    plain.apply_async(("a",), link=store.s())
    (plain.s("b") | store.s("4111")).apply_async()
    plain.apply_async(("c",), link=plain.s())
    assert [p.options.get("serializer") for p in published] == [
        SEALED_SERIALIZER,
        SEALED_SERIALIZER,
        None,
    ]
    assert all("argsrepr" not in p.options for p in published)  # the plain task's own reprs


def test_a_sensitive_tasks_result_never_reaches_a_task_that_is_not_in_clear(
    published: list[Published],
) -> None:
    from celery import chord, group

    secure = _secure_app("unit_successors")

    @secure.task(name="vault.store", shared=False, sensitive=True)
    def store(card: str) -> str: ...

    @secure.task(name="vault.mask", shared=False, sensitive=True)
    def mask(token: str) -> str: ...

    @secure.task(name="shop.notify", shared=False)
    def notify(token: str) -> None: ...

    # Every way its result becomes another task's argument is refused, before publishing
    attempts = {
        "link": lambda: store.apply_async(("4111",), link=notify.s()),
        "chain": lambda: (store.s("4111") | notify.s()).apply_async(),
        "later in the chain": lambda: (store.s("4111") | mask.s() | notify.s()).apply_async(),
        "a chain that starts plain": lambda: (notify.s("a") | store.s() | notify.s()).apply_async(),
        "chord body": lambda: chord([store.s("4111"), notify.s("x")], notify.s()).apply_async(),
        "nested chord body": lambda: chord(
            [group(mask.s("a"), store.s("4111"))], notify.s()
        ).apply_async(),
    }
    for how, attempt in attempts.items():
        with pytest.raises(ConfigurationError, match=r"shop\.notify.*sensitive=True"):
            attempt()
        assert published == [], how

    # A sensitive successor, a callback on failure and a plain task's chain go ahead
    (store.s("4111") | mask.s()).apply_async()
    store.apply_async(("4111",), link_error=notify.si("failed"))
    (notify.s("a") | notify.s()).apply_async()
    (notify.s("a") | notify.s() | store.s()).apply_async()  # nothing after the sensitive task
    assert len(published) == 4


SECRET = "k" * 16 + "0123456789abcdef"


def _sensitive_app(**settings: Any) -> LedgerCelery:
    from cryptography.fernet import Fernet

    settings.setdefault("key_secret", None)  # whatever the environment says
    return create_app(
        "unit_keys",
        settings=Settings(
            broker_url="redis://127.0.0.1:1/0",
            mongo_uri="mongodb://127.0.0.1:1/",
            encryption_keys=[Fernet.generate_key().decode()],
            **settings,
        ),
        set_as_current=False,
    )


def test_a_sensitive_tasks_derived_key_is_a_keyed_hmac_not_a_plain_hash(
    published: list[Published],
) -> None:
    app = _sensitive_app(key_secret=SECRET)

    @app.task(name="vault.keyed", shared=False, sensitive=True)
    def keyed(card: str) -> None: ...

    keyed.delay("4111111111111111")
    key = only(published).headers["ledger_key"]
    assert key.startswith("m:") and len(key) == 34
    # not the unkeyed hash anyone could recompute from a guessed card number
    assert key[2:] != default_key("vault.keyed", ["4111111111111111"], {})[2:]
    assert key == keyed.key_of(("4111111111111111",), {})  # stable: the same call, same job
    other = _sensitive_app(key_secret="z" * 32)
    assert other.tasks  # finalized
    assert default_key("vault.keyed", ["4111111111111111"], {}, secret=b"z" * 32) != key


def test_a_sensitive_task_that_would_derive_its_key_needs_a_key_secret(
    published: list[Published],
) -> None:
    app = _sensitive_app()

    # Declared without it (Flower and the CLI load the tasks with no keys at all)...
    @app.task(name="vault.unkeyed", shared=False, sensitive=True)
    def unkeyed(card: str) -> None: ...

    @app.task(name="vault.named", shared=False, sensitive=True, idempotency_key="{ref}")
    def named(ref: str, card: str) -> None: ...  # a key of fields that are not secret

    # ...but never published with a plain hash, and a worker would refuse to start
    with pytest.raises(ConfigurationError, match="LEDGER_KEY_SECRET"):
        unkeyed.delay("4111")
    assert published == []
    assert [p for p in app.missing_keys() if "vault.unkeyed" in p]
    assert not [p for p in app.missing_keys() if "vault.named" in p]
    assert named.key_of(("r-1", "4111"), {}) == "r-1"


def test_a_worker_app_without_encryption_keys_reports_its_sensitive_tasks() -> None:
    app = create_app(
        "unit_no_keys",
        settings=Settings(
            broker_url="redis://127.0.0.1:1/0",
            mongo_uri="mongodb://127.0.0.1:1/",
            encryption_keys=[],  # whatever the environment says (the integration suite sets it)
            key_secret=None,
        ),
        set_as_current=False,
    )

    @app.task(name="vault.keyless", shared=False, sensitive=True, idempotency_key="{ref}")
    def keyless(ref: str) -> None: ...

    @app.workflow(name="vault.flow", idempotency_key="{ref}", sensitive=True)
    def flow(wf: Any, ref: str) -> None: ...

    (problem,) = app.missing_keys()
    assert "vault.flow" in problem and "vault.keyless" in problem
    assert "LEDGER_ENCRYPTION_KEYS" in problem
    with pytest.raises(ConfigurationError, match="LEDGER_ENCRYPTION_KEYS"):
        keyless.delay("r-1")


@pytest.mark.parametrize("secret", ["short", "change-me-key-secret-0123456789abcdef"])
def test_a_weak_or_placeholder_key_secret_is_refused_without_echoing_it(secret: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="key_secret") as refused:
        _sensitive_app(key_secret=secret)
    assert secret not in str(refused.value)


@pytest.mark.parametrize(
    "option",
    [{"countdown": 0}, {"countdown": -5}, {"eta": datetime.now(UTC) - timedelta(minutes=1)}],
    ids=["zero", "negative", "past-eta"],
)
def test_due_now_is_published_at_once(
    add: LedgerTask, published: list[Published], delayed: FakeDelayed, option: dict[str, Any]
) -> None:
    add.apply_async((1, 2), **option)

    call = only(published)
    assert delayed.scheduled == []
    assert "countdown" not in call.options
    assert "eta" not in call.options


@pytest.mark.parametrize(
    "option",
    [
        {"countdown": float("inf")},
        {"countdown": float("nan")},
        {"countdown": 1e12},  # (the year 33658)
        {"countdown": "soon"},
        {"eta": "not a date"},
        {"eta": 1700000000},  # (a number is no eta)
        {"eta": datetime(9999, 12, 31, tzinfo=UTC)},
    ],
    ids=["infinite", "nan", "huge", "text-countdown", "text-eta", "number-eta", "year-9999"],
)
def test_a_due_time_that_is_no_time_is_refused_at_the_caller(
    add: LedgerTask, published: list[Published], delayed: FakeDelayed, option: dict[str, Any]
) -> None:
    # (in a body's self.retry(...), the same refusal ends the job dead with its reason: put
    # back, the delivery would ask for the same retry for ever)
    with pytest.raises(PayloadError, match=r"countdown|eta|later than the ledger can keep"):
        add.apply_async((1, 2), **option)
    assert published == [] and delayed.scheduled == []


@pytest.fixture
def utc_minus_5() -> Iterator[None]:
    """Run with the process's local time zone at UTC-5 (POSIX TZ, no tz database needed)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TZ", "XST+05")
        time.tzset()
        try:
            yield
        finally:
            mp.undo()
            time.tzset()


def test_naive_eta_means_utc_like_celery(
    add: LedgerTask, delayed: FakeDelayed, published: list[Published], utc_minus_5: None
) -> None:
    naive_eta = datetime.now(UTC).replace(tzinfo=None) + timedelta(hours=1)

    add.apply_async((1, 2), eta=naive_eta)

    [(*_, due_at)] = delayed.scheduled
    assert abs(due_at - (time.time() + 3600)) < 60


# -- dedupe on publish ------------------------------------------------------------------------


def test_dedupe_skips_publishing_a_known_key(
    app: LedgerCelery, add: LedgerTask, published: list[Published]
) -> None:
    ledger = FakeLedger(outcome=EnqueueOutcome.KNOWN)
    app.runtime.ledger = ledger  # type: ignore[assignment]
    add.dedupe_on_publish = True

    result = add.apply_async((1, 2))

    assert published == []
    [(record_id, fields)] = ledger.enqueued
    assert record_id == result.id
    key = default_key("math.add", (1, 2), {})
    message = fields.pop("message")
    assert fields.pop("objective") == {}  # no latency objective for this task
    assert fields.pop("claimable_at") is None  # at once
    assert fields == {"task": "math.add", "key": key, "tier": "default"}
    # kept so that the reconciler can republish the job if its message is lost
    assert message.arguments(app.sealer) == ([1, 2], {})
    assert message.headers["ledger_key"] == key
    assert message.headers["ledger_tier"] == "default"
    assert "ledger_enqueued_at" in message.headers


def test_dedupe_publishes_a_known_key_whose_first_publish_failed(
    app: LedgerCelery, add: LedgerTask, published: list[Published]
) -> None:
    app.runtime.ledger = FakeLedger(outcome=EnqueueOutcome.UNPUBLISHED)  # type: ignore[assignment]
    add.dedupe_on_publish = True

    add.apply_async((1, 2))

    assert len(published) == 1


def test_dedupe_publishes_a_new_key(
    app: LedgerCelery, add: LedgerTask, published: list[Published]
) -> None:
    app.runtime.ledger = ledger = FakeLedger()  # type: ignore[assignment]
    add.dedupe_on_publish = True

    add.apply_async((1, 2))

    assert only(published).task_id == ledger.enqueued[0][0]


def test_dedupe_keeps_the_queued_record_for_the_reconciler_when_publishing_fails(
    app: LedgerCelery, add: LedgerTask, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any, *args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker down")

    monkeypatch.setattr(celery.app.task.Task, "apply_async", broken)
    app.runtime.ledger = ledger = FakeLedger()  # type: ignore[assignment]
    add.dedupe_on_publish = True

    with pytest.raises(ConnectionError):
        add.apply_async((1, 2))
    # Another producer may have skipped its own publish because the record exists: the record
    # stays, marked so that the reconciler publishes it on its next sweep
    assert ledger.unpublished == [ledger.enqueued[0][0]]


def test_dedupe_with_the_ledger_down_still_publishes(
    app: LedgerCelery, add: LedgerTask, published: list[Published]
) -> None:
    app.runtime.ledger = FakeLedger(down=True)  # type: ignore[assignment]
    add.dedupe_on_publish = True

    add.apply_async((1, 2))

    # with the first claim's hint: most likely nothing was written; if the record was after
    # all (its reply lost), the claim's insert collides and the conditional claim takes it
    assert only(published).options["ledger_new"] is True


def test_dedupe_of_a_job_for_later_writes_its_record_claimable_when_due(
    app: LedgerCelery, add: LedgerTask, published: list[Published], delayed: FakeDelayed
) -> None:
    app.runtime.ledger = ledger = FakeLedger()  # type: ignore[assignment]
    add.dedupe_on_publish = True

    add.apply_async((1, 2), countdown=3600)

    # a record the reconciler looks after once it is due (a delayed set that loses the message)
    [(_name, _args, _kwargs, options, due_at)] = delayed.scheduled
    [(record_id, fields)] = ledger.enqueued
    assert record_id == options["task_id"] and published == []
    # (its due time, taken over to the ledger's clock: here the same clock, read twice)
    due = datetime.fromtimestamp(due_at, UTC)
    assert abs(fields["claimable_at"] - due) < timedelta(seconds=0.01)
    assert "ledger_new" not in options


def test_dedupe_skips_scheduling_a_known_job_for_later(
    app: LedgerCelery, add: LedgerTask, published: list[Published], delayed: FakeDelayed
) -> None:
    app.runtime.ledger = FakeLedger(outcome=EnqueueOutcome.KNOWN)  # type: ignore[assignment]
    add.dedupe_on_publish = True

    add.apply_async((1, 2), countdown=3600)

    assert delayed.scheduled == [] and published == []


def test_a_job_for_later_with_the_ledger_down_is_still_scheduled(
    app: LedgerCelery, add: LedgerTask, delayed: FakeDelayed
) -> None:
    app.runtime.ledger = FakeLedger(down=True)  # type: ignore[assignment]
    add.dedupe_on_publish = True

    add.apply_async((1, 2), countdown=3600)

    assert len(delayed.scheduled) == 1


def test_dedupe_of_a_job_for_later_whose_schedule_failed_lets_a_publish_tried_again_go_out(
    app: LedgerCelery, add: LedgerTask, delayed: FakeDelayed, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise PublishError("cannot delay math.add: broker down")

    monkeypatch.setattr(delayed, "schedule", broken)
    app.runtime.ledger = ledger = FakeLedger()  # type: ignore[assignment]
    add.dedupe_on_publish = True

    with pytest.raises(PublishError):
        add.apply_async((1, 2), countdown=3600)
    # marked so that its next enqueue says UNPUBLISHED (not KNOWN), still claimable when due
    assert ledger.unpublished == [f"{ledger.enqueued[0][0]} (later)"]


def test_dedupe_by_default(published: list[Published]) -> None:
    # A default app writes the job's record at publish (what the reconciler brings a message
    # the broker lost back from) and skips a key it knows
    app = create_app(
        "defaults", settings=Settings(broker_url="redis://127.0.0.1:1/0"), set_as_current=False
    )
    app.runtime.ledger = ledger = FakeLedger(outcome=EnqueueOutcome.KNOWN)  # type: ignore[assignment]

    @app.task(name="math.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    add.apply_async((1, 2))

    assert len(ledger.enqueued) == 1 and published == []


def test_no_dedupe_when_turned_off(
    app: LedgerCelery, add: LedgerTask, published: list[Published]
) -> None:
    app.runtime.ledger = ledger = FakeLedger(outcome=EnqueueOutcome.KNOWN)  # type: ignore[assignment]

    add.apply_async((1, 2))

    assert ledger.enqueued == []
    assert len(published) == 1


def test_a_ledger_away_at_publish_costs_one_timeout_not_one_per_publish(
    app: LedgerCelery, add: LedgerTask, published: list[Published]
) -> None:
    app.runtime.ledger = ledger = FakeLedger(down=True)  # type: ignore[assignment]
    add.dedupe_on_publish = True

    app.runtime.__dict__["unrecorded"] = unrecorded = FakeUnrecorded()

    for n in range(3):
        add.apply_async((1, n))

    # the first publish tried the ledger and went out without the record; the next ones did not
    # wait on it again, and every message went out
    assert ledger.tries == 1 and len(published) == 3
    # each with its record kept in the broker, for the reconciler to write once the ledger is
    # back (the record a publish with the ledger up writes)
    assert [job.record_id for job in unrecorded.kept] == [p.task_id for p in published]
    assert {job.key for job in unrecorded.kept} == {add.key_of((1, n), {}) for n in range(3)}
    assert all(job.task == add.name and job.message.args_json for job in unrecorded.kept)


def test_a_publish_that_fails_with_the_ledger_away_keeps_its_record_as_with_the_ledger_up(
    app: LedgerCelery, add: LedgerTask, monkeypatch: pytest.MonkeyPatch
) -> None:
    app.runtime.ledger = FakeLedger(down=True)  # type: ignore[assignment]
    app.runtime.__dict__["unrecorded"] = unrecorded = FakeUnrecorded()
    add.dedupe_on_publish = True

    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker away")

    monkeypatch.setattr(celery.app.task.Task, "apply_async", broker_down)
    for n in range(2):  # the ledger tried, then seen away
        with pytest.raises(ConnectionError):
            add.apply_async((2, n))

    # the message may have gone out (a reply lost): the record stays, as one written at
    # publish stays (marked unpublished), and the claim or a retried publish dedupes the job
    assert [job.key for job in unrecorded.kept] == [add.key_of((2, n), {}) for n in range(2)]


@pytest.mark.parametrize("acks", [0, 1])
def test_a_publish_whose_kept_record_no_replica_confirms_sends_no_message(
    app: LedgerCelery, add: LedgerTask, published: list[Published], acks: int
) -> None:
    """The ledger away, the broker failing over: the record kept in the broker not confirmed
    by a replica (unrecorded.py) refuses the publish before its message goes out, both ways
    the ledger is found away (a write that fails, then seen away); confirmed, it goes out."""
    from celery_ledger.unrecorded import Unrecorded
    from tests.unit.test_unrecorded import Replicated

    app.runtime.ledger = FakeLedger(down=True)  # type: ignore[assignment]
    add.dedupe_on_publish = True
    client = Replicated(acks)
    app.runtime.__dict__["unrecorded"] = Unrecorded(client, namespace="t", confirm_replicas=1)
    for n in range(2):
        if acks:
            add.apply_async((3, n))
        else:
            with pytest.raises(NotReplicated, match="not published: the ledger is away"):
                add.apply_async((3, n))
    assert len(published) == 2 * acks and len(client.fields) == 2 and len(client.waits) == 2


# -- the first claim's hint ---------------------------------------------------------------------


def test_a_first_publish_without_a_record_tells_its_claim_the_job_is_new(
    add: LedgerTask, published: list[Published]
) -> None:
    add.apply_async((1, 2))

    assert only(published).options["ledger_new"] is True  # a property of the message


@pytest.mark.parametrize("outcome", [EnqueueOutcome.NEW, EnqueueOutcome.UNPUBLISHED])
def test_a_publish_that_wrote_the_jobs_record_never_says_it_is_new(
    app: LedgerCelery, add: LedgerTask, published: list[Published], outcome: EnqueueOutcome
) -> None:
    app.runtime.ledger = FakeLedger(outcome=outcome)  # type: ignore[assignment]
    add.dedupe_on_publish = True

    add.apply_async((1, 2), ledger_new=True)

    assert "ledger_new" not in only(published).options


@pytest.mark.parametrize(
    "options",
    [{"retries": 1, "root_id": "r"}, {"retries": 0}, {ADMITTED: True}],
    ids=["retry", "deferral", "admitted"],
)
def test_a_copy_of_a_known_job_never_says_it_is_new(
    add: LedgerTask, published: list[Published], options: dict[str, Any]
) -> None:
    # an admitted job (a trigger's queued record, a workflow's step) may have its record
    # already; and a caller's own option never decides
    add.apply_async((1, 2), ledger_new=True, **options)

    assert "ledger_new" not in only(published).options


def test_a_retry_is_never_deduplicated(
    app: LedgerCelery, add: LedgerTask, published: list[Published]
) -> None:
    app.runtime.ledger = ledger = FakeLedger(outcome=EnqueueOutcome.KNOWN)  # type: ignore[assignment]
    add.dedupe_on_publish = True

    add.apply_async((1, 2), retries=1, root_id="r")

    assert ledger.enqueued == []
    assert len(published) == 1


@pytest.mark.parametrize(
    "exc",
    [MemoryError("pretend"), SystemExit(1), KeyboardInterrupt()],
    ids=lambda e: type(e).__name__,
)
def test_celery_is_never_handed_an_error_that_ends_a_worker(exc: BaseException) -> None:
    # (the guard recorded the outcome; Celery's main process re-raises a task's MemoryError
    # and a solo worker ends on a BaseException)
    from celery_ledger.errors import PermanentError
    from celery_ledger.guard import Verdict
    from celery_ledger.task import _follow

    with pytest.raises(PermanentError, match=type(exc).__name__):
        _follow(Verdict.raises(exc))


# -- a body's own publish refused for an outage -------------------------------------------------


@pytest.mark.parametrize(
    "refusal",
    [
        OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
        Backpressure("default", 1_001, 1_000),
        NotReplicated("not published: the ledger is away, ..."),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_a_body_whose_own_publish_meets_an_outage_is_retried_not_dead_lettered(
    app: LedgerCelery, add: LedgerTask, refusal: Exception
) -> None:
    """A child's ``delay()`` in a body while the broker is away past kombu's retries (or the
    tier is full, or no replica confirms): the job is retried with backoff, as after a
    connection error, not dead-lettered as an unknown bug; a task's ``fail_on`` still wins."""
    from celery_ledger.policies.retry import classify

    policy = add.policy("default")
    assert classify(refusal, retry_on=policy.retry_on, fail_on=policy.fail_on)
    assert not classify(ValueError("a bug"), retry_on=policy.retry_on, fail_on=policy.fail_on)
    add.fail_on = (type(refusal),)
    policy = add.policy("default")
    assert not classify(refusal, retry_on=policy.retry_on, fail_on=policy.fail_on)
