"""What SIGHUP does to a running poold: it reads its configuration again (the same file, environment
and flags as at its start) and applies what can change without a restart, then says in its log what
it reloaded and what waits for a restart. Running jobs, connections and the pool's Redis are left as
they are.

Live everywhere: the log level. Live on a server as well: the tokens file, read again whatever else
changed (users added or removed, their tokens, who is an admin, priority ceilings, fair-share
weights; the server's own `reload`), and the bounds on what one user may submit, which the server
alone keeps (`LIVE_ON_SERVER`). Every other option is read once, at the start: the daemon's sockets,
its Redis, its queues and slots are built from them (a worker's queues and slots are what it
registered with the pool), so a change to one is named in a warning and takes effect at the next
restart. A configuration that no longer loads, or a tokens file that no longer reads, changes
nothing: the running configuration is kept, and the error said.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from daemon import config as config_mod
from daemon import log_setup
from daemon.config import Config
from daemon.errors import ConfigError, GpupoolError

log = logging.getLogger("poold")

LIVE_EVERYWHERE = frozenset({"log_level"})
# Kept by the server alone, as each submission is judged (server/bounds.py, queue/user_room.py,
# handlers.py's priority ceiling). The claim-side caps (user_max_running_jobs, user_max_gpus) are
# not here: every worker keeps its own, read at its start.
LIVE_ON_SERVER = LIVE_EVERYWHERE | {
    "user_max_queued_jobs",
    "user_max_stored_bytes",
    "job_spec_max_bytes",
    "job_name_max_chars",
    "project_max_bytes",
    "default_max_priority",
    "queue_default_cpus",
    "queue_default_mem",
}

# What a daemon applies of a reloaded configuration beyond the log level: one sentence for each
# thing it reloaded. It raises GpupoolError having changed nothing.
Apply = Callable[[Config], Awaitable[list[str]]]


class Reloader:
    """Reloads `config` (loaded from `args`) when called: one reload at a time."""

    def __init__(
        self, args: argparse.Namespace, config: Config, live: frozenset[str], apply: Apply | None = None
    ) -> None:
        self.args = args
        self.config = config
        self.live = live
        self._apply = apply
        self._one_at_a_time = asyncio.Lock()

    async def __call__(self) -> None:
        async with self._one_at_a_time:
            await self._reload()

    async def _reload(self) -> None:
        old = self.config
        try:
            new = config_mod.load(self.args)
        except ConfigError as exc:
            log.error("SIGHUP: nothing reloaded, the running configuration is kept: %s", exc)
            return
        changed = [o.name for o in config_mod.OPTIONS if getattr(new, o.name) != getattr(old, o.name)]
        now = [name for name in changed if name in self.live]
        merged = dataclasses.replace(
            old,
            **{name: getattr(new, name) for name in now},
            sources={**old.sources, **{name: new.sources[name] for name in now}},
        )
        try:
            applied = await self._apply(merged) if self._apply is not None else []
        except GpupoolError as exc:
            log.error("SIGHUP: nothing reloaded, the running configuration is kept: %s", exc)
            return
        self.config = merged
        shown = merged.shown()
        said = [f"{name} = {shown[name]!r}" for name in now] + applied
        log.info("SIGHUP: reloaded %s", "; ".join(said) if said else "nothing (no live option changed)")
        if later := [name for name in changed if name not in self.live]:
            log.warning("SIGHUP: %s changed, which takes effect only at a restart of poold", ", ".join(later))
        log_setup.set_level(merged.log_level)  # after the lines above, which the old level decides
