"""A process that commits an order with its work in one transaction and is SIGKILLed before it
can publish anything: run by test_outbox.py. The order, a job (``record``) and a workflow
(``order``) are committed; the job and the workflow's first wake are never sent by it.

    python -m tests.integration.apps.outbox_committer TOKEN
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


def main() -> None:
    token = sys.argv[1]
    from tests.integration import ledger_app

    app = ledger_app.app

    def checkout(session: Any) -> None:
        world = session.client.get_database("reference_world")
        world.orders.insert_one({"_id": token}, session=session)
        app.tasks["tests.integration.ledger_app.record"].apply_async((token,), session=session)
        ledger_app.WORKFLOWS["order"].start_with((f"{token}-wf",), {"steps": 1}, session=session)

    with app.ledger.client.start_session() as session:
        session.with_transaction(checkout, write_concern=app.ledger.write_concern)
        print("committed", flush=True)
        # Dead between the commit and the publish: a host crash, an OOM kill
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
