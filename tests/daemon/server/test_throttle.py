"""Guessing tokens is throttled, on the wire and on the dashboard (issue 44 item 9): a real pool
server, real connections from several loopback addresses (127.0.0.N are all this machine's), and
the server's answers counted: how many guesses it checked, how many it refused. The timing rules
(pacing, decay, what is forgotten first) are proved on the Throttle itself, its clock given.

Before the throttle a guesser had ~860 guesses a second on the wire and ~900 on the dashboard."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.server.throttle import FREE, KNOWN, MOST, MOST_WAIT, REMEMBERED, Throttle
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


ALICE = "2001:db8:a11c:e::7"  # alice's own machine


def guessed(throttle: Throttle, peer: str, user: str, now: float) -> str:
    """One wrong attempt from `peer` for `user` at `now`, as the server runs it: "refused" (the
    address, or the user's turns, in back-off) or "failed" (checked)."""
    if throttle.refused(peer, now) or throttle.wait(peer, user, now) is None:
        return "refused"
    throttle.failed(peer, user, now)
    return "failed"


def signed_in(throttle: Throttle, peer: str, user: str, now: float) -> float | None:
    """The right token from `peer` for `user` at `now`: how long it waited, None if refused."""
    if throttle.refused(peer, now):
        return None
    wait = throttle.wait(peer, user, now)
    if wait is not None:
        throttle.succeeded(peer, user)
    return wait


def test_a_flood_naming_a_user_never_slows_them_from_a_peer_known_for_them() -> None:
    """issue 44 item 1 (review of item 9): a guesser rotating 4000 IPv6 /64s at 20 wrong attempts
    a second naming alice had her, every 7 s from her own machine, refused 125 times in 125 over
    15 minutes. Her machine, known for her since she last got in, is never paced by her name's
    back-off; the guesser still gets one guess per turn, not thousands."""
    throttle = Throttle()
    assert signed_in(throttle, ALICE, "alice", 0.0) == 0.0
    answers, hers = [], []
    for tick in range(1, 15 * 60 * 20):
        now = tick / 20
        answers.append(guessed(throttle, f"2001:db8:{tick % 4000:x}::1", "alice", now))
        if tick % (7 * 20) == 0:
            hers.append(signed_in(throttle, ALICE, "alice", now))
    assert hers == [0.0] * len(hers)
    assert answers.count("failed") <= 2 * FREE + 15 * 60 / MOST_WAIT, answers.count("failed")
    assert signed_in(throttle, "2001:db8:f00d::1", "alice", 15 * 60) is None  # elsewhere: paced


def test_a_known_peer_still_has_its_own_back_off() -> None:
    """issue 44 item 1: being known for alice spares a peer her name's pacing, not its own
    address's back-off: a guesser sharing her address (a NAT) gains no guesses by it."""
    throttle = Throttle()
    signed_in(throttle, ALICE, "alice", 0.0)
    assert [guessed(throttle, ALICE, "bob", 1.0) for _ in range(FREE + 1)][-1] == "refused"
    assert signed_in(throttle, ALICE, "alice", 1.0) is None


def test_failures_long_past_are_forgotten() -> None:
    """issue 44 item 2: counts never decayed: 9 typos over a month on the dashboard (each followed
    by a good sign-in, which never cleared the sign-ins' count) made the next three good sign-ins
    wait 0 s, 9 s and be refused. Failures are forgotten MOST after their back-off ended."""
    throttle, day = Throttle(), 86400.0
    for n in range(9):
        guessed(throttle, "192.0.2.9", " sign-ins", n * 3 * day)
    assert [signed_in(throttle, "192.0.2.10", " sign-ins", 30 * day + t) for t in (0, 1, 2)] == [0.0] * 3
    # and a peer's: FREE + 2 failures now, then long after its back-off one more starts nothing
    for _ in range(FREE + 2):
        throttle.failed("192.0.2.11", None, 0.0)
    assert throttle.refused("192.0.2.11", 1.0) > 0
    throttle.failed("192.0.2.11", None, 4.0 + MOST + 1)
    assert throttle.refused("192.0.2.11", 4.0 + MOST + 1) == 0


def test_failures_under_junk_names_or_from_new_peers_do_not_forget_a_back_off() -> None:
    """issue 44 item 3: the newest REMEMBERED entries were kept, whatever they were: failures
    under 4096 junk names, or from 4096 new /64s, forgot alice's back-off and every peer's. Those
    not in back-off are forgotten first."""
    throttle = Throttle()
    for _ in range(FREE + 3):
        throttle.failed("192.0.2.1", "alice", 0.0)
    for n in range(REMEMBERED + 10):
        throttle.failed(f"2001:db8:{n:x}::1", f"junk-{n}", 1.0)
    assert throttle.refused("192.0.2.1", 1.0) > 0
    assert throttle.wait("192.0.2.2", "alice", 1.0) == 0.0  # her turn, taken now ...
    assert throttle.wait("192.0.2.3", "alice", 1.0) == min(8.0, MOST_WAIT)  # ... and the next one's later


async def test_a_guessers_flood_naming_alice_does_not_slow_her_from_her_own_address(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 1: wrong HELLOs naming alice from many addresses took every turn of her name
    up to MOST_WAIT ahead, and her own right token was refused. From the address she last got in
    from she gets in at once, while the flood's connections wait their turns."""
    async with running_pool(redis_server, tmp_path) as pool:
        assert await attempt(pool, "alice", pool.tokens["alice"], source="127.0.0.5") == "in"
        assert [await attempt(pool, "alice", WRONG, source=f"127.0.1.{n}") for n in range(FREE)] == [
            "failed"
        ] * FREE
        flood = [asyncio.create_task(attempt(pool, "alice", WRONG, source=f"127.0.3.{n}")) for n in range(12)]
        try:
            await asyncio.sleep(0.3)  # the flood has taken the turns
            loop = asyncio.get_running_loop()
            for _ in range(3):
                start = loop.time()
                assert await attempt(pool, "alice", pool.tokens["alice"], source="127.0.0.5") == "in"
                assert loop.time() - start < 1.0
        finally:
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)


async def test_a_dashboard_peer_that_signed_in_lately_is_not_paced_by_others_failures(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 2: the dashboard's failures all count under one name, which paced everyone's
    sign-in, a good one too. A peer that signed in well lately is not paced by it."""
    async with running_pool(redis_server, tmp_path) as pool:
        assert pool.server.listener is not None
        pool.server.listener.throttle.first = 0.2  # others' turns: 0.2, 0.4, 0.8, 1.6 s
        assert await sign_in(pool, pool.tokens["alice"], source="127.0.0.5") == 303
        for n in range(6, 6 + KNOWN):  # other users' peers: every user's are known for the dashboard
            assert await sign_in(pool, pool.tokens["bob"], source=f"127.0.0.{n}") == 303
        assert [await sign_in(pool, WRONG, source=f"127.0.1.{n}") for n in range(FREE + 3)] == [401] * (
            FREE + 3
        )
        loop = asyncio.get_running_loop()
        for _ in range(3):  # (paced, the first would wait 0.8 s, the next 1.6 s)
            start = loop.time()
            assert await sign_in(pool, pool.tokens["alice"], source="127.0.0.5") == 303
            assert loop.time() - start < 0.5


async def test_a_connection_waiting_its_turn_is_not_the_first_closed_to_make_room(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 4 (review of item 9), feared: a connection waiting its turn (its user in
    back-off) holds a place among those authenticating, and a flood of new connections closes the
    oldest of those first, the real user with it. Not so: its right token checked, it no longer
    counts as authenticating, so the flood's own are closed (a guess waiting its turn does count:
    the next test)."""
    async with running_pool(redis_server, tmp_path, max_connections=4) as pool:
        assert pool.server.listener is not None
        pool.server.listener.throttle.first = 2.0
        for n in range(FREE + 1):  # the last takes the turn now; the next is 2 s off
            assert await attempt(pool, "alice", WRONG, source=f"127.0.1.{n}") == "failed"
        alice = asyncio.create_task(attempt(pool, "alice", pool.tokens["alice"], source="127.0.2.1"))
        await asyncio.sleep(0.5)  # she waits her turn
        host, port = pool.address.rsplit(":", 1)
        flood = [
            await asyncio.open_connection(host, int(port), local_addr=(f"127.0.3.{n}", 0)) for n in range(4)
        ]
        try:
            assert await alice == "in"
            async with asyncio.timeout(5):  # room was made, by closing the flood's oldest
                assert b"the oldest make room" in await flood[0][0].read()
        finally:
            for _, writer in flood:
                writer.close()


async def test_guesses_waiting_their_turns_cannot_hold_every_place(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 4: a guess that failed holds its verdict for its turn, up to MOST_WAIT, past
    AUTH: it counted as authenticated, and nothing closed it to make room, so guesses waiting
    their turns (a few per user name, from any number of addresses) could hold every place and
    the server refused real users. They are closed to make room, as connections still
    authenticating are."""
    async with running_pool(redis_server, tmp_path, max_connections=3) as pool:
        for n in range(FREE):
            assert await attempt(pool, "bob", WRONG, source=f"127.0.1.{n}") == "failed"
        guesses = []
        try:
            for n in range(4):  # one answered now, three waiting their turns (1, 3 and 7 s off)
                guesses.append(asyncio.create_task(attempt(pool, "bob", WRONG, source=f"127.0.4.{n}")))
                await asyncio.sleep(0.1)  # past AUTH before the next one opens
            assert await attempt(pool, "alice", pool.tokens["alice"], source="127.0.0.5") == "in"
        finally:
            for task in guesses:
                task.cancel()
            await asyncio.gather(*guesses, return_exceptions=True)
