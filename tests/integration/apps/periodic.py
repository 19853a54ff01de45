"""An app with Celery's own ``beat_schedule``, as a new user writes it: a task without arguments
(keyless: its arguments are its key) and one whose key template names a fixed argument, each
every 2 seconds. Every run records its slot (``self.scheduled_for``) under the test's tag
(``PERIODIC_RUN``), so a test counts runs per slot."""

from __future__ import annotations

import os
import time
from typing import Any

from celery_ledger import Settings, create_app
from tasks.effects import record_effect

NAMESPACE = "periodic_tests"
RUN = os.environ.get("PERIODIC_RUN", "none")

app = create_app(NAMESPACE, settings=Settings(ledger_collection="periodic_ledger"))


def _record(kind: str, task: Any) -> None:
    slot = task.scheduled_for
    record_effect(kind, RUN, slot=None if slot is None else slot.timestamp(), job=task.job_key)


@app.task(bind=True, name="periodic.tick")
def tick(self: Any) -> None:
    _record("tick", self)


@app.task(bind=True, name="periodic.tick_keyed", idempotency_key="{report}")
def tick_keyed(self: Any, report: str) -> None:
    _record("tick-keyed", self)


@app.task(bind=True, name="periodic.charge", sensitive=True, idempotency_key="charge")
def charge(self: Any, card: str) -> None:
    """A sensitive task an operator schedules at run time, with the card as its argument (a
    slot's job is keyed by its slot; the template, of no secret, serves a call by hand)."""
    record_effect("charge", RUN, slot=self.scheduled_for.timestamp(), last4=card[-4:])


app.conf.beat_schedule = {
    "tick": {"task": "periodic.tick", "schedule": 2.0},
    "tick-keyed": {"task": "periodic.tick_keyed", "schedule": 2.0, "args": ("daily",)},
}


@app.task(bind=True, name="periodic.slow")
def slow(self: Any) -> None:
    """A run longer than its period (5 s every 2 s): recorded as it starts."""
    _record("slow", self)
    time.sleep(5.0)


if os.environ.get("PERIODIC_OVERLAP"):  # (the overlap test's workers alone: the others count)
    app.periodic(2.0, name="slow", overlap=os.environ["PERIODIC_OVERLAP"])(slow)


@app.task(name="periodic.flow_step", idempotency_key="{workflow}")
def flow_step(workflow: str) -> None:
    record_effect("flow-step", RUN, workflow=workflow)


@app.workflow(name="periodic.flow")
def flow(wf: Any, report: str) -> str:
    """A durable workflow a schedule starts: one step, which records its workflow's id."""
    wf.run(flow_step.s(wf.id))
    return report


if os.environ.get("PERIODIC_WORKFLOW"):  # (the workflow test's workers alone)
    app.periodic(2.0, name="flow", kwargs={"report": "nightly"})(flow)
