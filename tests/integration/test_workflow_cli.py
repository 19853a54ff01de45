"""``celery -A APP ledger workflows ...`` against the session's stack: what an operator sees."""

from __future__ import annotations

import json
from argparse import Namespace
from datetime import UTC, datetime
from typing import Any

from click.testing import CliRunner

from celery_ledger.cli.workflows import workflows
from celery_ledger.embedded.stack import EmbeddedStack

from .helpers import wait_for


def cli(app: Any, *args: str) -> Any:
    return CliRunner().invoke(workflows, list(args), obj=Namespace(app=app))


def test_an_operator_lists_inspects_signals_and_time_travels_a_workflow(
    stack: EmbeddedStack, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["order"].start(token, steps=1, signal="go")
    wait_for(lambda: handle.status().waiting == ["signal go"], timeout=30, what="the wait")
    waiting_at = datetime.now(UTC).isoformat()

    listed = cli(app, "list", "--status", "running", "--json")
    assert listed.exit_code == 0, listed.output
    found = json.loads(listed.output)
    assert handle.id in [w["id"] for w in found["workflows"]] and found["counts"]["running"] >= 1
    shown = cli(app, "show", handle.id)
    assert shown.exit_code == 0 and "signal go" in shown.output and "running" in shown.output

    sent = cli(app, "signal", handle.id, "go", "--payload", '{"by": "ops"}', "--signal-id", "o-1")
    assert sent.exit_code == 0 and "sent" in sent.output, sent.output
    again = cli(app, "signal", handle.id, "go", "--signal-id", "o-1", "--json")
    if again.exit_code == 0:  # else the workflow completed in between: it says so
        assert json.loads(again.output)["added"] is False
    else:
        assert "completed" in again.output, again.output
    assert handle.result(timeout=60)["signal"] == {"by": "ops"}

    history = cli(app, "history", handle.id, "--json")
    events = json.loads(history.output)
    assert events[0]["kind"] == "started" and events[-1]["kind"] == "finished"
    assert all(e["worker"] for e in events)
    table = cli(app, "history", handle.id)
    assert table.exit_code == 0 and "finished" in table.output

    earlier = cli(app, "state", handle.id, "--as-of", waiting_at, "--json")
    assert json.loads(earlier.output)["status"] == "running"
    now = cli(app, "state", handle.id)
    assert now.exit_code == 0 and "completed" in now.output

    # Clear errors, exit status 1
    late = cli(app, "cancel", handle.id)
    assert late.exit_code == 1 and "completed" in late.output
    missing = cli(app, "show", "no-such-workflow")
    assert missing.exit_code == 1 and "no workflow" in missing.output
    bad = cli(app, "signal", handle.id, "go", "--payload", "{not json")
    assert bad.exit_code == 2 and "not JSON" in bad.output
    audit = app.ledger.audit_entries(limit=20)
    assert any(a["action"] == "workflow signal" and a["target"] == handle.id for a in audit)


def test_an_operator_cancels_and_retries_from_the_cli(
    stack: EmbeddedStack, app: Any, token: str
) -> None:
    from tests.integration.ledger_app import WORKFLOWS

    handle = WORKFLOWS["order"].start(token, steps=1, signal="never")
    wait_for(lambda: handle.status().waiting == ["signal never"], timeout=30, what="the wait")
    cancelled = cli(app, "cancel", handle.id, "--reason", "ops", "--json")
    assert cancelled.exit_code == 0, cancelled.output
    assert json.loads(cancelled.output) == {"id": handle.id, "action": "cancel", "reason": "ops"}
    wait_for(lambda: handle.status().status == "cancelled", timeout=30, what="cancelled")
    refused = cli(app, "retry", handle.id, "--from-step", "2")
    assert refused.exit_code == 1 and "only a retry from step 0" in refused.output
    again = cli(app, "retry", handle.id, "--from-step", "0", "--json")
    assert again.exit_code == 0, again.output
    retried = json.loads(again.output)
    assert retried["action"] == "retry" and retried["event"]["data"]["from_pos"] == 0
    wait_for(lambda: handle.status().waiting == ["signal never"], timeout=30, what="a new wait")
    listed = json.loads(cli(app, "list", "--json", "--limit", "1000").output)
    assert any(w["id"] == handle.id and w["status"] == "running" for w in listed["workflows"])
    cli(app, "cancel", handle.id)
