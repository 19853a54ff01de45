"""Change-stream triggers: ``@app.on_change("shop.orders", match=...)`` runs a ledger task once
per matching change of a MongoDB collection.

How a change becomes exactly one job:

1. One watcher per trigger across the fleet: every worker's housekeeping competes for the
   trigger's lease (a Redis lease with a fencing token, like the reconciler's); only the holder
   opens the change stream, renews the lease while it reads, and stops when it loses it. A
   holder that dies stops renewing; another worker takes over after ``lease_seconds``.
2. Each change is published through the task's ``apply_async`` (so a sensitive task's body is
   sealed) with the change's resume token as its idempotency key and ``dedupe_on_publish``:
   the ledger's ``queued`` record is written before the message, and a change read again after
   a crash is a known job, not published twice (its claim would refuse a second run anyway).
3. Only then is the resume token stored in the ledger (``<ledger collection>_triggers``), every
   ``save_every`` changes and whenever the stream is idle, conditional on the watcher's fencing
   token: a watcher paused past its lease cannot move the token back. A restarted watcher
   resumes after the stored token and re-reads at most the changes since the last save, which
   the ledger already knows.
4. Backpressure: before each publish the watcher checks the tier's depth against its
   high-water mark (counting its own publishes since the last sample) and, above it, waits with
   the stream open until the tier drains to its low-water mark. A burst never floods a tier.

A stream that cannot go on (the collection dropped or renamed: ``invalidated``; the stored token
no longer in the oplog: ``history_lost``; a token the server refuses: ``invalid_token``) stops
the trigger on every worker: it is stored, logged, counted
(``celery_ledger_trigger_problems_total``), sent to Sentry and reported by the health check,
until an operator resets the trigger (``celery -A APP ledger triggers reset NAME``) and runs a
backfill over the collection (a task reading it with ``self.batches(...)``) for the gap.

Arguments are JSON: a change event or document holds BSON types, converted with MongoDB's
relaxed Extended JSON (``ObjectId`` -> ``{"$oid": ...}``, ``datetime`` -> ``{"$date": ISO}``,
``Decimal128`` -> ``{"$numberDecimal": "1.50"}``; ints, floats, strings, lists and objects stay
as they are). :func:`from_json` turns such a value back into BSON types.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import pymongo
import redis
from bson import json_util
from bson.codec_options import CodecOptions, DatetimeConversion
from pymongo.errors import ConnectionFailure, OperationFailure

# The server's codes of passing conditions (an election, a shutdown, a timeout): the driver's
# own list, the one its retries follow.
from pymongo.helpers_shared import _RETRYABLE_ERROR_CODES

from .admission import ADMITTED, NEVER_SHED
from .broker import SweepLock
from .errors import Backpressure, ConfigurationError, LedgerUnavailable, NotReplicated, PayloadError
from .events import Observer
from .identity import derive_task_id
from .ledger.dead import DeadJob
from .ledger.record import State
from .ledger.store import Ledger, Unclaimed
from .ledger.trigger_store import TriggerStore

if TYPE_CHECKING:
    from pymongo.collection import Collection
    from pymongo.synchronous.change_stream import ChangeStream

    from .policies.backpressure import QueueDepths, TierLimit

logger = logging.getLogger("celery_ledger.triggers")

Argument = Literal["document", "change"]

# A watcher's defaults (the workers' come from LEDGER_TRIGGER_AWAIT_MS and _SAVE_EVERY).
DEFAULT_AWAIT_MS = 500
DEFAULT_SAVE_EVERY = 100
IDLE_SAVE_SECONDS = 30.0  # an idle stream's token still moves, so a restart never starts far back
STUCK_AFTER_FAILURES = 5  # the same non-outage error at one place this often: reported
SLICE_SECONDS = 1.0  # one housekeeping tick reads for about this long, then gives the lane back
ROOM_SAMPLE_SECONDS = 0.5
MAX_KEY_CHARS = 512  # the ledger's limit on an idempotency key

# Server error codes that end a stream for good (the rest are outages: retried).
_HISTORY_LOST = frozenset({136, 286})  # CappedPositionLost, ChangeStreamHistoryLost
_INVALID_TOKEN = frozenset({9, 260, 280})  # FailedToParse, InvalidResumeToken, fatal


@dataclass(frozen=True)
class Trigger:
    """A declared trigger: the task ``name`` runs once per change of ``database.collection``
    that ``match`` selects, with the document or the whole change event as its argument."""

    name: str
    database: str
    collection: str
    match: Mapping[str, Any] | None = None
    argument: Argument = "document"
    tier: str | None = None
    lease_seconds: float | None = None

    @property
    def namespace(self) -> str:
        return f"{self.database}.{self.collection}"

    def pipeline(self) -> list[dict[str, Any]]:
        """The stream's pipeline: ``match``, letting the ``invalidate`` event through (a filter
        on ``operationType`` would hide it, and the stream would just end, measured)."""
        if not self.match:
            return []
        return [{"$match": {"$or": [dict(self.match), {"operationType": "invalidate"}]}}]

    def watch_options(self) -> dict[str, Any]:
        # An update event carries only its delta: "document" asks the server for the document.
        return {"full_document": "updateLookup"} if self.argument == "document" else {}


def parse_namespace(namespace: str) -> tuple[str, str]:
    """``"shop.orders"`` -> ``("shop", "orders")`` (a collection name may hold dots)."""
    database, dot, collection = namespace.partition(".")
    if not dot or not database or not collection:
        raise ConfigurationError(f"on_change needs 'database.collection', not {namespace!r}")
    return database, collection


def change_key(change: Mapping[str, Any]) -> str:
    """The idempotency key of a change's job: its resume token's ``_data`` (the same whenever
    the change is read again), hashed if longer than a key may be."""
    token = change.get("_id")
    data = token.get("_data") if isinstance(token, Mapping) else None
    if not isinstance(data, str) or not data:
        raise ValueError(f"a change event without a resume token: {token!r}")
    if len(data) <= MAX_KEY_CHARS:
        return data
    return "sha256:" + hashlib.sha256(data.encode()).hexdigest()


def json_safe(value: Any) -> Any:
    """``value`` with its BSON types as relaxed Extended JSON (see the module docstring)."""
    return json.loads(json_util.dumps(value, json_options=json_util.RELAXED_JSON_OPTIONS))


def from_json(value: Any) -> Any:
    """The inverse of :func:`json_safe`: ``{"$oid": ...}`` back to an ``ObjectId`` and so on."""
    return json_util.loads(json.dumps(value), json_options=json_util.RELAXED_JSON_OPTIONS)


def argument_of(change: Mapping[str, Any], argument: Argument) -> Any:
    """The task's argument for ``change``: the document (None for a delete) or the event."""
    if argument == "document":
        return json_safe(change.get("fullDocument"))
    return json_safe(dict(change))


_OUTAGES = (ConnectionFailure, LedgerUnavailable, redis.RedisError, Backpressure, NotReplicated)


def _is_outage(exc: BaseException) -> bool:
    """An error that passes by itself (a server, a primary or the broker away, a full tier):
    retried, never reported stuck."""
    if isinstance(exc, _OUTAGES):
        return True
    if isinstance(exc, OperationFailure):
        labels = ("RetryableError", "TransientTransactionError", "RetryableWriteError")
        return exc.code in _RETRYABLE_ERROR_CODES or any(exc.has_error_label(x) for x in labels)
    return False


def problem_of(exc: BaseException) -> str | None:
    """Which lasting problem a server error means (None: an outage, retried)."""
    if not isinstance(exc, OperationFailure):
        return None
    if exc.code in _HISTORY_LOST:
        return "history_lost"
    if exc.code in _INVALID_TOKEN or exc.has_error_label("NonResumableChangeStreamError"):
        return "invalid_token"
    return None


def room_for(depth: int, limit: TierLimit | None, *, engaged: bool) -> bool:
    """Whether a tier at ``depth`` takes another message; ``engaged``: the tier was full at
    the last look (it then waits for the low-water mark, as the publish gate does)."""
    if limit is None or limit.high_water is None:
        return True
    release = limit.release_depth
    assert release is not None
    return depth <= release if engaged else depth < limit.high_water


class Room:
    """The tiers' room for a watcher's publishes: a fresh depth at most every
    ``sample_seconds``, plus the watcher's own publishes since (a burst is counted as it goes,
    not a second late)."""

    def __init__(
        self,
        depths: QueueDepths,
        limits: Mapping[str, TierLimit],
        *,
        sample_seconds: float = ROOM_SAMPLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._depths = depths
        self._limits = limits
        self._sample_seconds = sample_seconds
        self._clock = clock
        self._sampled: dict[str, int] = {}
        self._sampled_at = float("-inf")
        self._since: dict[str, int] = {}
        self._engaged: dict[str, bool] = {}

    def has_room(self, tier: str) -> bool:
        limit = self._limits.get(tier)
        if limit is None or limit.high_water is None:
            return True
        if self._clock() - self._sampled_at >= self._sample_seconds:
            self._sampled = self._depths.refresh()
            self._sampled_at = self._clock()
            self._since = {}
        depth = self._sampled.get(tier, 0) + self._since.get(tier, 0)
        room = room_for(depth, limit, engaged=self._engaged.get(tier, False))
        self._engaged[tier] = not room
        return room

    def published(self, tier: str) -> None:
        self._since[tier] = self._since.get(tier, 0) + 1


# Give up the lease if this process holds it with this token.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Raise the fencing counter to at least ARGV[1] (the ledger saw a higher token than Redis has:
# Redis lost its data), so the next holder's token is above every token the ledger has seen.
_RAISE_FLOOR = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""


class TriggerLease:
    """One watcher per trigger across the fleet: a :class:`SweepLock` renewed every third of
    its time to live while the holder reads."""

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        *,
        ttl_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = SweepLock(client, key, ttl_seconds=ttl_seconds)
        self._client = client
        self._key = key
        self._renew_every = ttl_seconds / 3
        self._clock = clock
        self.fence: int | None = None
        self._renewed_at = float("-inf")

    @property
    def owner(self) -> str:
        return self._lock.owner

    def hold(self) -> int | None:
        """This process's fencing token while it holds the lease (taking or renewing it when
        due), else None."""
        if self.fence is not None and self._clock() - self._renewed_at < self._renew_every:
            return self.fence
        # A token other than the last one is a new holding (the lease ended in between): the
        # watcher sees the change and starts again from the stored token.
        fence = self._lock.acquire()
        self.fence = fence
        self._renewed_at = self._clock() if fence is not None else float("-inf")
        return fence

    def still_holds(self, fence: int) -> bool:
        """Whether Redis says this process holds the lease with ``fence`` now (no cache)."""
        return self._lock.holds(fence)

    def release(self) -> None:
        if self.fence is not None:
            self._client.eval(_RELEASE, 1, self._key, f"{self.owner}|{self.fence}")
        self.fence = None

    def raise_floor(self, fence: int) -> None:
        self._client.eval(_RAISE_FLOOR, 1, f"{self._key}:token", str(fence))
        self.release()


# Less time than this left at a stop: the place is not saved (a save that cannot finish).
MIN_SAVE_SECONDS = 0.05

# (trigger, change, recovering) -> whether the change's job was known already
Publish = Callable[[Trigger, Mapping[str, Any], bool], bool]


@dataclass
class _Reading:
    """The open stream of the lease holder, and how far its changes' jobs are recorded."""

    stream: ChangeStream[Any]
    fence: int  # the holding it was opened under
    covered: dict[str, Any] | None  # every change before this token has its job recorded
    saved: dict[str, Any] | None  # the token the store holds
    unsaved: int = 0
    saved_at: float = field(default_factory=time.monotonic)


class TriggerWatcher:
    """Turns one trigger's changes into jobs while this process holds its lease.

    :meth:`tick` runs in a housekeeping lane: it reads for about ``slice_seconds`` and returns,
    keeping the stream open between ticks; any failure closes the stream (the next tick opens
    it again from the stored token) and is raised for the lane to log.
    """

    def __init__(
        self,
        trigger: Trigger,
        *,
        source: Callable[[], Collection[Any]],
        store: TriggerStore,
        lease: TriggerLease,
        publish: Publish,
        room: Room,
        tier: str,
        await_ms: int = DEFAULT_AWAIT_MS,
        save_every: int = DEFAULT_SAVE_EVERY,
        slice_seconds: float = SLICE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        observers: Observer | None = None,
        outages: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.trigger = trigger
        self._outages = outages  # (the publisher's, which this layer cannot name: kombu's)
        self._observers = observers or Observer()  # metrics, Sentry: the app's observers
        self._source = source
        self._store = store
        self._lease = lease
        self._publish = publish
        self._room = room
        self._tier = tier
        self._await_ms = await_ms
        self._save_every = save_every
        self._slice_seconds = slice_seconds
        self._clock = clock
        self._reading: _Reading | None = None
        self._reported: str | None = None
        self._waiting = False
        self._recovering = False
        self._lock = threading.Lock()
        self._stopped = False
        self._failures = 0  # ticks in a row that failed at ``_failed_at`` (not outages)
        self._failed_at: Any = None

    def tick(self) -> bool:
        """Read for one slice if this process holds the lease; True if it read (or waited on
        the server for a change), False if it had nothing to do (not the holder, stopped,
        waiting for room): the caller then pauses before the next tick."""
        with self._lock:
            if self._stopped:
                return False
            place = self._reading.covered if self._reading is not None else None
            try:
                read = self._tick()
            except Exception as exc:
                self._close(save=True)
                self._failed_again(exc, place)
                raise
            self._failures = 0
            return read

    def _failed_again(self, exc: Exception, place: Any) -> None:
        """An error that comes back at the same place, and is no outage (a change the driver
        cannot decode, an event over the server's size limit, a pipeline the server refuses),
        would hold the trigger there for good with only a lane's warning to show: after
        STUCK_AFTER_FAILURES in a row it is reported as the problem ``stuck`` (stopped, counted,
        Sentry, health down) for an operator's reset and backfill."""
        if _is_outage(exc) or isinstance(exc, self._outages):
            self._failures = 0
            return
        same = self._failures and place == self._failed_at
        self._failures = self._failures + 1 if same else 1
        self._failed_at = place
        fence = self._lease.fence
        if self._failures >= STUCK_AFTER_FAILURES and fence is not None:
            self._failures = 0
            detail = f"{type(exc).__name__} at the same place {STUCK_AFTER_FAILURES} times: {exc}"
            self._problem(fence, "stuck", detail[:1000])

    def stop(self, timeout: float = 5.0) -> None:
        """Save what is covered, close the stream and give up the lease (a worker's stop),
        all within ``timeout``."""
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            return  # a tick is stuck on an outage; the lease ends by itself
        try:
            self._stopped = True
            left = deadline - time.monotonic()
            # The ledger's operations keep to what is left (pymongo's own operation timeout):
            # with the ledger away, the save and the stream's close each waited for the
            # driver's timeouts. A place not saved is read again by the next holder, whose
            # claims tell the changes already run.
            if left >= MIN_SAVE_SECONDS:
                with pymongo.timeout(left):
                    self._close(save=True)
            else:
                logger.info("trigger %s: no time left to save its place", self.trigger.name)
                self._reading = None  # (its stream goes with the process)
        except Exception as exc:
            logger.warning("trigger %s: stop incomplete: %s", self.trigger.name, exc)
        finally:
            try:
                self._lease.release()  # Redis: whatever became of the ledger's part
            except Exception as exc:  # it ends by itself
                logger.warning("trigger %s: lease not given up: %s", self.trigger.name, exc)
            self._lock.release()

    # -- one tick ------------------------------------------------------------------------------

    def _tick(self) -> bool:
        fence = self._lease.hold()
        if fence is None:
            self._close(save=False)
            return False
        if self._reading is not None and self._reading.fence != fence:
            # A new holding (the lease ended in between): another holder may have saved a place
            # further on since; start again from the store's.
            self._close(save=False)
        reading = self._reading or self._open(fence)
        if reading is None:
            return False
        read = False
        deadline = self._clock() + self._slice_seconds
        while self._clock() < deadline:
            if self._lease.hold() != fence:
                self._close(save=False)  # the next holder re-reads what is not saved
                return read
            if not self._room.has_room(self._tier):
                if not self._waiting:
                    self._waiting = True
                    self._observers.trigger_waited(self.trigger.name, self._tier)
                    logger.info("trigger %s waits: tier %s is full", self.trigger.name, self._tier)
                break
            self._waiting = False
            read = True
            change = reading.stream.try_next()
            if change is None:
                reading.covered = _token(reading.stream.resume_token) or reading.covered
                if not reading.stream.alive:  # the server ended it: its namespace went away
                    self._problem(fence, "invalidated", "the change stream was closed")
                    return False
                idle = self._clock() - reading.saved_at >= IDLE_SAVE_SECONDS
                if reading.unsaved or (idle and reading.covered != reading.saved):
                    self._save(fence)
                break
            if change.get("operationType") == "invalidate":
                self._save(fence)
                self._problem(fence, "invalidated", f"invalidate event {change.get('_id')!r}")
                return False
            self._publish_one(change)
            reading.covered = _token(reading.stream.resume_token)
            reading.unsaved += 1
            if reading.unsaved >= self._save_every:
                self._save(fence)
        if self._reading is not None and self._reading.unsaved:
            self._save(fence)
        return read

    def _publish_one(self, change: Mapping[str, Any]) -> None:
        try:
            known = self._publish(self.trigger, change, self._recovering)
        except Backpressure:
            # The tier filled between the look and the publish: this change is read again.
            self._close(save=True)
            raise
        # Changes are handled in stream order: after the first new one, none is known.
        self._recovering = self._recovering and known
        self._room.published(self._tier)
        self._observers.trigger_change(self.trigger.name)

    def _open(self, fence: int) -> _Reading | None:
        state = self._store.load(self.trigger.name)
        if state is not None and state.problem:
            self._report(state.problem, state.detail or "", stored=True)
            return None
        self._reported = None
        token = state.token if state is not None else None
        options: dict[str, Any] = {"max_await_time_ms": self._await_ms}
        options.update(self.trigger.watch_options())
        if token is not None:
            options["resume_after"] = token
        try:
            stream = self._source().watch(self.trigger.pipeline(), **options)
        except OperationFailure as exc:
            problem = problem_of(exc)
            if problem is None:
                raise
            self._problem(fence, problem, f"cannot resume after {token!r}: {exc}")
            return None
        self._reading = _Reading(stream, fence, covered=token, saved=token, saved_at=self._clock())
        self._recovering = token is not None
        if token is None:
            # A new trigger starts now: keep that place at once, so a crash before its first
            # change loses nothing.
            self._reading.covered = _token(stream.resume_token)
            self._save(fence)
        logger.info(
            "trigger %s: watching %s (fence %d)%s",
            self.trigger.name,
            self.trigger.namespace,
            fence,
            "" if token is None else " from its stored token",
        )
        return self._reading

    def _save(self, fence: int) -> None:
        reading = self._reading
        if reading is None or reading.covered is None:
            return
        if reading.covered == reading.saved and not reading.unsaved:
            return
        saved = self._store.save_token(
            self.trigger.name,
            reading.covered,
            fence=fence,
            holder=self._lease.owner,
            changes=reading.unsaved,
        )
        if not saved:
            self._fenced_out(fence)
            return
        reading.saved, reading.unsaved, reading.saved_at = reading.covered, 0, self._clock()

    def _fenced_out(self, fence: int) -> None:
        """The store holds a higher fencing token than this holder's. Either a newer holder
        took over (this one lost its lease) or Redis lost the lease's counter; in the second
        case this process still holds the Redis lease, and raises the counter above the
        ledger's so its next holding writes again."""
        stored = self._store.highest_fence(self.trigger.name)
        logger.warning(
            "trigger %s: token not saved, fence %d is behind the ledger's %d",
            self.trigger.name,
            fence,
            stored,
        )
        self._close(save=False)
        if self._lease.still_holds(fence):
            self._lease.raise_floor(stored)
        else:
            self._lease.fence = None

    def _problem(self, fence: int, problem: str, detail: str) -> None:
        self._close(save=True)
        if self._store.report_problem(self.trigger.name, problem, detail, fence=fence):
            self._report(problem, detail, stored=False)

    def _report(self, problem: str, detail: str, *, stored: bool) -> None:
        if self._reported == problem:
            return
        self._reported = problem
        if not stored:  # counted once, by the watcher that found it
            self._observers.trigger_problem(
                self.trigger.name, self.trigger.namespace, problem, detail
            )
        logger.error(
            "trigger %s on %s stopped (%s): %s. Its changes are no longer turned into jobs:"
            " reset it (celery -A APP ledger triggers reset %s) and backfill the collection",
            self.trigger.name,
            self.trigger.namespace,
            problem,
            detail,
            self.trigger.name,
        )

    def _close(self, *, save: bool) -> None:
        reading, fence = self._reading, self._lease.fence
        if reading is None:
            return
        try:
            if save and fence is not None and (reading.unsaved or reading.covered != reading.saved):
                self._save(fence)
        finally:
            self._reading = None
            try:
                reading.stream.close()
            except Exception as exc:  # the server may be gone: nothing left to close
                logger.debug("trigger %s: close: %s", self.trigger.name, exc)


class TriggerRunner:
    """The watchers of a worker, run by one housekeeping lane: while a watcher holds its lease
    it reads slice after slice without the lane's pause, for up to ``run_seconds`` per lane
    tick; a watcher that fails is retried at the lane's next tick (after its interval)."""

    def __init__(
        self,
        watchers: list[TriggerWatcher],
        *,
        run_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.watchers = watchers
        self._run_seconds = run_seconds
        self._clock = clock
        self._stop = threading.Event()
        self.__qualname__ = "triggers"

    def __call__(self) -> None:
        deadline = self._clock() + self._run_seconds
        while not self._stop.is_set() and self._clock() < deadline:
            active, failure = False, None
            for watcher in self.watchers:
                try:
                    active = watcher.tick() or active
                except Exception as exc:  # the others go on; the lane logs this one
                    failure = failure or exc
            if failure is not None:
                raise failure
            if not active:
                return

    def stop(self, timeout: float = 5.0) -> None:
        """The worker stops: end the reading, save each watcher's place, give up the leases,
        all within ``timeout`` (a watcher still waiting when it is spent keeps its lease, which
        ends by itself)."""
        self._stop.set()
        deadline = self._clock() + timeout
        for watcher in self.watchers:
            watcher.stop(timeout=max(0.0, deadline - self._clock()))


def _token(value: Any) -> dict[str, Any] | None:
    return dict(value) if isinstance(value, Mapping) else None


# -- declaration and wiring --------------------------------------------------------------------


def declare(
    app: Any,
    namespace: str,
    *,
    match: Mapping[str, Any] | None = None,
    argument: Argument = "document",
    tier: str | None = None,
    name: str | None = None,
    lease_seconds: float | None = None,
    **task_options: Any,
) -> Callable[[Callable[..., Any]], Any]:
    """The decorator behind :meth:`LedgerCelery.on_change` (see the module docstring)."""
    database, collection = parse_namespace(namespace)
    if argument not in ("document", "change"):
        raise ConfigurationError(
            f"on_change argument must be 'document' or 'change', not {argument!r}"
        )
    if match is not None and not isinstance(match, Mapping):
        raise ConfigurationError("on_change match must be a $match document (a mapping)")
    if lease_seconds is not None and lease_seconds < 1:
        raise ConfigurationError("on_change lease_seconds must be at least 1")
    if task_options.get("dedupe_on_publish") is False:
        raise ConfigurationError(
            "a trigger's task writes its record at publish (dedupe_on_publish): a change read"
            " again after a crash must be recognised there"
        )

    def wrap(fn: Callable[..., Any]) -> Any:
        task_name = name or app.gen_task_name(fn.__name__, fn.__module__)
        if task_name in app.triggers:
            raise ConfigurationError(f"trigger {task_name} is already declared on this app")
        options = {**task_options, "name": task_name, "dedupe_on_publish": True}
        options.setdefault("shared", False)  # the trigger is this app's, and so is its task
        if tier is not None:
            options["tier"] = tier
        task = app.task(**options)(fn)
        app.triggers[task_name] = Trigger(
            task_name,
            database,
            collection,
            match=dict(match) if match is not None else None,
            argument=argument,
            tier=tier,
            lease_seconds=lease_seconds,
        )
        return task

    return wrap


def publisher(app: Any) -> Publish:
    """How a watcher publishes a change's job: the task's own ``apply_async`` (sealed if
    sensitive, its ``queued`` record written first), keyed on the change.

    ``recovering``: the change may have been read by a holder that died (it follows the stored
    token, and no change after it was found new yet). Its record is read first: a job that is
    running or ended is left alone; one still ``queued`` may have died with its holder between
    its record and its message, so it is published again (a second copy is at worst a
    duplicate that the claim suppresses). Returns whether the job was known.
    """

    def publish(trigger: Trigger, change: Mapping[str, Any], recovering: bool) -> bool:
        task = app.tasks[trigger.name]
        key = change_key(change)
        argument = argument_of(change, trigger.argument)
        try:
            if recovering:
                record = app.ledger.find_raw(derive_task_id(task.name, key))
                if record is not None:
                    if record.get("state") == State.QUEUED.value:
                        # Admitted: no second record write (it exists) and no backpressure (the
                        # watcher made room): the message goes out though the job is known.
                        task.apply_async((argument,), idempotency_key=key, **{ADMITTED: True})
                    return True
            # Never shed: above its mark the tier raises Backpressure, and the change is read
            # again once there is room (a shed job would be dead while the stream moved on)
            task.apply_async((argument,), idempotency_key=key, **{NEVER_SHED: True})
        except PayloadError as exc:
            _bury_unpublishable(app, task, key, change, exc)
        return False

    return publish


def _bury_unpublishable(
    app: Any, task: Any, key: str, change: Mapping[str, Any], exc: PayloadError
) -> None:
    """A change whose argument cannot be published (over ``LEDGER_MAX_PAYLOAD_BYTES``) would
    stop its trigger for good if retried: its job is recorded dead with the reason instead (an
    operator sees it among the dead letters), and the trigger goes on."""
    where = "" if task.sensitive else f"; document key {json_safe(change.get('documentKey'))}"
    dead = DeadJob.of_reason(
        "bad-arguments", f"payload: {exc}{where}"[:1000], task=task.name, group="payload"
    )
    tier = app.tier_of(task.name) or app.settings.default_tier
    record_id = derive_task_id(task.name, key)
    app.ledger.bury(record_id, dead, match=Unclaimed(), task=task.name, key=key, tier=tier)
    logger.error("trigger %s: change %s recorded dead: %s", task.name, record_id, exc)


def watchers_for(app: Any, outages: tuple[type[BaseException], ...] = ()) -> list[TriggerWatcher]:
    """A watcher per trigger of ``app``, for a worker's housekeeping (none when
    ``LEDGER_TRIGGERS_IN_WORKERS`` is off); a publish's ``outages`` are never ``stuck``."""
    runtime = app.runtime
    settings = runtime.settings
    if not app.triggers or not settings.triggers_in_workers:
        return []
    store = TriggerStore(runtime.ledger)
    room = Room(runtime.queue_depths, runtime.gate.limits)
    default_lease = settings.trigger_lease_seconds
    watchers = []
    # One lane runs every watcher in turn, and a holder renews its lease only in its own tick:
    # a round of them all (each a slice, or one wait for a change) must fit well inside the
    # shortest lease, however many triggers the app declares
    shortest = min(trigger.lease_seconds or default_lease for trigger in app.triggers.values())
    turn = shortest / (4 * len(app.triggers))
    await_ms = max(1, min(settings.trigger_await_ms, int(turn * 1000)))
    for trigger in app.triggers.values():
        ttl = trigger.lease_seconds or default_lease
        lease = TriggerLease(
            runtime.redis, f"{runtime.name}:ledger:trigger:{trigger.name}", ttl_seconds=ttl
        )
        tier = app.tier_of(trigger.name) or settings.default_tier
        watchers.append(
            TriggerWatcher(
                trigger,
                source=_source(runtime.ledger, trigger),
                store=store,
                lease=lease,
                publish=publisher(app),
                room=room,
                tier=tier,
                await_ms=await_ms,
                save_every=settings.trigger_save_every,
                slice_seconds=min(SLICE_SECONDS, turn),
                observers=runtime.observers,
                outages=outages,
            )
        )
    return watchers


def _source(ledger: Ledger, trigger: Trigger) -> Callable[[], Collection[Any]]:
    """The watched collection, on the ledger's deployment (and its client)."""

    # A date MongoDB stores but Python's datetime cannot hold (year 0 or 10000) arrives as a
    # DatetimeMS instead of failing every read of the stream at that change
    codec: CodecOptions[Any] = CodecOptions(
        tz_aware=True, datetime_conversion=DatetimeConversion.DATETIME_AUTO
    )

    def collection() -> Collection[Any]:
        database = ledger.client.get_database(trigger.database)
        return database.get_collection(trigger.collection, codec_options=codec)

    return collection


__all__ = [
    "Room",
    "Trigger",
    "TriggerLease",
    "TriggerRunner",
    "TriggerWatcher",
    "argument_of",
    "change_key",
    "declare",
    "from_json",
    "json_safe",
    "parse_namespace",
    "problem_of",
    "room_for",
    "watchers_for",
]
