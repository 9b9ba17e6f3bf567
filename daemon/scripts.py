"""The queue's Lua scripts, loaded from daemon/lua/ with the shared helpers of `_lib.lua` prepended.

Each script's header comment says what it guarantees. redis-py's Script objects run by EVALSHA
and fall back to loading the script on NOSCRIPT, so they survive a Redis restart.

`ScriptBatch` sends several script calls in ONE round trip. redis-py's own pipelined scripts ask
Redis `SCRIPT EXISTS` before every pipeline, a second round trip; a batch sends EVALSHA straight
away and only on a NOSCRIPT answer (Redis restarted or flushed its script cache) loads the
missing scripts and re-sends the calls that were refused, which therefore never ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

NAMES = ("enqueue", "claim", "renew", "complete", "cancel", "reclaim", "log", "release", "heartbeat")


def source(name: str) -> str:
    """The full text of a script as Redis runs it: the shared helpers, then the script."""
    lua = resources.files("daemon") / "lua"
    return (lua / "_lib.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


class Scripts:
    """One registered script per queue operation."""

    def __init__(self, redis: Redis) -> None:
        self.enqueue: AsyncScript = redis.register_script(source("enqueue"))
        self.claim: AsyncScript = redis.register_script(source("claim"))
        self.renew: AsyncScript = redis.register_script(source("renew"))
        self.complete: AsyncScript = redis.register_script(source("complete"))
        self.cancel: AsyncScript = redis.register_script(source("cancel"))
        self.reclaim: AsyncScript = redis.register_script(source("reclaim"))
        self.log: AsyncScript = redis.register_script(source("log"))
        self.release: AsyncScript = redis.register_script(source("release"))
        self.heartbeat: AsyncScript = redis.register_script(source("heartbeat"))


class ScriptBatch:
    """Script calls collected with `add`, then sent together by `execute` in one round trip."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._calls: list[tuple[AsyncScript, Sequence[Any], Sequence[Any]]] = []

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> int:
        """Queue one call; returns the index of its reply in `execute`'s list."""
        self._calls.append((script, keys, args))
        return len(self._calls) - 1

    async def execute(self) -> list[Any]:
        """Run every call; the replies in order. Raises the first error a call answered with."""
        if not self._calls:
            return []
        replies = await self._send(self._calls)
        refused = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if refused:
            for script in {id(self._calls[i][0]): self._calls[i][0] for i in refused}.values():
                script.sha = await self.redis.script_load(script.script)
            for i, reply in zip(refused, await self._send([self._calls[i] for i in refused]), strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def _send(self, calls: Sequence[tuple[AsyncScript, Sequence[Any], Sequence[Any]]]) -> list[Any]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))
