"""A ledger app whose Celery settings and task options an app team changed.

``SETTINGS_APP_NAME`` names the app (and so its queues); ``SETTINGS_APP_CONF`` (JSON) is laid
over the conf with ``app.conf.update`` after ``create_app``; ``SETTINGS_APP_TASK_OPTS`` (JSON,
by task name) adds options to the task declarations.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery.exceptions import Reject

from celery_ledger import LedgerCelery, create_app
from tasks.effects import effects, record_effect


def build(
    name: str, conf: dict[str, Any], task_opts: dict[str, dict[str, Any]], **kw: Any
) -> LedgerCelery:
    app = create_app(name, **kw)
    if conf:
        app.conf.update(**conf)

    def opts(task: str) -> dict[str, Any]:
        return {"name": task, "shared": False, **task_opts.get(task, {})}

    @app.task(**opts("settings.echo"))
    def echo(token: str) -> str:
        record_effect("settings-echo", token)
        return token

    @app.task(**opts("settings.reject_once"))
    def reject_once(token: str) -> str:
        runs = effects().count_documents({"kind": "settings-reject", "key": token})
        record_effect("settings-reject", token)
        if runs == 0:
            raise Reject("handed back once", requeue=True)
        return "second run"

    return app


app = build(
    os.environ.get("SETTINGS_APP_NAME", "celery_settings"),
    json.loads(os.environ.get("SETTINGS_APP_CONF", "{}")),
    json.loads(os.environ.get("SETTINGS_APP_TASK_OPTS", "{}")),
)
