"""The execution guard: claim the ledger record, run the body once, record the outcome.

Called by :meth:`LedgerTask.__call__` in the worker. Every outcome ends in exactly one of:
the body ran and its outcome is recorded under our fencing token; the delivery is a duplicate
and is acknowledged without running; or the message is deferred (republished for later through
the delayed deliveries) or requeued, so nothing is ever dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
import traceback
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import redis
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded

from . import headers
from .crypto import REDACTED
from .deadletter import dead_letter_fields, entry_of, fingerprint
from .errors import (
    CircuitOpen,
    LeaseLost,
    LedgerError,
    LedgerUnavailable,
    PayloadError,
    PermanentError,
)
from .ledger.record import ErrorEntry
from .ledger.store import ClaimOutcome, utcnow
from .policies.backoff import backoff_seconds
from .policies.breaker import Admission, CircuitBreaker
from .policies.retry import classify, decide
from .progress import Execution, Heartbeat, Interrupted
from .untrusted import (
    expiry_of,
    float_or_none,
    request_header,
    retries_done,
    storable,
    storable_value,
    valid_key_or_none,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from .task import LedgerTask

logger = logging.getLogger("celery_ledger.guard")


def run_guarded(task: LedgerTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    request = task.request
    ledger = task.app.ledger
    # Raw messages may carry anything: what the guard and Celery's retry read must be sound.
    request.retries = retries_done(request.retries)
    key = valid_key_or_none(request_header(request, headers.KEY), task.name) or f"id:{request.id}"
    header_tier = request_header(request, headers.TIER)  # raw messages may carry anything
    if not (isinstance(header_tier, str) and header_tier in task.app.tiers.names):
        header_tier = None
    tier: str = header_tier or task.tier or task.app.tiers.default
    request.ledger_run_tier = tier  # a retry republishes to it (LedgerTask.retry)
    request.ledger_key = key  # LedgerTask.job_key
    owner = f"{request.hostname or 'local'}:{os.getpid()}"
    context = {"task_id": request.id, "key": key, "tier": tier}
    breaker = task.app.breakers[task.breaker] if task.breaker else None
    admission = admit_or_defer(task, breaker, args, kwargs, key=key, tier=tier)
    wait_for_rate(task, args, kwargs, key=key, tier=tier)

    try:
        claim = ledger.claim(
            request.id,
            task=task.name,
            key=key,
            tier=tier,
            owner=owner,
            lease_seconds=task.lease_seconds,
            message=sealed_if_sensitive(
                task, {"args_json": json.dumps(list(args)), "kwargs_json": json.dumps(kwargs)}
            ),
            max_attempts=task.max_attempts,
        )
    except LedgerUnavailable as exc:
        deferrals = int(float_or_none(request_header(request, headers.DEFERRALS)) or 0)
        settings = task.app.settings
        delay = backoff_seconds(
            deferrals,
            base_seconds=settings.unavailable_backoff_base_seconds,
            cap_seconds=settings.unavailable_backoff_cap_seconds,
        )
        logger.warning(
            "ledger unavailable; deferring %s by %.1fs: %s", request.id, delay, exc, extra=context
        )
        defer(
            task,
            args,
            kwargs,
            delay_seconds=max(delay, 0.2),
            key=key,
            tier=tier,
            reason="ledger unavailable",
        )

    hooks = task.app.hooks
    if claim.outcome is ClaimOutcome.DUPLICATE:
        hooks.emit("duplicate", task=task.name, tier=tier, record_id=request.id)
        logger.info("duplicate suppressed: %s already succeeded", request.id, extra=context)
        request.ledger_settled = True
        if request.callbacks or request.chain:
            # The original run may have died before dispatching its callbacks: return the
            # stored result so Celery dispatches them (their own ledger records dedupe them).
            record = ledger.get_by_id(request.id)
            return None if record is None else record.result
        raise Ignore("duplicate delivery of a succeeded job")
    if claim.outcome is ClaimOutcome.DEAD:
        if claim.killed_reason:
            killed = ledger.find_raw(request.id)
            if killed is not None:
                announce_dead(task, killed, args, kwargs)
        logger.warning(
            "delivery of dead job %s dropped; replay it to run again", request.id, extra=context
        )
        raise Ignore("delivery of a dead job")
    if claim.outcome is ClaimOutcome.BUSY:
        assert claim.retry_at is not None
        # Back when the lease ends, or sooner to see whether the holder finished (then this
        # delivery is a suppressed duplicate); a holder that died is taken over at lease end.
        wait = max((claim.retry_at - utcnow()).total_seconds(), 0.0)
        wait = min(wait, task.app.settings.busy_recheck_seconds)
        delay = wait + random.uniform(0.05, 0.25 + wait * 0.1)
        logger.info(
            "%s is leased by another delivery; back in %.1fs", request.id, delay, extra=context
        )
        defer(
            task,
            args,
            kwargs,
            delay_seconds=delay,
            key=key,
            tier=tier,
            reason="leased by another delivery",
        )

    fence = claim.fence
    hooks.emit("claimed", task=task.name, tier=tier, record_id=request.id, fence=fence)
    started = time.monotonic()
    request.ledger_fence = fence
    request.ledger_settled = True
    lease_seconds = task.lease_seconds or ledger.lease_seconds
    context["fence"] = fence
    expired = expiry_reason(task, request)
    if expired is not None:
        retire_job(task, request.id, fence, args, kwargs, key=key, tier=tier, reason=expired)
        raise Ignore("expired")
    interval = lease_seconds / 3 if task.heartbeat_seconds is None else task.heartbeat_seconds
    heartbeat = Heartbeat(
        ledger,
        request.id,
        fence,
        lease_seconds=lease_seconds,
        interval_seconds=interval or lease_seconds,
    )
    if interval:
        heartbeat.start()
    request.ledger_execution = Execution(ledger, request.id, fence, heartbeat, lease_seconds)
    try:
        return _run_claimed(
            task,
            args,
            kwargs,
            key=key,
            tier=tier,
            owner=owner,
            fence=fence,
            admission=admission,
            breaker=breaker,
            started=started,
            context=context,
            lease_seconds=lease_seconds,
        )
    finally:
        heartbeat.stop()


def _run_claimed(
    task: LedgerTask,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    key: str,
    tier: str,
    owner: str,
    fence: int,
    admission: Admission | None,
    breaker: CircuitBreaker | None,
    started: float,
    context: dict[str, Any],
    lease_seconds: float,
) -> Any:
    """Run the body under the claim ``fence`` and record its outcome."""
    request = task.request
    ledger = task.app.ledger
    hooks = task.app.hooks

    def persist(write: Callable[[], None], what: str) -> None:
        persist_until(
            write,
            deadline=time.monotonic() + lease_seconds * 0.8,
            what=what,
            record_id=request.id,
            on_lease_lost=lambda lost: hooks.emit(
                "lease_lost", task=task.name, tier=tier, record_id=request.id, fence=lost.fence
            ),
        )

    def dead_letter(
        exc: BaseException, *, reason: str, digest: str, text: str, traceback_text: str = ""
    ) -> None:
        """Record the job dead with its reason and original message, then announce it."""
        error = error_entry(
            task.sensitive,
            exc,
            owner=owner,
            attempt=request.retries + 1,
            fence=fence,
            action="dead",
        )
        fields = dead_letter_fields(
            reason=storable(redacted_reason(task, reason)),
            digest=digest,
            text=storable(text),
            args=list(args),
            kwargs=kwargs,
            message_headers=storable_value(message_headers_of(request, key, tier)),
        )
        fields["message"] = sealed_if_sensitive(task, fields["message"])
        persist(
            lambda: ledger.record_failure(
                request.id,
                fence,
                error,
                retry_at=None,
                traceback=traceback_text,
                reason=fields["dead_reason"],
                dead_fields=fields,
            ),
            "failure record",
        )
        announce_dead(
            task,
            {
                "_id": request.id,
                "task": task.name,
                "key": key,
                "tier": tier,
                "errors": [error.model_dump()],
                **fields,
            },
            args,
            kwargs,
        )

    try:
        check_payload_size(task, args, kwargs)
        retval = task.run(*args, **kwargs)
    except Interrupted:  # warm shutdown: progress is checkpointed, the message goes back
        persist(lambda: ledger.release(request.id, fence), "release")
        logger.warning(
            "%s interrupted by shutdown; requeued to resume from its checkpoint",
            request.id,
            extra=context,
        )
        raise Reject("worker shutting down", requeue=True) from None
    except SoftTimeLimitExceeded:
        limit = task.soft_time_limit or (request.timelimit and request.timelimit[1])
        retire_job(
            task,
            request.id,
            fence,
            args,
            kwargs,
            key=key,
            tier=tier,
            reason=f"time limit exceeded (soft, {limit}s)",
        )
        raise
    except CircuitOpen as exc:  # a breaker used inside the body is open: come back later
        persist(lambda: ledger.release(request.id, fence), "release")
        delay = max((exc.retry_at or time.time()) - time.time(), 0.0) + random.uniform(0.05, 0.5)
        logger.info("%s: %s; deferred by %.1fs", request.id, exc, delay, extra=context)
        defer(
            task,
            args,
            kwargs,
            delay_seconds=delay,
            key=key,
            tier=tier,
            reason="circuit open (inside the body)",
        )
    except Retry as exc:  # the body (or Celery's autoretry) asked for a retry
        report_to_breaker(task, breaker, admission, exc.exc)
        retry_at = retry_time(exc.when)
        error = error_entry(
            task.sensitive,
            exc.exc or exc,
            owner=owner,
            attempt=request.retries + 1,
            fence=fence,
            action="retry",
        )
        text = "" if task.sensitive else storable(format_tb(exc.exc))
        persist(
            lambda: ledger.record_failure(
                request.id, fence, error, retry_at=retry_at, traceback=text
            ),
            "retry record",
        )
        raise
    except (Ignore, Reject):
        persist(lambda: ledger.release(request.id, fence), "release")
        raise
    except Exception as exc:
        report_to_breaker(task, breaker, admission, exc)
        decision = decide(
            exc,
            policy=task.resolved_retry_policy(tier),
            retries_done=request.retries,
            previous_delay=float_or_none(request_header(request, headers.PREVIOUS_DELAY)),
            retry_on=tuple(task.retry_on or ()),
            fail_on=tuple(task.fail_on or ()),
        )
        text = "" if task.sensitive else storable(format_tb(exc))
        if decision.retry:
            schedule_retry(
                task,
                exc,
                decision.delay_seconds,
                key=key,
                tier=tier,
                fence=fence,
                owner=owner,
                traceback_text=text,
                persist=persist,
            )
        digest, fingerprint_text = fingerprint(exc)
        dead_letter(
            exc, reason=decision.reason, digest=digest, text=fingerprint_text, traceback_text=text
        )
        raise

    try:
        result_json = json.dumps(retval, allow_nan=False)
    except (TypeError, ValueError) as exc:
        payload_error = PayloadError(f"{task.name} returned a value JSON cannot hold: {exc}")
        dead_letter(
            payload_error,
            reason=f"result not JSON: {exc}",
            digest="result-not-json",
            text=f"PayloadError: result of {task.name} is not JSON",
        )
        raise payload_error from exc
    report_to_breaker(task, breaker, admission, None)
    stored = task.app.sealer.seal(result_json) if task.sensitive else result_json
    persist(lambda: ledger.complete(request.id, fence, stored), "completion")
    hooks.emit(
        "succeeded",
        task=task.name,
        tier=tier,
        record_id=request.id,
        seconds=time.monotonic() - started,
    )
    return retval


def admit_or_defer(
    task: LedgerTask,
    breaker: CircuitBreaker | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    key: str,
    tier: str,
) -> Admission | None:
    """Ask the task's breaker; while it is open, defer without claiming (no attempt used)."""
    if breaker is None:
        return None
    try:
        admission = breaker.admit()
    except redis.RedisError as exc:  # the breaker's store is down: fail open, the job matters more
        logger.warning("breaker %s unavailable (%s); calling through", breaker.name, exc)
        return None
    if admission.allowed:
        return admission
    retry_at = admission.retry_at or time.time() + task.app.settings.busy_recheck_seconds
    until = datetime.fromtimestamp(retry_at, UTC)
    try:
        task.app.ledger.record_deferral(
            task.request.id,
            task=task.name,
            key=key,
            tier=tier,
            reason=f"circuit {breaker.name!r} open",
            until=until,
        )
    except LedgerError as exc:
        logger.warning("could not record the deferral of %s: %s", task.request.id, exc)
    delay = max(retry_at - time.time(), 0.0) + random.uniform(0.05, 0.5)
    logger.info("%s: circuit %r is open; deferred by %.1fs", task.request.id, breaker.name, delay)
    defer(task, args, kwargs, delay_seconds=delay, key=key, tier=tier, reason="circuit open")


def wait_for_rate(
    task: LedgerTask, args: tuple[Any, ...], kwargs: dict[str, Any], *, key: str, tier: str
) -> None:
    """Take a token from the task's shared bucket, or defer until one is due (no claim made)."""
    if not task.rate_bucket:
        return
    try:
        wait = task.app.rate_limits[task.rate_bucket].try_acquire()
    except redis.RedisError as exc:  # the bucket's store is down: fail open
        logger.warning("rate bucket %s unavailable (%s); running", task.rate_bucket, exc)
        return
    if wait > 0:
        defer(
            task,
            args,
            kwargs,
            delay_seconds=wait + random.uniform(0.0, wait * 0.2),
            key=key,
            tier=tier,
            reason=f"rate limited ({task.rate_bucket})",
        )


def report_to_breaker(
    task: LedgerTask,
    breaker: CircuitBreaker | None,
    admission: Admission | None,
    exc: BaseException | None,
) -> None:
    """Count the call's outcome: retryable errors are the dependency's failures."""
    if breaker is None or admission is None:
        return
    failed = exc is not None and classify(
        exc, retry_on=tuple(task.retry_on or ()), fail_on=tuple(task.fail_on or ())
    )
    try:
        if failed:
            breaker.record_failure(probe=admission.probe)
        else:
            breaker.record_success(probe=admission.probe)
    except redis.RedisError as error:
        logger.warning("could not report to breaker %s: %s", breaker.name, error)


def expiry_reason(task: LedgerTask, request: Any) -> str | None:
    """Why the job must not run any more (its ``max_age_seconds``, or Celery's ``expires``
    enforced here: see ``LedgerRequest``), or None."""
    age_limit = task.max_age_seconds
    sent_at = float_or_none(request_header(request, headers.ENQUEUED_AT))
    if age_limit is not None and sent_at is not None and time.time() - sent_at > age_limit:
        return f"expired: enqueued {time.time() - sent_at:.0f}s ago (max age {age_limit:.0f}s)"
    expires = expiry_of(request.expires)
    if expires is not None and expires <= datetime.now(UTC):
        return f"expired: the message expired at {expires.isoformat()} before it ran"
    return None


def retire_job(
    task: LedgerTask,
    record_id: str,
    fence: int | None,
    args: Any,
    kwargs: Any,
    *,
    key: str,
    tier: str,
    reason: str,
) -> None:
    """Dead-letter a job that ran out of budget, then run its cleanup hook."""
    ledger = task.app.ledger
    artefacts = list(ledger.load_progress(record_id).get("artefacts", []))
    if not ledger.retire(record_id, fence, reason):
        return
    logger.error("%s retired: %s", record_id, reason)
    try:
        task.on_retire(reason, artefacts)
    except Exception:
        logger.warning("cleanup of retired %s failed", record_id, exc_info=True)
    record = ledger.find_raw(record_id)
    if record is not None:
        announce_dead(task, record, args, kwargs)


def schedule_retry(
    task: LedgerTask,
    exc: Exception,
    delay: float,
    *,
    key: str,
    tier: str,
    fence: int,
    owner: str,
    traceback_text: str,
    persist: Callable[[Callable[[], None], str], None],
) -> NoReturn:
    """Publish the retry (held in the delayed set), record it, and tell Celery (``Retry``)."""
    request = task.request
    message_headers = message_headers_of(request, key, tier)
    message_headers[headers.PREVIOUS_DELAY] = delay
    error = error_entry(
        task.sensitive,
        exc,
        owner=owner,
        attempt=request.retries + 1,
        fence=fence,
        action="retry",
        planned_delay_seconds=delay,
    )
    try:
        # Celery's own retry machinery: republishes (through LedgerTask.apply_async, so the
        # delay waits in Redis), fires task_retry signals and events, raises Retry.
        task.retry(
            exc=exc, countdown=delay, max_retries=request.retries + 1, headers=message_headers
        )
    except Retry as retry:
        ledger = task.app.ledger
        retry_at = utcnow() + timedelta(seconds=delay)
        persist(
            lambda: ledger.record_failure(
                request.id, fence, error, retry_at=retry_at, traceback=traceback_text
            ),
            "retry record",
        )
        task.app.hooks.emit(
            "retried", task=task.name, tier=tier, record_id=request.id, delay=delay, error=exc
        )
        raise retry from exc
    raise AssertionError("Task.retry returned without raising")  # pragma: no cover


def check_payload_size(task: LedgerTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a message whose arguments exceed the limit (published around our API)."""
    limit = task.app.settings.max_payload_bytes
    size = len(json.dumps([list(args), kwargs], default=str))
    if size > limit:
        raise PermanentError(f"oversized message: arguments are {size} bytes, the limit is {limit}")


def message_headers_of(request: Any, key: str, tier: str) -> dict[str, Any]:
    message_headers = dict(request.headers or {})
    message_headers.update({headers.KEY: key, headers.TIER: tier})
    return message_headers


def announce_dead(task: LedgerTask, record: dict[str, Any], args: Any, kwargs: Any) -> None:
    try:
        entry = entry_of(record)
        task.app.dead_letters.announce(entry)
        task.app.hooks.emit(
            "dead",
            task=task.name,
            tier=entry.get("tier"),
            record_id=entry["record_id"],
            reason=entry.get("reason"),
            entry=entry,
        )
    except Exception:  # observability must never fail the task
        logger.warning("could not announce dead letter %s", record.get("_id"), exc_info=True)


def defer(
    task: LedgerTask,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    delay_seconds: float,
    key: str,
    tier: str,
    reason: str = "",
) -> NoReturn:
    """Republish this message to come back after ``delay_seconds``, then ack this delivery.

    A deferral does not count as a retry. If it cannot be republished, the delivery is
    requeued instead, so nothing is lost.
    """
    request = task.request
    message_headers = dict(request.headers or {})
    message_headers.update(
        {
            headers.KEY: key,
            headers.TIER: tier,
            headers.DEFERRALS: int(float_or_none(request_header(request, headers.DEFERRALS)) or 0)
            + 1,
        }
    )
    signature = task.signature_from_request(
        request, args, kwargs, countdown=delay_seconds, headers=message_headers
    )
    try:
        signature.apply_async()
    except Exception as exc:
        logger.error("could not defer %s (%s); requeueing it", request.id, exc)
        raise Reject(exc, requeue=True) from exc
    task.app.hooks.emit(
        "deferred",
        task=task.name,
        tier=tier,
        record_id=request.id,
        delay=delay_seconds,
        reason=reason,
    )
    raise Ignore(f"deferred by {delay_seconds:.1f}s")


def persist_until(
    write: Callable[[], None],
    *,
    deadline: float,
    what: str,
    record_id: str,
    on_lease_lost: Callable[[LeaseLost], None] | None = None,
) -> None:
    """Run a fenced ledger write, retrying while the ledger is unreachable until ``deadline``.

    Past the deadline our lease may be taken over anyway: the message is requeued, and the
    ledger decides again on redelivery.
    """
    attempt = 0
    while True:
        try:
            write()
            return
        except LeaseLost as lost:
            logger.warning(
                "%s of %s refused: the lease was taken over by a newer claim", what, record_id
            )
            if on_lease_lost is not None:
                on_lease_lost(lost)
            raise Ignore("lease lost") from None
        except LedgerUnavailable as exc:
            if time.monotonic() >= deadline:
                logger.error("%s of %s failed, ledger unreachable; requeueing", what, record_id)
                raise Reject(exc, requeue=True) from exc
            time.sleep(backoff_seconds(attempt, base_seconds=0.2, cap_seconds=5.0) + 0.05)
            attempt += 1


def retry_time(when: Any) -> datetime:
    """When a retry is due, from ``Retry.when`` (an eta datetime or a countdown)."""
    if isinstance(when, datetime):
        return when
    if isinstance(when, int | float):
        return utcnow() + timedelta(seconds=when)
    return utcnow()


def sealed_if_sensitive(task: LedgerTask, message: dict[str, Any]) -> dict[str, Any]:
    """A message's arguments, sealed when the task is sensitive (plain otherwise)."""
    if not task.sensitive:
        return message
    sealer = task.app.sealer
    return {
        **message,
        **{
            name: sealer.seal(message[name])
            for name in ("args_json", "kwargs_json")
            if name in message
        },
    }


def redacted_reason(task: LedgerTask, reason: str) -> str:
    """A dead reason without the exception's text for sensitive tasks ("kind: Type")."""
    return ": ".join(reason.split(": ")[:2]) if task.sensitive else reason


def error_entry(
    redact: bool,
    exc: BaseException,
    *,
    owner: str,
    attempt: int,
    fence: int,
    action: str = "",
    planned_delay_seconds: float | None = None,
) -> ErrorEntry:
    return ErrorEntry(
        action=action,
        planned_delay_seconds=planned_delay_seconds,
        type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=REDACTED if redact else storable(str(exc)[:2000]),
        traceback_digest=traceback_digest(exc),
        at=utcnow(),
        worker=owner,
        attempt=attempt,
        fence=fence,
    )


def traceback_digest(exc: BaseException) -> str:
    """A short digest of where the exception was raised (frames, not line text or values)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = "|".join(f"{f.filename}:{f.name}:{f.lineno}" for f in frames)
    return hashlib.sha256(f"{type(exc).__qualname__}|{where}".encode()).hexdigest()[:16]


def format_tb(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    return "".join(traceback.format_exception(exc))
