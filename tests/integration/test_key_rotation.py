"""Retiring an encryption key: ``ledger keys reseal`` seals every stored value again with the
newest key, ``ledger keys check`` says when nothing needs the old one, and after it is dropped
every job, dead letter, delayed delivery, queued message and workflow still opens."""

from __future__ import annotations

import base64
import json
import uuid
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from cryptography.fernet import Fernet
from kombu.utils.json import loads

from celery_ledger import State
from celery_ledger.cli.keys import keys
from celery_ledger.crypto import Sealer
from celery_ledger.errors import ConfigurationError
from celery_ledger.ledger.core import EPOCH
from celery_ledger.ledger.message import KeptMessage

from .conftest import make_isolated_stack, producer_app
from .helpers import shared_task, wait_for

STORE_CARD = "tests.integration.ledger_app.store_card"
REJECT_CARD = "tests.integration.ledger_app.reject_card"


def keys_cli(app: Any, *args: str) -> Any:
    return CliRunner().invoke(keys, list(args), obj=Namespace(app=app))


def sealed_strings(value: Any) -> list[str]:
    """Every sealed value in a stored document."""
    if isinstance(value, str):
        return [value] if Sealer.is_sealed(value) else []
    if isinstance(value, dict):
        return [s for item in value.values() for s in sealed_strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in sealed_strings(item)]
    return []


def test_after_a_reseal_the_old_key_can_be_dropped_and_nothing_is_lost(
    tmp_path: Path, stack: Any, token: str
) -> None:
    from tests.integration.ledger_app import declare_workflows

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    card, pin = f"4111-{uuid.uuid4().hex}", f"pin-{uuid.uuid4().hex}"
    running = make_isolated_stack(tmp_path)
    try:
        # Given a deployment that sealed with the old key alone: a job that ran, one that died
        # (its message and error history kept), a sensitive workflow that took a signal, a job
        # delayed an hour, and a job still queued when the key was rotated
        before = producer_app(running, "before_rotation", encryption_keys=[old])
        worker = running.start_worker(
            running.queues_of(), concurrency=1, env={"LEDGER_ENCRYPTION_KEYS": json.dumps([old])}
        )
        store = shared_task(before, STORE_CARD)
        ran = store.delay(token, card)
        assert ran.get(timeout=60)["echo"] == card
        died = shared_task(before, REJECT_CARD).delay(f"{token}-dies", card)
        wait_for(
            lambda: (
                (r := before.ledger.get(REJECT_CARD, f"{token}-dies")) and r.state is State.DEAD
            ),
            what="the dead record",
            timeout=60,
        )
        flow = declare_workflows(before)["vault"].start(f"{token}-wf", card)
        flow.signal("pin", pin)
        assert flow.result(timeout=60)["pin"] == pin
        worker.stop()
        running.workers.remove(worker)
        later = store.apply_async((f"{token}-later", card), countdown=3600)
        queued = store.delay(f"{token}-queued", card)

        # When the operator prepends a new key, checks, reseals and checks again (with a
        # sensitive message the transport kept as poison, not drained into the ledger yet)
        rotated = producer_app(running, "rotation_ops", encryption_keys=[new, old])
        poison = rotated.dead_letters.poison_key
        rotated.dead_letters.push_poison(
            queue="ledger_tests.default",
            reason="test poison",
            raw=Sealer([old]).seal(json.dumps([[card], {}])).encode(),
        )
        first = keys_cli(rotated, "check", "--json")
        assert first.exit_code == 1, first.output
        found = json.loads(first.output)
        assert found["total"]["stale"] >= 10 and found["total"]["unopenable"] == 0
        resealed = keys_cli(rotated, "reseal", "--actor", "rotation-test", "--json")
        assert resealed.exit_code == 0, resealed.output
        places = json.loads(resealed.output)["places"]
        assert places["delayed ledger_tests:ledger:delayed"]["stale"] == 1
        assert places["queue ledger_tests.default"]["stale"] == 1
        assert places["ledger ledger"]["stale"] >= 6  # args, kwargs, results, errors
        # the state holds the arguments; the result lives in the workflow's own ledger record
        assert places["ledger ledger_workflows"]["stale"] == 1
        assert places["ledger ledger_workflow_events"]["stale"] >= 2  # the step and the signal
        assert places[f"poison {poison}"]["stale"] == 1
        broker_client = redis.Redis.from_url(running.broker.url)  # type: ignore[union-attr]
        (entry,) = broker_client.lrange(poison, 0, -1)
        raw = base64.b64decode(json.loads(entry)["raw_base64"]).decode()
        assert json.loads(Sealer([new]).open(raw)) == [[card], {}]
        broker_client.close()
        done = keys_cli(rotated, "check")
        assert done.exit_code == 0, done.output
        again = json.loads(keys_cli(rotated, "reseal", "--json").output)
        assert again["total"]["stale"] == 0  # a second pass finds nothing to do

        # Then every sealed value in the ledger opens with the new key alone
        after = producer_app(running, "after_rotation", encryption_keys=[new])
        database = after.ledger.collection.database
        values = [
            value
            for name in database.list_collection_names()
            for doc in database[name].find()
            for value in sealed_strings(doc)
        ]
        assert len(values) >= 10
        only_new = Sealer([new])
        assert all(only_new.open(value) for value in values)

        # And a worker that holds only the new key runs the queued and the delayed jobs, and
        # the owner reads every result, the workflow and the dead job's arguments
        running.start_worker(
            running.queues_of(), concurrency=1, env={"LEDGER_ENCRYPTION_KEYS": json.dumps([new])}
        )
        assert after.AsyncResult(queued.id).get(timeout=60)["echo"] == card
        broker = redis.Redis.from_url(running.broker.url)  # type: ignore[union-attr]
        # (made due now: its delayed entry, and its record, written at its publish with its due
        # time, which a copy that comes early would wait for)
        for member in broker.zrange(after.runtime.delayed.key, 0, -1):
            broker.zadd(after.runtime.delayed.key, {member: 0})
        after.ledger.collection.update_one({"_id": later.id}, {"$set": {"claimable_at": EPOCH}})
        assert after.AsyncResult(later.id).get(timeout=60)["echo"] == card
        assert after.AsyncResult(ran.id).get(timeout=10)["echo"] == card
        handle = declare_workflows(after)["vault"].start(f"{token}-wf", card)
        assert handle.id == flow.id and handle.result(timeout=10)["pin"] == pin
        kept = KeptMessage.from_document(after.ledger.find_raw(died.id)["message"])
        assert kept is not None and kept.arguments(only_new) == ([f"{token}-dies", card], {})
        history = after.ledger.find_raw(died.id)["errors"]
        assert all(only_new.open(value) for value in sealed_strings(history))

        # And the reseal is on the audit trail: who, and what it did
        # (newest first: the second pass, by the OS user, resealed nothing)
        second, first = [e for e in after.ledger.audit_entries() if e["action"] == "reseal"]
        assert first["actor"] == "rotation-test [--actor]" and first["outcome"] == "done"
        assert first["resealed"] >= 10
        assert second["outcome"] == "done" and second["resealed"] == 0
        for producer in (before, rotated, after):
            producer.close()
    finally:
        running.stop()


def test_a_signing_key_rotation_signs_held_delayed_entries_again(stack: Any, token: str) -> None:
    from celery_ledger.delayed import DelayedDeliveries
    from celery_ledger.signing import Signer

    old, new = "old-signing-key-0123456789abcdef01234567", "new-signing-key-0123456789abcdef0123"
    key = f"rotation-test:{token}:delayed"
    url = stack.broker.url

    def held(signer: Signer | None) -> DelayedDeliveries:
        return DelayedDeliveries(url, key=key, signer=signer)

    # Given a countdown signed with the old key, and one from before signing was on
    held(Signer([old], required=False)).schedule("shop.ship", [7], {}, {"task_id": "a"}, 1e10)
    held(None).schedule("shop.ship", [8], {}, {"task_id": "b"}, 1e10)
    rotated = held(Signer([new, old], required=False))
    try:
        # When the operator reseals with the new key first
        assert rotated.reseal(lambda text: None, apply=False).stale == 2
        assert rotated.reseal(lambda text: None, apply=True).stale == 2

        # Then both are signed with the new key, and only it is needed from now on
        entries = [loads(m) for m in redis.Redis.from_url(url).zrange(key, 0, -1)]
        assert {Signer.key_id_of(e["sig"]) for e in entries} == {Signer([new]).newest_key_id}
        only_new = held(Signer([new], required=True))
        assert [only_new.entry_problem(e) for e in entries] == [None, None]
        assert rotated.reseal(lambda text: None, apply=False).stale == 0

        # And a process without signing keys refuses to reseal a signed entry it cannot sign
        # again (it would be refused when due)
        before, after = Fernet.generate_key().decode(), Fernet.generate_key().decode()
        held(Signer([new])).schedule(
            "shop.vault", ["4111"], {}, {"task_id": "c"}, 1e10, sealer=Sealer([before])
        )
        with pytest.raises(ConfigurationError, match="LEDGER_SIGNING_KEYS"):
            held(None).reseal(Sealer([after, before]).reseal, apply=True)
    finally:
        redis.Redis.from_url(url).delete(key)
