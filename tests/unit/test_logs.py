"""JSON logs: one object per line, with the running task's fields; sensitive tasks' values
redacted from Celery's task log lines."""

from __future__ import annotations

import gc
import io
import json
import logging
import weakref
from typing import Any

import pytest
from celery import Celery, Task, signals

from celery_ledger import Settings, create_app
from celery_ledger.crypto import REDACTED
from celery_ledger.observability import logs


@pytest.fixture
def stream() -> Any:
    out = io.StringIO()
    logger = logging.getLogger("logs_tests")
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logs.configure(logger)
    yield out
    logger.removeHandler(handler)


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_one_json_object_per_record_with_extra_fields_and_tracebacks(stream: Any) -> None:
    logger = logging.getLogger("logs_tests")
    logger.info("claimed %s", "r1", extra={"fence": 42})
    try:
        raise ValueError("multi\nline")
    except ValueError:
        logger.exception("failed")
    first, second = lines(stream)
    assert first["message"] == "claimed r1" and first["fence"] == 42
    assert first["level"] == "INFO" and first["logger"] == "logs_tests"
    assert first["ts"].endswith("+00:00")
    assert "task_id" not in first  # not inside a task
    assert second["level"] == "ERROR" and "ValueError: multi\nline" in second["exc_info"]


def test_records_emitted_while_a_task_runs_carry_its_fields(stream: Any) -> None:
    # Given a task whose body logs, run with ledger headers and a fencing token
    app = create_app("logs_tests", settings=Settings(), set_as_current=False)
    app.conf.task_always_eager = True

    @app.task(bind=True, name="logs_tests.work", shared=False)
    def work(self: Any) -> None:
        self.request.ledger_fence = 7  # what the guard sets after its claim
        logging.getLogger("logs_tests").info("working")

    work.apply(task_id="id-1", retries=2, headers={"ledger_key": "k-1", "ledger_tier": "bulk"})
    # Then the log line has the task's id, name, key, tier, attempt and fence
    [line] = lines(stream)
    assert line["message"] == "working"
    assert {k: line[k] for k in logs.TASK_FIELDS} == {
        "task_id": "id-1",
        "task_name": "logs_tests.work",
        "key": "k-1",
        "tier": "bulk",
        "attempt": 3,
        "fence": 7,
    }


def test_json_logs_follow_the_setting_through_celery_signals() -> None:
    # Given an app with LEDGER_LOG_FORMAT=json
    create_app("logs_json", settings=Settings(log_format="json"), set_as_current=False)
    logger = logging.getLogger("logs_tests.signal")
    handler = logging.StreamHandler(io.StringIO())
    logger.addHandler(handler)
    try:
        # When Celery sets up its logger
        signals.after_setup_logger.send(sender=None, logger=logger, loglevel=logging.INFO)
        # Then its handlers format JSON with the task filter
        assert isinstance(handler.formatter, logs.JsonFormatter)
        assert any(isinstance(f, logs.TaskContextFilter) for f in handler.filters)
    finally:
        logger.removeHandler(handler)


def test_one_filter_redacts_for_every_live_app_and_holds_none() -> None:
    logger = logging.getLogger("celery.app.trace")

    class App:
        def __init__(self, secret: str) -> None:
            self.secret = secret

        def is_sensitive(self, name: object) -> bool:
            return name == self.secret

    def line(name: str) -> str:
        record = logging.LogRecord(
            logger.name, logging.INFO, __file__, 1, "%(name)s: %(return_value)s", None, None
        )
        record.args = {"name": name, "return_value": "4111"}
        assert all(f.filter(record) for f in logger.filters)  # type: ignore[union-attr]
        return record.getMessage()

    # Given two apps, each with a sensitive task of its own
    first, second = App("a.secret"), App("b.secret")
    logs.redact_task_logs(first)
    logs.redact_task_logs(second)
    logs.redact_task_logs(first)  # (built twice: still one filter)
    # Then one filter on Celery's task logger redacts each app's task and nothing else
    assert len([f for f in logger.filters if type(f).__name__ == "RedactSensitive"]) == 1
    assert line("a.secret") == f"a.secret: {REDACTED}"
    assert line("b.secret") == f"b.secret: {REDACTED}"
    assert line("c.public") == "c.public: 4111"
    # And an app dropped by its owner is not kept alive by the logging module
    gone = weakref.ref(second)
    del second
    gc.collect()
    assert gone() is None
    assert line("b.secret") == "b.secret: 4111"


def test_a_sensitive_task_is_redacted_under_any_name_it_is_logged_by(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a task that says it is sensitive, of an app that does not know it by its logged
    # name (as when a caller gives it a ``shadow`` name, which Celery logs it under)
    class Sensitive(Task):  # type: ignore[misc]
        sensitive = True

    class Unaware:
        def is_sensitive(self, name: object) -> bool:
            return False

    owner = Unaware()
    logs.redact_task_logs(owner)
    app = Celery("shadowed", broker="memory://", backend="cache+memory://", set_as_current=False)

    @app.task(base=Sensitive, name="billing.charge", shared=False)  # type: ignore[untyped-decorator]
    def charge(card: str) -> str:
        return card

    # When it runs and Celery logs its outcome
    with caplog.at_level(logging.INFO, "celery.app.trace"):
        assert charge.apply(("4111",)).get() == "4111"
    # Then the line names the task and holds no value of it
    (line,) = [r.getMessage() for r in caplog.records if "billing.charge" in r.getMessage()]
    assert "4111" not in line and REDACTED in line
