"""A web request that publishes a job, traced: run by test_tracing.py as a process of its own
with ``LEDGER_TRACING`` on, as a web app would be. The request's server span is the root of
the job's trace. Prints the task id and the trace id as JSON.

    python -m tests.integration.apps.traced_producer TASK_NAME ARGS_JSON
    python -m tests.integration.apps.traced_producer workflow:NAME '[ARGS, KWARGS]'
"""

from __future__ import annotations

import json
import sys

from opentelemetry import trace
from opentelemetry.trace import SpanKind


def main() -> None:
    task_name, args_json = sys.argv[1], sys.argv[2]
    from tests.integration import ledger_app

    with trace.get_tracer("web").start_as_current_span(
        "POST /checkout", kind=SpanKind.SERVER
    ) as request:
        if task_name.startswith("workflow:"):  # a durable workflow of the test app
            workflow = ledger_app.WORKFLOWS[task_name.removeprefix("workflow:")]
            args = json.loads(args_json)
            started = workflow.start(*args[0], **args[1]).id
        else:
            started = ledger_app.app.tasks[task_name].apply_async(json.loads(args_json)).id
        trace_id = format(request.get_span_context().trace_id, "032x")
    trace.get_tracer_provider().shutdown()  # type: ignore[attr-defined]
    print(json.dumps({"task_id": started, "trace_id": trace_id}))


if __name__ == "__main__":
    main()
