"""Guessing tokens is throttled, on the wire and on the dashboard (issue 44 item 9): a real pool
server, real connections from several loopback addresses (127.0.0.N are all this machine's), and
the server's answers counted: how many guesses it checked, how many it refused.

Before the throttle a guesser had ~860 guesses a second on the wire and ~900 on the dashboard."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.server.throttle import FREE
from protocol import NEED_DATA, Authenticated, ClientConnection, ConnectionClosed, ConnectionFailed, ErrorCode
from tests.support.pool import Pool, running_pool

pytestmark = pytest.mark.timeout(60)

WRONG = "a-wrong-token-of-some-length"


async def attempt(pool: Pool, user: str, token: str, source: str = "127.0.0.1") -> str:
    """One handshake from `source` as `user` with `token`: "in", "failed" (the token was checked
    and wrong) or "refused" (the server would not check it), as the server answers."""
    return await answer(*await opened(pool, user, token, source))


async def opened(
    pool: Pool, user: str, token: str, source: str = "127.0.0.1"
) -> tuple[ClientConnection, asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection from `source` that has sent its HELLO (and is ready to send its AUTH)."""
    host, port = pool.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
    conn = ClientConnection(user, token.encode())
    writer.write(conn.start())
    return conn, reader, writer


async def answer(conn: ClientConnection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
    """The rest of `conn`'s handshake: the server's answer, as `attempt` says it."""
    try:
        async with asyncio.timeout(30):
            while True:
                conn.receive_data(await reader.read(65536))
                while (event := conn.next_event()) is not NEED_DATA:
                    match event:
                        case Authenticated():
                            return "in"
                        case ConnectionFailed(code=ErrorCode.AUTH_FAILED):
                            return "failed"
                        case ConnectionFailed(code=ErrorCode.TOO_MANY_REQUESTS):
                            return "refused"
                        case ConnectionFailed() | ConnectionClosed():
                            raise AssertionError(f"unexpected answer: {event}")
                writer.write(conn.data_to_send())
    finally:
        writer.close()


async def test_a_peer_that_fails_too_often_is_refused_and_others_still_get_in(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 9: tokens could be guessed ~860/s on the wire. After FREE failures from one
    address, its next attempts are refused before their token is checked (even the right one:
    the refusal tells nothing), while the real user, from another address, gets in."""
    async with running_pool(redis_server, tmp_path) as pool:
        answers = [await attempt(pool, "alice", WRONG) for _ in range(20)]
        checked = answers.count("failed")
        assert FREE <= checked <= FREE + 2, answers  # the back-off lets one more through per period
        assert answers.count("refused") == 20 - checked
        assert await attempt(pool, "alice", pool.tokens["alice"]) == "refused"
        assert await attempt(pool, "alice", pool.tokens["alice"], source="127.0.0.2") == "in"


async def test_connections_opened_before_the_back_off_gain_no_guesses(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 9: a guesser that opens its connections first, then fails on others, gets no
    more guesses out of them: their answers are refusals too."""
    async with running_pool(redis_server, tmp_path) as pool:
        early = [await opened(pool, "alice", WRONG) for _ in range(4)]
        assert [await attempt(pool, "alice", WRONG) for _ in range(FREE)] == ["failed"] * FREE
        assert [await answer(*connection) for connection in early] == ["refused"] * 4


async def test_guesses_for_one_user_from_many_peers_are_slowed_never_blocked(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 9: guesses for one user from ever new addresses (none of them throttled on
    its own) are answered one per back-off step once the user has failed FREE times: in a window
    the server checks a handful, not hundreds; and the real user still gets in afterwards."""
    async with running_pool(redis_server, tmp_path) as pool:
        assert pool.server.listener is not None
        throttle = pool.server.listener.throttle
        throttle.first = 0.1  # steps of 0.1, 0.2, 0.4, 0.8 s: the test stays short
        answers = []
        loop = asyncio.get_running_loop()
        end = loop.time() + 1.5
        peer = 10
        while loop.time() < end:
            answers.append(await attempt(pool, "bob", WRONG, source=f"127.0.1.{peer}"))
            peer += 1
        assert "refused" not in answers  # no address failed more than once
        assert FREE <= answers.count("failed") <= FREE + 5, answers
        assert await attempt(pool, "bob", pool.tokens["bob"], source="127.0.2.1") == "in"
        # and the other users were never slowed
        assert await attempt(pool, "alice", pool.tokens["alice"], source="127.0.2.2") == "in"


async def sign_in(pool: Pool, token: str, source: str = "127.0.0.1") -> int:
    """The status of a dashboard sign-in with `token` from `source`."""
    assert pool.server.web is not None
    connector = aiohttp.TCPConnector(local_addr=(source, 0))
    async with (
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as http,
        http.post(pool.server.web.address + "/signin", data={"token": token}, allow_redirects=False) as r,
    ):
        if r.status == 429:
            assert "Too many failed sign-ins from 127.0.0.1" in await r.text()
        return r.status


async def test_dashboard_sign_ins_are_throttled_per_peer(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    """issue 44 item 9: tokens could be guessed ~900/s on the dashboard. After FREE failed sign-ins
    from one address it is answered 429 before its token is checked (the right one too), and the
    real user, from another address, signs in."""
    async with running_pool(redis_server, tmp_path) as pool:
        statuses = [await sign_in(pool, WRONG) for _ in range(20)]
        checked = statuses.count(401)
        assert FREE <= checked <= FREE + 2, statuses
        assert statuses.count(429) == 20 - checked
        assert await sign_in(pool, pool.tokens["alice"]) == 429
        assert await sign_in(pool, pool.tokens["alice"], source="127.0.0.2") == 303
