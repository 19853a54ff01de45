"""Celery settings and task options an app team may change on a create_app app.

Each test asserts the promised outcome: the setting is refused (ConfigurationError, at
create_app, at the declaration or at the worker's start), or it works with the guarantees
intact.
"""

from __future__ import annotations

import base64
import json
import pickle
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ledger import ConfigurationError
from celery_ledger.crypto import SEALED_CONTENT_TYPE
from celery_ledger.embedded.servers import ServerStartError
from celery_ledger.embedded.stack import EmbeddedStack, WorkerProcess

from .helpers import effect_count, wait_for

MODULE = "tests.integration.apps.celery_settings"
Start = Callable[..., tuple[Any, WorkerProcess | None, str]]


@pytest.fixture
def launch(stack: EmbeddedStack, tmp_path: Path) -> Iterator[Start]:
    """``launch(conf, task_opts, env)``: (producer app, worker or None, why it did not start).
    The producer is built in this process with the same conf and task options; a
    ConfigurationError there is returned as the reason, no worker started."""
    from tests.integration.apps.celery_settings import build

    stacks: list[EmbeddedStack] = []

    def start(
        conf: dict[str, Any] | None = None,
        task_opts: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> tuple[Any, WorkerProcess | None, str]:
        name = f"settings_{uuid.uuid4().hex[:8]}"
        conf, task_opts = conf or {}, task_opts or {}
        try:
            producer = build(name, conf, task_opts, set_as_current=False)
        except ConfigurationError as exc:
            return None, None, f"ConfigurationError: {exc}"
        other = EmbeddedStack(
            MODULE, tmp_path, broker=stack.broker, ledger=stack.ledger, queue_namespace=name
        )
        stacks.append(other)  # its workers are stopped at the end, started or not
        worker_env = {
            "SETTINGS_APP_NAME": name,
            "SETTINGS_APP_CONF": json.dumps(conf),
            "SETTINGS_APP_TASK_OPTS": json.dumps(task_opts),
            **(env or {}),
        }
        try:
            worker = other.start_worker(
                other.queues_of(),
                concurrency=1,
                name=f"{name}@127.0.0.1",
                env=worker_env,
                wait=wait,
            )
            if not wait:  # its control replies may be in a serializer a probe refuses
                time.sleep(8)
                if not worker.alive():
                    raise ServerStartError(worker.log_path.read_text()[-2000:])
        except ServerStartError as exc:
            return producer, None, str(exc)
        return producer, worker, ""

    yield start
    for other in stacks:
        for worker in other.workers:
            worker.stop()


def refused_clearly(why: str) -> bool:
    """Refused by the producer (its ConfigurationError), or by the worker at its start: the
    one ``Error:`` line a mistake is on the command line, without a traceback."""
    if why.startswith("ConfigurationError: "):
        return True
    said = any(line.startswith("Error: ") for line in why.splitlines())
    return said and "Traceback" not in why


# -- per-task acks_late=False -------------------------------------------------------------------


@pytest.mark.parametrize("acks_late", [True, False])
def test_a_requeued_job_of_a_task_with_acks_late_option_comes_back(
    launch: Start, acks_late: bool
) -> None:
    producer, worker, why = launch(task_opts={"settings.reject_once": {"acks_late": acks_late}})
    if worker is None:
        assert refused_clearly(why), why
        return
    token = uuid.uuid4().hex[:10]
    producer.tasks["settings.reject_once"].delay(token)
    # The body hands its message back once (Reject(requeue=True)); the job must run again.
    wait_for(
        lambda: effect_count("settings-reject", token) >= 2,
        timeout=25,
        what=f"the second run (acks_late={acks_late})",
    )


# -- pickle ----------------------------------------------------------------------------------


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def test_accept_content_with_pickle_is_refused_or_never_unpickles(
    launch: Start, stack: EmbeddedStack, tmp_path: Path
) -> None:
    conf = {"accept_content": ["json", "pickle", SEALED_CONTENT_TYPE]}
    # signatures required: an unsigned message must never be acted upon
    # C_FORCE_ROOT: Celery's own refusal applies to root only; production workers are not root
    producer, worker, why = launch(
        conf=conf, env={"LEDGER_SIGNATURES_REQUIRED": "true", "C_FORCE_ROOT": "true"}
    )
    if worker is None:
        assert refused_clearly(why), why
        return
    marker = tmp_path / f"unpickled-{uuid.uuid4().hex[:6]}"
    body = pickle.dumps(((_Marker(str(marker)),), {}, {}))
    task_id = str(uuid.uuid4())
    queue = producer.tiers.queue("default")
    item = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "binary",
        "content-type": "application/x-python-serialize",
        "headers": {
            "lang": "py",
            "task": "settings.echo",
            "id": task_id,
            "root_id": task_id,
            "argsrepr": "",
            "kwargsrepr": "",
        },
        "properties": {
            "correlation_id": task_id,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    with redis.Redis.from_url(stack.broker.url) as broker:
        broker.lpush(queue, json.dumps(item))
        wait_for(lambda: broker.llen(queue) == 0, timeout=15, what="the item taken")
    time.sleep(3)
    assert not marker.exists(), "the worker unpickled an unsigned broker message (ran code)"


@pytest.mark.parametrize(
    ("conf", "task_opts"),
    [
        ({}, {"settings.echo": {"serializer": "pickle"}}),
        ({"task_serializer": "pickle"}, {}),
        ({"task_serializer": "yaml"}, {}),
        (
            {"accept_content": ["json"]},
            {"settings.echo": {"sensitive": True, "idempotency_key": "{token}"}},
        ),
    ],
    ids=[
        "task-serializer-pickle",
        "conf-task-serializer-pickle",
        "conf-task-serializer-yaml",
        "accept-content-without-sealed",
    ],
)
def test_serializer_changes_are_refused_or_jobs_run(
    launch: Start, conf: dict[str, Any], task_opts: dict[str, Any]
) -> None:
    try:
        producer, worker, why = launch(conf=conf, task_opts=task_opts, wait=False)
    except ConfigurationError as exc:  # refused at the declaration
        assert str(exc)
        return
    if worker is None:
        assert refused_clearly(why), why
        return
    token = uuid.uuid4().hex[:10]
    try:
        result = producer.tasks["settings.echo"].delay(token)
    except ConfigurationError:
        return  # refused at publish, before anything left: acceptable
    try:
        assert result.get(timeout=20) == token
    finally:
        rec = producer.ledger.resolve(result.id)
        print("record:", rec and {k: rec.get(k) for k in ("state", "dead_reason")})
    assert effect_count("settings-echo", token) == 1


# -- message format ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "conf",
    [
        {"task_protocol": 1},
        {"task_compression": "gzip"},
        {"worker_prefetch_multiplier": 8},
        {"worker_deduplicate_successful_tasks": True},
        {"task_track_started": True, "result_extended": True},
        {"task_ignore_result": True},
    ],
    ids=lambda c: ",".join(c),
)
def test_message_settings_are_refused_or_jobs_run_once(launch: Start, conf: dict[str, Any]) -> None:
    producer, worker, why = launch(conf=conf)
    if worker is None:
        assert refused_clearly(why), why
        return
    token = uuid.uuid4().hex[:10]
    result = producer.tasks["settings.echo"].delay(token)
    try:
        assert result.get(timeout=20) == token
    finally:
        rec = producer.ledger.resolve(result.id)
        print("record:", rec and {k: rec.get(k) for k in ("state", "dead_reason")})
    # a second publish of the same job is a suppressed duplicate
    assert producer.tasks["settings.echo"].delay(token).get(timeout=20) == token
    assert effect_count("settings-echo", token) == 1
    assert worker.alive()


# -- transport -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "conf",
    [
        {"broker_transport_options": {"visibility_timeout": 600}},
        {"broker_transport": "redis"},
    ],
    ids=["transport-options-replaced", "transport-overridden"],
)
def test_transport_changes_still_dead_letter_a_bad_item(
    launch: Start, stack: EmbeddedStack, conf: dict[str, Any]
) -> None:
    producer, worker, why = launch(conf=conf)
    if worker is None:
        assert refused_clearly(why), why
        return
    queue = producer.tiers.queue("default")
    bad = b"\x00\xff not json " + uuid.uuid4().hex.encode()
    with redis.Redis.from_url(stack.broker.url) as broker:
        broker.lpush(queue, bad)
        token = uuid.uuid4().hex[:10]
        result = producer.tasks["settings.echo"].delay(token)
        try:
            assert result.get(timeout=20) == token
            raw = base64.b64encode(bad).decode()
            wait_for(
                lambda: producer.ledger.collection.find_one(
                    {"state": "dead", "message.raw_base64": raw}
                ),
                timeout=15,
                what="the bad item's dead record",
            )
        finally:
            print("worker alive:", worker.alive())
            print(
                "poison lists:",
                {k.decode(): broker.llen(k) for k in broker.scan_iter(match="*poison*")},
            )
