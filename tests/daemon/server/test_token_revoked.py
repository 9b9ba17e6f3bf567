"""A token the pool's admin takes back (issue 47's reload of the tokens file, SIGHUP): its user was
refused at their next connection, while every connection they had open, and their dashboard
sessions, went on for as long as they liked: a leaked token, removed, still worked for whoever
held a connection with it. A reload now ends them.

Real server, real Redis, real connections and a real HTTP client for the dashboard."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from daemon.client.pool_client import ClientError
from daemon.queue.embedded_redis import EmbeddedRedis
from protocol import Enqueue, Enqueued, ErrorCode, Ping, Pong, Waited, WaitJobs
from tests.support.pool import running_pool


async def test_a_reload_that_takes_a_token_back_ends_its_connections_and_dashboard_sessions(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with running_pool(redis_server, tmp_path, users=("alice", "bob", "carol")) as pool:
        assert pool.server.web is not None
        dashboard = pool.server.web.address
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
            async with browser.post(f"{dashboard}/signin", data={"token": pool.tokens["alice"]}) as r:
                assert r.status == 200  # (followed to the signed-in page)
            async with (
                pool.client("alice") as alice,
                pool.client("bob") as bob,
                pool.client("carol") as carol,
            ):
                job_id = (await alice.call(Enqueue({"argv": ["true"]}, None), Enqueued)).job_id
                waiting = asyncio.create_task(alice.call(WaitJobs([job_id], None), Waited))
                await carol.call(Ping(), Pong)
                # alice removed, carol given a new token, bob kept
                tokens = {"bob": pool.tokens["bob"], "carol": "carols-new-token-0123456789"}
                pool.tokens_file.write_text("".join(f'"{u}" = "{t}"\n' for u, t in tokens.items()))
                said = await pool.server.reload(pool.server.config)
                assert "removed alice; new token for carol" in " ".join(said), said
                with pytest.raises(ClientError) as ended:
                    await asyncio.wait_for(waiting, 10)
                assert ended.value.code is ErrorCode.AUTH_FAILED, ended.value
                assert "token" in str(ended.value), ended.value
                with pytest.raises(ClientError):
                    await asyncio.wait_for(carol.call(Ping(), Pong), 10)
                assert isinstance(await bob.call(Ping(), Pong), Pong)  # no one else's
            async with browser.get(f"{dashboard}/", allow_redirects=False) as r:
                assert r.status == 303, "alice's dashboard session outlived her token"
