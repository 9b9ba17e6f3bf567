"""The queue's Lua scripts, loaded from daemon/lua/ with the shared helpers of `_lib.lua` prepended.

Each script's header comment says what it guarantees. redis-py's Script objects run by EVALSHA
and fall back to loading the script on NOSCRIPT, so they survive a Redis restart.
"""

from __future__ import annotations

from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

NAMES = ("enqueue", "claim", "renew", "complete", "cancel", "reclaim", "log")


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
