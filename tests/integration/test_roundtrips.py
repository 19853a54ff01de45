"""Ledger operations per delivery, with the benchmark's own counter (``ops.bench.roundtrips``):
the figures the README quotes and the goals this test holds are counted the same way."""

from __future__ import annotations

from typing import Any

from ops.bench.roundtrips import GOALS, QUEUE, counting_worker, measure_clean, operations


def test_round_trips_per_delivery(stack: Any) -> None:
    assert stack.broker is not None and stack.ledger is not None
    with counting_worker(stack.broker.url, stack.ledger.url, "ledger_tests") as (app, listener):
        # A probe: the first delivery also creates the collection and its indexes
        app.tasks["rt.happy"].apply_async(("probe",), queue=QUEUE).get(timeout=60)
        commands = measure_clean(app, listener)

    observed = {case: operations(found) for case, found in commands.items()}
    print("\nledger round trips per delivery:", commands)
    for case, goal in GOALS.items():
        assert goal is None or observed[case] <= goal, (case, commands[case])
    # and what the README reports exactly
    assert observed == {
        "happy path": 2,
        "suppressed duplicate": 2,
        "one retry: failing attempt": 2,
        "one retry: both attempts": 4,
        "dead-letter": 3,
    }, commands
    # one round trip per operation on the happy path: nothing rides a bulk it does not need;
    # the publish wrote the record (dedupe on publish, the default), so the claim is the
    # conditional update; a copy sent without dedupe says its publish wrote none, so its claim
    # tries the insert first (refused: the record exists) and then reads it as a duplicate
    kinds = {case: [c.split(":")[0] for c in found] for case, found in commands.items()}
    assert kinds["happy path"] == ["updatex1", "updatex1"]
    assert kinds["suppressed duplicate"] == ["insertx1", "updatex1"]
    # a retry's claim takes the record that exists: the conditional claim, no insert tried
    assert kinds["one retry: both attempts"] == ["updatex1"] * 4
