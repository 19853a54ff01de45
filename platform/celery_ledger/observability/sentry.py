"""Sentry reports (extra ``sentry``: ``sentry-sdk`` with its Celery integration).

On when ``LEDGER_SENTRY_DSN`` is set. Besides the task failures the Celery integration reports,
three platform events become Sentry events, each grouped by its own fingerprint:

    dead        ["celery-ledger", "dead", <the dead letter's fingerprint>]   level error
    breaker     ["celery-ledger", "breaker-open", <breaker name>]            level warning
    lease_lost  ["celery-ledger", "lease-lost", <task name>]                  level warning

A dead job raised by its body is reported with that exception (the integration's later report
of the same exception is dropped by Sentry's dedupe). Control flow is never reported (Celery's
``Retry``/``Ignore``/``Reject``, our ``LeaseLost``/``CircuitOpen``). Scrubbed by default: no
PII, no local variables, no task arguments, results or request bodies, no credentials in URLs.
An event about a ``sensitive=True`` task keeps its exception's type and stack (code, not
data) but not its message, nor any message or reason text: an exception's text often carries
the arguments it failed on.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore, Reject, Retry

from ..errors import ConfigurationError, ControlFlow
from ..events import Job, Observer

if TYPE_CHECKING:
    from ..ledger.dead import DeadLetter
    from ..runtime import Runtime

logger = logging.getLogger("celery_ledger.sentry")

CONTROL_FLOW: tuple[type[BaseException], ...] = (Retry, Ignore, Reject, ControlFlow)
FILTERED = "[Filtered]"
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/\s@:]*:[^/\s@]*@", re.I)
_DATA_KEYS = frozenset({"args", "kwargs", "result", "retval", "return_value", "message", "body"})


def install(
    runtime: Runtime,
    *,
    transport: Any = None,
    sensitive: Callable[[str], bool] = lambda name: False,
) -> bool:
    """``sentry_sdk.init`` with the integration and the scrubbing; observe the events.
    ``sensitive`` tells whether a task name is a sensitive task (its events lose their text)."""
    dsn = runtime.settings.sentry_dsn
    if not dsn:
        return False
    try:
        import sentry_sdk
        from sentry_sdk.integrations.celery import CeleryIntegration
        from sentry_sdk.integrations.logging import ignore_logger
    except ImportError as exc:
        raise ConfigurationError(
            "LEDGER_SENTRY_DSN needs sentry-sdk: pip install 'celery-ledger[sentry]'"
        ) from exc
    options: dict[str, Any] = {}
    if transport is not None:
        options["transport"] = transport
    sentry_sdk.init(
        dsn=dsn,
        integrations=[CeleryIntegration(propagate_traces=False)],
        # No PII: send_default_pii is off by default (and deprecated in recent SDKs, which
        # derive their data_collection from it); our before_send scrubs on top of that.
        include_local_variables=False,
        max_request_body_size="never",
        before_send=functools.partial(before_send, sensitive=sensitive),  # type: ignore[arg-type]
        before_breadcrumb=before_breadcrumb,
        **options,
    )
    ignore_logger("celery_ledger.deadletter")  # its error line is the `dead` event below
    runtime.observers.add(SentryObserver())
    return True


class SentryObserver(Observer):
    """Dead letters, breakers opening and lost leases as Sentry events."""

    def dead(self, job: Job, letter: DeadLetter) -> None:
        """Called inside the guard's ``except`` when a body's exception killed the job."""
        import sentry_sdk

        group = str(letter.fingerprint or job.task)
        with sentry_sdk.new_scope() as scope:
            scope.fingerprint = ["celery-ledger", "dead", group]
            _tag(scope, "dead", task=job.task, tier=job.tier)
            scope.set_context(
                "dead letter",
                {
                    "record_id": job.record_id,
                    "reason": str(letter.reason or "")[:500],
                    "fingerprint": group,
                    "fingerprint_text": letter.fingerprint_text,
                },
            )
            exc = sys.exc_info()[1]
            if exc is not None and not isinstance(exc, CONTROL_FLOW):
                sentry_sdk.capture_exception(exc)
            else:
                sentry_sdk.capture_message(
                    f"dead-lettered {job.task}: {letter.reason}", level="error"
                )

    def breaker(self, name: str, old: str, new: str) -> None:
        import sentry_sdk

        if new != "open":
            return
        with sentry_sdk.new_scope() as scope:
            scope.fingerprint = ["celery-ledger", "breaker-open", name]
            _tag(scope, "breaker", breaker=name)
            sentry_sdk.capture_message(f"circuit breaker {name!r} opened", level="warning")

    def trigger_problem(self, trigger: str, namespace: str, problem: str, detail: str) -> None:
        import sentry_sdk
        from sentry_sdk.integrations.logging import ignore_logger

        ignore_logger("celery_ledger.triggers")  # its error line is this event
        with sentry_sdk.new_scope() as scope:
            scope.fingerprint = ["celery-ledger", "trigger", trigger, problem]
            _tag(scope, "trigger_problem", trigger=trigger)
            scope.set_context("trigger", {"namespace": namespace, "detail": detail[:500]})
            sentry_sdk.capture_message(
                f"trigger {trigger} stopped: {problem}; reset it and backfill", level="error"
            )

    def commit_lost(self, job: Job, steps: tuple[str, ...]) -> None:
        import sentry_sdk

        with sentry_sdk.new_scope() as scope:
            scope.fingerprint = ["celery-ledger", "commit-lost"]
            _tag(scope, "commit_lost", task=job.task, tier=job.tier)
            scope.set_context("commit", {"record_id": job.record_id, "steps": list(steps)})
            sentry_sdk.capture_message(
                "the ledger lost a transaction it had acknowledged (atomic steps of"
                f" {job.task}); the job runs again. Check the server's journaling and the"
                " write concern (LEDGER_MONGO_WRITE_CONCERN=majority)",
                level="error",
            )

    def step_skipped(self, job: Job, step: str, reason: str) -> None:
        # Not an event: a breadcrumb on whatever the job reports later (a degraded job that
        # then fails shows which of its steps were skipped, and why).
        import sentry_sdk

        sentry_sdk.add_breadcrumb(
            category="celery-ledger.degraded",
            message=f"optional step {step} of {job.task} skipped: {reason}",
            level="warning",
        )

    def degraded(self, job: Job, reason: str, fallback: str) -> None:
        # A breadcrumb: degrading is the platform working as configured; what the job reports
        # later (its replacement failing, say) shows it was served degraded, and why.
        import sentry_sdk

        sentry_sdk.add_breadcrumb(
            category="celery-ledger.degraded",
            message=f"{job.task} served its fallback {fallback} ({reason})",
            level="warning",
            data={"record_id": job.record_id, "reason": reason, "fallback": fallback},
        )

    def late(self, job: Job, age_seconds: float, slo_seconds: float) -> None:
        import sentry_sdk

        with sentry_sdk.new_scope() as scope:
            scope.fingerprint = ["celery-ledger", "late", job.task]
            _tag(scope, "late", task=job.task, tier=job.tier)
            scope.set_context(
                "objective",
                {
                    "record_id": job.record_id,
                    "age_seconds": round(age_seconds, 1),
                    "slo_seconds": slo_seconds,
                },
            )
            sentry_sdk.capture_message(
                f"{job.task} is late: {age_seconds:.0f}s old, its objective is"
                f" {slo_seconds:.0f}s (see the runbook: jobs past their objective)",
                level="warning",
            )

    def lease_lost(self, job: Job, fence: int) -> None:
        import sentry_sdk

        with sentry_sdk.new_scope() as scope:
            scope.fingerprint = ["celery-ledger", "lease-lost", job.task]
            _tag(scope, "lease_lost", task=job.task, tier=job.tier)
            scope.set_context("lease", {"record_id": job.record_id, "fence": fence})
            sentry_sdk.capture_message(
                f"lease lost by {job.task}: a newer claim took over (raise lease_seconds?)",
                level="warning",
            )


def _tag(scope: Any, event: str, **tags: Any) -> None:
    scope.set_tag("celery_ledger.event", event)
    for name, value in tags.items():
        if value is not None:
            scope.set_tag(f"celery_ledger.{name}", str(value))


def before_send(
    event: dict[str, Any],
    hint: dict[str, Any],
    *,
    sensitive: Callable[[str], bool] = lambda name: False,
) -> dict[str, Any] | None:
    """Drop control flow; scrub request data, task data, local variables and URL credentials;
    and every text of an event about a sensitive task."""
    exc_info = hint.get("exc_info") if hint else None
    if exc_info and isinstance(exc_info[1], CONTROL_FLOW):
        return None
    try:
        event = scrub(event)
        task = _task_of(event)
        return _without_text(event) if task is not None and sensitive(task) else event
    except Exception:  # never send an event we could not scrub
        logger.warning("could not scrub a Sentry event; dropped", exc_info=True)
        return None


def before_breadcrumb(crumb: dict[str, Any], hint: dict[str, Any]) -> dict[str, Any] | None:
    crumb.pop("data", None)
    if isinstance(crumb.get("message"), str):
        crumb["message"] = redact(crumb["message"])
    return crumb


def scrub(event: dict[str, Any]) -> dict[str, Any]:
    event.pop("request", None)
    for name in ("extra", "contexts"):
        section = event.get(name)
        if isinstance(section, dict):
            event[name] = _strip_data(section)
    for container in ("exception", "threads"):
        for value in (event.get(container) or {}).get("values") or []:
            if isinstance(value.get("value"), str):
                value["value"] = redact(value["value"])
            for frame in (value.get("stacktrace") or {}).get("frames") or []:
                frame.pop("vars", None)
    if isinstance(event.get("message"), str):
        event["message"] = redact(event["message"])
    logentry = event.get("logentry")
    if isinstance(logentry, dict):
        for key in ("message", "formatted"):
            if isinstance(logentry.get(key), str):
                logentry[key] = redact(logentry[key])
        logentry.pop("params", None)  # log arguments: any data
    for crumb in (event.get("breadcrumbs") or {}).get("values") or []:
        before_breadcrumb(crumb, {})
    return event


SENSITIVE_TEXT = "[Filtered: sensitive task]"


def _task_of(event: dict[str, Any]) -> str | None:
    """The task an event is about: the Celery integration's job context, or our tag."""
    job = (event.get("extra") or {}).get("celery-job")
    if isinstance(job, dict) and isinstance(job.get("task_name"), str):
        return str(job["task_name"])
    tags = event.get("tags")
    if isinstance(tags, dict) and isinstance(tags.get("celery_ledger.task"), str):
        return str(tags["celery_ledger.task"])
    return None


def _without_text(event: dict[str, Any]) -> dict[str, Any]:
    for container in ("exception", "threads"):
        for value in (event.get(container) or {}).get("values") or []:
            if "value" in value:
                value["value"] = SENSITIVE_TEXT
    if "message" in event:
        event["message"] = SENSITIVE_TEXT
    logentry = event.get("logentry")
    if isinstance(logentry, dict):
        for key in ("message", "formatted"):
            if key in logentry:
                logentry[key] = SENSITIVE_TEXT
    dead = (event.get("contexts") or {}).get("dead letter")
    if isinstance(dead, dict):
        dead["reason"] = SENSITIVE_TEXT
    for crumb in (event.get("breadcrumbs") or {}).get("values") or []:
        if "message" in crumb:
            crumb["message"] = SENSITIVE_TEXT
    return event


def _strip_data(value: Any) -> Any:
    """Task arguments and results out; strings redacted, recursively."""
    if isinstance(value, dict):
        return {
            key: FILTERED if key in _DATA_KEYS else _strip_data(item) for key, item in value.items()
        }
    if isinstance(value, list):
        return [_strip_data(item) for item in value]
    if isinstance(value, str):
        return redact(value)
    return value


def redact(text: str) -> str:
    """``redis://:secret@host`` → ``redis://[Filtered]@host``."""
    return _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{FILTERED}@", text)
