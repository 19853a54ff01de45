"""celery_ledger.routing: tiers, and the tier a publish goes to."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from celery_ledger.errors import ConfigurationError
from celery_ledger.routing import DEAD_LETTER, TIER_WORKER_DEFAULTS, Tiers
from celery_ledger.settings import TIERS

KNOWN = "known tiers: critical, default, bulk"


def task(name: str, tier: str | None = None) -> Any:
    return SimpleNamespace(name=name, tier=tier)


@pytest.fixture
def tiers() -> Tiers:
    return Tiers(TIERS, default="default", rules={"reports.*": "bulk", "billing.*": "critical"})


# -- precedence: call option > settings rule > task option > default --------------------------


def test_call_option_beats_rule_and_task_tier(tiers: Tiers) -> None:
    assert tiers.resolve(task("reports.daily", tier="critical"), "default") == "default"


def test_rule_beats_task_tier(tiers: Tiers) -> None:
    assert tiers.resolve(task("reports.daily", tier="critical")) == "bulk"


def test_task_tier_beats_default(tiers: Tiers) -> None:
    assert tiers.resolve(task("mail.send", tier="critical")) == "critical"


def test_default_when_nothing_names_a_tier(tiers: Tiers) -> None:
    assert tiers.resolve(task("mail.send")) == "default"
    assert tiers.resolve(SimpleNamespace(name="mail.send")) == "default"  # no .tier at all
    assert tiers.resolve(task("mail.send"), None) == "default"


def test_default_tier_is_configurable() -> None:
    assert Tiers(TIERS, default="bulk").resolve(task("mail.send")) == "bulk"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("reports.daily", "bulk"),
        ("reports.daily.pdf", "bulk"),  # fnmatch's * crosses dots
        ("reports.", "bulk"),
        ("Reports.daily", "default"),  # case-sensitive (fnmatchcase)
        ("myreports.daily", "default"),  # anchored at both ends
        ("reports", "default"),
        ("billing.refund", "critical"),
    ],
)
def test_rules_are_case_sensitive_globs_over_the_whole_name(
    tiers: Tiers, name: str, expected: str
) -> None:
    assert tiers.resolve(task(name)) == expected


def test_glob_character_classes_and_single_character_wildcards() -> None:
    tiers = Tiers(TIERS, default="default", rules={"etl.v[12].?": "bulk"})

    assert tiers.resolve(task("etl.v1.a")) == "bulk"
    assert tiers.resolve(task("etl.v2.b")) == "bulk"
    assert tiers.resolve(task("etl.v3.a")) == "default"
    assert tiers.resolve(task("etl.v1.ab")) == "default"


def test_first_matching_rule_wins() -> None:
    tiers = Tiers(
        TIERS, default="default", rules={"reports.big.*": "critical", "reports.*": "bulk"}
    )

    assert tiers.resolve(task("reports.big.year")) == "critical"
    assert tiers.resolve(task("reports.small")) == "bulk"


# -- unknown tiers ----------------------------------------------------------------------------


def test_unknown_default_tier_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="unknown tier 'urgent' in default tier") as info:
        Tiers(TIERS, default="urgent")
    assert KNOWN in str(info.value)


def test_unknown_tier_in_a_rule_is_refused_naming_the_rule() -> None:
    with pytest.raises(
        ConfigurationError, match=r"unknown tier 'urgent' in routing rule 'x\.\*'"
    ) as info:
        Tiers(TIERS, default="default", rules={"x.*": "urgent"})
    assert KNOWN in str(info.value)


def test_unknown_tier_in_a_call_is_refused_naming_the_task(tiers: Tiers) -> None:
    with pytest.raises(
        ConfigurationError, match=r"unknown tier 'urgent' in the call of mail\.send"
    ) as info:
        tiers.resolve(task("mail.send"), "urgent")
    assert KNOWN in str(info.value)


def test_tier_names_are_case_sensitive(tiers: Tiers) -> None:
    with pytest.raises(ConfigurationError, match=KNOWN):
        tiers.resolve(task("mail.send"), "Critical")


def test_unknown_task_tier_is_refused(tiers: Tiers) -> None:
    with pytest.raises(ConfigurationError, match=KNOWN):
        tiers.resolve(task("mail.send", tier="urgent"))


# -- worker defaults --------------------------------------------------------------------------


def test_every_tier_has_worker_defaults() -> None:
    assert set(TIER_WORKER_DEFAULTS) == set(TIERS)
    assert DEAD_LETTER not in TIERS


def test_critical_workers_prefetch_one_message() -> None:
    assert TIER_WORKER_DEFAULTS["critical"].prefetch_multiplier == 1


def test_worker_defaults_are_sane() -> None:
    for defaults in TIER_WORKER_DEFAULTS.values():
        assert defaults.concurrency >= 1
        assert defaults.prefetch_multiplier >= 1


def test_the_sweeps_bring_back_this_fleets_records_whatever_task_and_leave_other_apps() -> None:
    tiers = Tiers(TIERS, default="default", namespace="shop")
    # a task of this release: the tier the call chose, if this app has it, else the task's
    assert tiers.for_record({"tier": "bulk"}, "critical") == "bulk"
    assert tiers.for_record({"tier": "nope", "fleet": "other"}, "critical") == "critical"
    # a task this release lacks: its record's tier, if the record is this fleet's
    assert tiers.for_record({"tier": "bulk", "fleet": "shop"}, None) == "bulk"
    assert tiers.for_record({"tier": "overnight", "fleet": "shop"}, None) is None
    assert tiers.for_record({"tier": "bulk", "fleet": "billing"}, None) is None
    assert tiers.for_record({"tier": "bulk"}, None) is None  # written before records named it
    assert tiers.for_record({"tier": None, "fleet": "shop"}, None) is None
