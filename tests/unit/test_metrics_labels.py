"""Metric labels stay in bounded sets, whatever text an event's reason or strings carry.

A reason may quote a message (a deferral of arguments that do not bind names the keyword the
message used): as a label it would put message content in Prometheus and make a new series
of each new text.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from celery_ledger import Job
from celery_ledger.errors import LedgerUnavailable
from celery_ledger.events import Observers
from celery_ledger.observability import metrics
from celery_ledger.observability.metrics import (
    BREAKER_STATES,
    DEFERRAL_REASONS,
    OTHER,
    UNAVAILABLE_WHERE,
    WORKFLOW_ENDS,
    MetricsObserver,
)
from celery_ledger.routing import TIERS
from tests.unit.test_guard import TASK, FakeBody, Harness

BREAKER = "payments"
WORKFLOW = "shop.checkout"
# Every label's bounded set: task and tier come from the app, the rest from fixed categories
BOUNDED = {
    "task": {TASK, "unregistered"},
    "tier": {*TIERS, "unknown"},
    "reason": {*DEFERRAL_REASONS, OTHER},
    "where": {*UNAVAILABLE_WHERE, OTHER},
    "breaker": {BREAKER},
    "to": {*BREAKER_STATES, OTHER},
    "workflow": {WORKFLOW},
    "status": {*WORKFLOW_ENDS, OTHER},
    "outcome": {"succeeded", "failed", "retried", "dead", "lease_lost", "deferred"},
    "queue": {*TIERS, "unknown", "bulk"},
}


def label_values(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Every value each label takes in the registry's samples."""
    seen: dict[str, set[str]] = {}
    for family in registry.collect():
        for sample in family.samples:
            for name, value in sample.labels.items():
                if name != "le":  # a histogram's bucket bound
                    seen.setdefault(name, set()).add(value)
    return seen


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    registry = CollectorRegistry()
    metrics.enable(registry)
    yield registry
    metrics.disable()


texts = st.text(max_size=60) | st.sampled_from(
    [
        "arguments do not bind: got an unexpected keyword argument 'card_4111111111111111'",
        "rate limited (reports)",
        "circuit open (inside the body)",
        "circuit open: 'x'",
        "ledger unavailable (in the body)",
        "",
    ]
)


@given(reasons=st.lists(texts, min_size=1, max_size=8))
def test_labels_stay_in_their_bounded_sets_whatever_the_text(reasons: list[str]) -> None:
    registry = CollectorRegistry()
    metrics.enable(registry)
    try:
        # When events carry any text where a reason, a place or a state goes
        events = Observers(MetricsObserver(lambda: {TASK}))
        for number, text in enumerate(reasons):
            job = Job(TASK, "critical", f"r{number}", "k")
            events.deferred(job, text, 1.0)
            events.ledger_unavailable(job, text)
            events.breaker(BREAKER, "closed", text)
            events.workflow_ended(WORKFLOW, text)
            events.throttle("bulk", True, text)
        seen = label_values(registry)
    finally:
        metrics.disable()

    # Then every label value is one of its bounded set: no text becomes a series of its own
    assert seen.keys() <= BOUNDED.keys()
    for label, values in seen.items():
        assert values <= BOUNDED[label], label
    # And a known category is kept under its own name, details dropped
    if "rate limited (reports)" in reasons:
        assert "rate limited" in seen["reason"]


def test_every_deferral_the_guard_makes_has_a_category_of_its_own(
    registry: CollectorRegistry,
) -> None:
    # Given the guard's deferrals: arguments that do not bind (the message's own keyword in
    # the reason), a live lease, the ledger unreachable at the claim
    h = Harness()
    h.runtime.observers.add(MetricsObserver(lambda: {TASK}))
    keyword = "card_4111111111111111"
    unbound = f"got an unexpected keyword argument '{keyword}'"
    h.guard.run(h.delivery(), h.policy(), FakeBody(), unbound=unbound)
    h.ledger.claim(h.delivery().record_id, task=TASK, key="order-7", tier="critical", owner="o:1")
    h.run()
    h.ledger.docs.clear()
    h.ledger.fail("claim", LedgerUnavailable("down"))
    h.run()

    # Then each is counted under its category, none as "other", and no label holds the keyword
    reasons = label_values(registry)["reason"]
    assert reasons == {"arguments do not bind", "leased by another delivery", "ledger unavailable"}
    assert not any(
        keyword in value for values in label_values(registry).values() for value in values
    )
    # (the reason itself, for people, still says which keyword)
    deferred = [args for name, args in h.recorder.events if name == "deferred"]
    assert keyword in deferred[0][1]


def test_a_category_is_read_from_the_head_of_a_reason() -> None:
    assert metrics.category("rate limited (reports)", DEFERRAL_REASONS) == "rate limited"
    assert metrics.category("arguments do not bind: x", DEFERRAL_REASONS) == "arguments do not bind"
    assert metrics.category("circuit open (inside the body)", DEFERRAL_REASONS) == (
        "circuit open (inside the body)"
    )
    for unknown in ("", None, "something else: circuit open", "x" * 10_000):
        assert metrics.category(unknown, DEFERRAL_REASONS) == OTHER
