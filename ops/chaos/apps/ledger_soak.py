"""The soak on celery-ledger: settings from ``LEDGER_*``; ``soak.work`` keyed on ``key``, and
the workflow ``soak.flow`` whose steps and compensations are ``soak.step`` jobs.

Every effect is an atomic step (``self.step("effect").atomic``): the effect document and the
step record commit in one transaction on the ledger's server.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from celery import signals
from pymongo.client_session import ClientSession

from celery_ledger import LedgerCelery, PermanentError, Settings, create_app
from celery_ledger.app import WAKE_TASK
from celery_ledger.untrusted import redelivered

from ..plan import step_effect_key, tenant_of, undo_effect_key
from . import world

TICK_SECONDS = 2.0  # the soak's periodic task (``soak.tick``)
RESTORE_SWEEP = {
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    # A worker killed while it sweeps holds the sweep lock until this expires (300 s default).
    "unacked_mutex_expire": 10,
}


def _tenant(key: str, kind: str, param: float) -> str | None:
    return tenant_of(key)


def build(settings: Settings | None = None, release: int | None = None) -> LedgerCelery:
    """The app (settings from ``LEDGER_*`` unless given): the job ``soak.work``, the workflow
    ``soak.flow`` and its steps' task ``soak.step``; from release 2 (``SOAK_RELEASE`` unless
    given) also the job ``soak.newer``, which the first release's workers do not know."""
    if release is None:
        release = int(os.environ.get("SOAK_RELEASE", "1"))
    app = create_app("soak_ledger", settings=settings, set_as_current=False)
    # kombu sweeps for unacked messages past the visibility timeout only every
    # interval x throttle seconds (10 x 10 by default): sweep every second instead.
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        **RESTORE_SWEEP,
    }

    def body(task: Any, key: str, kind: str, param: float) -> str:
        def act(doc: dict[str, Any]) -> None:
            # The effect commits with the step record, in one transaction on the ledger.
            def write(session: ClientSession) -> None:
                effects = session.client.get_database("soak_world").get_collection("effects")
                effects.insert_one(dict(doc), session=session)

            task.step("effect").atomic(write)

        try:
            request = task.request
            fence = getattr(request, "ledger_fence", None)
            # (a copy kombu restored or a requeue: it reached the queue past its tenant's lane)
            detail = {"redelivered": redelivered(request), "retries": request.retries or 0}
            return world.work("ledger", key, kind, param, fence, act, detail)
        except world.DesignedFailure as exc:
            raise PermanentError(str(exc)) from exc

    options: dict[str, Any] = {
        "bind": True,
        "shared": False,
        "idempotency_key": "{key}",
        "retry_on": (world.FlakyError,),
        "max_retries": 8,
        "retry_base_seconds": 0.2,
        "retry_cap_seconds": 1.0,
        # The job's tenant (plan.py; most name one): its tier queue is fed from per-tenant
        # lanes, and a republish (a retry, the reconciler's copy) names it again
        "tenant": _tenant,
    }

    def count_wake(sender: Any = None, args: Any = None, **_: Any) -> None:
        """Each wake a worker runs, by workflow (the soak reports wakes per workflow)."""
        if getattr(sender, "name", None) == WAKE_TASK and getattr(sender, "app", None) is app:
            with contextlib.suppress(Exception):  # counting never fails a wake
                world.collection("wakes").insert_one(
                    {"workflow": str((args or ["?"])[0]), "at": time.time()}
                )

    signals.task_prerun.connect(count_wake, weak=False)

    @app.task(name="soak.work", **options)  # type: ignore[untyped-decorator]
    def work(self: Any, key: str, kind: str, param: float) -> str:
        return body(self, key, kind, param)

    if release >= 2:

        @app.task(name="soak.newer", **options)  # type: ignore[untyped-decorator]
        def newer(self: Any, key: str, kind: str, param: float) -> str:
            return body(self, key, kind, param)

    # A periodic task every 2 s, fired by the workers' own scheduler through every fault: each
    # slot's run counts itself, in an atomic step (the count commits with the step's record)
    @app.task(name="soak.tick", bind=True, shared=False)  # type: ignore[untyped-decorator]
    def tick(self: Any) -> None:
        slot = self.scheduled_for
        key = "unscheduled" if slot is None else f"{slot.timestamp():.0f}"

        def count(session: ClientSession) -> None:
            ticks = session.client.get_database("soak_world").get_collection("ticks")
            ticks.update_one({"_id": key}, {"$inc": {"runs": 1}}, upsert=True, session=session)

        self.step("tick").atomic(count)

    app.conf.beat_schedule = {
        **app.conf.beat_schedule,
        "soak-tick": {"task": "soak.tick", "schedule": TICK_SECONDS},
    }

    # A workflow's step or compensation (its ledger key is the workflow's: ``wf:<id>:...``).
    @app.task(name="soak.step", **options)  # type: ignore[untyped-decorator]
    def step(self: Any, key: str, kind: str, param: float) -> str:
        return body(self, key, kind, param)

    @app.workflow(name="soak.flow", idempotency_key="{key}")  # type: ignore[untyped-decorator]
    def flow(wf: Any, key: str, steps: list[list[Any]], tier: str) -> list[str]:
        """Each step in turn, then its compensation registered: a step that fails for good
        (the designed failures' last) has the earlier ones undone, newest first."""
        done = []
        for index, (kind, param) in enumerate(steps):
            done.append(wf.run(step.s(step_effect_key(key, index), kind, param).set(tier=tier)))
            wf.compensate(step.s(undo_effect_key(key, index), "quick", 0.0).set(tier=tier))
        return done

    return app


def __getattr__(name: str) -> Any:  # ``celery -A`` reads ``app``; built on first access
    if name == "app":
        globals()["app"] = build()
        return globals()["app"]
    raise AttributeError(name)
