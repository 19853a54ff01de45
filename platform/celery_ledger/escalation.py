"""Escalation: a job past its latency objective is reported late, once.

A task's ``slo_seconds`` (or its tier's, ``LEDGER_SLO_SECONDS``) puts ``slo_at`` on its record at
the first claim (from the job's publish time). Every worker's housekeeping runs
:meth:`Escalation.check` (indexed reads of the ledger's ``_objectives``, where only jobs with an
objective not yet settled have a document, so that no other job's writes pay for an index of
it); the attempt that finishes a job late reports it too. Whoever marks
the record first (:meth:`Ledger.mark_late`, a conditional write) reports it: the ``late``
observer event (metric ``celery_ledger_late_total``, a Sentry event, a log line). The record's
``late_at`` makes its status ``late`` to callers polling ``AsyncResult`` or ``app.ledger.get``
until it finishes.

A job has a record from its first claim (or its publish, with ``dedupe_on_publish``): a job
still waiting in its queue is seen at its claim, and a backlog as a whole by the queue-wait
alerts.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from .errors import LedgerError
from .events import Job
from .ledger.ports import EscalationStore
from .ledger.record import TERMINAL, State
from .runtime import Runtime

logger = logging.getLogger("celery_ledger.escalation")


class Escalation:
    """Finds and reports jobs past their latency objective (see the module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def check(self, *, limit: int = 200) -> int:
        """Report every job newly found late; returns how many this call reported."""
        ledger: EscalationStore = self.runtime.ledger
        try:
            found = ledger.overdue(limit=limit)
        except LedgerError as exc:  # the next check looks again
            logger.info("escalation check skipped: %s", exc)
            return 0
        reported = 0
        for doc in found:
            record_id = str(doc["_id"])
            try:
                state = State(str(doc.get("state")))
            except ValueError:
                continue
            try:
                if state in TERMINAL:  # dead (reported as such) before anyone looked
                    ledger.forget_objective(record_id)
                    continue
                created = doc.get("created_at")
                slo_at = doc.get("slo_at")
                slo = float(doc.get("slo_seconds") or 0.0)
                if not ledger.mark_late(record_id):
                    continue  # another worker's check (or the finishing attempt) reported it
            except LedgerError as exc:
                logger.info("escalation of %s skipped: %s", record_id, exc)
                continue
            now = ledger.now()
            age = _seconds(now, created) if created is not None else slo
            if slo_at is not None and slo:
                age = max(age, slo + _seconds(now, slo_at))
            job = Job(str(doc.get("task")), doc.get("tier"), record_id, doc.get("key"))
            logger.warning(
                "%s (%s) is late: %.0fs old, objective %.0fs", record_id, job.task, age, slo
            )
            self.runtime.observers.late(job, age, slo)
            reported += 1
        return reported


def _seconds(now: datetime, then: datetime) -> float:
    aware = then if then.tzinfo else then.replace(tzinfo=UTC)
    return (now - aware).total_seconds()
