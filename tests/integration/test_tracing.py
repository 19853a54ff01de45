"""One trace per job, across real processes: a web request's process publishes, a prefork
worker with tracing on runs the attempts (each pool process exporting its spans to a file of its
own), and the spans read back from those files must form one tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from celery_ledger import State
from celery_ledger.embedded.stack import EmbeddedStack

from .conftest import make_isolated_stack, producer_app
from .helpers import shared_task, wait_for

CARD = "4111111111111111"
TRACING_ENV = {
    "LEDGER_TRACING": "true",
    "OTEL_TRACES_EXPORTER": "none",  # no collector here: the spans go to LEDGER_TRACING_DIR
    "LEDGER_LOG_FORMAT": "json",
}


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, stack: Any) -> Iterator[dict[str, Any]]:
    """A stack of its own with one 2-process worker tracing into a directory."""
    base = tmp_path_factory.mktemp("traced")
    running = make_isolated_stack(base)
    spans = base / "spans"
    env = {**TRACING_ENV, "LEDGER_TRACING_DIR": str(spans)}
    try:
        worker = running.start_worker(
            running.queues_of("default", "critical", "bulk"),
            concurrency=2,
            name="traced@127.0.0.1",
            env=env,
        )
        yield {"stack": running, "spans": spans, "env": env, "worker": worker}
    finally:
        running.stop()


def publish_traced(traced: dict[str, Any], task: str, args: list[Any]) -> dict[str, str]:
    """Publish ``task`` from a web request's span in a process of its own (tracing on)."""
    running: EmbeddedStack = traced["stack"]
    env = {**os.environ, **running.env, **traced["env"]}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.apps.traced_producer", task, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answer: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def spans_of(directory: Path, trace_id: str) -> list[dict[str, Any]]:
    """The finished spans of ``trace_id`` every process wrote (ids as plain hex)."""
    found = []
    for path in directory.glob("spans-*.jsonl"):
        for line in path.read_text().splitlines():
            span = json.loads(line)
            span["trace_id"] = span["context"]["trace_id"].removeprefix("0x")
            span["span_id"] = span["context"]["span_id"].removeprefix("0x")
            span["parent"] = (span.get("parent_id") or "").removeprefix("0x") or None
            if span["trace_id"] == trace_id:
                found.append(span)
    return found


def ancestors(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> list[str]:
    names = []
    while span["parent"] is not None and span["parent"] in by_id:
        span = by_id[span["parent"]]
        names.append(span["name"])
    return names


def test_a_request_publish_retry_and_success_are_one_trace(traced: dict[str, Any]) -> None:
    token = f"trace-{uuid.uuid4().hex[:8]}"
    name = "tests.integration.ledger_app.sensitive_progress"

    # Given a web request that publishes a sensitive job whose first attempt fails after its
    # steps (it is retried through the delayed set, published again by housekeeping)
    sent = publish_traced(traced, name, [token, CARD])
    probe = producer_app(traced["stack"], "traced_probe")
    wait_for(
        lambda: (r := probe.ledger.get(name, token)) and r.state is State.SUCCEEDED,
        timeout=60,
        what="the job succeeded",
    )

    # Then every span of both attempts is in the request's trace
    def both_runs_exported() -> list[dict[str, Any]] | None:
        spans = spans_of(traced["spans"], sent["trace_id"])
        runs = [s for s in spans if s["name"] == f"run/{name}"]
        return spans if len(runs) == 2 else None

    spans = wait_for(both_runs_exported, timeout=30, what="both attempts' spans")
    by_id = {s["span_id"]: s for s in spans}
    roots = [s for s in spans if s["parent"] is None]
    assert [r["name"] for r in roots] == ["POST /checkout"]
    assert all(ancestors(s, by_id)[-1:] == ["POST /checkout"] for s in spans if s not in roots)

    runs = sorted((s for s in spans if s["name"] == f"run/{name}"), key=lambda s: s["start_time"])
    first, second = runs
    assert first["attributes"]["ledger.outcome"] == "retried"
    assert second["attributes"]["ledger.outcome"] == "succeeded"
    # The retry is published from the first attempt: the second attempt descends from it
    assert first["name"] in ancestors(second, by_id)
    assert by_id[second["parent"]]["name"] == f"apply_async/{name}"
    # Each attempt claims, runs its body and its steps, and completes, as child spans
    for run in runs:
        below = {s["name"] for s in spans if run["name"] in ancestors(s, by_id)[:3]}
        assert {"ledger claim", "body", "step vault", "step charge"} <= below, below
    assert any(
        s["name"] == "ledger completion" and second["span_id"] in _chain(s, by_id) for s in spans
    )
    assert first["attributes"]["ledger.fence"] < second["attributes"]["ledger.fence"]
    assert any(e["name"] == "retry scheduled" for e in first["events"])

    # And no span carries the card number; the key of a sensitive task is a digest
    assert CARD not in json.dumps(spans)
    assert second["attributes"]["ledger.key"].startswith(("hmac:", "sha256:"))

    # And the record names the trace; the worker's log lines of the job carry it
    record = probe.ledger.get(name, token)
    assert record is not None and record.trace_id == sent["trace_id"]
    logged = [
        entry
        for line in traced["worker"].log_path.read_text().splitlines()
        if line.startswith("{") and sent["task_id"] in line
        if (entry := json.loads(line))["process"].startswith("ForkPoolWorker")
    ]
    assert len(logged) == 2  # the retry and the success
    assert all(entry.get("trace_id") == sent["trace_id"] for entry in logged)


def _chain(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> list[str]:
    ids = []
    while span["parent"] is not None and span["parent"] in by_id:
        ids.append(span["parent"])
        span = by_id[span["parent"]]
    return ids


def test_a_sensitive_jobs_error_text_is_on_no_span(traced: dict[str, Any]) -> None:
    token = f"trace-card-{uuid.uuid4().hex[:8]}"
    name = "tests.integration.ledger_app.reject_card"
    probe = producer_app(traced["stack"], "traced_probe")

    # Given a sensitive job whose error quotes the card it failed on
    sent = publish_traced(traced, name, [token, CARD])
    wait_for(
        lambda: (r := probe.ledger.get(name, token)) and r.state is State.DEAD,
        timeout=60,
        what="the job dead",
    )

    def run_exported() -> list[dict[str, Any]] | None:
        spans = spans_of(traced["spans"], sent["trace_id"])
        return spans if any(s["name"] == f"run/{name}" for s in spans) else None

    # Then its spans say it failed, and how (the exception's type), never with what
    spans = wait_for(run_exported, timeout=30, what="the job's spans")
    [run] = [s for s in spans if s["name"] == f"run/{name}"]
    assert run["attributes"]["ledger.outcome"] == "dead"
    assert run["status"]["status_code"] == "ERROR"
    exceptions = [e for s in spans for e in s["events"] if e["name"] == "exception"]
    assert exceptions and all(
        set(e["attributes"]) <= {"exception.type", "exception.escaped"} for e in exceptions
    )
    assert CARD not in json.dumps(spans)
    assert "celery.retry.reason" not in json.dumps(spans)


def test_a_replayed_dead_job_continues_its_trace(traced: dict[str, Any]) -> None:
    token = f"trace-dead-{uuid.uuid4().hex[:8]}"
    name = "tests.integration.ledger_app.fails_until_fixed"
    probe = producer_app(traced["stack"], "traced_probe")
    shared_task(probe, name)  # a replay needs the task registered where it runs

    # Given a traced job that is dead-lettered
    sent = publish_traced(traced, name, [token])
    wait_for(
        lambda: (r := probe.ledger.get(name, token)) and r.state is State.DEAD,
        timeout=60,
        what="the job dead",
    )
    # When its data is fixed and an operator replays it (from a process without tracing)
    with MongoClient(traced["stack"].ledger.url) as client:  # the traced stack's world
        client.get_database("reference_world").effects.insert_one({"kind": "fixed", "key": token})
    dead = probe.ledger.find_raw(probe.ledger.get(name, token).id)  # type: ignore[union-attr]
    assert probe.dead_letters.replay(dead, actor="test").replayed
    wait_for(
        lambda: (r := probe.ledger.get(name, token)) and r.state is State.SUCCEEDED,
        timeout=60,
        what="the replay succeeded",
    )

    # Then the replayed run is in the original trace, below the dead attempt's run
    def replay_exported() -> list[dict[str, Any]] | None:
        spans = spans_of(traced["spans"], sent["trace_id"])
        runs = [s for s in spans if s["name"] == f"run/{name}"]
        ok = [r for r in runs if r["attributes"].get("ledger.outcome") == "succeeded"]
        return spans if ok else None

    spans = wait_for(replay_exported, timeout=30, what="the replay's spans")
    by_id = {s["span_id"]: s for s in spans}
    runs = sorted((s for s in spans if s["name"] == f"run/{name}"), key=lambda s: s["start_time"])
    assert runs[0]["attributes"]["ledger.outcome"] == "dead"
    assert runs[-1]["attributes"]["ledger.outcome"] == "succeeded"
    assert runs[0]["span_id"] in _chain(runs[-1], by_id)


def test_a_workflow_its_steps_and_its_timer_are_one_trace(traced: dict[str, Any]) -> None:
    token = f"trace-wf-{uuid.uuid4().hex[:8]}"
    probe = producer_app(traced["stack"], "traced_probe")

    # Given a workflow started by a web request: two steps, a timer, a fan-out of two
    sent = publish_traced(traced, "workflow:order", [[token], {"steps": 2, "sleep": 0.3}])
    wait_for(
        lambda: (r := probe.ledger.get_by_id(sent["task_id"])) and r.state is State.SUCCEEDED,
        timeout=60,
        what="the workflow completed",
    )

    # Then every step's run is in the request's trace, under the request
    step = "run/tests.integration.ledger_app.wf_step"

    def steps_exported() -> list[dict[str, Any]] | None:
        spans = spans_of(traced["spans"], sent["trace_id"])
        return spans if sum(s["name"] == step for s in spans) == 4 else None

    spans = wait_for(steps_exported, timeout=30, what="the steps' spans")
    by_id = {s["span_id"]: s for s in spans}
    assert [s["name"] for s in spans if s["parent"] is None] == ["POST /checkout"]
    for run in (s for s in spans if s["name"] == step):
        assert ancestors(run, by_id)[-1] == "POST /checkout"


def test_a_malformed_trace_header_costs_the_job_nothing(traced: dict[str, Any]) -> None:
    probe = producer_app(traced["stack"], "traced_probe")
    record = shared_task(probe, "tests.integration.ledger_app.record")
    tokens = []
    # Given messages whose trace headers are not W3C (garbage, a list, a number, huge)
    for i, bad in enumerate(["garbage", ["00-x"], 12, "00-" + "f" * 5000]):
        token = f"trace-bad-{i}-{uuid.uuid4().hex[:6]}"
        record.apply_async((token,), headers={"traceparent": bad, "tracestate": bad})
        tokens.append(token)
    # Then each job runs once and succeeds, in a trace of its own
    for token in tokens:
        wait_for(
            lambda t=token: (r := probe.ledger.get(record.name, t)) and r.state is State.SUCCEEDED,
            timeout=30,
            what=f"{token} succeeded",
        )
