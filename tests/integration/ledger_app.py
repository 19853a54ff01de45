"""Tasks the integration tests run in real workers; each records its effect to be counted."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from celery import signals

from celery_ledger import Alternate, Fallback, LastGood, PermanentError, bounded, create_app
from celery_ledger.events import Job, Observer
from tasks.effects import effects, record_effect, record_effect_in

app = create_app("ledger_tests")

# A test that fails because a job never ran asks the session worker's processes for their
# stacks (conftest.py sends SIGUSR2 to the main process and each pool process): they go to the
# worker's log, which the failure report quotes, so a hang seen only in CI shows where it hung.
DUMP_STACKS = signal.SIGUSR2


@signals.worker_init.connect
@signals.worker_process_init.connect
def _dump_stacks_on_request(**_: Any) -> None:
    if sys.__stderr__ is not None:
        faulthandler.register(DUMP_STACKS, file=sys.__stderr__, all_threads=True)


# A pool process of a worker started with this set to a path kills itself (SIGKILL) as it
# starts, once (the path marks it done): a pool process killed as the worker starts (the OOM
# killer, an operator) must not end the worker
KILL_FIRST_POOL_PROCESS = "TEST_KILL_FIRST_POOL_PROCESS"


@signals.worker_process_init.connect
def _killed_as_it_starts(**_: Any) -> None:
    mark = os.environ.get(KILL_FIRST_POOL_PROCESS)
    if mark and not os.path.exists(mark):
        Path(mark).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


@signals.worker_ready.connect
def _once_it_is_dead(**_: Any) -> None:
    """(In the main process, before its first loop checks its pool: the killed process is dead
    by then whatever the machine's load, so that the check meets it.)"""
    mark = os.environ.get(KILL_FIRST_POOL_PROCESS)
    if not mark:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            status = Path(f"/proc/{int(Path(mark).read_text())}/status")
            if not status.exists() or "State:\tZ" in status.read_text():
                return  # (dead: reaped, or a zombie the check reaps)
        time.sleep(0.05)


class FlakyError(ConnectionError):
    """Fails the first attempts of ``flaky``."""


@app.task(idempotency_key="{token}")
def record(token: str, sleep_seconds: float = 0.0, held: bool = False) -> dict[str, Any]:
    """Sleep, then record one effect. ``held``: sleep only until the test releases the job (a
    ``release`` effect of the token), at most ``sleep_seconds`` (a body that must outlast what
    the test does meanwhile, however long that takes, and then end at once)."""
    deadline = time.monotonic() + sleep_seconds
    while held and time.monotonic() < deadline:
        if effects().count_documents({"kind": "release", "key": token}, limit=1):
            break
        time.sleep(0.2)
    time.sleep(0.0 if held else sleep_seconds)
    record_effect("record", token)
    return {"token": token, "pid": os.getpid()}


@app.task(
    bind=True,
    idempotency_key="{token}",
    autoretry_for=(FlakyError,),
    default_retry_delay=0.3,
    max_retries=5,
    retry_backoff=False,
)
def flaky(self: Any, token: str, failures: int) -> str:
    """Fail ``failures`` times (counted as attempt effects), then record one effect."""
    record_effect("attempt", token)
    if effects().count_documents({"kind": "attempt", "key": token}) <= failures:
        raise FlakyError(f"flaky failure for {token}")
    record_effect("flaky", token)
    return f"ok after {failures} failures"


@app.task(idempotency_key="{token}")
def boom(token: str) -> None:
    raise ValueError(f"boom {token}")


@app.task(idempotency_key="{token}")
def returns_a_set(token: str) -> Any:
    return {1, 2, 3}


@app.task(idempotency_key="{token}", dedupe_on_publish=True)
def record_deduped(token: str) -> str:
    record_effect("deduped", token)
    return token


@app.task
def add(x: int, y: int) -> int:
    record_effect("add", f"{x}+{y}")
    return x + y


@app.task(
    bind=True,
    idempotency_key="{token}",
    autoretry_for=(FlakyError,),
    default_retry_delay=3,
    max_retries=1,
    retry_backoff=False,
)
def slow_retry(self: Any, token: str) -> str:
    """Fails once, then is retried after 3 seconds."""
    record_effect("attempt", token)
    if effects().count_documents({"kind": "attempt", "key": token}) == 1:
        raise FlakyError("first attempt")
    return "retried"


@app.task(idempotency_key="{token}")
def fails_until_fixed(token: str) -> str:
    """Permanently fails until a 'fixed' effect exists for the token (an operator's fix)."""
    if effects().count_documents({"kind": "fixed", "key": token}) == 0:
        raise PermanentError(f"bad data for {token}")
    record_effect("fixed_run", token)
    return "fixed"


@app.task(idempotency_key="{token}", max_retries=2, retry_base_seconds=0.1, retry_cap_seconds=0.3)
def always_down(token: str) -> None:
    """A dependency that never comes back: retried twice, then dead."""
    record_effect("attempt", token)
    raise ConnectionError(f"dependency down for {token}")


class RateLimited(Exception):
    """A 429 with a Retry-After hint."""

    retry_after = 1.5


@app.task(
    idempotency_key="{token}",
    retry_on=(RateLimited,),
    retry_base_seconds=0.01,
    retry_cap_seconds=0.02,
)
def rate_limited_once(token: str) -> str:
    record_effect("attempt", token)
    if effects().count_documents({"kind": "attempt", "key": token}) == 1:
        raise RateLimited("429 Too Many Requests")
    return "through"


@app.task(idempotency_key="{token}")
def kills_its_worker(token: str) -> None:
    """Dies with SIGKILL every time (a poison message for plain Celery's requeue loop)."""
    record_effect("attempt", token)
    os.kill(os.getpid(), 9)


@app.task(
    idempotency_key="{token}",
    breaker="payments",
    max_retries=10,
    retry_base_seconds=0.2,
    retry_cap_seconds=0.4,
)
def call_payments(token: str) -> str:
    """Calls the payments dependency (recorded), which fails while an outage is recorded."""
    record_effect("payment_call", token)
    if effects().count_documents({"kind": "outage", "key": "payments"}):
        raise ConnectionError("payments gateway unreachable")
    return "paid"


@app.task(bind=True, idempotency_key="{token}")
def enriched_order(self: Any, token: str) -> dict[str, Any]:
    """An order with an optional enrichment, down while an outage is recorded for the token."""

    def enrich() -> dict[str, Any]:
        record_effect("enrich_call", token)
        if effects().count_documents({"kind": "outage", "key": f"enrichment-{token}"}):
            raise ConnectionError(f"enrichment unreachable for {token}")
        return {"score": 1}

    extra: dict[str, Any] = self.step("enrich", optional=True, default={"score": None}).run(enrich)
    record_effect("order", token)
    return extra


@app.task(bind=True, idempotency_key="{token}", deadline_seconds=0.5)
def slow_recommendations(self: Any, token: str) -> list[str]:
    """An optional step whose dependency takes 5 s, under a 0.5 s deadline over the body."""

    def recommend() -> list[str]:
        record_effect("recommend_call", token)
        time.sleep(5)
        return ["late"]

    extra: list[str] = self.step("recommend", optional=True, default=[]).run(
        lambda: bounded(recommend)
    )
    record_effect("page", token)
    return extra


# -- graceful degradation (test_fallbacks.py): each test forces its breakers open or closed --


def _down(service: str, token: str) -> bool:
    return bool(effects().count_documents({"kind": "outage", "key": f"{service}-{token}"}))


@app.task(
    idempotency_key="{token}",
    breaker="warehouse",
    fallback=Fallback((LastGood("dashboard-{customer}"),), replace_after_seconds=1.0),
)
def dashboard(customer: str, token: str) -> dict[str, Any]:
    """A report built from the warehouse; while it is down, the customer's last good one."""
    record_effect("dashboard_build", token)
    return {"customer": customer, "built_for": token}


def backup_charge(token: str) -> dict[str, Any]:
    """The alternate gateway (a plain function behind its own breaker)."""
    record_effect("backup_charge", token)
    if _down("backup", token):
        raise ConnectionError("backup gateway unreachable")
    return {"paid": token, "via": "backup"}


@app.task(
    idempotency_key="{token}",
    breaker="primary",
    # The backup charge is the real charge: never replaced (that would charge twice).
    fallback=Fallback(
        (Alternate(backup_charge, breaker="backup", name="backup"),),
        on=frozenset({"circuit-open"}),
        replace=False,
    ),
)
def charge_with_backup(token: str) -> dict[str, Any]:
    record_effect("primary_charge", token)
    return {"paid": token, "via": "primary"}


@app.task(idempotency_key="{token}", slo_seconds=1.0)
def slow_report(token: str, seconds: float) -> str:
    """Takes ``seconds``, past its 1 s objective when longer."""
    time.sleep(seconds)
    record_effect("slow_report", token)
    return token


@app.task(idempotency_key="{token}", slo_seconds=5.0)
def patient_report(token: str, seconds: float) -> str:
    """Takes ``seconds``, past its 5 s objective when longer (an objective a loaded machine's
    quick job keeps, where a 1 s one was once missed by a job of 0.1 s)."""
    time.sleep(seconds)
    record_effect("patient_report", token)
    return token


class LateRecorder(Observer):
    """Counts late reports as effects: across every process that reports one."""

    def late(self, job: Job, age_seconds: float, slo_seconds: float) -> None:
        if job.key is not None:
            record_effect("late", job.key)


app.observers.add(LateRecorder())


@app.task(idempotency_key="{token}", rate_bucket="limited")
def rate_limited(token: str) -> str:
    """Draws from the shared 'limited' bucket (4/s, burst 2) across all worker processes."""
    record_effect("limited", token)
    return token


@app.task(idempotency_key="{token}", tier="bulk")
def bulk_item(token: str) -> str:
    time.sleep(0.02)
    record_effect("bulk", token)
    return token


def _processed() -> Any:
    return effects().database.get_collection("processed")


@app.task(bind=True, idempotency_key="{token}")
def backfill_docs(self: Any, token: str, batch_size: int = 250, pause: float = 0.15) -> int:
    """Process every document of source_<token> once, in checkpointed batches."""
    from pymongo.errors import BulkWriteError

    source = effects().database.get_collection(f"source_{token}")
    done = 0
    for batch in self.batches(source, batch_size=batch_size):
        record_effect("read", token, n=len(batch))
        # Idempotent by construction: a re-read batch cannot process a document twice.
        with contextlib.suppress(BulkWriteError):
            _processed().insert_many([{"_id": f"{token}:{d['_id']}"} for d in batch], ordered=False)
        done += len(batch)
        time.sleep(pause)
    return done


@app.task(bind=True, idempotency_key="{token}")
def two_steps(self: Any, token: str, pause: float) -> dict[str, Any]:
    """A charge step, a pause (the crash window), then a receipt step."""
    with self.step("charge") as charged:
        if not charged.done:
            record_effect("charge", token)
            charged.result = f"ch-{token}"
    time.sleep(pause)
    receipt = self.step("receipt").run(lambda: record_effect("receipt", token) or "sent")
    return {"charge": charged.result, "receipt": receipt}


@app.task(idempotency_key="{token}")
def spanned(token: str, seconds: float) -> None:
    """Sleep, then record when the body started and ended (bodies at once)."""
    started = time.time()
    time.sleep(seconds)
    record_effect("span", token, started=started, ended=time.time())


@app.task(idempotency_key="{token}")
def long_sleeper(token: str, seconds: float) -> int:
    """Runs longer than its lease; heartbeats keep the claim."""
    time.sleep(seconds)
    record_effect("slept", token)
    return os.getpid()


@app.task(idempotency_key="{token}", heartbeat_seconds=0)
def slow_without_heartbeat(token: str, seconds: float) -> int:
    time.sleep(seconds)
    record_effect("slow", token)
    return os.getpid()


@app.task(idempotency_key="{token}", max_age_seconds=60)
def expiring(token: str) -> None:
    record_effect("expiring", token)


@app.task(bind=True, idempotency_key="{token}", soft_time_limit=1)
def soft_limited(self: Any, token: str, artefact: str) -> None:
    self.register_artefact(artefact)
    time.sleep(10)


@app.task(idempotency_key="{token}", time_limit=2)
def hard_limited(token: str) -> None:
    time.sleep(10)
    record_effect("hard", token)


@app.task(idempotency_key="{token}", sensitive=True)
def store_card(token: str, card_number: str) -> dict[str, str]:
    record_effect("card", token)
    return {"last4": card_number[-4:], "echo": card_number}


@app.task(idempotency_key="{token}", sensitive=True)
def reject_card(token: str, card_number: str) -> None:
    raise PermanentError(f"card {card_number} declined")


@app.task(idempotency_key="{token}", sensitive=True)
def refuse_card(token: str, card_number: str, how: str) -> None:
    """Ends the job with Celery's own verdicts, whose text names the card."""
    from celery.exceptions import Ignore, Reject

    if how == "ignore":
        raise Ignore(f"card {card_number} handled by hand")
    raise Reject(f"card {card_number} refused", requeue=False)


@app.task(
    bind=True,
    idempotency_key="{token}",
    sensitive=True,
    autoretry_for=(FlakyError,),
    default_retry_delay=0.2,
    max_retries=2,
    retry_backoff=False,
)
def sensitive_progress(self: Any, token: str, card_number: str) -> dict[str, Any]:
    """A sensitive job's checkpoint, step and atomic step all hold the card; the first
    attempt fails after them, and the second must resume from what they stored."""
    import datetime

    record_effect("sensitive-attempt", token)
    if self.checkpoint_state is None:
        self.checkpoint({"card": card_number, "at": datetime.datetime(2026, 1, 2, 3, 4, 5)})
    vault = self.step("vault").run(lambda: record_effect("vault", token) or {"pan": card_number})

    def charge(session: Any) -> str:
        record_effect_in(session, "sensitive-charge", token)
        return f"charged {card_number}"

    receipt = self.step("charge").atomic(charge)
    if effects().count_documents({"kind": "sensitive-attempt", "key": token}) == 1:
        raise FlakyError(f"failed after the steps: {token}")
    state = self.checkpoint_state
    return {
        "resumed": state["card"] == card_number and state["at"].year == 2026,
        "vault": vault["pan"] == card_number,
        "receipt": receipt == f"charged {card_number}",
    }


@app.task
def explode(*args: Any, **kwargs: Any) -> None:
    """Takes any arguments, then fails naming them (odd text reaches the error record)."""
    raise TypeError(f"unexpected arguments {args!r} {sorted(kwargs)!r}")


@app.task
def echo(*args: Any, **kwargs: Any) -> list[Any]:
    """Returns its arguments as given (the bad-input suite's round trip)."""
    return [list(args), kwargs]


@app.task(
    bind=True,
    idempotency_key="{token}",
    autoretry_for=(FlakyError,),
    default_retry_delay=0.3,
    max_retries=3,
    retry_backoff=False,
)
def atomic_effect(self: Any, token: str, mode: str, ledger_pid: int = 0) -> dict[str, Any]:
    """One effect in an atomic step; ``mode`` says what goes wrong on the first attempt.

    ``kill-after``: the pool process dies after the step commits; ``fail-after``: a retryable
    error after the step; ``fail-inside``: the step's function fails after its write;
    ``kill-ledger-after``: the ledger's server (``ledger_pid``) is SIGKILLed the moment the
    step's commit is acknowledged (once: a file marks it, since the attempt's own effect
    documents may die with the server); ``fail-inside-caught``: the step's function fails after
    its write, and the body catches the failure and returns (the step's write is rolled back).
    """
    record_effect("atomic-attempt", token)
    first = effects().count_documents({"kind": "atomic-attempt", "key": token}) == 1

    def charge(session: Any) -> dict[str, Any]:
        record_effect_in(session, "atomic", token)
        if mode in ("fail-inside", "fail-inside-caught"):
            raise PermanentError(f"declined after the write: {token}")
        return {"receipt": f"r-{token}", "pid": os.getpid()}

    if mode == "fail-inside-caught":
        try:
            self.step("charge").atomic(charge)
        except PermanentError:
            return {"receipt": None}
    receipt: dict[str, Any] = self.step("charge").atomic(charge)
    if first and mode == "kill-after":
        os.kill(os.getpid(), 9)
    if mode == "kill-ledger-after":
        with contextlib.suppress(FileExistsError):
            marker = Path(tempfile.gettempdir()) / f"celery-ledger-test-{token}"
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            os.kill(ledger_pid, 9)
    if first and mode == "fail-after":
        raise FlakyError(f"failed after the step: {token}")
    return receipt


@app.task(idempotency_key="{token}", lease_seconds=3, heartbeat_seconds=0)
def outlasted_by_its_ledger(token: str, ledger_pid_file: str, times: int) -> int:
    """Its first ``times`` attempts SIGKILL the ledger's server (whose pid the test writes to
    ``ledger_pid_file`` each time it starts it) as they return: each worker stays alive, and
    cannot record how its attempt ended. Attempts are counted in a file (the ledger dies)."""
    marker = Path(tempfile.gettempdir()) / f"celery-ledger-test-{token}"
    with marker.open("a") as attempts:
        attempts.write("attempt\n")
    done = len(marker.read_text().splitlines())
    if done <= times:
        time.sleep(1.0)  # the claim's write is on disk before the server dies
        deadline = time.monotonic() + 30
        while True:
            try:
                os.kill(int(Path(ledger_pid_file).read_text()), signal.SIGKILL)
                break
            except ProcessLookupError:  # restarted, its new pid not written yet: in a moment
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    return done


# -- the regression tests of the ledger's correctness paths (test_correctness_paths.py) -------


@app.task(bind=True, idempotency_key="{token}", time_limit=6, heartbeat_seconds=0, lease_seconds=2)
def outlived(self: Any, token: str) -> str:
    """The first attempt outlives its lease without heartbeats (and is killed at its hard
    limit); the next one heartbeats by hand through the first one's kill, then finishes."""
    record_effect("outlived-attempt", token)
    if effects().count_documents({"kind": "outlived-attempt", "key": token}) == 1:
        time.sleep(10)
    for _ in range(10):
        self.heartbeat()
        time.sleep(0.5)
    record_effect("outlived", token)
    return "second holder"


@app.task(bind=True, idempotency_key="{token}")
def checkpointing(self: Any, token: str, steps: int) -> int:
    """Checkpoints every 0.2 s (a ledger call inside the body), then records one effect."""
    start = (self.checkpoint_state or {}).get("i", 0)
    for i in range(start, steps):
        self.checkpoint({"i": i + 1})
        time.sleep(0.2)
    record_effect("checkpointed", token)
    return steps


@app.task(idempotency_key="{token}")
def ignores(token: str) -> None:
    from celery.exceptions import Ignore

    record_effect("ignores", token)
    raise Ignore("handled by hand")


@app.task(idempotency_key="{token}")
def rejects(token: str) -> None:
    from celery.exceptions import Reject

    record_effect("rejects", token)
    raise Reject("bad order", requeue=False)


@app.task(bind=True, idempotency_key="{token}", dedupe_on_publish=True)
def replaced(self: Any, token: str) -> None:
    record_effect("replaced", token)
    raise self.replace(record.s(f"{token}-replacement"))


@app.task(idempotency_key="{token}")
def huge(token: str) -> str:
    record_effect("huge", token)
    return "x" * 5_000_000


@app.task(idempotency_key="{token}", track_started=True)
def tracked(token: str) -> str:
    record_effect("tracked", token)
    return token


@app.task
def describe(*args: Any, **kwargs: Any) -> list[str]:
    """The types of its arguments (kombu's JSON turns __type__ markers into objects)."""
    record_effect("describe", str(args[0]) if args else "")
    return [type(a).__name__ for a in args]


# -- workflows (tests/integration/test_workflows.py) ------------------------------------------
# WORKFLOW_CODE picks a version of the code, as a deploy would: "v1" (the original), "changed"
# (a step swapped without a version gate: non-determinism) and "gated" (the same change behind
# wf.version, which keeps old workflows on their path).
WORKFLOW_CODE = os.environ.get("WORKFLOW_CODE", "v1")


GATE_SECONDS = 120.0


def pass_gate(token: str, name: str) -> None:
    """Record that step ``name`` reached its gate, then wait until the test opens it.

    A test that kills a worker while a step waits here knows no effect is in flight: an effect
    outside an atomic step, cut off after it happened and before its completion was recorded,
    runs again (the README's documented window), so a kill left to timing can land there.
    """
    key = f"{token}:{name}"
    record_effect("wf_reached", key)
    deadline = time.monotonic() + GATE_SECONDS
    while not effects().count_documents({"kind": "wf_gate", "key": key}, limit=1):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gate of step {name} stayed shut for {GATE_SECONDS} s")
        time.sleep(0.05)


@app.task(idempotency_key="{token}")
def wf_step(token: str, name: str, pause: float = 0.0, gated: bool = False) -> str:
    """One effect per workflow step (counted by the tests); a gated step waits for the test."""
    time.sleep(pause)
    if gated:
        pass_gate(token, name)
    record_effect("wf_step", f"{token}:{name}")
    return f"{name}-done"


@app.task(idempotency_key="{token}")
def wf_undo(token: str, name: str) -> str:
    record_effect("wf_undo", f"{token}:{name}")
    return f"{name}-undone"


@app.task(idempotency_key="{token}")
def wf_refuse(token: str, name: str) -> None:
    record_effect("wf_refuse", f"{token}:{name}")
    raise PermanentError(f"refused {name}")


def order_flow(
    wf: Any,
    token: str,
    steps: int = 3,
    fail_at_end: bool = False,
    sleep: float = 0.0,
    signal: str | None = None,
    signal_timeout: float | None = None,
    pause: float = 0.0,
    gated: bool = False,
) -> dict[str, Any]:
    """Sequential steps, each with a compensation; a timer, a signal, a fan-out; maybe a
    last step that fails for good. ``gated``: every step waits for the test (pass_gate)."""
    # ungated steps keep the arguments the other tests read in the log
    gate, part_gate = ((True,), (0.0, True)) if gated else ((), ())
    done = []
    for i in range(steps):
        done.append(wf.run(wf_step, token, f"s{i}", pause, *gate))
        wf.compensate(wf_undo, token, f"s{i}")
    if sleep:
        wf.sleep(sleep)
    got = wf.wait_signal(signal, timeout=signal_timeout) if signal else None
    parts = wf.gather([wf_step.s(token, f"g{i}", *part_gate) for i in range(2)])
    if fail_at_end:
        wf.run(wf_refuse, token, "last")
    return {"done": done, "parts": parts, "signal": got}


def deploy_flow(wf: Any, token: str) -> str:
    """Its first step differs between versions of the code (WORKFLOW_CODE); workflows started
    on the original code have it in their log when the new code resumes them."""
    path = "v1"
    if WORKFLOW_CODE == "changed":
        wf.run(wf_undo, token, "first")  # another task at a recorded position
        path = "changed"
    elif WORKFLOW_CODE == "gated" and wf.version("first-step", 2) == 2:
        wf.run(wf_step, token, "first-v2")
        path = "v2"
    else:
        wf.run(wf_step, token, "first")
    wf.wait_signal("go")
    wf.run(wf_step, token, "second")
    return path


def parent_flow(wf: Any, token: str) -> list[Any]:
    """A child workflow as a step."""
    first = wf.run(wf_step, token, "parent")
    child = wf.run(order_flow_wf.s(f"{token}-child", steps=1))
    return [first, child]


def nesting_flow(wf: Any, token: str) -> Any:
    """A child that waits for a signal nobody sends (until the parent is cancelled)."""
    return wf.run(order_flow_wf.s(f"{token}-nested", steps=1, signal="never"))


def long_flow(wf: Any, token: str, steps: int) -> int:
    for i in range(steps):
        wf.run(wf_step, token, f"n{i}")
    return steps


def card_flow(wf: Any, token: str, card_ref: str) -> str:
    """A sensitive step: its arguments and result stay sealed in the workflow's log."""
    stored = wf.run(store_card, token, f"4111-1111-{card_ref}")
    return str(stored["last4"])


def vault_flow(wf: Any, token: str, card: str, fail: bool = False) -> dict[str, Any]:
    """A sensitive workflow: its arguments, a signal's payload, its result and its code's
    exception text never reach the log in clear."""
    stored = wf.run(store_card, token, card)
    pin = wf.wait_signal("pin", timeout=60)
    if fail:
        raise ValueError(f"card {card} refused with pin {pin}")
    return {"last4": stored["last4"], "card": card, "pin": pin}


@app.task(idempotency_key="{token}")
def wf_until_fixed(token: str) -> str:
    """Fails for good until the test records a fix in the world."""
    record_effect("wf_try", f"{token}:fixable")
    if effects().find_one({"kind": "fixed", "key": token}) is None:
        raise PermanentError("not fixed yet")
    return "fixed"


def fixable_flow(wf: Any, token: str) -> list[str]:
    """No compensations: a failure ends it ``failed``, and an operator can retry the step."""
    return [wf.run(wf_step, token, "before"), wf.run(wf_until_fixed, token)]


def undo_fails_flow(wf: Any, token: str) -> None:
    """A compensation that itself fails for good: the workflow ends dead, with both reasons."""
    wf.run(wf_step, token, "a")
    wf.compensate(wf_undo, token, "a")
    wf.run(wf_step, token, "b")
    wf.compensate(wf_refuse, token, "undo-b")
    wf.run(wf_refuse, token, "c")


def set_result_flow(wf: Any, token: str) -> Any:
    """Returns what JSON cannot hold: the workflow fails with that reason."""
    wf.run(wf_step, token, "only")
    return {1, 2}


def declare_workflows(target: Any) -> dict[str, Any]:
    """Declare the test workflows on ``target`` (the workers' app, or a test's producer)."""
    names = "tests.integration.ledger_app"
    return {
        "order": target.workflow(
            order_flow, name=f"{names}.order_flow", idempotency_key="order-{token}"
        ),
        "deploy": target.workflow(
            deploy_flow, name=f"{names}.deploy_flow", idempotency_key="{token}"
        ),
        "parent": target.workflow(
            parent_flow, name=f"{names}.parent_flow", idempotency_key="{token}"
        ),
        "card": target.workflow(card_flow, name=f"{names}.card_flow", idempotency_key="{token}"),
        "vault": target.workflow(
            vault_flow, name=f"{names}.vault_flow", idempotency_key="{token}", sensitive=True
        ),
        "nesting": target.workflow(
            nesting_flow, name=f"{names}.nesting_flow", idempotency_key="{token}"
        ),
        "fixable": target.workflow(
            fixable_flow, name=f"{names}.fixable_flow", idempotency_key="{token}"
        ),
        "undo_fails": target.workflow(
            undo_fails_flow, name=f"{names}.undo_fails_flow", idempotency_key="{token}"
        ),
        "set_result": target.workflow(
            set_result_flow, name=f"{names}.set_result_flow", idempotency_key="{token}"
        ),
        "long": target.workflow(long_flow, name=f"{names}.long_flow", idempotency_key="{token}"),
    }


WORKFLOWS = declare_workflows(app)
order_flow_wf = WORKFLOWS["order"]
