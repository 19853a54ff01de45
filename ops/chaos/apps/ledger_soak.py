"""The soak on celery-ledger: settings from ``LEDGER_*``; ``soak.work`` keyed on ``key``.

Its effect is an atomic step (``self.step("effect").atomic``): the effect document and the
step record commit in one transaction on the ledger's server.
"""

from __future__ import annotations

from typing import Any

from pymongo.client_session import ClientSession

from celery_ledger import LedgerCelery, PermanentError, Settings, create_app

from . import world

RESTORE_SWEEP = {
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    # A worker killed while it sweeps holds the sweep lock until this expires (300 s default).
    "unacked_mutex_expire": 10,
}


def build(settings: Settings | None = None) -> LedgerCelery:
    """The app (settings from ``LEDGER_*`` unless given) with its one task, ``soak.work``."""
    app = create_app("soak_ledger", settings=settings, set_as_current=False)
    # kombu sweeps for unacked messages past the visibility timeout only every
    # interval x throttle seconds (10 x 10 by default): sweep every second instead.
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        **RESTORE_SWEEP,
    }

    @app.task(  # type: ignore[untyped-decorator]
        bind=True,
        shared=False,
        name="soak.work",
        idempotency_key="{key}",
        retry_on=(world.FlakyError,),
        max_retries=8,
        retry_base_seconds=0.2,
        retry_cap_seconds=1.0,
    )
    def work(self: Any, key: str, kind: str, param: float) -> str:
        def act(doc: dict[str, Any]) -> None:
            # The effect commits with the step record, in one transaction on the ledger.
            def write(session: ClientSession) -> None:
                effects = session.client.get_database("soak_world").get_collection("effects")
                effects.insert_one(dict(doc), session=session)

            self.step("effect").atomic(write)

        try:
            fence = getattr(self.request, "ledger_fence", None)
            return world.work("ledger", key, kind, param, fence, act)
        except world.DesignedFailure as exc:
            raise PermanentError(str(exc)) from exc

    return app


def __getattr__(name: str) -> Any:  # ``celery -A`` reads ``app``; built on first access
    if name == "app":
        globals()["app"] = build()
        return globals()["app"]
    raise AttributeError(name)
