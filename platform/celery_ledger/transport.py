"""The Redis transport with one change: an undecodable or malformed queue item cannot kill the
worker.

kombu's Redis channel pops an item and decodes it as JSON inside the worker's event loop; a
non-JSON item, or an envelope whose fields have the wrong types (see
:func:`celery_ledger.envelope.envelope_problem`), raises out of the loop and the worker exits
("Unrecoverable error"), having already popped (and so lost) the item. kombu offers no
decode-error hook for this transport, so ``_brpop_read`` and ``_get`` are restated here with
the decode guarded: such an item is kept, with its queue and the reason, in the app's poison
list (the transport option ``ledger_poison_key``, set by ``create_app``) and the worker goes on.
A broker at its memory limit refuses the writes that follow a take (the booking of the message
as unacknowledged, a requeue, a poison entry); none of them may end the worker either (see
:class:`QoS`). Takes are booked on the broker's clock, and kombu's visibility sweep judges them
on it (see :class:`QoS`): a worker whose host clock is off neither books a take as old (to be
put back while it runs) nor puts back another worker's takes early. Everything else is kombu's
(selected through Celery's ``broker_transport`` setting), but for one saving: the channel
reuses its Redis client for the commands it sends outside the event loop (see
:meth:`Channel.conn_or_acquire`); and one repair: a worker without an event loop (the gevent
and eventlet pools) sees credit its tasks return while it waits for messages (see
:func:`poll_timeout`).

For a Redis behind Sentinel (``sentinel://`` broker URLs), :class:`SentinelTransport` is the
same transport over kombu's Sentinel channel, and :class:`Connection` keeps it when kombu would
move to another URL of the list (see there).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from queue import Empty
from time import monotonic
from typing import Any

from kombu.connection import Connection as KombuConnection
from kombu.transport import get_transport_cls, virtual
from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads
from redis import exceptions as redis_errors
from redis.exceptions import NoScriptError

from .clock import ServerClock, redis_time
from .envelope import envelope_problem
from .errors import ConfigurationError
from .fair_scripts import SCRIPT as FAIR_SCRIPT
from .fairness import FairDispatch, message_tenant, put_arguments, take_keys
from .poller import MultiChannelPoller
from .sentinel import SentinelSettings, connection_options, is_sentinel_url
from .settings import BROKER_URL_UNSET, UNSET_BROKER_HOST

logger = logging.getLogger("celery_ledger.transport")


class QoS(kombu_redis.QoS):
    """kombu's QoS, whose sweep of messages left unacknowledged past the visibility timeout
    can be turned off for a process that must not do it (``ledger_restore_visible``).

    The sweep takes an entry out of kombu's bookkeeping and then pushes it back on its queue.
    Flower consumes too (control replies), so kombu sweeps in it; but its broker user may not
    write the queues, so the push would fail after the entry was taken out: the message would
    be lost. Workers sweep; Flower (``LEDGER_RESTORE_UNACKED=false``) does not.
    """

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        """kombu's sweep, restated for one change: the visibility timeout is counted on the
        broker's clock, as the takes are booked (kombu counts on this host's)."""
        if not self.channel.ledger_restore_visible:
            return
        self._vrestore_count += 1
        if (self._vrestore_count - 1) % (interval or 1):
            return
        with self.channel.conn_or_acquire() as client:
            ceil = self.channel.broker_clock.now() - self.visibility_timeout
            try:
                with kombu_redis.Mutex(client, self.unacked_mutex_key, self.unacked_mutex_expire):
                    visible = client.zrange(
                        self.unacked_index_key,
                        ceil,
                        0,
                        desc=True,
                        byscore=True,
                        offset=num and start,
                        num=num,
                        withscores=True,
                    )
                    for tag, _score in visible or []:
                        self.restore_by_tag(tag, client)
            except kombu_redis.MutexHeld:
                pass
            except redis_errors.ResponseError as exc:  # (a primary refusing writes: later)
                logger.warning("broker refused the visibility sweep, tried again later: %s", exc)

    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        """kombu's put-back of a take, which a broker refusing writes (NOREPLICAS) would raise
        into the worker's loop, ending it (at a reconnection: the consumer puts back what it
        holds). Its transaction applied nothing then: the take stays booked, for the next
        sweep (kombu's visibility timeout, the reconciler) to put back."""
        try:
            super().restore_by_tag(tag, client, leftmost)
        except redis_errors.ResponseError as exc:
            logger.error("broker refused to put back message %s (left booked): %s", tag, exc)

    def _book(self, message: Any, delivery_tag: str) -> None:
        """kombu's booking of a take (``QoS.append``), scored on the broker's clock; with it,
        in the same round trip, the refill of the queue it came from (fairness.py)."""
        delivery = message.delivery_info
        exchange, routing_key = delivery["exchange"], delivery["routing_key"]
        taken_from = self.channel.taken_from()
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: self.channel.broker_clock.now()}).hset(
                self.unacked_key, delivery_tag, dumps([message._raw, exchange, routing_key])
            )
            fair = self.channel.fair
            if taken_from is not None and fair is not None:
                fair.refill(taken_from, pipe)
            results = pipe.execute(raise_on_error=False)
            for result in results[:2]:  # the booking's own
                if isinstance(result, Exception):
                    raise result
            if len(results) > 2 and isinstance(results[2], Exception):
                self._refill_again(taken_from, results[2])
            virtual.QoS.append(self, message, delivery_tag)

    # A broker at its memory limit (``maxmemory`` with ``noeviction``) still answers reads and
    # deletes (BRPOP, HDEL, ZREM) but refuses every write that adds (LPUSH, ZADD, HSET) with an
    # error reply. kombu pops a message, then books it as unacknowledged, then hands it on: a
    # refused booking raised out of the worker's loop, which ended the worker with the message
    # in neither the queue nor the bookkeeping (lost), and so did a refused requeue. A full
    # broker is what a deep backlog makes, so every worker lost a message and died in turn.

    def _refill_again(self, queue: str, error: Exception) -> None:
        """A take's refill that failed in the booking's pipeline: the script unknown to the
        broker (restarted) is sent whole now; any other failure is left to the next take, put
        or housekeeping tick (the booking itself stood)."""
        fair = self.channel.fair
        try:
            if not isinstance(error, NoScriptError) or fair is None:
                raise error
            fair.refill(queue)
        except redis_errors.RedisError as exc:
            logger.warning("refill of %s after a take failed: %s", queue, exc)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Messages taken while the broker refused their booking, by delivery tag: their raw
        # form, to requeue them from here (kombu requeues from its bookkeeping).
        self._unbooked: dict[str, tuple[Any, str, str]] = {}
        # Requeues of those the broker refused too: put back at the next take, or at close.
        self._held_requeues: dict[str, tuple[Any, str, str]] = {}

    def append(self, message: Any, delivery_tag: str) -> None:
        try:
            self._book(message, delivery_tag)
        except redis_errors.ResponseError as exc:
            # Handed on all the same, booked in this process only: its claim records the job
            # before its body runs (a worker that dies in between loses it, as a worker killed
            # between kombu's pop and its booking always could: dedupe on publish covers both)
            logger.error(
                "broker refused to book message %s as taken (%s); running it unbooked",
                delivery_tag,
                exc,
            )
            info = message.delivery_info
            self._unbooked[delivery_tag] = (
                message._raw,
                info.get("exchange", ""),
                info.get("routing_key", ""),
            )
            virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        self._unbooked.pop(delivery_tag, None)
        try:
            super().ack(delivery_tag)
        except redis_errors.ResponseError as exc:
            # A primary refusing every write (without enough replicas: NOREPLICAS) refuses the
            # removal too. Never raised into the worker: the take stays booked, and its copy
            # put back later (the reconciler, kombu's visibility timeout) finds the job ended
            logger.error("broker refused to remove acknowledged message %s: %s", delivery_tag, exc)
            virtual.QoS.ack(self, delivery_tag)

    def booked(self, delivery_tag: str) -> bool:
        """Whether a take is booked in the broker (a worker that dies holding it has it put
        back by the visibility sweep), not held in this process only (a full broker)."""
        return delivery_tag not in self._unbooked

    def restore_unacked(self, client: Any = None) -> Any:
        """At the channel's close kombu puts back what it holds from its bookkeeping; the
        unbooked, and the requeues the broker refused, are put back from here. One refused
        again is lost with the process: logged with its body, for an operator to publish."""
        for tag in list(self._unbooked):
            self._held_requeues[tag] = self._unbooked.pop(tag)
        self.push_held(client)
        for tag, (raw, _exchange, queue) in self._held_requeues.items():
            logger.critical(
                "message %s of %s could not be put back before the worker stopped: %s",
                tag,
                queue,
                json.dumps(raw, default=str),
            )
        self._held_requeues.clear()
        return super().restore_unacked(client)

    def push_held(self, client: Any = None) -> None:
        """Put back the requeues the broker refused, oldest first, as far as it takes them."""
        for tag, unbooked in list(self._held_requeues.items()):
            try:
                with self.channel.conn_or_acquire(client) as conn:
                    pipe = conn.pipeline()
                    self.channel._do_restore_message(*unbooked, pipe, leftmost=True)
                    pipe.execute()
            except redis_errors.RedisError:
                return
            del self._held_requeues[tag]

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        unbooked = self._unbooked.pop(delivery_tag, None)
        if requeue and unbooked is not None:
            # Put back from the message itself (no bookkeeping to put it back from); refused,
            # it is held here and put back at the next take, or at close
            self._held_requeues[delivery_tag] = unbooked
            self.push_held()
            if delivery_tag in self._held_requeues:
                logger.error("broker refused to requeue message %s; held", delivery_tag)
            virtual.QoS.ack(self, delivery_tag)
            return
        try:
            super().reject(delivery_tag, requeue=requeue)
        except redis_errors.ResponseError as exc:
            # Not requeued now, never raised into the worker's loop: the message stays in the
            # bookkeeping (kombu's transaction applied nothing), where the reconciler finds it
            # held without a running claim, and kombu after its visibility timeout
            logger.error(
                "broker refused to requeue message %s (%s); left for the reconciler",
                delivery_tag,
                exc,
            )
            virtual.QoS.ack(self, delivery_tag)


def _refused(error: Exception, connection: Any) -> redis_errors.ConnectionError:
    """A consumer's take the broker refused with an error reply (a primary without enough
    replicas to write: NOREPLICAS; one loading its data, busy, or a replica): nothing was
    taken, and kombu would raise it out of the worker's loop and end the worker. As a lost
    connection instead (``connection``: the one to drop), so the consumer connects again,
    with kombu's backoff, and asks again."""
    if connection is not None:
        connection.disconnect()
    return redis_errors.ConnectionError(f"the broker refused to hand out messages: {error}")


class Channel(kombu_redis.Channel):
    QoS = QoS
    ledger_poison_key = "celery_ledger:poison"
    ledger_restore_visible = True
    # Fair dispatch (fairness.py): the most messages a tier queue holds while tenants' lanes
    # wait (0: off, a tenant's message goes to the queue as any other), and how long a moved
    # message counts against its tenant's concurrency limit before a worker renews it.
    ledger_fair_depth = 0
    ledger_fair_lease = 60.0
    from_transport_options = (  # type: ignore[assignment]
        *kombu_redis.Channel.from_transport_options,
        "ledger_poison_key",
        "ledger_restore_visible",
        "ledger_fair_depth",
        "ledger_fair_lease",
    )

    _ledger_client: tuple[Any, Any] | None = None  # (the pool, a client of it)
    # The express process's channel (express.py): the task consumer's, whose queues it serves
    ledger_express_for: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Poison entries the broker refused (at its memory limit): see _push_poison.
        self._held_poison: list[str] = []
        # Takes are booked, and their visibility judged, on the broker's clock (see QoS)
        self.broker_clock = ServerClock("broker", self._broker_time)
        self._taken_from: str | None = None  # the queue of the take being booked

    @property
    def fair(self) -> FairDispatch | None:
        """The fair lanes on this channel's client, or None when fair dispatch is off."""
        if not self.ledger_fair_depth:
            return None
        with self.conn_or_acquire() as client:
            return FairDispatch(
                client, depth=int(self.ledger_fair_depth), lease_seconds=self.ledger_fair_lease
            )

    def taken_from(self) -> str | None:
        """The queue the take now being booked came from (once: then forgotten)."""
        queue, self._taken_from = self._taken_from, None
        return queue

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        """kombu's, but for a message that names a tenant while fair dispatch is on: to its
        tenant's lane, from which the queue is fed (fairness.py)."""
        tenant = message_tenant(message) if self.ledger_fair_depth else None
        if tenant is None:
            super()._put(queue, message, **kwargs)
            return
        step = self.priority(self._get_message_priority(message, reverse=False))
        payload = dumps(message)
        batch = kwargs.pop("_publish_batch", None)
        if batch is not None:  # kombu's producer batch (bulk_publish.py): one pipeline, whose
            # failure leaves its delivery uncertain: the script whole, never NOSCRIPT
            depth, lease = int(self.ledger_fair_depth), self.ledger_fair_lease
            args = put_arguments(queue, tenant, step, payload, depth, lease)
            batch.add("eval", FAIR_SCRIPT, 0, *args)
            return
        fair = self.fair
        assert fair is not None  # (ledger_fair_depth is set)
        fair.put(queue, tenant, step, payload)

    def _broker_time(self) -> float:
        with self.conn_or_acquire() as client:
            return redis_time(client)

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """kombu's, with the client kept: kombu makes a new ``redis.Redis`` for every publish,
        acknowledgement and queue-length read, and making one (its table of reply handlers,
        some 170 entries) costs about as much CPU as sending the command. Measured here: a
        ledger task's publish fell from 0.37 to 0.32 ms of the producer's CPU (plain Celery's:
        0.33). A client holds no connection of its own (each command takes one from the
        channel's pool and gives it back) and may be shared by threads, so one per pool does
        what a new one per command did (a connection the broker closed is opened again by the
        pool, under any client). When kombu drops the pool (a channel whose first ping fails,
        after a fork, on close) a new client is made on the new one."""
        if client:
            yield client
            return
        if self._pool is None and getattr(self.connection, "client", None) is None:
            # The transport was closed under this channel. After a lost broker connection,
            # Celery's consumer collects the connection (its transport closed), then closes it,
            # which closes its default channel; kombu's close puts back the messages the
            # channel took, and a pool made from a transport without its connection details
            # raised AttributeError, which Celery's close does not ignore: the worker ended
            # ("Unrecoverable error", seen in the chaos soak on a proxy reset). A connection
            # error it ignores: the messages stay booked in the broker, and the visibility
            # sweep or the reconciler puts them back.
            raise redis_errors.ConnectionError("the channel's transport is closed")
        pool = self.pool
        kept = self._ledger_client
        if kept is None or kept[0] is not pool:
            kept = self._ledger_client = (pool, self._create_client())
        yield kept[1]

    def _brpop_start(self, timeout: Any = None) -> None:
        """kombu's take, but with fair dispatch on it reads the queues' express lists first, and
        the express process's channel reads them alone, of the queues the worker serves now
        (fairness.py: ``take_keys``)."""
        if not self.ledger_fair_depth:
            return super()._brpop_start(timeout)  # type: ignore[no-any-return]
        queues = self._queue_cycle.consume(len(self.active_queues))
        serving = self.ledger_express_for
        if serving is not None:
            queues = [queue for queue in queues if queue in serving.active_queues]
        if not queues:
            return None
        keys = take_keys(queues, self.priority_steps, self._q_for_pri, express_only=bool(serving))
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()  # type: ignore[assignment]
        wait = self.brpop_timeout if timeout is None else timeout
        command_args = ["BRPOP", *keys, wait or 0]
        if self.global_keyprefix:
            command_args = self.client._prefix_args(command_args)
        self.client.connection.send_command(*command_args)
        return None

    def _brpop_read(self, **options: Any) -> bool | None:
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            except redis_errors.ResponseError as exc:
                raise _refused(exc, self.client.connection) from exc
            if not dest__item:
                raise Empty()
            dest, item = dest__item
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            message = self._decode_or_quarantine(item, dest)
            if message is not None:
                self._taken_from = dest  # (its booking refills the queue: see QoS._book)
                self.connection._deliver(message, dest)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]  # kombu's own reset
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()
            self._push_held()  # after the reply is read, never before (it would be lost)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the broker may be gone: logged below
            self._push_poison()
        for entry in self._held_poison:
            logger.critical("poison entry lost with the worker's stop (not kept): %s", entry)
        self._held_poison.clear()
        super().close()

    def _push_held(self) -> None:
        """What the broker refused earlier (poison entries, requeues), offered again."""
        if self._held_poison:
            self._push_poison()
        qos = self._qos
        if qos is not None and qos._held_requeues:
            qos.push_held()

    def _get(self, queue: str, timeout: Any = None) -> Any:
        with self.conn_or_acquire() as client:
            for pri in self.priority_steps:
                try:
                    item = client.rpop(self._q_for_pri(queue, pri))
                except redis_errors.ResponseError as exc:
                    raise _refused(exc, None) from exc
                if item:
                    self._maybe_update_queues_expire(client, queue)
                    message = self._decode_or_quarantine(item, queue)
                    if message is None:
                        raise Empty()
                    return message
            self._maybe_update_queues_expire(client, queue)
            raise Empty()

    def _decode_or_quarantine(self, item: bytes, queue: str) -> Any:
        """The envelope of ``item``, or None once it is kept as poison with its reason."""
        try:
            message = loads(bytes_to_str(item))
        except Exception as exc:  # kombu's decoder builds objects from "__type__" markers in
            # the item and can raise anything (InvalidOperation, AttributeError, OverflowError)
            self._keep_poison(item, queue, f"undecodable message: {type(exc).__name__}: {exc}")
            return None
        try:
            problem = envelope_problem(message, self.codecs)
        except Exception as exc:  # a value no check foresaw: refuse it rather than crash
            problem = f"unreadable envelope: {type(exc).__name__}: {exc}"
        if problem is None:
            return message
        headers = message.get("headers") if isinstance(message, dict) else None
        self._keep_poison(item, queue, f"malformed message: {problem}", headers)
        return None

    def _keep_poison(self, item: bytes, queue: str, reason: str, headers: Any = None) -> None:
        entry = {
            "queue": queue,
            "reason": reason,
            "at": self.broker_clock.now(),  # (the broker's clock, as every time it keeps)
            "raw_base64": base64.b64encode(item).decode(),
            "raw_kind": "envelope",
        }
        if isinstance(headers, dict):
            entry["headers"] = headers  # the dead record's task and id, where usable
        self._held_poison.append(json.dumps(entry, default=str))
        self._push_poison()
        if self._held_poison:
            logger.error(
                "queue %s: %s; the broker refused to keep it: held in this process (%d held)",
                queue,
                reason,
                len(self._held_poison),
            )
        else:
            logger.error("queue %s: %s; kept in %s", queue, reason, self.ledger_poison_key)

    def _push_poison(self) -> None:
        """Push the poison entries this process holds, oldest first, as far as the broker takes
        them. A broker at its memory limit refuses them (it took the item, it will not take
        the entry): they are held here and pushed at the next take, never raised into the
        worker's loop (which would end it with the item lost)."""
        while self._held_poison:
            try:
                with self.conn_or_acquire() as client:
                    client.lpush(self.ledger_poison_key, self._held_poison[0])
            except redis_errors.RedisError:  # (refused, or the broker away: held still)
                return
            self._held_poison.pop(0)


class Transport(kombu_redis.Transport):
    Channel = Channel

    def __init__(self, client: Any, *args: Any, **kwargs: Any) -> None:
        # create_app gives Celery a host that never resolves when LEDGER_BROKER_URL is unset:
        # refused here, by the setting's name, before any connection is tried
        if getattr(client, "hostname", None) == UNSET_BROKER_HOST:
            raise ConfigurationError(BROKER_URL_UNSET)
        super().__init__(client, *args, **kwargs)
        # The poller all channels share, in place of the one kombu just made (kombu types the
        # attribute as the virtual transport's cycle; its Redis transport puts a poller there).
        self.cycle = MultiChannelPoller()  # type: ignore[assignment]


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """This module's channel over kombu's Sentinel channel: its pool asks the sentinels
    (``master_name`` in the transport options) for the primary at every new connection, and
    drops a connection to one that is gone or demoted, so a failover is a lost connection that
    Celery restores, as for a broker restart, on the new primary."""

    from_transport_options = (  # type: ignore[assignment]
        *Channel.from_transport_options,
        "master_name",
        "min_other_sentinels",
        "sentinel_kwargs",
        "sentinel_fanout_compat",
    )


class SentinelTransport(Transport):
    """:class:`Transport` through Sentinel (what ``create_app`` sets for ``sentinel://`` URLs)."""

    Channel = SentinelChannel
    default_port = kombu_redis.SentinelTransport.default_port  # type: ignore[assignment]
    asks_every_sentinel = True  # (see Connection)


class Connection(KombuConnection):
    """kombu's connection (Celery's, through ``LedgerAMQP``), which keeps the transport it was
    given.

    A broker URL that lists several servers (``sentinel://a;sentinel://b``, Celery's form for
    Sentinel) makes kombu move to the next entry after a connection error, and its ``switch``
    took the transport from that entry's scheme: a worker whose broker failed over went on with
    kombu's own transport (losing what this module adds) and without the first entry's user and
    password (the data nodes'). A Sentinel channel asks every sentinel of the list whichever
    entry is current, so such a connection does not move at all; any other keeps its transport.
    """

    def maybe_switch_next(self) -> None:
        if getattr(get_transport_cls(self.transport_cls), "asks_every_sentinel", False):
            return
        super().maybe_switch_next()

    def switch(self, conn_str: str) -> None:
        given = self._initial_params.get("transport")
        super().switch(conn_str)
        if given:
            self.transport_cls = given


# A publish that fails on a connection error is tried once more, on a new connection (a pooled
# one the broker closed, a failover's new primary), not three times (Celery's default): against
# a broker that hangs, each try waits out LEDGER_BROKER_TIMEOUT_SECONDS, and a web request
# publishing must fail within a few of those.
PUBLISH_RETRY_POLICY = {
    "max_retries": 1,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": 0.2,
}


def path_for(broker_url: str | None) -> str:
    """The transport ``create_app`` sets for ``broker_url`` (Celery's ``broker_transport``)."""
    name = "SentinelTransport" if is_sentinel_url(broker_url) else "Transport"
    return f"{__name__}:{name}"


def broker_options(settings: SentinelSettings) -> dict[str, Any]:
    """The transport options of the broker's connection settings (see sentinel.py)."""
    return connection_options(settings)


def broker_address(connection: Any) -> str | None:
    """The Redis server the channels of ``connection`` (a kombu connection of this transport)
    use now: through Sentinel, the primary their pool found at its last connection; otherwise
    the URL's server. None before a channel has connected."""
    transport = getattr(connection, "transport", None)  # (its channels are the transport's)
    for channel in list(getattr(transport, "channels", None) or ()):
        for pool in (getattr(channel, "_async_pool", None), getattr(channel, "_pool", None)):
            if pool is None:
                continue
            address = getattr(pool, "master_address", None)  # (a Sentinel pool)
            if address:
                return f"{address[0]}:{address[1]}"
            kwargs = pool.connection_kwargs
            if "host" in kwargs:
                return f"{kwargs['host']}:{kwargs.get('port')}"
    return None


def declare_queues(app: Any) -> None:
    """Declare ``app``'s queues again. kombu keeps each exchange's bindings in the broker, and a
    publish to an exchange without them goes nowhere; Celery declares a queue once per process,
    so after the broker lost its data (which held them) its producers publish into the void
    until this (the reconciler calls it when it notices the loss)."""
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        for queue in app.amqp.queues.values():
            queue(channel).declare()
