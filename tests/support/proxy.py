"""A TCP proxy between a client and a real redis-server, to make real replies late or lost.

Each connection's bytes from the server go through a queue of their own, so a connection can be
held back (`hold`: nothing reaches the client until released), delayed (`delay`: every reply
arrives that much later, order kept), or cut (`cut`: both sockets closed, as a network would).
Bytes from the client always go straight through. Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class Link:
    """One client connection through the proxy."""

    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    held: bytearray = field(default_factory=bytearray)
    holding: bool = False
    upheld: bytearray | None = None  # requests held back on their way to the server
    replies: asyncio.Queue[tuple[float, bytes]] = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class Proxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.links: list[Link] = []
        self.delay_seconds = 0.0
        self._holding = False
        self._trigger: Callable[[bytes], bool] | None = None
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            await self._close(link)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()

    # -- faults -------------------------------------------------------------------------------------

    def hold(self, new_connections: bool = True) -> None:
        """From now on no reply reaches its client until `release`: on the open connections, and
        on new ones too unless `new_connections` is False."""
        self._holding = new_connections
        for link in self.links:
            link.holding = True

    def hold_request(self, request: Callable[[bytes], bool]) -> None:
        """Hold back, on its way to the server, the next request that `request` matches (say, one
        naming a script's SHA), and what its connection sends after it, until `send_held`: the
        request is sent, as the client saw it, but reaches the server late."""
        self._trigger = request

    def send_held(self) -> None:
        for link in self.links:
            if link.upheld is not None:
                data, link.upheld = bytes(link.upheld), None
                link.server.write(data)

    def release(self, keep: Callable[[bytes], bool] = lambda held: False) -> None:
        """Let the held replies through, except on the connections whose held bytes `keep` says to
        hold on; those stay held (replies to come included) until a later `release`."""
        self._holding = False
        for link in self.links:
            if link.holding and not keep(bytes(link.held)):
                link.holding = False
                data, link.held[:] = bytes(link.held), b""
                if data:
                    link.client.write(data)

    def held(self) -> list[bytes]:
        return [bytes(link.held) for link in self.links if link.held]

    def delay(self, seconds: float) -> None:
        """Replies from now on reach their clients `seconds` late (0: on time again)."""
        self.delay_seconds = seconds

    async def cut(self) -> None:
        """Close every connection, as a broken network would: replies in flight, and held ones, are
        lost. New connections are served as usual."""
        self._holding = False
        for link in list(self.links):
            await self._close(link)

    # -- plumbing -----------------------------------------------------------------------------------

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_w.close()
            return
        link = Link(client_w, server_w, holding=self._holding)
        self.links.append(link)
        link.tasks = [
            asyncio.create_task(self._up(link, client_r)),
            asyncio.create_task(self._down(link, server_r)),
            asyncio.create_task(self._deliver(link)),
        ]

    async def _up(self, link: Link, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if self._trigger is not None and self._trigger(data):
                    self._trigger, link.upheld = None, bytearray()
                if link.upheld is not None:
                    link.upheld += data
                else:
                    link.server.write(data)
        await self._close(link)

    async def _down(self, link: Link, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                link.replies.put_nowait((loop.time() + self.delay_seconds, data))
        await self._close(link)

    async def _deliver(self, link: Link) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await link.replies.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if link.holding:
                link.held += data
            else:
                with contextlib.suppress(OSError):
                    link.client.write(data)

    async def _close(self, link: Link) -> None:
        if link not in self.links:
            return
        self.links.remove(link)
        for writer in (link.client, link.server):
            with contextlib.suppress(OSError, RuntimeError):
                writer.close()
        current = asyncio.current_task()
        for task in link.tasks:
            if task is not current:
                task.cancel()
