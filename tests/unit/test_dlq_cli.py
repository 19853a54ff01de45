"""``ledger dlq`` over an in-memory ledger: a replay by filter takes every match (page after
page), a listing says when it shows only the newest, a purge's audit names what it removed,
and a forced replay of an unauthenticated message is audited as forced."""

from __future__ import annotations

from argparse import Namespace
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from click.testing import CliRunner, Result

from celery_ledger.cli.dlq import dlq
from celery_ledger.identity import derive_task_id
from celery_ledger.ledger.dead import DeadJob
from celery_ledger.ledger.message import KeptMessage
from celery_ledger.ledger.record import State
from celery_ledger.ledger.store import Unclaimed
from celery_ledger.signing import Signer
from tests.unit.test_audit import AuditLedger
from tests.unit.test_dead_letter_authentication import NEW, keep, message
from tests.unit.test_dead_letters import TASK, World


def run(world: World, audit: AuditLedger, *args: str) -> Result:
    app = SimpleNamespace(dead_letters=world.letters, ledger=audit)
    result = CliRunner().invoke(dlq, list(args), obj=Namespace(app=app))
    assert result.exit_code == 0, result.output
    return result


def bury(world: World, count: int, *, same_time: bool = False, batch: str = "a") -> list[str]:
    """``count`` dead jobs, one a second apart (or all at once: ties broken by id)."""
    ids = []
    for n in range(count):
        key = f"order-{batch}{n}"
        record_id = derive_task_id(TASK, key)
        kept = KeptMessage.of_call([n], {}, message_headers={"ledger_key": key})
        dead = DeadJob.of_reason("failed", "permanent error: declined", task=TASK, message=kept)
        world.ledger.bury(record_id, dead, match=Unclaimed(), task=TASK, key=key, tier="bulk")
        if not same_time:
            world.ledger.now.advance(1)
        ids.append(record_id)
    return ids


def test_a_replay_by_filter_replays_every_match_past_any_page() -> None:
    # Given more dead jobs than a page holds (some dead in the same instant)
    world, audit = World(), AuditLedger()
    ids = bury(world, 5) + bury(world, 4, same_time=True, batch="b")

    # When they are replayed by a filter, two records per ledger query
    result = run(world, audit, "replay", "--task", TASK, "--page-size", "2", "--actor", "ops")

    # Then every one of them is published once and audited
    assert sorted(t.options["task_id"] for t in world.outbox.tasks) == sorted(ids)
    assert "9 of 9 replayed" in result.output
    assert sorted(e["target"] for e in audit.entries if e["action"] == "replay") == sorted(ids)
    assert all(world.ledger.docs[i]["state"] == State.QUEUED for i in ids)


def test_a_dry_run_by_filter_counts_every_match_past_any_page() -> None:
    world = World()
    bury(world, 7)

    result = run(world, AuditLedger(), "replay", "--task", TASK, "--dry-run", "--page-size", "3")

    assert "7 of 7 would be replayed" in result.output and world.outbox.tasks == []


def test_a_listing_cut_by_its_limit_says_more_exist() -> None:
    world = World()
    bury(world, 5)

    cut = run(world, AuditLedger(), "list", "--records", "--limit", "3")
    whole = run(world, AuditLedger(), "list", "--records", "--limit", "5")

    assert "3 dead jobs (newest 3; more exist)" in cut.stdout
    assert "more exist" in cut.stderr
    assert "5 dead jobs" in whole.stdout and "more exist" not in whole.output


def test_a_json_listing_cut_by_its_limit_warns_on_stderr_only() -> None:
    import json

    world = World()
    bury(world, 4)

    result = run(world, AuditLedger(), "list", "--records", "--json", "--limit", "2")

    assert len(json.loads(result.stdout)) == 2 and "more exist" in result.stderr


def test_a_purge_audits_the_records_it_removed_not_those_replayed_meanwhile() -> None:
    # Given three dead jobs, one of which an operator replays between the listing and the purge
    world, audit = World(), AuditLedger()
    ids = bury(world, 3)
    listed = world.letters.find

    def find_then_replay(**filters: Any) -> list[dict[str, Any]]:
        docs = listed(**filters)
        world.ledger.reopen(ids[0], actor="someone else")
        return docs

    world.letters.find = find_then_replay  # type: ignore[method-assign]

    # When the purge runs
    result = run(world, audit, "purge", "--task", TASK, "--yes", "--actor", "ops")

    # Then the replayed job is left running, and the audit says so
    [entry] = [e for e in audit.entries if e["action"] == "purge"]
    assert sorted(entry["selected_ids"]) == sorted(ids)
    assert sorted(entry["record_ids"]) == sorted(ids[1:]) and entry["purged"] == 2
    assert entry["left_ids"] == [ids[0]]
    assert world.ledger.docs[ids[0]]["state"] == State.QUEUED
    assert "purged 2 dead records" in result.output and "1 of the 3 selected" in result.output


def test_an_unauthenticated_message_is_replayed_only_when_forced_and_audited_as_such() -> None:
    world, audit = World(signer=Signer([NEW], required=True)), AuditLedger()
    record_id = keep(world, *message())  # unsigned, under signatures required

    refused = run(world, audit, "replay", record_id, "--actor", "ops")
    assert world.outbox.tasks == [] and "failed authentication" in refused.output
    forced = run(world, audit, "replay", record_id, "--actor", "ops", "--force-unsigned")

    assert len(world.outbox.tasks) == 1 and "forced" in forced.output
    assert "--force-unsigned" in forced.stderr
    first, second = (e for e in audit.entries if e["action"] == "replay")
    assert first["replayed"] is False and "force_unsigned" not in first
    assert second["force_unsigned"] is True and second["forced"] is True and second["replayed"]


def test_show_says_what_an_unauthenticated_message_claims() -> None:
    world = World(signer=Signer([NEW], required=True))
    record_id = keep(world, *message())

    result = run(world, AuditLedger(), "show", record_id)

    assert "unauthenticated" in result.output and "claims to be" in result.output


def test_records_dead_at_the_same_time_are_paged_in_id_order() -> None:
    world = World()
    ids = bury(world, 6, same_time=True)
    world.ledger.now.advance(timedelta(seconds=1).total_seconds())

    pages = list(world.letters.each(task=TASK, page_size=4))

    assert [d["_id"] for d in pages] == sorted(ids, reverse=True)
