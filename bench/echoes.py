"""The paths a keystroke takes (bench/interactive.py): one open connection whose far end echoes
what it is sent, and the seconds one byte took to come back through it: a TCP connection (directly
or through a tunnel), a process's pipes (`ssh HOST cat`), or a channel into a job
(`PoolClient.channel`: exec's `cat`, or a tty job's terminal)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

from bench.common import STEP_LIMIT, bounded, stop
from daemon.client.pool_client import PoolClient
from protocol import OpenChannel


class Echo:
    """One open connection whose far end echoes: `key()` the seconds one byte took to come back."""

    async def key(self) -> float:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class StreamEcho(Echo):
    """A TCP connection to the job's server (directly or through a tunnel), in echo mode."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> StreamEcho:
        reader, writer = await bounded("connect", asyncio.open_connection("127.0.0.1", port))
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(b"echo\n")
        return cls(reader, writer)

    async def key(self) -> float:
        began = time.perf_counter()
        self.writer.write(b"k")
        if await bounded("a keystroke's echo", self.reader.readexactly(1)) != b"k":
            raise RuntimeError("the echo is not the keystroke")
        return time.perf_counter() - began

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await bounded("close", self.writer.wait_closed())


class PipeEcho(Echo):
    """A process (`ssh HOST cat`) whose stdout gives back its stdin."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdin is not None
        assert proc.stdout is not None
        self.proc, self.stdin, self.stdout = proc, proc.stdin, proc.stdout

    async def key(self) -> float:
        began = time.perf_counter()
        self.stdin.write(b"k")
        await self.stdin.drain()
        if await bounded("a keystroke's echo", self.stdout.readexactly(1)) != b"k":
            raise RuntimeError("the echo is not the keystroke")
        return time.perf_counter() - began

    async def close(self) -> None:
        self.stdin.close()
        await stop(self.proc)


class ChannelEcho(Echo):
    """A channel into a job (PoolClient.channel) whose far end echoes what it is sent: `cat` run
    by an exec, or on a tty job's terminal (attach: closed by detaching, as `poolctl attach`)."""

    def __init__(self, client: PoolClient, request: OpenChannel, *, detach: bool = False) -> None:
        self.detach = detach
        self.typed: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.echoed: asyncio.Queue[bytes] = asyncio.Queue()
        self.channel = asyncio.ensure_future(client.channel(request, self._output, self._input()))
        self.channel.add_done_callback(lambda done: done.cancelled() or done.exception())  # seen here

    async def _input(self) -> AsyncIterator[bytes]:
        while (data := await self.typed.get()) is not None:
            yield data

    async def _output(self, stream: str, data: bytes) -> None:
        del stream  # cat writes only what it reads; a terminal has one output
        self.echoed.put_nowait(data)

    async def key(self) -> float:
        began = time.perf_counter()
        self.typed.put_nowait(b"k")
        echoed = asyncio.ensure_future(self.echoed.get())
        done, _ = await asyncio.wait(
            {echoed, self.channel}, timeout=STEP_LIMIT, return_when=asyncio.FIRST_COMPLETED
        )
        if echoed not in done:
            echoed.cancel()
            if self.channel in done:
                raise RuntimeError(f"the channel ended under a keystroke: {self.channel.result()}")
            raise TimeoutError(f"a keystroke's echo: nothing within {STEP_LIMIT:.0f} s")
        if echoed.result() != b"k":
            raise RuntimeError("the echo is not the keystroke")
        return time.perf_counter() - began

    async def close(self) -> None:
        if self.detach:  # the channel's cancel: the server detaches, the job goes on
            self.channel.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await bounded("the detach", self.channel)
            return
        self.typed.put_nowait(None)  # stdin's end: cat exits
        closed = await bounded("the channel's end", self.channel)
        if closed.exit_code != 0:
            raise RuntimeError(f"cat in the job ended: {closed.reason}, exit {closed.exit_code}")
