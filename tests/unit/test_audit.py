"""The audit trail: every operator action is written before it runs, with its outcome after,
and its actor says where the name came from."""

from __future__ import annotations

from typing import Any

import pytest

from celery_ledger import audit
from celery_ledger.errors import LedgerUnavailable


class AuditLedger:
    """The ledger's two audit calls, in memory (``down``: the ledger refuses them)."""

    def __init__(self, *, down: bool = False) -> None:
        self.entries: list[dict[str, Any]] = []
        self.down = down

    def audit(self, action: str, target: str, *, actor: str, **details: Any) -> int:
        if self.down:
            raise LedgerUnavailable("ledger down")
        self.entries.append({"action": action, "target": target, "actor": actor, **details})
        return len(self.entries) - 1

    def audit_outcome(self, entry_id: int, outcome: str, **details: Any) -> None:
        self.entries[entry_id].update(outcome=outcome, **details)


def test_an_action_is_written_before_it_runs_and_its_outcome_after() -> None:
    ledger = AuditLedger()
    seen_during: list[dict[str, Any]] = []
    with audit.action(ledger, "purge", "2 dead records", actor="a", record_ids=["r1"]) as entry:  # type: ignore[arg-type]
        seen_during.append(dict(ledger.entries[0]))
        entry.note(purged=1)
    assert seen_during[0]["outcome"] == "started"
    assert ledger.entries[0]["outcome"] == "done" and ledger.entries[0]["purged"] == 1
    assert ledger.entries[0]["record_ids"] == ["r1"]


def test_a_failed_action_is_recorded_failed_and_still_raises() -> None:
    ledger = AuditLedger()
    with pytest.raises(RuntimeError), audit.action(ledger, "replay", "r1", actor="a"):  # type: ignore[arg-type]
        raise RuntimeError("broker down")
    assert ledger.entries[0]["outcome"] == "failed"
    assert "broker down" in ledger.entries[0]["error"]


def test_an_action_the_ledger_cannot_audit_does_not_run() -> None:
    ran: list[bool] = []
    with (
        pytest.raises(LedgerUnavailable),
        audit.action(AuditLedger(down=True), "x", "t", actor="a"),
    ):  # type: ignore[arg-type]
        ran.append(True)
    assert ran == []


def test_the_actor_says_where_its_name_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LEDGER_ACTOR", raising=False)
    assert audit.current_actor().endswith(" [os user]")
    monkeypatch.setenv("LEDGER_ACTOR", "ops-bot")
    assert audit.current_actor() == "ops-bot [LEDGER_ACTOR]"
    assert audit.current_actor("alice") == "alice [--actor]"
