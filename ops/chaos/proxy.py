"""A TCP proxy on loopback that injects delays, connection resets and partitions (asyncio).

Workers connect to the proxy's port instead of the server's; the soak turns faults on and off
from its own thread::

    with ProxyLoop() as loop:
        proxy = loop.add("ledger", target_port=27017)
        proxy.delay(0.05)            # every forwarded chunk waits 50 ms
        proxy.reset()                # every open connection is aborted with a TCP RST
        proxy.partition(4.0)         # nothing passes for 4 s; then the held connections reset
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType

LOOPBACK = "127.0.0.1"
CHUNK = 65536


@dataclass(eq=False)
class _Link:
    """One client connection and its upstream connection."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def abort(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                _abort_with_rst(writer)
        for task in self.tasks:
            task.cancel()


def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class Proxy:
    """Forwards ``listen_port`` to ``target_port`` on loopback, with faults on demand."""

    def __init__(
        self,
        name: str,
        target_port: int,
        loop: asyncio.AbstractEventLoop,
        tls: ssl.SSLContext | None = None,
        plain_too: bool = False,
    ) -> None:
        self.name = name
        self.target_port = target_port
        self.tls = tls  # clients connect with TLS, which the proxy terminates
        # ...or in plain text, told apart by their first byte (a TLS handshake's is 0x16): a
        # Redis server's replicas and sentinels reach it where its clients do (the address it
        # announces), and valkey built without TLS speaks it to neither
        self.plain_too = plain_too
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Future[None] | None = None
        self._sniffing: set[asyncio.Future[None]] = set()  # (held: the loop keeps weak ones)
        self.listen_port = 0
        self.counts: Counter[str] = Counter()
        self._loop = loop
        self._delay_seconds = 0.0
        self._open = asyncio.Event()  # set: traffic passes; clear: partitioned
        self._open.set()
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None

    # -- control, from any thread -----------------------------------------------------------

    def delay(self, seconds: float) -> None:
        """Delay every forwarded chunk by ``seconds`` (0 to stop)."""
        self._loop.call_soon_threadsafe(setattr, self, "_delay_seconds", seconds)

    def reset(self) -> int:
        """Abort every open connection with a RST; returns how many were open."""
        return self._call(self._reset)

    def partition(self, seconds: float) -> None:
        """Let nothing through for ``seconds`` (connections hang), then reset them all.

        Blocks the calling thread for ``seconds``.
        """
        self._call(self._open.clear)
        time.sleep(seconds)
        self._call(self._heal)

    # -- inside the loop --------------------------------------------------------------------

    def _call(self, func: object) -> int:
        async def run() -> int:
            return int(func() or 0)  # type: ignore[operator]

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def _reset(self) -> int:
        links = list(self._links)
        for link in links:
            link.abort()
        self._links.clear()
        self.counts["resets"] += len(links)
        return len(links)

    def _heal(self) -> int:
        aborted = self._reset()
        self._open.set()
        return aborted

    async def start(self) -> None:
        if self.tls is not None and self.plain_too:
            listener = self._listener = socket.socket()
            listener.bind((LOOPBACK, 0))
            listener.listen(64)
            listener.setblocking(False)
            self.listen_port = listener.getsockname()[1]
            self._accepting = asyncio.ensure_future(self._accept(listener))
            return
        self._server = await asyncio.start_server(self._handle, LOOPBACK, 0, ssl=self.tls)
        self.listen_port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError:  # (out of descriptors, or the listener closed): accept again
                if listener.fileno() < 0:
                    return
                await asyncio.sleep(0.1)
                continue
            task = asyncio.ensure_future(self._sniff(sock))
            self._sniffing.add(task)
            task.add_done_callback(self._sniffing.discard)

    async def _sniff(self, sock: socket.socket) -> None:
        """Serve a connection in TLS or in plain text, as its first byte says."""
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(sock.fileno(), ready)
        try:
            await readable
        except asyncio.CancelledError:  # (the proxy stopped first)
            loop.remove_reader(sock.fileno())
            sock.close()
            raise
        loop.remove_reader(sock.fileno())
        try:
            first = sock.recv(1, socket.MSG_PEEK)
        except OSError:
            first = b""
        if not first:
            sock.close()
            return
        tls = first == b"\x16"
        self.counts["tls" if tls else "plain"] += 1
        reader = asyncio.StreamReader(limit=CHUNK, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol, sock, ssl=self.tls if tls else None
            )
        except (OSError, ssl.SSLError):
            self.counts["handshakes failed"] += 1
            sock.close()
            return
        await self._handle(reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        for task in list(self._sniffing):  # (their sockets close as they end)
            task.cancel()
        if self._listener is not None:
            self._listener.close()
        if self._server is not None:
            self._server.close()
        self._reset()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(writer)
        self._links.add(link)
        self.counts["connections"] += 1
        try:
            await self._open.wait()  # a new connection during a partition hangs
            try:
                up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self.target_port)
            except OSError:
                self.counts["upstream refused"] += 1
                _abort_with_rst(writer)
                return
            link.upstream = up_writer
            link.tasks = [
                asyncio.ensure_future(self._pipe(reader, up_writer)),
                asyncio.ensure_future(self._pipe(up_reader, writer)),
            ]
            await asyncio.wait(link.tasks, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass
        finally:
            link.abort()
            self._links.discard(link)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
            while data := await reader.read(CHUNK):
                if self._delay_seconds:
                    await asyncio.sleep(self._delay_seconds)
                await self._open.wait()  # a partition holds the data (the link hangs)
                writer.write(data)
                await writer.drain()


class ProxyLoop:
    """An event loop in a daemon thread that runs the proxies."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxies: list[Proxy] = []
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="chaos-proxy", daemon=True
        )

    def __enter__(self) -> ProxyLoop:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def add(
        self,
        name: str,
        *,
        target_port: int,
        tls: ssl.SSLContext | None = None,
        plain_too: bool = False,
    ) -> Proxy:
        """A proxy to ``target_port``; with ``tls``, one that terminates TLS for a server
        built without it (``plain_too``: and passes plain text connections on as they are)."""
        proxy = Proxy(name, target_port, self.loop, tls, plain_too)
        asyncio.run_coroutine_threadsafe(proxy.start(), self.loop).result(10)
        self.proxies.append(proxy)
        return proxy

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        for proxy in self.proxies:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(proxy.stop(), self.loop).result(10)

        async def cancel_all() -> None:
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
