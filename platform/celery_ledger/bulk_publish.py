"""Bulk publish: the queued records of many ledger jobs in one ledger write and their messages
in one broker pipeline, per batch of up to ``ENQUEUE_BATCH`` (100) jobs.

Published one by one, each job costs a ledger round trip (its ``queued`` record: dedupe on
publish) and a broker round trip (its LPUSH). A bulk publish is a scope, open on one producer:
:meth:`LedgerTask.apply_async <celery_ledger.task.LedgerTask.apply_async>` checks and plans
each job exactly as it would alone (its identity, tier, payload and canvas checks, sealing,
backpressure) and, when the job would have its record written and its message sent now (not
eager, not in a transaction, not for later, not a retry, the ledger not seen away), hands it to
the scope instead (:meth:`BulkPublish.hold`). Every ``ENQUEUE_BATCH`` jobs, and when the scope
closes, the scope writes the held jobs' records in one unordered bulk write
(:meth:`Ledger.enqueue_many <celery_ledger.ledger.publishing.Publishing.enqueue_many>`, which
answers NEW, KNOWN or UNPUBLISHED for each, as the single write does), and sends the messages
of those not KNOWN through kombu's producer batch (``Producer.batch``: one Redis pipeline).

The single publish's rules hold for each job of the batch:

- a KNOWN job is not published again; an UNPUBLISHED one (its first publish failed) is;
- the ledger unreachable (the outcome of the write unknown): every job of the batch is
  published without its record, marked a first publish (``ledger_new``), its record kept in
  the broker for the reconciler to write (unrecorded.py), and the ledger is seen away
  (``LEDGER_AWAY_SECONDS``) as after a single publish;
- the pipeline failed, or a message could not be made: every record the batch wrote is marked
  unpublished in one write, so the outbox relay and the reconciler publish those jobs
  (nothing lost; a message that did reach the broker as well only makes a duplicate, which
  its claim suppresses), and the error is raised to the caller.

Scopes open two ways: :meth:`BulkPublishing.publish_many` (any ledger signatures published
through its producer), and Celery's own ``group`` (its ``apply_async`` publishes every member
through one producer from ``app.producer_or_acquire``: members of a group, which carry its
``group_id``, join the scope that call opens, so ``group(...).apply_async()`` and a chord's
header are bulk publishes with no change to the caller's code). A job that does not join (a
plain Celery task, a job for later, a retry) is published at once, on its own, as before.
The results are returned at once: a held job's record is written when its batch is, before the
scope (the group's ``apply_async``, ``publish_many``) returns.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.canvas import Signature, signature
from celery.result import ResultBase

from .errors import LedgerError, LedgerUnavailable
from .ledger.store import ENQUEUE_BATCH, EnqueueOutcome, QueuedJob

if TYPE_CHECKING:
    from .app import LedgerCelery

logger = logging.getLogger("celery_ledger.bulk_publish")

# The open bulk publish of this thread (or task), if any.
_OPEN: ContextVar[BulkPublish | None] = ContextVar("celery_ledger_bulk_publish", default=None)
# kombu's producer batch flushes itself past this many buffered Redis commands; a batch here
# is ENQUEUE_BATCH messages of one LPUSH each (and a PEXPIRE per priority for a queue that
# expires), flushed by the scope, so this is only a ceiling.
_PIPELINE_COMMANDS = 10_000


@dataclass(slots=True)
class HeldJob:
    """A job held for its batch: its record, and how its message is sent (``new``: a first
    publish with no record written, its claim may insert it)."""

    job: QueuedJob
    send: Callable[..., Any]


class BulkPublish:
    """One bulk publish, open on ``producer`` (see the module docstring).

    ``canvas_only``: only a canvas's members join (the scope ``group`` opens through
    ``app.producer_or_acquire``); else every ledger publish through ``producer`` does.
    """

    def __init__(self, app: LedgerCelery, producer: Any, *, canvas_only: bool) -> None:
        self.app = app
        self.producer = producer
        self.canvas_only = canvas_only
        self.held: list[HeldJob] = []

    def takes(self, producer: Any, options: dict[str, Any]) -> bool:
        """Whether a publish through ``producer`` with ``options`` joins this scope."""
        if producer is None or producer is not self.producer:
            return False
        return not self.canvas_only or options.get("group_id") is not None

    def hold(self, job: QueuedJob, send: Callable[..., Any], result: Any) -> Any:
        """Hold a job for its batch (written and sent with it); returns ``result``."""
        self.held.append(HeldJob(job, send))
        if len(self.held) >= ENQUEUE_BATCH:
            self.flush()
        return result

    def flush(self) -> None:
        """Write the held jobs' records (one bulk write) and send the messages of those not
        known (one pipeline).

        Raises:
            StoreError: a record could not be written (none of the batch is sent; the records
                written are marked unpublished).
            NotReplicated: the ledger away, the broker's replicas did not confirm the records
                kept in it (unrecorded.py; none of the batch is sent).
            Exception: what sending raised (the batch's records are marked unpublished).
        """
        held, self.held = self.held, []
        if not held:
            return
        try:
            outcomes = self.app.ledger.enqueue_many([entry.job for entry in held])
        except LedgerUnavailable as exc:
            # As a single publish: the claim still runs each job once, and their records are
            # kept in the broker until the reconciler writes them (unrecorded.py)
            self.app.runtime.ledger_absence.seen_away()
            self.app.runtime.unrecorded.keep([entry.job for entry in held])
            logger.warning(
                "ledger unreachable; %d jobs published, their queued records kept in the broker"
                " until the ledger is back: %s",
                len(held),
                exc,
            )
            self._send(held, new=True)  # (if it fails, the records are kept: as below)
            return
        self._send(
            [e for e, o in zip(held, outcomes, strict=True) if o is not EnqueueOutcome.KNOWN],
            new=False,
        )

    def _send(self, held: list[HeldJob], *, new: bool) -> None:
        if not held:
            return
        # kombu before 5.7 has no producer batch: the messages go one by one, the records still
        # in one write (kombu's batch does the same on a transport set to retry its writes)
        batch = getattr(self.producer, "batch", None)
        try:
            with batch(max_size=_PIPELINE_COMMANDS) if batch else contextlib.nullcontext():
                for entry in held:
                    entry.send(new)
        except Exception:
            if not new:
                # Keep the records (another producer may have skipped its publish because of
                # them) and make them due for the relay and the reconciler now.
                with contextlib.suppress(LedgerError):
                    self.app.ledger.mark_unpublished_many([e.job.record_id for e in held])
            raise


def joining(producer: Any, options: dict[str, Any]) -> BulkPublish | None:
    """The open bulk publish a publish through ``producer`` with ``options`` joins, or None."""
    bulk = _OPEN.get()
    return bulk if bulk is not None and bulk.takes(producer, options) else None


@contextlib.contextmanager
def gathering(app: LedgerCelery, producer: Any, *, canvas_only: bool) -> Iterator[BulkPublish]:
    """Open a bulk publish on ``producer`` for the block; its last batch goes when it ends.

    A block that raises still sends what it held (those jobs would have gone out one by one
    before the error); a failure to send them is logged and the block's error raised."""
    bulk = BulkPublish(app, producer, canvas_only=canvas_only)
    token = _OPEN.set(bulk)
    try:
        yield bulk
        bulk.flush()
    except Exception:
        if bulk.held:
            try:
                bulk.flush()
            except Exception as exc:
                logger.error("%d held jobs not published after an error: %s", len(bulk.held), exc)
        raise
    finally:
        try:
            _OPEN.reset(token)
        except ValueError:  # closed in another context (a generator finalised elsewhere)
            _OPEN.set(None)


class BulkPublishing:
    """The app's bulk publish: :meth:`publish_many`, and ``group`` made one (a mixin of
    :class:`~celery_ledger.app.LedgerCelery`)."""

    def publish_many(
        self, signatures: Iterable[Signature | dict[str, Any]], *, producer: Any = None
    ) -> list[ResultBase]:
        """Publish signatures as one bulk publish: the ledger jobs among them cost one ledger
        write (two when some were known and unpublished) and one broker pipeline per 100.

        Each job keeps the rules of its single publish (``task.apply_async``): its key, task
        id, tier, backpressure, sealing, and dedupe (a known job is not published again).
        Signatures of other tasks, of canvases, of jobs for later (``countdown``, ``eta``)
        are published one by one as they come. ``producer``: a kombu producer of this app's
        (by default one from its pool).

        Returns:
            Each signature's result handle, in order.

        Raises:
            TypeError: an item is not a signature (nothing is published).
            PayloadError, IdentityError, Backpressure, ConfigurationError: as
                ``apply_async``; the jobs before the one refused are published.
            StoreError: a batch's records could not be written (its jobs are not published;
                earlier batches are).
            NotReplicated: the ledger away, the broker's replicas did not confirm a batch's jobs
                (its jobs are not published; earlier batches are): publish them all again.
        """
        app: Any = self
        found = [_signature_of(item, app) for item in signatures]
        results: list[ResultBase] = []
        with _acquired(app, producer) as acquired, gathering(app, acquired, canvas_only=False):
            for sig in found:
                results.append(sig.apply_async(producer=acquired))
        return results

    def producer_or_acquire(self, producer: Any = None) -> AbstractContextManager[Any]:
        """Celery's producer context; outside a bulk publish, one for a canvas's members (a
        ``group`` publishes them all through it)."""
        acquiring: AbstractContextManager[Any] = Celery.producer_or_acquire(self, producer)
        if _OPEN.get() is not None:
            return acquiring
        return _canvas_scope(self, acquiring)


def _acquired(app: Any, producer: Any) -> AbstractContextManager[Any]:
    """Celery's own producer context (no canvas scope: the caller opens its own)."""
    acquiring: AbstractContextManager[Any] = Celery.producer_or_acquire(app, producer)
    return acquiring


@contextlib.contextmanager
def _canvas_scope(app: Any, acquiring: AbstractContextManager[Any]) -> Iterator[Any]:
    with acquiring as producer, gathering(app, producer, canvas_only=True):
        yield producer


def _signature_of(item: Any, app: Any) -> Signature:
    if isinstance(item, dict) and isinstance(item.get("task"), str):
        item = signature(item, app=app)
    if not isinstance(item, Signature):
        raise TypeError(
            f"publish_many takes signatures (task.s(...), task.signature(...)),"
            f" not {type(item).__name__}"
        )
    return item
