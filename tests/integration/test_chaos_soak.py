"""The chaos soak's CI profile (ops/chaos): exactly-once under kills, restarts and a bad network.

300 jobs on celery-ledger and, under the same faults, on plain Celery with ``acks_late``; the
assertions are the issue's: every ledger job terminal as designed, one effect per job, none
lost, dead letters exactly the designed failures. Plain Celery's counts are printed for
comparison only. About two minutes; ``python -m ops.chaos.soak --profile long`` runs 5,000 jobs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.chaos.soak import PROFILES, run

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(600)
def test_ci_soak_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    report = run(PROFILES["ci"], seed=20261122, data_dir=tmp_path)
    report.render()
    ledger = report.systems["ledger"]

    assert sum(report.faults.values()) >= 20, report.faults  # the faults did happen
    assert ledger.lost == [], ledger.details
    assert ledger.wrong_outcome == [], ledger.details
    assert ledger.duplicates == 0, ledger.details
    assert ledger.effects_of_failed_jobs == 0
    assert ledger.succeeded + ledger.dead == ledger.tasks
    assert ledger.dead_letters_match, ledger.dead_letter_detail
    assert ledger.quiet, ledger.details  # nothing left behind in the broker
