"""``ledger health``: which tiers have workers, and the exit code when something is down."""

from __future__ import annotations

import json
from types import SimpleNamespace

from click.testing import CliRunner

from celery_ledger import Settings, create_app
from celery_ledger.cli.health import health
from celery_ledger.embedded.servers import free_port
from celery_ledger.health import parked_status, tier_checks

TIERS = ("critical", "default", "bulk")


def test_a_required_tier_without_a_worker_is_down_and_others_only_warn() -> None:
    active = {
        "critical@a": [{"name": "critical"}],
        "all@b": [{"name": "critical"}, {"name": "default"}, {"name": "celery"}],
    }
    checks = {c.name: c for c in tier_checks(active, TIERS, required=("critical", "bulk"))}
    assert checks["tier critical"].status == "ok"
    assert checks["tier critical"].data["workers"] == ["all@b", "critical@a"]
    assert checks["tier default"].status == "ok"
    assert checks["tier bulk"].status == "down"
    assert tier_checks(active, TIERS, required=("critical",))[2].status == "warn"
    assert {c.status for c in tier_checks(None, TIERS, required=())} == {"warn"}


def test_broker_and_ledger_down_exit_non_zero_with_json() -> None:
    # Given an app whose broker and ledger ports answer nothing
    app = create_app(
        "health_down",
        settings=Settings(
            broker_url=f"redis://127.0.0.1:{free_port()}/0",
            mongo_uri=f"mongodb://127.0.0.1:{free_port()}/?directConnection=true",
        ),
        set_as_current=False,
    )
    # When the health command runs
    result = CliRunner().invoke(
        health, ["--json", "--timeout", "0.3", "--tiers", "critical"], obj=SimpleNamespace(app=app)
    )
    # Then it exits 1 and says what is down
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert report["ok"] is False
    assert status["broker"] == "down" and status["ledger"] == "down"
    assert status["tier critical"] == "down" and status["tier bulk"] == "skipped"


def test_an_unknown_tier_is_a_usage_error() -> None:
    app = create_app("health_usage", settings=Settings(), set_as_current=False)
    result = CliRunner().invoke(health, ["--tiers", "critcal"], obj=SimpleNamespace(app=app))
    assert result.exit_code == 2 and "unknown tier 'critcal'" in result.output


def test_the_outbox_check_warns_of_committed_jobs_nobody_publishes() -> None:
    from celery_ledger.health import OUTBOX_SAMPLE, outbox_report

    assert outbox_report([], overdue_seconds=11)[0] == "ok"
    status, detail, data = outbox_report(
        [{"tier": "critical"}, {"tier": "bulk"}, {"tier": "bulk"}], overdue_seconds=11
    )
    assert status == "warn" and data == {"waiting": {"bulk": 2, "critical": 1}}
    assert "3 committed job(s) unpublished for over 11s (bulk 2, critical 1)" in detail
    assert "LEDGER_OUTBOX_RELAY_IN_WORKERS" in detail
    many = [{"tier": "bulk"}] * OUTBOX_SAMPLE
    assert f"{OUTBOX_SAMPLE} or more" in outbox_report(many, overdue_seconds=11)[1]


def test_parked_messages_warn_then_are_down_past_half_their_window() -> None:
    assert parked_status(({}, 0.0), window_seconds=900)[0] == "ok"
    counts = {("unknown-task", "shop.new"): 2, ("no-key", "shop.pay"): 1}
    status, detail, data = parked_status((counts, 120.0), window_seconds=900)
    assert status == "warn"
    assert "3 message(s)" in detail and "shop.new (unknown-task) 2" in detail
    assert data["parked"] == {"shop.new (unknown-task)": 2, "shop.pay (no-key)": 1}
    # Past half the window its jobs are dead-lettered soon: someone must finish the deploy
    assert parked_status((counts, 451.0), window_seconds=900)[0] == "down"


def test_fewer_replicas_than_a_publish_waits_for_warn_before_the_ledger_is_away() -> None:
    from celery_ledger.health import replicas_status

    assert replicas_status(1, 2)[0] == "ok"
    status, detail, data = replicas_status(2, 1)
    assert status == "warn" and data == {"wanted": 2, "replicas": 1}
    assert "LEDGER_BROKER_CONFIRM_REPLICAS asks 2" in detail and "NotReplicated" in detail
