"""An observer of the platform's events, as an app team would add one (``app.observers``).

Metrics and Sentry are observers too; this one writes a warning for each job that took longer
than its team's budget, and for each job put off because the ledger could not be reached. An
observer only reads what it is told: it never fails a task (the platform logs its errors).
"""

from __future__ import annotations

import logging

from celery_ledger import Job, Observer

logger = logging.getLogger("tasks.observers")


class SlowJobs(Observer):
    """Warns when a job's body ran longer than ``budget_seconds``."""

    def __init__(self, budget_seconds: float) -> None:
        self.budget_seconds = budget_seconds

    def succeeded(self, job: Job, seconds: float) -> None:
        if seconds > self.budget_seconds:
            logger.warning(
                "%s [%s] took %.1fs (budget %.1fs)", job.task, job.key, seconds, self.budget_seconds
            )

    def ledger_unavailable(self, job: Job, where: str) -> None:
        logger.warning("%s [%s]: ledger unreachable at the %s; put off", job.task, job.key, where)
