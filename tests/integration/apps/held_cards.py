"""An app with a slow sensitive task: it holds a card while the worker is asked what it runs."""

from __future__ import annotations

import time
from typing import Any

from celery_ledger import create_app

NAMESPACE = "held_cards"
HOLD = "held_cards.hold"


def hold(token: str, card_number: str, seconds: float) -> str:
    time.sleep(seconds)
    return card_number[-4:]


def register(app: Any) -> Any:
    """The task on ``app`` (a producer binds it too; not a shared task, which every app of a
    test process would get)."""
    return app.task(name=HOLD, idempotency_key="{token}", sensitive=True, shared=False)(hold)


app = create_app(NAMESPACE, set_as_current=False)
held = register(app)
