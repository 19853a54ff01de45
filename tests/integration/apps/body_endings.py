"""An app of one task whose body ends in a chosen way (``mode``), on any pool.

Every run first records a ``body-run`` effect (counted by the tests: a body that runs again
shows up as a second effect), then ends as ``mode`` says.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from celery.exceptions import Ignore, Reject, Retry, TaskRevokedError

from celery_ledger import create_app
from tasks.effects import record_effect

NAMESPACE = "body_endings"
BODY = "body_endings.body"


class NeedsArgs(Exception):
    def __init__(self, a: Any, b: Any) -> None:
        super().__init__(f"needs {a} and {b}")


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ of BadStr raised")


class BadStrBoth(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ raised")

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ raised")


class RetryableBadStr(ConnectionError):
    def __str__(self) -> str:
        raise RuntimeError("__str__ of RetryableBadStr raised")


class CustomBase(BaseException):
    pass


class HugeRetryAfter(ConnectionError):
    retry_after = 10**400


class InfRetryAfter(ConnectionError):
    retry_after = float("inf")


class UnreadableRetryAfter(ConnectionError):
    @property
    def retry_after(self) -> float:  # (an HTTP error reading a header it was not given)
        raise KeyError("Retry-After")


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("__repr__ raised")

    __str__ = __repr__


def _deep(n: int) -> Any:
    value: Any = []
    for _ in range(n):
        value = [value]
    return value


def body(self: Any, token: str, mode: str) -> Any:
    record_effect("body-run", token)
    attempt = int(self.request.retries or 0)
    # -- return values -------------------------------------------------------------------
    if mode == "ok":
        return {"ok": token}
    if mode == "ret_set":
        return {1, 2}
    if mode == "ret_bytes":
        return b"\x00\xff"
    if mode == "ret_nan":
        return float("nan")
    if mode == "ret_inf":
        return [math.inf]
    if mode == "ret_deep":
        return _deep(100_000)
    if mode == "ret_generator":
        return (i for i in range(3))
    if mode == "ret_badrepr":
        return BadRepr()
    if mode == "ret_bigint":
        return 10**5000
    if mode == "ret_int64":
        return 2**70
    if mode == "ret_tuple_keys":
        return {(1, 2): 3}
    if mode == "ret_huge":
        return "x" * (30 * 1024 * 1024)
    if mode == "ret_exception":
        return ValueError("a returned exception")
    # -- exceptions ----------------------------------------------------------------------
    if mode == "exc_needs_args":
        raise NeedsArgs(1, 2)
    if mode == "exc_badstr":
        raise BadStr()
    if mode == "exc_badstr_both":
        raise BadStrBoth()
    if mode == "exc_retryable_badstr":
        raise RetryableBadStr()
    if mode == "exc_unjson_args":
        raise ValueError(object(), {1, 2}, b"\xff")
    if mode == "exc_huge_msg":
        raise ValueError("y" * (20 * 1024 * 1024))
    if mode == "exc_nul_msg":
        raise ValueError("bad \x00 text \udcff")
    if mode == "exc_memory":
        raise MemoryError("pretend out of memory")
    if mode == "exc_recursion":
        return body_recurse(0)
    if mode == "exc_huge_retry_after":
        raise HugeRetryAfter("retry after a googol")
    if mode == "exc_unreadable_retry_after":
        raise UnreadableRetryAfter("no Retry-After header")
    if mode == "exc_inf_retry_after":
        raise InfRetryAfter("retry after forever")
    if mode == "sys_exit":
        sys.exit()
    if mode == "sys_exit_1":
        sys.exit(1)
    if mode == "system_exit_0":
        raise SystemExit(0)
    if mode == "keyboard_interrupt":
        raise KeyboardInterrupt()
    if mode == "generator_exit":
        raise GeneratorExit()
    if mode == "custom_base":
        raise CustomBase("custom BaseException")
    # -- Celery control flow raised by hand --------------------------------------------------
    if mode == "raise_retry_bare":
        raise Retry()
    if mode == "raise_retry_exc":
        raise Retry(exc=ValueError("hand-made"), when=1)
    if mode == "raise_ignore":
        raise Ignore("ignored by hand")
    if mode == "raise_reject":
        raise Reject("rejected by hand", requeue=False)
    if mode == "raise_reject_badstr":
        raise Reject(BadRepr(), requeue=False)
    if mode == "raise_ignore_badstr":
        raise Ignore(BadRepr())
    if mode == "raise_revoked":
        raise TaskRevokedError("revoked by hand")
    if mode == "raise_worker_shutdown":
        from celery.exceptions import WorkerShutdown

        raise WorkerShutdown()
    if mode == "raise_worker_terminate":
        from celery.exceptions import WorkerTerminate

        raise WorkerTerminate()
    if mode == "raise_worker_lost":
        from billiard.exceptions import WorkerLostError

        raise WorkerLostError("lost by hand")
    if mode == "raise_time_limit":
        from billiard.exceptions import TimeLimitExceeded

        raise TimeLimitExceeded(1.0)
    if mode == "raise_soft_limit":
        from billiard.exceptions import SoftTimeLimitExceeded

        raise SoftTimeLimitExceeded()
    # -- self.retry with odd arguments (once: the retry succeeds) ------------------------------
    if mode.startswith("retry_") and attempt >= 1:
        return {"retried": attempt}
    if mode == "retry_neg":
        raise self.retry(exc=ValueError("x"), countdown=-5)
    if mode == "retry_nan":
        raise self.retry(exc=ValueError("x"), countdown=float("nan"))
    if mode == "retry_inf":
        raise self.retry(exc=ValueError("x"), countdown=float("inf"))
    if mode == "retry_huge":
        raise self.retry(exc=ValueError("x"), countdown=1e12)
    if mode == "retry_eta_naive_past":
        raise self.retry(exc=ValueError("x"), eta=datetime.utcnow() - timedelta(hours=1))
    if mode == "retry_eta_far":
        raise self.retry(exc=ValueError("x"), eta=datetime(9999, 12, 31, tzinfo=UTC))
    if mode == "retry_eta_str":
        raise self.retry(exc=ValueError("x"), eta="not a date")
    if mode == "retry_max0":
        raise self.retry(exc=ValueError("x"), countdown=0.2, max_retries=0)
    if mode == "retry_exc_str":
        raise self.retry(exc="not an exception", countdown=0.2)  # type: ignore[arg-type]
    if mode == "retry_no_exc":
        raise self.retry(countdown=0.2)
    if mode == "retry_exc_badstr":
        raise self.retry(exc=BadStrBoth(), countdown=0.2)
    if mode == "retry_nothrow":
        self.retry(exc=ValueError("x"), countdown=0.2, throw=False)
        return {"after": "retry(throw=False)"}
    # -- the process ----------------------------------------------------------------------
    if mode == "os_exit_0":
        os._exit(0)
    if mode == "os_exit_1":
        os._exit(1)
    if mode == "sigsegv":
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(5)
    raise ValueError(f"unknown mode {mode}")


def body_recurse(n: int) -> Any:
    return body_recurse(n + 1)


def register(app: Any) -> Any:
    # One retry at most: a case that retries shows it in two runs, not in the tier's budget
    return app.task(name=BODY, bind=True, idempotency_key="{token}", shared=False, max_retries=1)(
        body
    )


app = create_app(NAMESPACE, set_as_current=False)
task = register(app)
